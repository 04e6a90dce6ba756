"""Command line: `tpu-llm <command>` or `python -m tpu_llm <command>` (Google fire).

  train       train (or resume) a run:  tpu-llm train --config configs/tiny.yaml --model.n_layer=6
  generate    sample from a run:        tpu-llm generate --run_dir runs/tiny --prompt "def "
  data        tpu-llm data prepare --input 'corpus/*.txt' --output shards/ --tokenizer byte
  tokenizer   tpu-llm tokenizer train --input 'corpus/*.txt' --vocab_size 8000 --output sp.model
  bench       tpu-llm bench   (the shakespeare_char benchmark; see README)
  info        tpu-llm info --config configs/tiny.yaml   (devices found, the strategy chosen and why)
  launch      tpu-llm launch --workers 2 [--ps 1] -- train --config configs/tiny.yaml   (local cluster)
  plan        tpu-llm plan --config configs/gpt2_125m.yaml --accelerator v5p-16   (memory, step time)
  export      tpu-llm export --run_dir runs/tiny [--output DIR] [--overwrite]   (SavedModel + Keras weights)
  config      tpu-llm config --config configs/tiny.yaml   (the effective config; --reference: every key)
  doctor      tpu-llm doctor [--run_dir gs://bucket/doctor]   (first-contact check of this machine)

Config overrides are dotted flags (`--train.steps=100`) or `--set train.steps=100` (repeatable).
A user mistake prints one line starting with "error:" and exits with status 2.
"""

from __future__ import annotations

import os
import sys


def _quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported


class DataCommands:
    """Pre-tokenize text into TFRecord shards."""

    def prepare(self, input: str = "", output: str = "", tokenizer: str = "byte", tokenizer_model: str = "",
                shards: int = 8, overwrite: bool = False):
        """Tokenize --input (files/globs; "" = embedded corpus) into --shards TFRecord files in --output."""
        from tpu_llm import data, perf
        from tpu_llm.config import DataConfig
        from tpu_llm.errors import UserError
        from tpu_llm.tokenizer import build_tokenizer

        if not output:
            raise UserError("data prepare needs --output DIR (local or gs://) for the shards")
        if not isinstance(shards, int) or shards < 1:
            raise UserError(f"--shards={shards!r} must be a positive integer")
        cfg = DataConfig(train=_join(input), tokenizer=tokenizer, tokenizer_model=tokenizer_model,
                         format="text")
        if cfg.train:
            files = data.expand_globs(cfg.train, "--input")
            data.detect_format(files, "text", "--input")
            source = data.Source(files, "text", description=f"{cfg.train}: {len(files)} files")
        else:
            files = data.embedded_corpus_files()
            source = data.Source(files, "text", description=f"embedded corpus: {len(files)} files")
        tok = build_tokenizer(tokenizer, tokenizer_model, files)
        print(f"tokenizing {source.description} with the {tok.kind} tokenizer into {shards} shards")
        bar = perf.Progress(len(files), label="files ")
        meta = data.write_shards(source, tok, output, shards, overwrite=overwrite,
                                 progress=lambda i, n, tokens: (i % 50 == 0 or i == n) and bar.update(
                                     i, f"{perf.format_count(tokens)} tokens"))
        bar.close()
        print(f"wrote {meta['tokens']:,} tokens in {meta['records']:,} records to {output} "
              f"({meta['shards']} shards, {meta['seconds']} s); train with "
              f"--data.train='{output.rstrip('/')}/*.tfrecord' --data.tokenizer={tok.kind}")


class TokenizerCommands:
    """Train a SentencePiece tokenizer."""

    def train(self, input: str = "", vocab_size: int = 8000, output: str = "tokenizer.model"):
        """Train a BPE SentencePiece model (byte fallback) on --input files/globs; write --output."""
        from tpu_llm import data
        from tpu_llm.errors import UserError
        from tpu_llm.tokenizer import train_sentencepiece

        if not isinstance(vocab_size, int) or vocab_size < 260:
            raise UserError(f"--vocab_size={vocab_size!r} must be an integer >= 260 "
                            "(256 byte-fallback pieces plus specials)")
        files = data.expand_globs(_join(input), "--input") if input else data.embedded_corpus_files()
        data.detect_format(files, "text", "--input")
        tok = train_sentencepiece(files, vocab_size, output)
        print(f"wrote {output}: {tok.vocab_size} pieces from {len(files)} files; use it with "
              f"--data.tokenizer=sentencepiece --data.tokenizer_model={output}")


class Commands:
    def __init__(self):
        self.data = DataCommands()
        self.tokenizer = TokenizerCommands()

    def train(self, config: str = "", set=None, **overrides):
        """Train or resume. --config FILE.yaml; overrides as --section.key=value or --set k=v."""
        from tpu_llm.config import load_config, parse_set_args

        cfg = load_config(config or None, {**parse_set_args(set), **overrides})
        from tpu_llm.controller import train  # TensorFlow loads only once the config is valid

        train(cfg)

    def generate(self, run_dir: str, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1):
        """Sample text from the newest checkpoint of --run_dir."""
        from tpu_llm.config import config_from_dict
        from tpu_llm.controller import print_samples
        from tpu_llm.generate import load_for_generation

        model, tokenizer, cfg = load_for_generation(run_dir)
        sample = {"num_samples": num_samples, "max_new_tokens": max_new_tokens, "prompt": str(prompt),
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        cfg = config_from_dict({**cfg.to_dict(), "sample": sample}, source="command line")  # checks types
        print_samples(model, tokenizer, cfg)

    def export(self, run_dir: str = "", output: str = "", overwrite: bool = False):
        """Write --run_dir's newest checkpoint as a SavedModel (signatures `logits` and `generate`) plus
        model.weights.h5, the config and the tokenizer, to --output (default <run_dir>/export)."""
        from tpu_llm.errors import UserError

        if not run_dir:
            raise UserError("export needs --run_dir: the run directory of a `tpu-llm train` run")
        from tpu_llm import export

        meta = export.export(str(run_dir), str(output or ""), overwrite=bool(overwrite))
        out, vocab = meta["output"], meta["vocab_size"]
        print(f"exported  {meta['run_dir']} at step {meta['step']} to {out}")
        print(f"saved     SavedModel: signature logits (tokens int32 [batch, time] -> logits float32 "
              f"[batch, time, {vocab}]), generate (tokens, max_new_tokens, temperature, top_k, top_p, seed -> "
              "ids int32 [batch, max_new_tokens])")
        print(f"weights   {out}/model.weights.h5 (Keras), with config.yaml and the tokenizer beside it")
        print(f"use       tf.saved_model.load({out!r}).signatures['generate'](tokens=..., max_new_tokens=...)")

    def config(self, config: str = "", reference: bool = False, set=None, **overrides):
        """Print the effective config (defaults <- --config <- overrides) as YAML; --reference prints
        every key with its default and meaning (the README's reference section)."""
        from tpu_llm.config import load_config, parse_set_args

        cfg = load_config(config or None, {**parse_set_args(set), **overrides})
        if reference:
            from tpu_llm.config_reference import reference as make_reference

            print(make_reference(), end="")
        else:
            print(cfg.to_yaml(), end="")

    def info(self, config: str = "", set=None, **overrides):
        """What this machine offers (GPUs, TPU, TF_CONFIG) and which strategy a run would use, and why."""
        from tpu_llm.config import load_config, parse_set_args

        cfg = load_config(config or None, {**parse_set_args(set), **overrides})
        import tensorflow as tf

        from tpu_llm import distribute

        found = distribute.look_around(cfg)
        print(f"tensorflow {tf.__version__}, keras {__import__('keras').__version__}")
        for line in found.describe():
            print(line)
        name, reason = distribute.choose(cfg, found)
        print(f"strategy  {name} ({reason})")

    def plan(self, config: str = "", accelerator: str = "", mfu: float = 0.4, set=None, **overrides):
        """Memory per chip and step time of a config on --accelerator (v5p-16, v4-8, v5litepod-8, v6e-8,
        cpu) at an assumed --mfu, without training; refuses a config that cannot fit."""
        from tpu_llm.config import load_config, parse_set_args
        from tpu_llm.errors import UserError

        cfg = load_config(config or None, {**parse_set_args(set), **overrides})
        if not accelerator:
            raise UserError("plan needs --accelerator: a TPU type such as v5p-16, v4-8, v5litepod-8, v6e-8, or cpu")
        from tpu_llm import plan

        result = plan.plan(cfg, str(accelerator), mfu=mfu, check=False)
        print(f"plan      {config or 'defaults'}")
        for line in result.lines():
            print(line)
        result.check()  # after the table, so the terms are on screen above the error line

    def doctor(self, run_dir: str = "runs/doctor", tpu: str = "", strategy: str = "auto", cpu_devices: int = 8,
               stages: int = 0, tensor: int = 0, steps: int = 4):
        """First-contact check of this machine (~2 minutes on a v5e-8): devices, per-stage placement,
        replica sync, bfloat16 vs float32, a checkpoint round trip in --run_dir (gs:// on a TPU), input vs
        step speed, measured vs planned step time. Prints PASS/FAIL lines, writes <run_dir>/doctor.json,
        exits 2 when a check fails."""
        from tpu_llm import doctor

        doctor.main(run_dir=str(run_dir), tpu=str(tpu), strategy=str(strategy), cpu_devices=int(cpu_devices),
                    stages=int(stages), tensor=int(tensor), steps=int(steps))

    def bench(self, suite: str = "shakespeare_char", data: str = "", steps: int = 0, config: str = "",
              run_dir: str = "", only: str = "", set=None, **overrides):
        """Benchmarks: `bench` (shakespeare_char: tokens/s, MFU, losses), `bench strategies` (every
        strategy on configs/tiny.yaml: tokens/s, steps/s, losses, parameter-server staleness),
        `bench modes` (eager / graph / xla, float32 / bfloat16), `bench pipeline` (GPipe P x M, measured
        vs simulated), `bench comm` (gradient compression and local SGD: loss, bytes per step, tokens/s)."""
        from tpu_llm import bench
        from tpu_llm.errors import UserError

        if suite == "strategies":
            bench.strategies(steps=steps or 200, config=config or "configs/tiny.yaml", only=only)
            return
        if suite == "modes":
            bench.modes(steps=steps or 100, config=config or "configs/tiny.yaml")
            return
        if suite == "pipeline":
            bench.pipeline_stages(steps=steps or 60, config=config or "configs/tiny.yaml")
            return
        if suite == "comm":  # compression and local SGD against sync and async data parallel
            bench.comm(steps=steps or 100, config=config or "configs/tiny.yaml", only=only)
            return
        if suite != "shakespeare_char":
            raise UserError(f"unknown benchmark {suite!r}; choose shakespeare_char, strategies, modes, pipeline "
                            "or comm")
        steps, config = steps or 2000, config or "configs/shakespeare_char.yaml"
        bench.shakespeare_char(data=data, steps=steps, config=config, run_dir=run_dir, set_args=set,
                         overrides=overrides)


def _join(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value or "")


def _merge_set_flags(argv: list[str]) -> list[str]:
    """Fire keeps only the last of repeated flags: fold every `--set K=V` into one list-valued --set."""
    items, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # what follows is for fire itself
            rest += argv[i:]
            break
        if arg == "--set" and i + 1 < len(argv):
            items.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--set="):
            items.append(arg[len("--set="):])
        else:
            rest.append(arg)
        i += 1
    return argv if len(items) < 2 else rest[:1] + [f"--set={items!r}"] + rest[1:]


def main(argv: list[str] | None = None) -> int:
    _quiet_tensorflow()
    import fire

    from tpu_llm.errors import EXIT_USER_ERROR, RunStopped, UserError

    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["launch"]:  # its own parser: what follows `--` goes to the tasks verbatim
            from tpu_llm import launch

            return launch.main(argv[1:])
        argv = _merge_set_flags(argv)
        fire.Fire(Commands, command=argv, name="tpu-llm")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunStopped as e:  # a signal, divergence or a lost cluster task (tpu_llm/fault.py)
        print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
