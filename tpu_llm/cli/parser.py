"""The command line's parser and help: commands registered with `@command(...)`, flags checked in full
against each command's parameters and the config schema before a command runs and before TensorFlow is
imported. A misspelt flag or command is one `error:` line naming the nearest valid one.

Why our own parser and not fire or argparse: fire (in the original design) runs the command before it
can refuse a misspelt flag, and argparse cannot take every config key as `--section.key=value` with a
nearest-name hint drawn from the config schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
from typing import Any, Callable

from tpu_llm.errors import UserError

PROG = "tpu-llm"
CONFIG_DOCS = "`tpu-llm config --reference` (every key with its default and meaning; docs/configuration.md)"


@dataclasses.dataclass
class Flag:
    name: str
    default: Any  # its type is the flag's type; None: a string that must be given
    help: str

    @property
    def kind(self) -> type:
        return str if self.default is None else type(self.default)

    @property
    def required(self) -> bool:
        return self.default is None


@dataclasses.dataclass
class Command:
    name: str  # "train", or "data prepare" for a command of a group
    run: Callable
    summary: str  # one line, shown in `tpu-llm --help`
    example: str
    flags: dict[str, Flag]
    config: bool = False  # also --config FILE, --set K=V and --section.key=value overrides
    positional: str = ""  # a flag that may also be given as the one positional argument
    details: str = ""  # more text for `--help`


COMMANDS: dict[str, Command] = {}


def command(name: str, summary: str, example: str, config: bool = False, positional: str = "",
            details: str = "", **flag_help: str):
    """Register the decorated function as `tpu-llm <name>`; its parameters are the flags, `flag_help`
    says what each one means. Config commands receive `config` (the file) and `overrides` (a dict)."""
    def register(fn: Callable) -> Callable:
        flags, renamed = {}, {}
        for p in inspect.signature(fn).parameters.values():
            if p.name in ("config", "overrides") and config or p.name == "task_args":  # not flags (launch: after --)
                continue
            flag = p.name[:-1] if p.name.endswith("_") else p.name  # from_: --from, list_: --list
            assert flag in flag_help, f"{name}: --{flag} needs a help text"
            flags[flag] = Flag(flag, None if p.default is inspect.Parameter.empty else p.default, flag_help[flag])
            if flag != p.name:
                renamed[p.name] = flag

        def run(**kwargs):
            return fn(**{k if k not in renamed.values() else f"{k}_": v for k, v in kwargs.items()})

        COMMANDS[name] = Command(name, run if renamed else fn, summary, example, flags, config, positional,
                                 details.strip())
        return fn
    return register


# --------------------------------------------------------------------------------------------------
# Parsing


def nearest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return close[0] if close else ""


def _config_keys() -> dict[str, str]:
    """{every config key in dotted form (model.n_layer, run_dir, ...): its type's name}."""
    from tpu_llm.config import Config

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", f.type if isinstance(f.type, str) else f.type.__name__
    return dict(walk(Config(), ""))


def _unknown_flag(flag: str, cmd: Command) -> UserError:
    valid = [f"--{name}" for name in cmd.flags] + ["--help", "--verbose"]
    if cmd.config:
        valid += ["--config", "--set"] + [f"--{key}" for key in _config_keys()]
    # the nearest by the whole name, or by the key without its section (`--steps` for `--train.steps`)
    scored = [(difflib.SequenceMatcher(None, flag, v).ratio(), v) for v in valid]
    scored += [(difflib.SequenceMatcher(None, flag[2:], v.rpartition(".")[2]).ratio(), v) for v in valid if "." in v]
    score, near = max(scored)
    hint = f"did you mean {near}? " if score >= 0.6 else ""
    return UserError(f"{PROG} {cmd.name}: unknown flag {flag}; {hint}see `{PROG} {cmd.name} --help`")


def _convert(flag: Flag, value: Any) -> Any:
    kind = flag.kind
    if kind is bool:
        if value is True or str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise UserError(f"--{flag.name}={value!r}: give --{flag.name} alone, or true/false")
    try:
        return kind(value)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise UserError(f"--{flag.name}={value!r} must be {what}") from None


def _refuse_non_utf8(argv: list[str]) -> None:
    """UserError for an argument that is not UTF-8 text. Python hands bytes that are not UTF-8 (a
    terminal or a script in Latin-1) over as lone surrogates, which every later step (a prompt's
    tokens, a path for TensorFlow) fails to encode, with a traceback."""
    for i, arg in enumerate(argv):
        bad = next((j for j, c in enumerate(arg) if "\ud800" <= c <= "\udfff"), None)
        if bad is None:
            continue
        key, has_value, value = arg.partition("=")
        if arg.startswith("--") and has_value:
            name, bad = key, bad - len(key) - 1
        else:
            name, value = (argv[i - 1], arg) if i and argv[i - 1].startswith("--") and "=" not in argv[i - 1] \
                else (f"argument {i + 1}", arg)
        code = ord(value[bad])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        shown = value.encode("utf-8", "surrogateescape" if what.startswith("byte") else "backslashreplace")
        shown = shown.decode("utf-8", "backslashreplace")
        hint = ", or put the text in a UTF-8 file and pass --prompt_file FILE" if name == "--prompt" else ""
        raise UserError(f"{name}: '{shown[:60]}' is not UTF-8 text ({what} at character {bad}); tpu-llm reads its "
                        "arguments as UTF-8: convert the text, or run from a terminal or script in a UTF-8 locale "
                        f"(e.g. LANG=C.UTF-8){hint}")


def _refuse_nul(argv: list[str]) -> None:
    """UserError for an argument holding a NUL byte: no path or name can hold one (os.stat raised
    ValueError, a traceback). A process's own argv cannot carry one; `cli.main([...])` from Python can."""
    for i, arg in enumerate(argv):
        if "\0" in arg:
            raise UserError(f"argument {i + 1} ({ascii(arg)[:80]}) holds a NUL byte, which no path, name or text "
                            "tpu-llm reads may hold; remove it")


def parse(argv: list[str]) -> tuple[Command | None, dict]:
    """(command, keyword arguments) for `argv` (without the program name); (None, {}) when help was
    printed. Raises UserError for anything wrong, before any work is done."""
    _refuse_nul(argv)
    _refuse_non_utf8(argv)
    cmd, i = _command(argv)
    if cmd is None:
        return None, {}
    rest = argv[i:]
    task_args = None
    if cmd.name == "launch":  # what follows `--` goes to every task verbatim (checked below)
        if "--" in rest:
            task_args, rest = rest[rest.index("--") + 1:], rest[:rest.index("--")]
    parsed = _flags(cmd, rest)
    if parsed is None:
        return None, {}
    kwargs, overrides, positional = parsed
    if positional:
        if cmd.positional and len(positional) == 1 and cmd.positional not in kwargs:
            kwargs[cmd.positional] = _convert(cmd.flags[cmd.positional], positional[0])
        else:
            raise UserError(f"{PROG} {cmd.name}: unexpected argument {positional[-1]!r}; flags are given as "
                            f"--name VALUE (see `{PROG} {cmd.name} --help`)")
    for flag in cmd.flags.values():
        if flag.required and flag.name not in kwargs:
            raise UserError(f"{PROG} {cmd.name} needs --{flag.name}: {flag.help}")
    if cmd.config:
        kwargs["overrides"] = overrides
    if cmd.name == "launch":
        if not task_args:
            raise UserError(f"{PROG} launch needs the command to run after --, e.g. `{COMMANDS['launch'].example}`")
        inner, _ = parse(task_args)  # every task would fail the same way: say it once, now
        if inner is None:
            raise UserError(f"{PROG} launch: give the tasks a command to run, not --help")
        kwargs["task_args"] = task_args
    return cmd, kwargs


def _command(argv: list[str]) -> tuple[Command | None, int]:
    """The command `argv` names and the index of its first flag; (None, 0) when help or the version was
    printed instead."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":  # flags before the command
        i += 1
    lead, help_asked = argv[:i], bool({"-h", "--help"} & set(argv[:i]))
    strange = [a for a in lead if a not in ("-h", "--help", "--verbose", "--version")]
    if strange:
        raise UserError(f"{strange[0]} is not a flag of {PROG} itself; give a command first (`{PROG} --help` "
                        "lists them)")
    if "--version" in lead:
        from tpu_llm import __version__

        print(f"{PROG} {__version__}")
        return None, 0
    if i == len(argv) or argv[i] == "--":
        print(overview())
        return None, 0
    name, i = argv[i], i + 1
    groups = {c.split()[0]: [] for c in COMMANDS if " " in c}
    for c in COMMANDS:
        if " " in c:
            groups[c.split()[0]].append(c.split()[1])
    if name in groups:
        members = groups[name]
        if i == len(argv) or argv[i].startswith("-"):
            if help_asked or argv[i:i + 1] in (["-h"], ["--help"]):
                print(overview(group=name))
                return None, 0
            raise UserError(f"{PROG} {name} needs a command: {', '.join(members)} (e.g. "
                            f"`{PROG} {name} {members[0]} --help`)")
        sub, i = argv[i], i + 1
        if sub not in members:
            near = nearest(sub, members)
            raise UserError(f"'{name} {sub}' is not a command; " + (f"did you mean '{name} {near}'? " if near else "")
                            + f"{name} commands: {', '.join(members)}")
        name = f"{name} {sub}"
    elif name not in COMMANDS:
        top = list(dict.fromkeys(c.split()[0] for c in COMMANDS))
        near = nearest(name, top)
        raise UserError(f"'{name}' is not a command; " + (f"did you mean '{near}'? " if near else "")
                        + f"commands: {', '.join(top)}")
    cmd = COMMANDS[name]
    if help_asked:
        print(help_text(cmd))
        return None, 0
    return cmd, i


def _flags(cmd: Command, rest: list[str]) -> tuple[dict, dict, list[str]] | None:
    """The command's flags in `rest`: (its keyword arguments, config overrides, positional arguments); None
    when help was printed instead."""
    from tpu_llm.config.reading import parse_set_args

    kwargs: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    positional: list[str] = []
    keys = _config_keys() if cmd.config else {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        i += 1
        if arg in ("-h", "--help"):
            print(help_text(cmd))
            return None
        if arg == "--verbose":
            continue
        if not arg.startswith("-") or arg == "-":
            positional.append(arg)
            continue
        key, has_value, value = arg.lstrip("-").partition("=")
        if not arg.startswith("--") or not key:
            raise _unknown_flag(arg, cmd)
        flag = cmd.flags.get(key)
        if flag is not None:
            if not has_value:
                if flag.kind is bool:  # a switch; `--overwrite false` also works
                    value = rest[i] if i < len(rest) and rest[i].lower() in ("true", "false") else True
                    i += value is not True
                elif i >= len(rest):
                    raise UserError(f"--{key} needs a value ({flag.help})")
                else:
                    value, i = rest[i], i + 1
            kwargs[key] = _convert(flag, value)
            continue
        if not cmd.config or key not in keys and key not in ("set", "config"):
            raise _unknown_flag(f"--{key}", cmd)
        if not has_value:
            if keys.get(key) == "bool" and (i >= len(rest) or rest[i].lower() not in ("true", "false")):
                value = "true"  # a bool key given alone: on
            elif i >= len(rest):
                raise UserError(f"--{key} needs a value, e.g. " + ("--set model.n_layer=6" if key == "set"
                                                                    else f"--{key}=VALUE"))
            else:
                value, i = rest[i], i + 1
        if key == "config":
            kwargs["config"] = value
        else:  # a YAML scalar (6, 3e-4, true) or the text; --set: a misspelt key is named by load_config
            overrides.update(parse_set_args([value if key == "set" else f"{key}={value}"]))
    return kwargs, overrides, positional


# --------------------------------------------------------------------------------------------------
# Help


def overview(group: str = "") -> str:
    width = max(len(name) for name in COMMANDS) + 2
    lines = [f"usage: {PROG} {group + ' ' if group else ''}COMMAND [flags]   ({PROG} COMMAND --help: its flags "
             "and an example)", ""]
    if not group:
        lines += ["Train, sample and export GPT-style language models with TensorFlow on Cloud TPU, GPUs or the "
                  "CPU.", "", "commands:"]
    for name, cmd in COMMANDS.items():
        if not group or name.startswith(f"{group} "):
            lines.append(f"  {name:<{width}}{cmd.summary}")
    if not group:
        lines += ["", "get going:", "  tpu-llm train --config configs/tiny.yaml      # a small GPT on this machine's "
                  "CPU, ~2 min", "  tpu-llm generate --run_dir runs/tiny --prompt 'def '", "",
                  "global flags: --verbose shows TensorFlow's own log lines (hidden otherwise)",
                  f"configuration: {CONFIG_DOCS}",
                  "a mistake prints one line starting with 'error:' and exits with status 2"]
    return "\n".join(lines)


def help_text(cmd: Command) -> str:
    lines = [f"usage: {PROG} {cmd.name} " + (f"[{cmd.positional.upper()}] " if cmd.positional else "")
             + ("[--config FILE.yaml] [--section.key=VALUE ...] " if cmd.config else "") + "[flags]"
             + (" -- COMMAND [flags]" if cmd.name == "launch" else ""), "", cmd.summary[0].upper() + cmd.summary[1:]
             + "."]
    if cmd.details:
        lines += [""] + cmd.details.splitlines()
    rows = []
    for flag in cmd.flags.values():
        value = "" if flag.kind is bool else " " + {int: "N", float: "X"}.get(flag.kind, "TEXT")
        default = "required" if flag.required else f"default {flag.default!r}" if flag.default != "" else ""
        rows.append((f"--{flag.name}{value}", flag.help + (f" ({default})" if default else "")))
    if cmd.config:
        rows += [("--config FILE.yaml", "a config file (configs/*.yaml); keys not in it keep their defaults"),
                 ("--section.key=VALUE", "any config key, e.g. --model.n_layer=6 --train.steps=1000 --run_dir=runs/x"),
                 ("--set KEY=VALUE", "the same, repeatable: --set model.n_layer=6 --set train.lr=3e-4")]
    rows += [("--verbose", "show TensorFlow's own log lines"), ("-h, --help", "this help")]
    width = max(len(left) for left, _ in rows) + 2
    lines += ["", "flags:"] + [f"  {left:<{width}}{right}" for left, right in rows]
    if cmd.config:
        lines += ["", "config keys, by section (their defaults and meanings: `tpu-llm config --reference`, "
                  "docs/configuration.md):"]
        sections: dict[str, list[str]] = {}
        for key in _config_keys():
            section, _, leaf = key.rpartition(".")
            sections.setdefault(section or "(top level)", []).append(leaf)
        for section, leaves in sections.items():
            lines += textwrap.wrap(" ".join(leaves), 100, initial_indent=f"  {section:<12}", subsequent_indent=" " * 14)
    lines += ["", "example:", f"  {cmd.example}"]
    return "\n".join(lines)
