"""Command line: `tpu-llm <command>` or `python -m tpu_llm <command>`; `tpu-llm --help` lists the commands.

Every command is one function below, registered with `@command(...)`: its name, a one-line summary,
an example, and a help text for each of its parameters. The parameters are the command's flags
(their defaults give their types: bool flags are switches). Adding a command is adding one function.

Arguments are parsed and checked here, in full, before a command runs and before TensorFlow is
imported: an unknown flag or command is one `error:` line naming the nearest valid one (exit 2).
Commands registered with `config=True` also take `--config FILE.yaml`, any config key as
`--section.key=value` (or `--section.key value`) and `--set section.key=value` (repeatable); their
names are checked against the config schema (tpu_llm/config.py) here, their values by `load_config`.

TensorFlow's own start-up output (C++ log lines such as CUDA's `failed call to cuInit`, absl and
Python warnings) is kept off the terminal unless `--verbose` (or TPU_LLM_VERBOSE=1) is given.
A user mistake prints one line starting with "error:" and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import keyword
import os
import re
import sys
import textwrap
import threading
from typing import Any, Callable

from tpu_llm.errors import UserError

PROG = "tpu-llm"
VERBOSE_ENV = "TPU_LLM_VERBOSE"  # inherited by the tasks of `tpu-llm launch`
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
        flags = {}
        for p in inspect.signature(fn).parameters.values():
            if p.name in ("config", "overrides") and config or p.name == "task_args":  # not flags (launch: after --)
                continue
            flag = p.name.rstrip("_") if keyword.iskeyword(p.name.rstrip("_")) else p.name  # from_: --from
            assert flag in flag_help, f"{name}: --{flag} needs a help text"
            flags[flag] = Flag(flag, None if p.default is inspect.Parameter.empty else p.default, flag_help[flag])
        renamed = {f"{k}_": k for k in flags if keyword.iskeyword(k)}

        def run(**kwargs):
            return fn(**{k if k not in renamed.values() else f"{k}_": v for k, v in kwargs.items()})

        COMMANDS[name] = Command(name, run if renamed else fn, summary, example, flags, config, positional,
                                 details.strip())
        return fn
    return register


# --------------------------------------------------------------------------------------------------
# The commands


@command("train", "train a GPT, or resume the run in --run_dir",
         "tpu-llm train --config configs/tiny.yaml --model.n_layer=6 --run_dir runs/six", config=True,
         details="""
Trains to train.steps, evaluating and checkpointing on the way, then prints samples. Re-using a
--run_dir resumes that run from its newest readable checkpoint. Everything that can be checked (the
config, the data, the tokenizer against the data, the run directory, the checkpoints) is checked
before the first step and before anything in the run directory is written.""")
def train(config: str = "", overrides: dict | None = None):
    from tpu_llm.config import load_config

    cfg = load_config(config or None, overrides)
    from tpu_llm.controller import train as run  # TensorFlow loads only once the config is valid

    run(cfg)


@command("generate", "sample text from the newest checkpoint of a run",
         "tpu-llm generate --run_dir runs/tiny --prompt 'def ' --max_new_tokens 100 --temperature 0.7",
         details="""
A prompt character that the run's tokenizer cannot represent (a char vocabulary built from other
text) is an error: the model never saw the unknown id it would become.""",
         run_dir="the run directory of a `tpu-llm train` run", prompt="text to continue (default: start "
         "after an end-of-text token)", max_new_tokens="tokens generated per sample",
         temperature="sampling temperature; 0 = greedy", top_k="sample from the k most likely tokens; 0 = off",
         top_p="sample from the smallest set of tokens holding this probability; 1.0 = off",
         seed="sample i draws with seed + i: the same seed gives the same text", num_samples="samples printed")
def generate(run_dir: str, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1):
    from tpu_llm.config import config_from_dict
    from tpu_llm.controller import print_samples
    from tpu_llm.generate import load_for_generation
    from tpu_llm.tokenizer import check_covers

    model, tokenizer, cfg, notes = load_for_generation(run_dir, with_notes=True)
    sample = {"num_samples": num_samples, "max_new_tokens": max_new_tokens, "prompt": prompt,
              "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    cfg = config_from_dict({**cfg.to_dict(), "sample": sample}, source="command line")  # checks the values
    check_covers(tokenizer, prompt, "--prompt")
    for note in notes:  # e.g. an unreadable newest checkpoint skipped for the previous one
        print(f"warning   {note}", file=sys.stderr, flush=True)
    print_samples(model, tokenizer, cfg)


@command("export", "write a run's newest checkpoint as a SavedModel plus Keras weights, or in the HF layout",
         "tpu-llm export --run_dir runs/tiny --output exports/tiny",
         details="""
--format savedmodel: the SavedModel has two signatures: logits (tokens int32 [batch, time] -> logits)
and generate (tokens, max_new_tokens, temperature, top_k, top_p, seed -> ids); model.weights.h5,
config.yaml and the tokenizer are written beside it. See tpu_llm/export.py.
--format hf: config.json, model.safetensors, generation_config.json and the tokenizer files, which
transformers' AutoModelForCausalLM.from_pretrained loads (GPT2LMHeadModel or LlamaForCausalLM). See
tpu_llm/hf.py and docs/hugging-face.md.""",
         run_dir="the run directory of a `tpu-llm train` run", output="where to write (default <run_dir>/export, "
         "<run_dir>/hf with --format hf)", overwrite="replace an earlier export at --output",
         format="savedmodel | hf (Hugging Face: safetensors and config.json)",
         dtype="--format hf: weights as auto (an imported run's own dtype, else float32) | float32 | bfloat16 | float16")
def export(run_dir: str, output: str = "", overwrite: bool = False, format: str = "savedmodel", dtype: str = "auto"):
    from tpu_llm import export

    if format not in ("savedmodel", "hf"):
        near = _nearest(format, ("savedmodel", "hf"))
        raise UserError(f"--format={format!r}; " + (f"did you mean {near!r}? " if near else "") + "choose savedmodel or hf")
    if format == "hf":
        from tpu_llm import hf

        meta = hf.export(run_dir, output, overwrite=overwrite, dtype=dtype)
        for note in meta.get("notes", []):
            print(f"warning   {note}", file=sys.stderr, flush=True)
        out = meta["output"]
        print(f"exported  {meta['run_dir']} at step {meta['step']} to {out}")
        print(f"saved     Hugging Face {meta['family']} model in {meta['dtype']}: config.json, model.safetensors, "
              f"generation_config.json" + "".join(f", {name}" for name in meta["tokenizer_files"]))
        print(f"use       transformers.AutoModelForCausalLM.from_pretrained({out!r})")
        return
    if dtype != "auto":
        raise UserError("--dtype is for --format hf (the SavedModel is float32)")
    meta = export.export(run_dir, output, overwrite=overwrite)
    for note in meta.get("notes", []):
        print(f"warning   {note}", file=sys.stderr, flush=True)
    out, vocab = meta["output"], meta["vocab_size"]
    print(f"exported  {meta['run_dir']} at step {meta['step']} to {out}")
    print(f"saved     SavedModel: signature logits (tokens int32 [batch, time] -> logits float32 "
          f"[batch, time, {vocab}]), generate (tokens, max_new_tokens, temperature, top_k, top_p, seed -> "
          "ids int32 [batch, max_new_tokens])")
    print(f"weights   {out}/model.weights.h5 (Keras), with config.yaml and the tokenizer beside it")
    print(f"use       tf.saved_model.load({out!r}).signatures['generate'](tokens=..., max_new_tokens=...)")


@command("import", "make a run directory from a Hugging Face checkpoint (GPT-2 or Llama layout)",
         "tpu-llm import --from gpt2 --run_dir runs/gpt2", details="""
--from is a Hugging Face model directory (e.g. `huggingface-cli download gpt2 --local-dir gpt2`):
config.json, model.safetensors or a sharded model.safetensors.index.json, and the tokenizer files.
The new run directory holds config.yaml (the model section mapped from config.json, fine-tuning
defaults for the rest), the tokenizer and a checkpoint at step 0: `generate` and `export` use it as
it is, `train --config <run_dir>/config.yaml --data.train=...` fine-tunes it (docs/hugging-face.md).""",
         **{"from": "the Hugging Face model directory", "run_dir": "the new run directory (must not exist, or be empty)",
            "max_len": "llama: a shorter context than config.json's max_position_embeddings (it sizes generation's "
                       "KV cache); 0 = config.json's"})
def import_(from_: str, run_dir: str, max_len: int = 0):
    from tpu_llm import hf

    result = hf.import_checkpoint(from_, run_dir, max_len=max_len)
    print(f"imported  {from_} ({result['family']}, {result['params']:,} parameters, {result['dtype']}) "
          f"into {result['run_dir']} at step 0")
    print(f"next      tpu-llm generate --run_dir {result['run_dir']} --prompt 'Hello'")
    print(f"          tpu-llm train --config {result['run_dir']}/config.yaml --data.train=FILES  (fine-tune)")


@command("plan", "memory per chip and step time of a config on a TPU type, without training",
         "tpu-llm plan --config configs/gpt2_125m.yaml --accelerator v5p-16 --set parallel.pipeline_stages=4",
         config=True, details="Refuses (exit 2, after the table) a config that cannot fit.",
         accelerator="a TPU type (v5p-16, v4-8, v5litepod-8, v6e-8) or cpu",
         mfu="the model FLOPs utilisation assumed for the step time")
def plan(config: str = "", overrides: dict | None = None, accelerator: str = "", mfu: float = 0.4):
    from tpu_llm.config import load_config

    cfg = load_config(config or None, overrides)
    if not accelerator:
        raise UserError("plan needs --accelerator: a TPU type such as v5p-16, v4-8, v5litepod-8, v6e-8, or cpu")
    from tpu_llm import plan

    result = plan.plan(cfg, accelerator, mfu=mfu, check=False)
    print(f"plan      {config or 'defaults'}")
    for line in result.lines():
        print(line)
    result.check()  # after the table, so the terms are on screen above the error line


@command("doctor", "first-contact check of this machine: PASS/FAIL per check, with numbers",
         "tpu-llm doctor --run_dir gs://my-bucket/doctor --tpu local", details="""
Run it first on any new machine (TPU VM, pod worker 0, Colab/Kaggle TPU, GPU box, laptop); about two
minutes on a v5e-8. Checks: devices and topology; a tiny run whose pipeline stages and tensor groups
each keep their variables on their own device or TPU core; replicas' weights bit-identical; bfloat16
loss close to float32; a checkpoint round trip in --run_dir (gs:// on a TPU); input pipeline faster
than the step; measured step time against `tpu-llm plan`. Writes <run_dir>/doctor.json; exits 2 when
a check fails, with what to do under each FAIL line (docs/doctor.md).""",
         run_dir="where doctor.json and the round-trip checkpoint go (gs:// on a TPU)",
         tpu="as train's tpu= ('' finds a Colab/Kaggle TPU or TPU_NAME, local on a TPU VM, a name or grpc://)",
         strategy="as train's strategy=", cpu_devices="logical CPU devices when there is no accelerator",
         stages="pipeline stages of the tiny run (0 = chosen from the devices)",
         tensor="tensor groups of the tiny run (0 = chosen from the devices)", steps="steps of each tiny run")
def doctor(run_dir: str = "runs/doctor", tpu: str = "", strategy: str = "auto", cpu_devices: int = 8,
           stages: int = 0, tensor: int = 0, steps: int = 4):
    from tpu_llm import doctor

    doctor.main(run_dir=run_dir, tpu=tpu, strategy=strategy, cpu_devices=cpu_devices, stages=stages,
                tensor=tensor, steps=steps)


@command("info", "what this machine offers (GPUs, TPU, TF_CONFIG) and which strategy a run would use",
         "tpu-llm info --config configs/tiny.yaml", config=True)
def info(config: str = "", overrides: dict | None = None):
    from tpu_llm.config import load_config

    cfg = load_config(config or None, overrides)
    import tensorflow as tf

    from tpu_llm import distribute

    found = distribute.look_around(cfg)
    print(f"tensorflow {tf.__version__}, keras {__import__('keras').__version__}")
    for line in found.describe():
        print(line)
    name, reason = distribute.choose(cfg, found)
    print(f"strategy  {name} ({reason})")


@command("config", "print the effective config (defaults <- --config <- overrides) as YAML",
         "tpu-llm config --config configs/tiny.yaml --model.n_layer=6", config=True,
         reference="print every config key with its default and meaning instead")
def config_(config: str = "", overrides: dict | None = None, reference: bool = False):
    from tpu_llm.config import load_config

    cfg = load_config(config or None, overrides)
    if reference:
        from tpu_llm.config_reference import reference as make_reference

        print(make_reference(), end="")
    else:
        print(cfg.to_yaml(), end="")


BENCH_SUITES = ("shakespeare_char", "strategies", "modes", "pipeline", "comm", "families", "memory", "data")


@command("bench", "benchmarks: tokens/s, MFU and losses (docs/benchmarks.md)",
         "tpu-llm bench strategies --steps 100", config=True, positional="suite", details="""
Suites: shakespeare_char (nanoGPT's CPU reference run), strategies (every strategy on
configs/tiny.yaml), modes (eager / graph / xla, float32 / bfloat16), pipeline (GPipe P x M, measured
vs simulated), comm (gradient compression and local SGD), families (gpt2 vs llama on Shakespeare at
matched size, and the planner on a 1B llama), memory (chunked loss and blockwise attention: XLA's peak
memory vs the planner, speed, longest context; --only xla|speed|context), data (the input pipeline
against a v5p-16's demand on configs/gpt2_125m.yaml: throughput, resume time, memory, batch diversity).""",
         suite="which benchmark: " + ", ".join(BENCH_SUITES), data="shakespeare_char: the tinyshakespeare text",
         steps="steps per run (0 = the suite's default)", run_dir="shakespeare_char: keep the run here "
         "(default: a temporary directory)", only="strategies, comm: run only the rows whose name contains this; "
         "memory: xla, speed or context")
def bench(suite: str = "shakespeare_char", data: str = "", steps: int = 0, config: str = "", run_dir: str = "",
          only: str = "", overrides: dict | None = None):
    from tpu_llm import bench

    if suite not in BENCH_SUITES:
        near = _nearest(suite, BENCH_SUITES)
        raise UserError(f"unknown benchmark {suite!r}; " + (f"did you mean {near!r}? " if near else "")
                        + f"choose {', '.join(BENCH_SUITES)}")
    if suite != "shakespeare_char" and (overrides or data or run_dir):
        given = [f"--{k}" for k in overrides or {}] + ["--data"] * bool(data) + ["--run_dir"] * bool(run_dir)
        raise UserError(f"bench {suite} runs fixed cases from --config (default configs/tiny.yaml) and takes no "
                        f"{', '.join(given)}; only shakespeare_char does")
    if suite == "strategies":
        bench.strategies(steps=steps or 200, config=config or "configs/tiny.yaml", only=only)
    elif suite == "modes":
        bench.modes(steps=steps or 100, config=config or "configs/tiny.yaml")
    elif suite == "pipeline":
        bench.pipeline_stages(steps=steps or 60, config=config or "configs/tiny.yaml")
    elif suite == "memory":  # chunked loss and blockwise attention (docs/memory.md)
        if only not in ("", "xla", "speed", "context"):
            raise UserError(f"--only={only!r}: bench memory runs xla, speed or context (or all three without --only)")
        bench.memory(steps=steps or 60, only=only)
    elif suite == "comm":  # compression and local SGD against sync and async data parallel
        bench.comm(steps=steps or 100, config=config or "configs/tiny.yaml", only=only)
    elif suite == "families":  # gpt2 vs llama; its configs are fixed (bench.FAMILY_CONFIGS)
        if config:
            raise UserError("bench families runs configs/shakespeare_char.yaml and configs/shakespeare_char_llama.yaml;"
                            " drop --config")
        bench.families(steps=steps or 2000)
    elif suite == "data":  # the input pipeline alone, against a slice's demand
        bench.data_pipeline(steps=steps or 20, config=config or "configs/gpt2_125m.yaml")
    else:
        bench.shakespeare_char(data=data, steps=steps or 2000, config=config or "configs/shakespeare_char.yaml",
                               run_dir=run_dir, overrides=overrides)


@command("data prepare", "tokenize text once into TFRecord shards (what TPU pods read)",
         "tpu-llm data prepare --input 'corpus/*.txt' --output shards/ --tokenizer byte",
         input="text files or globs, comma-separated (default: the embedded corpus)",
         output="directory for the shards (local or gs://)", tokenizer="byte | char | sentencepiece | hf",
         tokenizer_model="the SentencePiece .model file (sentencepiece); an HF model directory or its tokenizer.json (hf)",
         shards="number of shard files, balanced by tokens (never empty; docs/data.md: how many)",
         overwrite="replace shards already in --output")
def data_prepare(input: str = "", output: str = "", tokenizer: str = "byte", tokenizer_model: str = "",
                 shards: int = 8, overwrite: bool = False):
    from tpu_llm.config import TOKENIZERS

    if not output:
        raise UserError("data prepare needs --output DIR (local or gs://) for the shards")
    if shards < 1:
        raise UserError(f"--shards={shards} must be a positive integer")
    if tokenizer not in TOKENIZERS:
        raise UserError(f"--tokenizer={tokenizer!r}; valid choices: {', '.join(TOKENIZERS)}")
    from tpu_llm import data, perf, prepare, sources
    from tpu_llm.tokenizer import build_tokenizer

    if input:
        files = sources.expand_globs(input, "--input")
        sources.detect_format(files, "text", "--input")
        source = sources.Source(files, "text", description=f"{input}: {len(files)} files")
    else:
        files = sources.embedded_corpus_files()
        source = sources.Source(files, "text", description=f"embedded corpus: {len(files)} files")
    tok = build_tokenizer(tokenizer, tokenizer_model, files)
    print(f"tokenizing {source.description} with the {tok.kind} tokenizer into {shards} shards")
    bar = perf.Progress(len(files), label="files ")
    meta = prepare.write_shards(source, tok, output, shards, overwrite=overwrite,
                                progress=lambda i, n, tokens: (i % 50 == 0 or i == n) and bar.update(
                                    i, f"{perf.format_count(tokens)} tokens"))
    bar.close()
    print(f"wrote {meta['tokens']:,} tokens in {meta['records']:,} records to {output} "
          f"({meta['shards']} shards, {meta['seconds']} s); train with "
          f"--data.train='{output.rstrip('/')}/*.tfrecord' --data.tokenizer={tok.kind}")


@command("tokenizer train", "train a SentencePiece tokenizer (BPE with byte fallback)",
         "tpu-llm tokenizer train --input 'corpus/*.txt' --vocab_size 8000 --output sp.model",
         input="text files or globs, comma-separated (default: the embedded corpus)",
         vocab_size="pieces in the vocabulary (>= 260)", output="the .model file to write")
def tokenizer_train(input: str = "", vocab_size: int = 8000, output: str = "tokenizer.model"):
    if vocab_size < 260:
        raise UserError(f"--vocab_size={vocab_size} must be an integer >= 260 (256 byte-fallback pieces plus "
                        "specials)")
    from tpu_llm import sources
    from tpu_llm.tokenizer import train_sentencepiece

    files = sources.expand_globs(input, "--input") if input else sources.embedded_corpus_files()
    sources.detect_format(files, "text", "--input")
    tok = train_sentencepiece(files, vocab_size, output)
    print(f"wrote {output}: {tok.vocab_size} pieces from {len(files)} files; use it with "
          f"--data.tokenizer=sentencepiece --data.tokenizer_model={output}")


@command("launch", "run a command on a local cluster of tpu-llm processes (multi_worker or parameter_server)",
         "tpu-llm launch --workers 2 --ps 1 -- train --config configs/tiny.yaml", details="""
Everything after `--` is the tpu-llm command each task runs; only its TF_CONFIG differs. Output lines
are prefixed with the task. See tpu_llm/launch.py.""",
         workers="worker processes", ps="parameter-server tasks; > 0 adds a chief and trains asynchronously",
         network="auto: the tasks get a network namespace with only loopback when the run needs no network and "
                 "the system allows it; open: the host's network (TF's servers listen on every interface)")
def launch(workers: int = 2, ps: int = 0, network: str = "auto", task_args: list | None = None):
    from tpu_llm import launch

    if network not in ("auto", "open"):
        raise UserError(f"tpu-llm launch: --network={network!r}; choose auto or open")
    return launch.launch(workers, ps, task_args or [], network=network)



# --------------------------------------------------------------------------------------------------
# Parsing


def _nearest(name: str, choices) -> str:
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


def parse(argv: list[str]) -> tuple[Command | None, dict]:
    """(command, keyword arguments) for `argv` (without the program name); (None, {}) when help was
    printed. Raises UserError for anything wrong, before any work is done."""
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
        return None, {}
    if i == len(argv) or argv[i] == "--":
        print(overview())
        return None, {}
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
                return None, {}
            raise UserError(f"{PROG} {name} needs a command: {', '.join(members)} (e.g. "
                            f"`{PROG} {name} {members[0]} --help`)")
        sub, i = argv[i], i + 1
        if sub not in members:
            near = _nearest(sub, members)
            raise UserError(f"'{name} {sub}' is not a command; " + (f"did you mean '{name} {near}'? " if near else "")
                            + f"{name} commands: {', '.join(members)}")
        name = f"{name} {sub}"
    elif name not in COMMANDS:
        top = list(dict.fromkeys(c.split()[0] for c in COMMANDS))
        near = _nearest(name, top)
        raise UserError(f"'{name}' is not a command; " + (f"did you mean '{near}'? " if near else "")
                        + f"commands: {', '.join(top)}")
    cmd = COMMANDS[name]
    if help_asked:
        print(help_text(cmd))
        return None, {}
    from tpu_llm.config import parse_set_args

    rest = argv[i:]
    task_args = None
    if cmd.name == "launch":  # what follows `--` goes to every task verbatim (checked below)
        if "--" in rest:
            task_args, rest = rest[rest.index("--") + 1:], rest[:rest.index("--")]
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
            return None, {}
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


# --------------------------------------------------------------------------------------------------
# Entry point


def _quiet_tensorflow(verbose: bool) -> None:
    """Keep TensorFlow's start-up output off the terminal (before it is imported): C++ log lines below
    FATAL (level 2 still lets CUDA's `failed call to cuInit` ERROR line through on a machine without a
    GPU), its Python and absl loggers below ERROR, and Python warnings raised inside TF and Keras."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # the tasks of `tpu-llm launch` inherit it
        return
    import logging
    import warnings

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    for name in ("tensorflow", "absl", "keras"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("tensorflow", "keras", "tf_keras", "absl", "google.protobuf", "h5py", "tensorflow_text"):
        warnings.filterwarnings("ignore", module=module)


# A C++ log line of TensorFlow/XLA below FATAL: absl's format (`I0000 00:00:1796.5  123 file.cc:196] ...`,
# which TF_CPP_MIN_LOG_LEVEL does not govern, e.g. XLA's "Compiled cluster using XLA!"), TSL's format
# (`2026-12-03 09:38:53.252688: E external/.../cuda_platform.cc:51] ...`) and absl's notice before them.
_NATIVE_LOG = re.compile(rb"[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] |"
                         rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] [\w./-]+:\d+\] |"
                         rb"WARNING: All log messages before absl::InitializeLog\(\) is called")


class NativeLogFilter:
    """Drops TensorFlow's C++ log lines (`_NATIVE_LOG`) from file descriptor 2, where C++ writes them,
    and passes everything else on. Python's own `sys.stderr` is pointed straight at the terminal
    (the progress bar still sees a tty); only what reaches fd 2 from native code goes through a pipe
    read by a thread. Installed only when sys.stderr is the process's own (not under pytest's capture
    or in a notebook)."""

    def __init__(self):
        self.active = sys.stderr is sys.__stderr__ and _fileno(sys.stderr) == 2
        if not self.active:
            return
        sys.stderr.flush()
        self.terminal = os.dup(2)
        self.python_stderr = sys.stderr
        sys.stderr = io.TextIOWrapper(io.FileIO(os.dup(self.terminal), "w"), encoding=sys.stderr.encoding,
                                      errors="backslashreplace", line_buffering=True, write_through=True)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()

    def _pump(self, read: int) -> None:
        pending = b""
        while chunk := os.read(read, 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not _NATIVE_LOG.match(line))
            if pending and not _NATIVE_LOG.match(pending + b" " * 80):  # not the start of a log line
                kept, pending = kept + pending, b""
            self._write(kept)
        os.close(read)
        self._write(pending)

    def _write(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self.terminal, data):]
        except OSError:
            pass  # the terminal is gone: go on draining the pipe, so that no writer ever blocks on it

    def close(self) -> None:
        if not self.active:
            return
        sys.stderr.flush()
        os.dup2(self.terminal, 2)  # closes this process's end of the pipe: the thread sees its end
        self.thread.join(timeout=2)  # (a child process still holding the pipe must not hold us up)
        sys.stderr = self.python_stderr


def _fileno(stream) -> int:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return -1


def tensorflow_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


def main(argv: list[str] | None = None) -> int:
    from tpu_llm.errors import EXIT_USER_ERROR, RunStopped

    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv
    verbose = "--verbose" in own or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    _quiet_tensorflow(verbose)
    native = None if verbose else NativeLogFilter()
    try:
        cmd, kwargs = parse(argv)
        if cmd is None:  # --help was printed
            return 0
        if not tensorflow_installed():  # TensorFlow comes with an extra: one wheel per environment
            raise UserError("TensorFlow is not installed: pip install 'tpu-llm[cpu]' (CPU), 'tpu-llm[gpu]' (NVIDIA "
                            "GPUs) or 'tpu-llm[tpu]' (a Cloud TPU VM), one of them per environment")
        result = cmd.run(**kwargs)
        return result if isinstance(result, int) else 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunStopped as e:  # a signal, divergence or a lost cluster task (tpu_llm/fault.py)
        print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if native:
            native.close()
