"""Reading a configuration: YAML files (a path or a preset's name), `--set KEY=VALUE` arguments, and a
mapping applied onto the config dataclasses with each value's type checked.

What it reads may come from elsewhere (a copied run's config.yaml, a Hugging Face config.json mapped by
tpu_llm/interop/hf_config.py), so reading is bounded: a YAML file of at most MAX_CONFIG_BYTES, and messages
that echo a value cut short (`REPR`). The schema and its caps are config/schema.py's, the checks of the
values read config/checks.py's.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
from typing import Any, Callable

import yaml

from tpu_llm.errors import UserError
from tpu_llm.platform import files

MAX_CONFIG_BYTES = 1 << 20  # a YAML config is a few KB; PyYAML parses about 1 MB a second
# a value in a message, cut to a few levels and characters (see _short)
REPR = reprlib.Repr()
REPR.maxlevel, REPR.maxstring, REPR.maxother, REPR.maxlong = 3, 80, 80, 40

PRESETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")  # package data (the wheel has it)


def check(ok: bool, message: str | Callable[[], str]) -> None:
    """A UserError with `message` unless `ok`; a message that costs something to build (the divisors of a
    number) is given as a function, called only on failure. (config/checks.py's.)"""
    if not ok:
        raise UserError(f"config: {message() if callable(message) else message}")


def presets() -> dict[str, str]:
    """{name: file} of the configs shipped in the package (tpu_llm/presets/*.yaml; configs/ links to them)."""
    files = sorted(f for f in os.listdir(PRESETS_DIR) if f.endswith(".yaml")) if os.path.isdir(PRESETS_DIR) else []
    return {f[:-len(".yaml")]: os.path.join(PRESETS_DIR, f) for f in files}


def config_file(path: str) -> str:
    """The file `--config path` means: the path itself if it exists, else the preset of that name (`tiny`,
    `gpt2_125m`, `tiny.yaml`), so a pip-installed tpu-llm runs `--config tiny` from any directory."""
    if os.path.exists(path) or os.sep in path or "/" in path:
        return path
    name = path[:-len(".yaml")] if path.endswith(".yaml") else path
    return presets().get(name, path)


def parse_set_args(items: list[str] | str | None) -> dict[str, Any]:
    """`--set a.b=1 --set c.d=x` (or one comma-free string) -> {'a.b': 1, 'c.d': 'x'}."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [items]
    out = {}
    for item in items:
        if "=" not in str(item):
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set model.n_layer=6")
        key, value = str(item).split("=", 1)
        out[key.strip()] = _parse_value(value)
    return out


def _parse_value(text: str) -> Any:
    """A YAML scalar (6, 0.5, true); anything else (a prompt like `def f():`, `[x`) stays the raw string."""
    if re.fullmatch(r"\s*\d+(:\d+)+\s*", text):  # YAML 1.1 reads 10:20 as the base-60 number 620
        return text.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an integer of over 4300 digits
        return text
    return value if isinstance(value, (str, int, float, bool)) else text


def read_yaml(path: str) -> dict:
    """The mapping of a YAML config file (empty for an empty file); a UserError naming the file otherwise."""
    if not os.path.exists(path):
        name = os.path.basename(path)
        name = name[:-len(".yaml")] if name.endswith(".yaml") else name
        close = difflib.get_close_matches(name, list(presets()), n=1, cutoff=0.6)
        hint = f"--config {close[0]} (a preset) or " if close else ""
        raise UserError(f"config file {path!r} not found; give {hint}a YAML file's path; presets: "
                        f"{', '.join(presets())} (`tpu-llm config --list`)")
    if os.path.isdir(path):
        here = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))[:8]
        hint = f", e.g. --config {os.path.join(path, here[0])} ({', '.join(here)})" if here else ""
        raise UserError(f"--config {path!r} is a directory; give a YAML file{hint}")
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise UserError(f"{path}: {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a config file may have; give a "
                        "YAML config (a few KB)")
    try:  # a regular file only (a FIFO or a device is refused, not read), at most MAX_CONFIG_BYTES read
        raw = files.read_regular(path, MAX_CONFIG_BYTES, "config file", "give a YAML config (a few KB)",
                                 follow_links=True)
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as e:  # e.g. a file saved as Latin-1
        raise UserError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "save the config file as UTF-8") from None
    except OSError as e:  # unreadable: permissions, a special file
        raise UserError(f"config file {path!r} cannot be read ({e.strerror or e}); check the path") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}: YAML syntax error{where}: {_short(problem)}; fix the file") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; nesting thousands deep
        what = "nested too deeply" if isinstance(e, RecursionError) else _short(str(e).splitlines()[0])
        raise UserError(f"{path}: a value YAML cannot hold ({what}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    return data


def apply_mapping(obj: Any, data: dict, source: str, prefix: str = "") -> None:
    """Set the fields of the config dataclass `obj` (its sections recursively) from `data`, each value
    coerced to its field's type; an unknown key or a wrong type is a UserError naming `source`."""
    for key, value in data.items():
        full = f"{prefix}{key}"
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if key not in fields:
            raise UserError(_unknown_key_message(full, list(fields), prefix, source))
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"{source}: {_quoted(full)} is a section; give it keys such as "
                                f"{', '.join(f.name for f in dataclasses.fields(current))[:80]}")
            apply_mapping(current, value, source, prefix=f"{full}.")
        else:
            setattr(obj, key, _coerce(full, value, fields[key].type, source))


def set_dotted(cfg: Any, key: str, value: Any, source: str) -> None:
    """`apply_mapping` of one dotted key: model.n_layer=6."""
    parts = key.split(".")
    nested: dict = value
    for part in reversed(parts):
        nested = {part: nested}
    apply_mapping(cfg, nested, source)


def _short(value) -> str:
    """`value` for a one-line message: a plain short string as it is, anything else by a repr cut to a
    few levels and characters (a YAML document can nest aliases into an exponentially long value)."""
    if isinstance(value, str) and len(value) <= 80 and value.isprintable():
        return value
    return REPR.repr(value)


def _quoted(key) -> str:
    """A config key from a file in a message: 'model.n_layer', or a repr when it is no plain text."""
    return f"'{key}'" if isinstance(key, str) and key == _short(key) else _short(key)


def _unknown_key_message(full: str, valid: list[str], prefix: str, source: str) -> str:
    name = str(full)[len(prefix):]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
    section = prefix.rstrip(".") or "the top level"
    return f"{source}: unknown config key {_quoted(full)}; {hint}valid keys in {section}: {', '.join(valid)}"


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _coerce(key: str, value: Any, type_name: Any, source: str) -> Any:
    expected = _TYPES[type_name if isinstance(type_name, str) else type_name.__name__]
    if expected is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if expected is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:  # a str: YAML 1.1 reads 3e-4 (no dot) as a string
            number = float(value)
        except (ValueError, OverflowError):  # OverflowError: an int past float's range
            number = None
        if number is not None:
            if not math.isfinite(number):
                raise UserError(f"{source}: '{key}' must be a finite number, got {REPR.repr(value)}")
            return number
    if expected is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if key == "sample.early_stopping" and isinstance(value, bool):  # true | false | never: YAML reads two as booleans
        return str(value).lower()
    if expected is str and isinstance(value, (list, tuple)) and all(  # a YAML list of files
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool) and expected is not bool or not isinstance(value, expected):
        raise UserError(f"{source}: '{key}' must be {expected.__name__}, got {REPR.repr(value)} "
                        f"({type(value).__name__})")
    return value
