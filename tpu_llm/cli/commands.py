"""The commands of `tpu-llm`: one function each, registered with `@command(...)` (cli/parser.py): its name,
a one-line summary, an example, and a help text for each of its parameters, which are the command's
flags (their defaults give their types: bool flags are switches). Adding a command is adding one
function. Each imports what it needs inside its body, so that TensorFlow loads only once the arguments
have been checked.
"""

from __future__ import annotations

import shlex
import sys

from tpu_llm import __version__
from tpu_llm.cli import generate_flags, pjrt
from tpu_llm.cli.parser import command, nearest
# generate's bounds are the config's (checked in generate_flags.py)
from tpu_llm.config import MAX_BEAMS, MAX_NEW_TOKENS, MAX_SAMPLES, SampleConfig
from tpu_llm.errors import UserError
from tpu_llm.platform.run_layout import SP_MODEL_FILE


@command("train", "train a GPT, or resume the run in --run_dir",
         "tpu-llm train --config configs/tiny.yaml --model.n_layer=6 --run_dir runs/six", config=True,
         details="""
Trains to train.steps, evaluating and checkpointing on the way, then prints samples. Re-using a
--run_dir resumes that run from its newest readable checkpoint. Everything that can be checked (the
config, the data, the tokenizer against the data, the run directory, the checkpoints) is checked
before anything in the run directory is written. --dry_run does those checks only and says what the
run would do ("resumes from ckpt-500 at step 500", "starts a new run"): no model, no compile.""",
         dry_run="check config, data, tokenizer, run directory and strategy, print what the run would do, "
                 "and exit without building the model or writing anything")
def train(config: str = "", overrides: dict | None = None, dry_run: bool = False):
    from tpu_llm.config import load_config

    overrides = overrides or {}
    cfg = load_config(config or None, overrides)
    # named in a refusal of the run directory: a command without them lands on an earlier run's directory
    unstated = " and ".join(f"no --{flag}" for flag, given in (("config", bool(config)),
                                                                ("run_dir", "run_dir" in overrides)) if not given)
    if dry_run:
        from tpu_llm.training.dry_run import dry_run as check

        check(cfg, unstated=unstated)
        return
    print("starting  loading TensorFlow ...", flush=True)  # the import takes 10-30 s (training/progress.py)
    from tpu_llm import api  # TensorFlow loads only once the config is valid
    from tpu_llm.training.goodput import command_started

    # the interpreter's and TensorFlow's start-up count as the run's
    api.train(cfg, started=command_started(), unstated=unstated)


@command("generate", "sample text from the newest checkpoint of a run",
         "tpu-llm generate --run_dir runs/tiny --prompt 'def ' --max_new_tokens 100 --temperature 0.7",
         details=f"""
A prompt character that the run's tokenizer cannot represent (a char vocabulary built from other
text) is an error: the model never saw the unknown id it would become. Every flag is checked before
the model loads: --max_new_tokens 1 to {MAX_NEW_TOKENS:,}, --num_samples 1 to {MAX_SAMPLES:,}, --temperature
finite and >= 0, --top_p in (0, 1], --top_k >= 0, the prompt UTF-8 text.

--num_beams N (2 to {MAX_BEAMS}, with --temperature 0) searches N beams instead of sampling, as
transformers' generate(num_beams=N, do_sample=False) does, and prints the --num_return_sequences best.""",
         run_dir="the run directory of a `tpu-llm train` run", prompt="text to continue (default: start "
         "after an end-of-text token)", prompt_file="a UTF-8 text file holding the prompt, taken verbatim (a final "
         "newline included); for long prompts, instead of --prompt",
         max_new_tokens=f"tokens generated per sample (1 to {MAX_NEW_TOKENS:,})",
         temperature="sampling temperature; 0 = greedy", top_k="sample from the k most likely tokens; 0 = off",
         top_p="sample from the smallest set of tokens holding this probability; 1.0 = off",
         seed="sample i draws with seed + i: the same seed gives the same text",
         num_samples=f"samples printed (1 to {MAX_SAMPLES:,})",
         num_beams=f"beams searched (1 to {MAX_BEAMS}); 1 = off (sample); more needs --temperature 0",
         length_penalty="beam search: a finished beam scores sum(log p) / length ** this; > 0 favours long ones",
         early_stopping="beam search: false | true (stop at num_beams finished beams) | never (transformers')",
         num_return_sequences="beam search: the best beams printed (1 to --num_beams)")
def generate(run_dir: str, prompt: str = "", prompt_file: str = "", max_new_tokens: int = 200,
             temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1,
             num_beams: int = SampleConfig.num_beams, length_penalty: float = SampleConfig.length_penalty,
             early_stopping: str = SampleConfig.early_stopping,
             num_return_sequences: int = SampleConfig.num_return_sequences):
    prompt = generate_flags.read_prompt(prompt, prompt_file)  # all checked before TensorFlow loads (seconds)
    generate_flags.check_sampling(max_new_tokens, temperature, top_k, top_p, seed, num_samples)
    early_stopping = early_stopping.lower()
    generate_flags.check_beams(num_beams, length_penalty, early_stopping, num_return_sequences, temperature,
                               num_samples)
    generate_flags.check_run_dir(run_dir)
    from tpu_llm import api
    from tpu_llm.training.controller import say_now

    run = api.load(run_dir)
    for note in run.notes:  # e.g. an unreadable newest checkpoint skipped for the previous one
        print(f"warning   {note}", file=sys.stderr, flush=True)
    run.samples(prompt, num_samples, max_new_tokens, temperature, top_k, top_p, seed, say=say_now,
                prompt_source="--prompt_file" if prompt_file else "--prompt", num_beams=num_beams,
                length_penalty=length_penalty, early_stopping=early_stopping,
                num_return_sequences=num_return_sequences)


EXPORT_FORMATS = ("savedmodel", "hf", "peft", "run")


@command("export", "write a run's newest checkpoint as a SavedModel plus Keras weights, or in the HF layout",
         "tpu-llm export --run_dir runs/tiny --output exports/tiny",
         details="""
--format savedmodel: the SavedModel has two signatures: logits (tokens int32 [batch, time] -> logits)
and generate (tokens, max_new_tokens, temperature, top_k, top_p, seed -> ids); model.weights.h5,
config.yaml and the tokenizer are written beside it. See tpu_llm/interop/export.py.
--format hf: config.json, model.safetensors, generation_config.json and the tokenizer files, which
transformers' AutoModelForCausalLM.from_pretrained loads (GPT2LMHeadModel or LlamaForCausalLM). See
tpu_llm/interop/hf_export.py and docs/hugging-face.md; a LoRA run's adapters come merged into the weights.
--format peft: a LoRA run's adapters (adapter_config.json, adapter_model.safetensors), which
peft.PeftModel.from_pretrained puts on the base transformers model. See docs/lora.md.
--format run: a new run directory (default <run_dir>-merged) holding the newest weights as its checkpoint
at step 0, a LoRA run's adapters merged in, with the run's config and tokenizer: a base run for
train.init_from (a LoRA run is none; docs/lora.md).""",
         run_dir="the run directory of a `tpu-llm train` run", output="where to write (default <run_dir>/export, "
         "<run_dir>/hf or <run_dir>/peft with those formats, <run_dir>-merged with run)",
         overwrite="replace an earlier export at --output (not with run: a run directory is never replaced)",
         format="savedmodel | hf (Hugging Face: safetensors and config.json) | peft (a LoRA run's adapters) | run "
                "(a new run directory, adapters merged: a base for train.init_from)",
         dtype="--format hf: weights as auto (an imported run's own dtype, else float32) | float32 | bfloat16 | float16")
def export(run_dir: str, output: str = "", overwrite: bool = False, format: str = "savedmodel", dtype: str = "auto"):
    from tpu_llm.interop import export

    if format not in EXPORT_FORMATS:
        near = nearest(format, EXPORT_FORMATS)
        raise UserError(f"--format={format!r}; " + (f"did you mean {near!r}? " if near else "") +
                        "choose savedmodel, hf, peft or run")
    if format == "run":
        if dtype != "auto" or overwrite:
            raise UserError("--format run takes neither --dtype (its weights are float32) nor --overwrite (a run "
                            "directory is never replaced: give a new --output)")
        meta = export.export_run(run_dir, output)
        for note in meta.get("notes", []):
            print(f"warning   {note}", file=sys.stderr, flush=True)
        print(f"exported  {meta['run_dir']} at step {meta['step']} to {meta['output']}")
        print(f"saved     a run directory: its {meta['params']:,} weights (any LoRA adapters merged in) at step 0, "
              f"config.yaml without adapters, the {meta['tokenizer']} tokenizer")
        out = shlex.quote(meta["output"])
        print(f"use       train.init_from={out}, e.g. tpu-llm train --config {out}/config.yaml --run_dir NEW "
              f"--train.init_from={out} --train.lora_rank=8")
        return
    if format == "peft":
        from tpu_llm.interop import peft

        if dtype != "auto":
            raise UserError("--dtype is for --format hf (PEFT's adapters are float32)")
        meta = peft.export(run_dir, output, overwrite=overwrite)
        for note in meta.get("notes", []):
            print(f"warning   {note}", file=sys.stderr, flush=True)
        print(f"exported  {meta['run_dir']} at step {meta['step']} to {meta['output']}")
        print(f"saved     {meta['adapters']} LoRA adapters of rank {meta['rank']} in PEFT's format: "
              f"{peft.CONFIG_FILE}, {peft.WEIGHTS_FILE}")
        print(f"use       peft.PeftModel.from_pretrained(base_model, {meta['output']!r})")
        return
    if format == "hf":
        from tpu_llm.interop import hf_export

        meta = hf_export.export(run_dir, output, overwrite=overwrite, dtype=dtype)
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
                       "KV cache); 0 = config.json's",
            "allow_non_finite": "import tensors holding NaN or infinity (refused otherwise: a damaged download)",
            "adapter": "a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to put on "
                       "the model: a LoRA run (docs/lora.md)"})
def import_(from_: str, run_dir: str, max_len: int = 0, allow_non_finite: bool = False, adapter: str = ""):
    from tpu_llm.interop import hf, peft

    options = {"max_len": max_len, "allow_non_finite": allow_non_finite,
               "warn": lambda line: print(line, file=sys.stderr)}
    result = (peft.import_with_adapter(from_, run_dir, adapter, **options) if adapter
              else hf.import_checkpoint(from_, run_dir, **options))
    lora = f" with the LoRA adapter {adapter} (rank {result['adapter_rank']})" if adapter else ""
    print(f"imported  {from_} ({result['family']}, {result['params']:,} parameters, {result['dtype']}){lora} "
          f"into {result['run_dir']} at step 0")
    print(f"next      tpu-llm generate --run_dir {result['run_dir']} --prompt 'Hello'")
    # the hf tokenizer trains on shards only: the fine-tune hint tokenizes first (both lines work as printed)
    shards = f"{result['run_dir'].rstrip('/')}-shards"
    print(f"          tpu-llm data prepare --input 'corpus/*.txt' --output {shards} --tokenizer hf "
          f"--tokenizer_model {result['run_dir']}  (tokenize your text for fine-tuning)")
    print(f"          tpu-llm train --config {result['run_dir']}/config.yaml {train_flags(shards, 'hf')}  (fine-tune)")


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
    from tpu_llm.tools import plan

    result = plan.plan(cfg, accelerator, mfu=mfu, check=False)
    print(f"plan      {config or 'defaults'}")
    for line in result.lines():
        print(line)
    result.check()  # after the table, so the terms are on screen above the error line


@command("doctor", "first-contact check of this machine: PASS/FAIL per check, with numbers",
         "tpu-llm doctor --run_dir gs://my-bucket/doctor --tpu local", details="""
Run it first on any new machine (TPU VM, pod worker 0, Colab/Kaggle TPU, GPU box, laptop); about two
minutes on a v5e-8. A tiny data-parallel run first (one replica per TPU core, GPU or logical CPU):
devices; replicas' weights bit-identical; bfloat16 loss close to float32; a checkpoint round trip in
--run_dir (gs:// on a TPU); input pipeline faster than the step; measured step time against `tpu-llm
plan`; memory. Then, as its own line, the same model in pipeline stages x tensor groups sized to the
devices found (2 x 2 where 4 divides their number, 2 x 1 on two, none on one): each stage on its own
device or core, the same loss. On a TPU VM last, the same layout one step in mixed_bfloat16, dropout 0.1,
grad_accum 2 under the default and the MLIR bridge: its matmuls per core in the HLO XLA dumps (hlo lines).
Writes <run_dir>/doctor.json; exits 2 when a check fails, with what to do under each FAIL line
(docs/doctor.md).""",
         run_dir="where doctor.json and the round-trip checkpoint go (gs:// on a TPU)",
         tpu="as train's tpu= ('' finds a Colab/Kaggle TPU or TPU_NAME, local on a TPU VM, a name or grpc://)",
         strategy="as train's strategy=", cpu_devices="logical CPU devices when there is no accelerator",
         stages="pipeline stages of the model-parallel run (0 = chosen from the devices)",
         tensor="tensor groups of the model-parallel run (0 = chosen from the devices)", steps="steps of each tiny run")
def doctor(run_dir: str = "runs/doctor", tpu: str = "", strategy: str = "auto", cpu_devices: int = 8,
           stages: int = 0, tensor: int = 0, steps: int = 4):
    import tempfile

    from tpu_llm.platform import xla_flags

    # XLA reads XLA_FLAGS once, on first use: the hlo lines' dump is asked for before TensorFlow is imported
    dump = "" if pjrt.not_here(tpu) else xla_flags.ask_dump(tempfile.mkdtemp(prefix=xla_flags.PREFIX))
    from tpu_llm.tools import doctor

    # the runtime and libtpu `main` pointed TensorFlow at (pjrt.set_variables), said on doctor's first lines
    doctor.main(run_dir=run_dir, tpu=tpu, strategy=strategy, cpu_devices=cpu_devices, stages=stages,
                tensor=tensor, steps=steps, runtime=pjrt.describe(), hlo_dump=dump)


@command("info", "what this machine offers (GPUs, TPU, TF_CONFIG) and which strategy a run would use",
         "tpu-llm info --config configs/tiny.yaml", config=True)
def info(config: str = "", overrides: dict | None = None):
    from tpu_llm.config import load_config

    cfg = load_config(config or None, overrides)
    import tensorflow as tf

    from tpu_llm.parallel import distribute

    found = distribute.look_around(cfg)
    print(f"tpu-llm {__version__}, tensorflow {tf.__version__}, keras {__import__('keras').__version__}")
    for line in found.describe():
        print(line)
    name, reason = distribute.choose(cfg, found)
    print(f"strategy  {name} ({reason})")


@command("config", "print the effective config (defaults <- --config <- overrides) as YAML",
         "tpu-llm config --config tiny --model.n_layer=6", config=True,
         reference="print every config key with its default and meaning instead",
         list="list the presets shipped in the package (--config NAME) with what each is for")
def config_(config: str = "", overrides: dict | None = None, reference: bool = False, list_: bool = False):
    from tpu_llm.config import load_config
    from tpu_llm.config.reading import presets

    if list_:
        for name, path in presets().items():
            print(f"{name:<24} {_preset_summary(path)}")
        return
    cfg = load_config(config or None, overrides)
    if reference:
        from tpu_llm.tools.config_reference import reference as make_reference

        print(make_reference(), end="")
    else:
        print(cfg.to_yaml(), end="")


def _preset_summary(path: str) -> str:
    """The first sentence of a preset file's leading comment: what it is for."""
    words = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            words += line.lstrip("#").split()
    text = " ".join(words)
    return text.split(". ", 1)[0].rstrip(".")


BENCH_SUITES = ("shakespeare_char", "strategies", "modes", "pipeline", "comm", "families", "memory", "data",
                "placement")


@command("bench", "benchmarks: tokens/s, MFU and losses (docs/benchmarks.md)",
         "tpu-llm bench strategies --steps 100", config=True, positional="suite", details="""
Suites: shakespeare_char (nanoGPT's CPU reference run), strategies (every strategy on
configs/tiny.yaml), modes (eager / graph / xla, float32 / bfloat16), pipeline (GPipe P x M, measured
vs simulated), comm (gradient compression and local SGD), families (gpt2 vs llama on Shakespeare at
matched size, and the planner on a 1B llama), memory (chunked loss and blockwise attention: XLA's peak
memory vs the planner, speed, longest context, LoRA vs full fine-tuning, AdamW's moments divided over
replicas; --only xla|speed|context|lora|shard), data (the input pipeline
against a v5p-16's demand on configs/gpt2_125m.yaml: throughput, resume time, memory, batch diversity),
placement (where the train step's matmuls, collectives and variables run on a replica's TPU cores for
each P x T, in the HLO a TPU would compile, made offline through TPUStrategy; docs/pipeline-tensor.md).""",
         suite="which benchmark: " + ", ".join(BENCH_SUITES), data="shakespeare_char: the tinyshakespeare text",
         steps="steps per run (0 = the suite's default)", run_dir="shakespeare_char: keep the run here "
         "(default: a temporary directory)", only="strategies, comm: run only the rows whose name contains this; "
         "memory: xla, speed, context, lora or shard")
def bench(suite: str = "shakespeare_char", data: str = "", steps: int = 0, config: str = "", run_dir: str = "",
          only: str = "", overrides: dict | None = None):
    from tpu_llm.tools import bench, bench_data, bench_memory

    if suite not in BENCH_SUITES:
        near = nearest(suite, BENCH_SUITES)
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
        if only not in ("", "xla", "speed", "context", "lora", "shard"):
            raise UserError(f"--only={only!r}: bench memory runs xla, speed, context, lora or shard (or all five "
                            "without --only)")
        bench_memory.memory(steps=steps or 60, only=only)
    elif suite == "comm":  # compression and local SGD against sync and async data parallel
        bench.comm(steps=steps or 100, config=config or "configs/tiny.yaml", only=only)
    elif suite == "families":  # gpt2 vs llama; its configs are fixed (bench.FAMILY_CONFIGS)
        if config:
            raise UserError("bench families runs configs/shakespeare_char.yaml and configs/shakespeare_char_llama.yaml;"
                            " drop --config")
        bench.families(steps=steps or 2000)
    elif suite == "data":  # the input pipeline alone, against a slice's demand
        bench_data.data_pipeline(steps=steps or 20, config=config or "configs/gpt2_125m.yaml")
    elif suite == "placement":  # the train step's work per TPU core, compiled offline as a TPU would
        from tpu_llm.harness import placement_audit

        problems = [p for audit in placement_audit.run() for p in audit.problems()]
        if problems:
            raise UserError(f"{len(problems)} placement problem(s) in the compiled step, listed above as NOT PLACED")
    else:
        bench.shakespeare_char(data=data, steps=steps or 2000, config=config or "configs/shakespeare_char.yaml",
                               run_dir=run_dir, overrides=overrides)


@command("data prepare", "tokenize text once into TFRecord shards (what TPU pods read)",
         "tpu-llm data prepare --input 'corpus/*.txt' --output shards/ --tokenizer byte",
         input="text files or globs, comma-separated (default: the embedded corpus)",
         output="directory for the shards (local or gs://)", tokenizer="byte | char | sentencepiece | hf",
         tokenizer_model="the SentencePiece .model file (sentencepiece); an HF model directory or its tokenizer.json (hf)",
         shards="number of shard files, balanced by tokens (never empty; docs/data.md: how many)",
         overwrite="replace data prepare's own files already in --output (its shards, meta.json, tokenizer; "
                   "nothing else; never a run directory)")
def data_prepare(input: str = "", output: str = "", tokenizer: str = "byte", tokenizer_model: str = "",
                 shards: int = 8, overwrite: bool = False):
    from tpu_llm.config import TOKENIZERS

    if not output:
        raise UserError("data prepare needs --output DIR (local or gs://) for the shards")
    if shards < 1:
        raise UserError(f"--shards={shards} must be a positive integer")
    if tokenizer not in TOKENIZERS:
        raise UserError(f"--tokenizer={tokenizer!r}; valid choices: {', '.join(TOKENIZERS)}")
    from tpu_llm.data import prepare, sources
    from tpu_llm.platform import perf
    from tpu_llm.tokenizers import build_tokenizer

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
          f"({meta['shards']} shards, {meta['seconds']} s); train with {train_flags(output, tok.kind)}")


def train_flags(shard_dir: str, kind: str) -> str:
    """The `train` flags that read shards written by `data prepare` (a hint that must work as printed:
    sentencepiece needs its model file, which prepare saved beside the shards)."""
    shard_dir = shard_dir.rstrip("/")
    flags = f"--data.train='{shard_dir}/*.tfrecord' --data.tokenizer={kind}"
    if kind == "sentencepiece":
        flags += f" --data.tokenizer_model='{shard_dir}/{SP_MODEL_FILE}'"
    return flags


@command("tokenizer train", "train a SentencePiece tokenizer (BPE with byte fallback)",
         "tpu-llm tokenizer train --input 'corpus/*.txt' --vocab_size 8000 --output sp.model",
         input="text files or globs, comma-separated (default: the embedded corpus)",
         vocab_size="pieces in the vocabulary (>= 260)", output="the .model file to write")
def tokenizer_train(input: str = "", vocab_size: int = 8000, output: str = "tokenizer.model"):
    if vocab_size < 260:
        raise UserError(f"--vocab_size={vocab_size} must be an integer >= 260 (256 byte-fallback pieces plus "
                        "specials)")
    from tpu_llm.data import sources
    from tpu_llm.tokenizers import train_sentencepiece

    files = sources.expand_globs(input, "--input") if input else sources.embedded_corpus_files()
    sources.detect_format(files, "text", "--input")
    tok = train_sentencepiece(files, vocab_size, output)
    print(f"wrote {output}: {tok.vocab_size} pieces from {len(files)} files; use it with "
          f"--data.tokenizer=sentencepiece --data.tokenizer_model={output}")


@command("launch", "run a command on a local cluster of tpu-llm processes (multi_worker or parameter_server)",
         "tpu-llm launch --workers 2 --ps 1 -- train --config configs/tiny.yaml", details="""
Everything after `--` is the tpu-llm command each task runs; only its TF_CONFIG differs. Output lines
are prefixed with the task. See tpu_llm/parallel/launch.py.""",
         workers="worker processes", ps="parameter-server tasks; > 0 adds a chief and trains asynchronously",
         network="auto: the tasks get a network namespace with only loopback when the run needs no network and "
                 "the system allows it; open: the host's network (TF's servers listen on every interface)")
def launch(workers: int = 2, ps: int = 0, network: str = "auto", task_args: list | None = None):
    from tpu_llm.parallel import launch

    if network not in ("auto", "open"):
        raise UserError(f"tpu-llm launch: --network={network!r}; choose auto or open")
    return launch.launch(workers, ps, task_args or [], network=network)


@command("report", "where a run's wall time went (goodput by category, across resumes) and its loss curve",
         "tpu-llm report --run_dir runs/tiny", details="""
Reads <run_dir>/goodput.jsonl (what each training process of the run recorded) and metrics.jsonl, and
prints the wall time split into productive steps, compilation, evaluation, checkpoints, profiling,
sampling, start-up, restarts (start-up of resumed processes, steps done twice, killed processes'
unrecorded ends) and the rest, with the goodput (productive / wall time). Where matplotlib is
importable it also writes a PNG of the loss curves and the time per category (docs/goodput.md).""",
         run_dir="the run directory of a `tpu-llm train` run", plot="the PNG to write (default: <run_dir>/report.png)")
def report(run_dir: str, plot: str = ""):
    from tpu_llm.tools.report import report as make_report  # no TensorFlow for a local run directory

    make_report(run_dir, plot)


@command("eval", "score a run on lm-evaluation-harness tasks, or a text file's perplexity (docs/evaluation.md)",
         "tpu-llm eval --run_dir runs/tiny --tasks tiny_choice --include_path tests/data/eval_tasks", details="""
Runs EleutherAI's lm-evaluation-harness (lm_eval, `pip install 'tpu-llm[eval]'`) with this run as its model:
lm-eval builds the requests and computes the metrics, tpu-llm scores them (loglikelihood, rolling
perplexity, greedy generation) on the newest readable checkpoint. Prints lm-eval's table; --output writes
its results as JSON, and with --log_samples each task's per-sample records next to it
(<output stem>_samples_<task>.jsonl). A task YAML can run Python (`!function`): --include_path is trusted input.

--text FILE instead of --tasks: the perplexity of a UTF-8 text file, the whole file as one document, in
lm-eval's rolling windows and with its metrics (word_perplexity, byte_perplexity, bits_per_byte), as its
wikitext task reports them. Scored over every device found (train's strategy=auto; generation on one).""",
         run_dir="the run directory of a `tpu-llm train` or `tpu-llm import` run",
         tasks="lm-eval task, group or tag names, comma-separated (hellaswag,arc_easy); or --text",
         text="a UTF-8 text file to score as one document (instead of --tasks)",
         include_path="a folder of your own task YAML files (trusted: they can run Python)",
         num_fewshot="few-shot examples per prompt (default: each task's own)",
         limit="documents per task, >= 1 (default: all)",
         batch_size="requests scored at once on each device", output="the results JSON to write",
         log_samples="also write each task's per-sample records next to --output",
         cpu_devices="logical CPU devices to score over when there is no accelerator", tpu="as train's tpu=")
def eval_(run_dir: str, tasks: str = "", text: str = "", include_path: str = "", num_fewshot: str = "",
          limit: str = "", batch_size: int = 8, output: str = "", log_samples: bool = False, cpu_devices: int = 1,
          tpu: str = ""):
    from tpu_llm.eval.run import command

    command(run_dir, tasks, text, include_path, num_fewshot, limit, batch_size, output, log_samples, cpu_devices, tpu)
