"""Run configuration: one schema, every default defined once.

A run is configured by the dataclasses below, then a YAML file (`configs/*.yaml`), then command-line
overrides in dotted form (`--model.n_layer=6`, or `--set model.n_layer=6`), later layers winning.
Unknown keys, wrong types and inconsistent values are rejected with a one-line `UserError` naming the
key and the valid choices. `docs`-style help for every field is its comment here.

A config may come from elsewhere (a copied run's config.yaml, a Hugging Face config.json mapped by
tpu_llm/interop/hf.py), so reading it is bounded: a YAML file of at most MAX_CONFIG_BYTES (reading the
file, the `--set` arguments and a mapping onto the dataclasses: tpu_llm/config_reading.py), sizes and
counts under CAPS and a model of at most MAX_PARAMS parameters (checked first), messages that echo a
value cut short, and no message built unless its check fails.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from typing import Any

import yaml

from tpu_llm.model import families, spec
from tpu_llm.model.families.base import divisors as _divisors
from tpu_llm.config_lora import lora_targets, validate_lora  # noqa: F401 (re-exported)
from tpu_llm.config_reading import REPR, apply_mapping, config_file, read_yaml, set_dotted
from tpu_llm.config_reading import check as _check

TOKENIZERS = ("byte", "char", "sentencepiece", "hf")
DATA_FORMATS = ("auto", "text", "tfrecord")
STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "parameter_server", "default")
COMMUNICATIONS = ("auto", "ring", "nccl")
BAD_STEP_ACTIONS = ("skip", "rollback")
PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
EXECUTIONS = ("xla", "graph", "eager")
SCHEDULES = ("gpipe",)
COMPRESSIONS = ("none", "bf16", "powersgd", "topk")
OUTER_OPTIMIZERS = ("sgd", "nesterov")
ATTENTIONS = ("dense", "blockwise")
EARLY_STOPPING = ("false", "true", "never")  # sample.early_stopping: transformers' False, True, "never"
# each beam is a row of the KV cache (num_beams contexts in memory); published beam searches use 1 to 10
MAX_BEAMS = 64

# Upper bounds of sizes and counts, checked before anything else (validate): a value from a file or a
# flag must not reach a loop, a message or an allocation that it would make run for hours. Each is far
# above any real use: the largest published models have widths under 2^15, 126 layers, vocabularies of
# 256K and contexts of 10M tokens; a step count of 10^9 is years of training.
WIDTH, COUNT, LENGTH = 2**20, 10**9, 2**24
# Sampling (a run's samples, `tpu-llm generate`, which checks the same bounds before TensorFlow loads): each
# new token is one step of the model, milliseconds to a second, so a million tokens already take hours and
# a larger number is a typo; sample i draws with the 64-bit seed + i.
MAX_NEW_TOKENS, MAX_SAMPLES, INT64 = 10**6, 1000, 2**63
CAPS: dict[str, tuple[int, str]] = {
    "model.n_layer": (10_000, "layers: 10x the 1,000-layer DeepNet"),
    "model.n_head": (WIDTH, "heads: 2^20, at most one per width unit"),
    "model.n_kv_head": (WIDTH, "heads: 2^20, at most one per width unit"),
    "model.n_embd": (WIDTH, "widths: 2^20; the widest published models are under 2^15"),
    "model.mlp_hidden": (WIDTH, "widths: 2^20; the widest published models are under 2^15"),
    "model.max_len": (LENGTH, "contexts: 2^24 tokens; the longest published one is 10M"),
    "model.vocab_size": (10**7, "vocabularies: 10^7; the largest published ones are about 256K"),
    "model.attention_block": (LENGTH, "contexts: 2^24 tokens"),
    "model.rope_original_max_len": (LENGTH, "contexts: 2^24 tokens"),
    "data.seq_len": (LENGTH, "contexts: 2^24 tokens"),
    "data.shuffle_buffer": (LENGTH, "windows held in memory: 2^24"),
    "train.steps": (COUNT, "steps: 10^9"),
    "train.batch_size": (WIDTH, "sequences per step: 2^20"),
    "train.grad_accum": (WIDTH, "micro-steps: 2^20"),
    "train.steps_per_loop": (COUNT, "steps: 10^9"),
    "train.warmup_steps": (COUNT, "steps: 10^9"),
    "train.decay_steps": (COUNT, "steps: 10^9"),
    "train.eval_every": (COUNT, "steps: 10^9"),
    "train.eval_steps": (COUNT, "steps: 10^9"),
    "train.max_bad_steps": (COUNT, "steps: 10^9"),
    "train.loss_chunk": (2**30, "tokens: 2^30"),
    "train.lora_rank": (WIDTH, "adapter ranks: 2^20, at most a width"),
    "train.seed": (2**32 - 1, "numpy's seeds: 0 to 2^32 - 1"),
    "checkpoint.every_steps": (COUNT, "steps: 10^9"),
    "checkpoint.keep": (COUNT, "checkpoints: 10^9"),
    "sample.num_samples": (MAX_SAMPLES, "samples: 1,000, each max_new_tokens steps of the model"),
    "sample.max_new_tokens": (MAX_NEW_TOKENS, "tokens: 10^6; each is one step of the model (a million take hours)"),
    "sample.top_k": (10**7, "vocabularies: 10^7"),
    "sample.seed": (INT64 - 1 - MAX_SAMPLES, "64-bit seeds: sample i draws with seed + i"),
    "cpu_devices": (1024, "logical CPU devices: 1024"),
    "cluster.timeout_seconds": (COUNT, "seconds: 10^9"),
    "parallel.pipeline_stages": (10_000, "stages: at most one per layer"),
    "parallel.microbatches": (WIDTH, "micro-batches: 2^20"),
    "parallel.tensor": (WIDTH, "tensor groups: 2^20"),
    "comm.rank": (WIDTH, "ranks: 2^20"),
    "comm.sync_every": (COUNT, "steps: 10^9"),
}
MAX_PARAMS = 2 * 10**12  # parameters a model section may describe: a 1T-parameter model is inside, twice over


@dataclasses.dataclass
class ModelConfig:
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # model width
    max_len: int = 256  # longest context (gpt2: learned positions; both: the KV cache's length)
    dropout: float = 0.0  # on attention probabilities and residual branches
    bias: bool = True  # the family's biases: gpt2 Dense and LayerNorm, qwen2 q/k/v; llama and mistral have none (false)
    vocab_size: int = 0  # 0: the tokenizer's size; larger pads the table (e.g. to a multiple of 128)
    # gpt2 (LayerNorm, learned positions, GELU) | llama (RMSNorm, rotary, SwiGLU, GQA) | qwen2 (llama's with q/k/v biases)
    family: str = "gpt2"  # | mistral (llama's, as Mistral's checkpoints name it); docs/model-families.md
    n_kv_head: int = 0  # llama/qwen2/mistral: key/value heads (grouped-query attention), dividing n_head; 0 = n_head, 1 = multi-query
    mlp_hidden: int = 0  # MLP hidden units; 0 = the family's: gpt2 4 x n_embd, the rotary ones 8/3 x n_embd rounded up to a multiple of 256
    rope_theta: float = 10000.0  # rotary embedding base (Llama 3 uses 500000)
    # none | llama3: Llama 3.1/3.2's rotary frequencies for long contexts (rope_factor ... rope_original_max_len)
    rope_scaling: str = "none"
    rope_factor: float = 8.0  # llama3: low frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above rope_original_max_len / this are scaled in full
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below rope_original_max_len / this are kept
    rope_original_max_len: int = 8192  # llama3: the context of pretraining
    norm_eps: float = 1e-5  # epsilon of LayerNorm (gpt2) / RMSNorm (the rotary families); HF checkpoints carry their own
    tie_embeddings: bool = True  # output head = the token embedding table; false (not gpt2): a separate lm_head

    def kv_heads(self) -> int:
        """Key/value heads per block."""
        return self.n_kv_head or self.n_head

    def head_size(self) -> int:
        """Each attention head's width."""
        return self.n_embd // self.n_head

    def hidden(self) -> int:
        """The MLP's hidden size: model.mlp_hidden, or the family's default (model/families/)."""
        return self.mlp_hidden or families.get(self.family).hidden(self)
    attention: str = "dense"  # dense (T x T scores) | blockwise (online softmax over key blocks, T x block; docs/memory.md)
    attention_block: int = 128  # blockwise: queries and keys per block


@dataclasses.dataclass
class DataConfig:
    train: str = ""  # comma-separated files/globs (local or gs://); "" = embedded stdlib corpus; builtin:tinyshakespeare = the shipped text
    validation: str = ""  # same; "" = hold out validation_fraction of `train`
    validation_fraction: float = 0.1  # by file when there are >= 10 files, else the tail of each file
    format: str = "auto"  # auto | text | tfrecord (pre-tokenized shards from `tpu-llm data prepare`)
    tokenizer: str = "byte"  # byte | char (vocabulary built from the data) | sentencepiece | hf (shards only)
    tokenizer_model: str = ""  # SentencePiece .model file (sentencepiece); HF model dir or tokenizer.json (hf)
    seq_len: int = 128  # tokens per training window
    shuffle_buffer: int = 1024  # windows held for shuffling


@dataclasses.dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps in total (a resumed run continues up to this)
    batch_size: int = 16  # global batch in sequences per optimizer step (all replicas, all micro-steps)
    grad_accum: int = 1  # micro-steps accumulated per optimizer step
    steps_per_loop: int = 25  # steps run inside one host call (logging happens between loops)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the cosine decay
    warmup_steps: int = 50  # linear warmup from lr / warmup_steps at step 0 to lr at this step; 0 = none
    decay_steps: int = 0  # the step where the cosine decay reaches min_lr, counted from step 0; 0 = `steps`
    weight_decay: float = 0.1  # AdamW decoupled decay (not applied to norms, biases, embeddings)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.99  # AdamW second-moment decay
    epsilon: float = 1e-8  # AdamW denominator epsilon
    clip_norm: float = 1.0  # global-norm gradient clipping; 0 = off
    eval_every: int = 100  # steps between validation passes; 0 = only at the end
    eval_steps: int = 10  # validation batches per pass
    seed: int = 1337  # initial weights, data order and dropout
    max_bad_steps: int = 10  # steps with a non-finite loss/gradient skipped (not applied) before the run stops
    on_bad_step: str = "skip"  # skip (go on) | rollback (to the newest checkpoint, past the bad batches)
    # fine-tuning (docs/hugging-face.md): embeddings (gpt2: with its tied head), head (untied lm_head), blocks:A-B, blocks:N
    freeze: str = ""  # layers kept as they are, comma-separated, e.g. embeddings,blocks:0-7; "" = train all
    init_from: str = ""  # a run directory (e.g. from `tpu-llm import`) whose newest weights start a new run; "" = random init
    # LoRA (docs/lora.md), PEFT's low-rank adapters on the lora_targets projections, every other weight frozen:
    lora_rank: int = 0  # each adapter's rank r (A: in x r, B: r x out, adds x A B lora_alpha / r); 0 = off (full fine-tuning)
    lora_alpha: float = 8.0  # the adapters' scale is lora_alpha / lora_rank (PEFT's lora_alpha)
    lora_dropout: float = 0.0  # dropout on each adapter's input (PEFT's lora_dropout)
    # PEFT module names, comma-separated: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (llama layout)
    lora_targets: str = ""  # or c_attn, c_proj, c_fc (gpt2); "" = PEFT's default: q_proj,v_proj (llama layout), c_attn (gpt2)
    # how the frozen projection kernels of the blocks are stored (docs/lora.md); the adapters train in float32:
    lora_base_dtype: str = "float32"  # float32 | bfloat16 | int8 (Keras' int8: per-output-channel scales)
    loss_chunk: int = 0  # tokens per chunk of the head and loss (no B x T x vocab logits); 0 = off (docs/memory.md)
    # START:END: a TensorFlow profiler trace of steps START to END (1 = the first step), in logs/train/plugins/profile
    profile_steps: str = ""  # e.g. 10:20; whole host calls, cut at START-1 and END (docs/profiling.md); "" = off


@dataclasses.dataclass
class CheckpointConfig:
    every_steps: int = 100  # save every N steps (and always at the end); 0 = only at the end
    every_minutes: float = 0.0  # also save when this much time passed since the last save; 0 = off
    keep: int = 3  # newest checkpoints kept
    keep_every_hours: float = 0.0  # also keep one checkpoint per this many hours for good; 0 = off


@dataclasses.dataclass
class SampleConfig:
    num_samples: int = 2  # samples printed after training
    max_new_tokens: int = 200  # tokens generated per sample
    prompt: str = ""  # "" = start from the end-of-text token
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0  # sample i draws with seed + i: the same seed gives the same text
    num_beams: int = 1  # beam search, as transformers' generate(num_beams=N, do_sample=False), at temperature 0; 1 = off
    length_penalty: float = 1.0  # beam search: a finished beam scores sum(log p) / length ** this: > 0 favours long ones
    early_stopping: str = "false"  # beam search: false | true (stop at num_beams finished) | never (transformers' meanings)
    num_return_sequences: int = 1  # beam search: the best beams printed, 1 to num_beams


@dataclasses.dataclass
class ClusterConfig:
    # how multi_worker all-reduces: auto (TF picks), ring (gRPC, CPUs), nccl (GPUs)
    communication: str = "auto"
    timeout_seconds: int = 0  # a collective waiting longer than this fails the step (a dead peer); 0 = wait


@dataclasses.dataclass
class ParallelConfig:
    pipeline_stages: int = 1  # P: the blocks cut into P stages, each on its own device (TPU: core)
    microbatches: int = 1  # M: each replica's batch split into M micro-batches that flow through the stages
    schedule: str = "gpipe"  # gpipe (why not 1f1b: docs/pipeline-tensor.md)
    tensor: int = 1  # T: each block's attention heads and MLP units split over T devices (TPU: cores), Megatron-style
    remat: bool = False  # recompute each block's activations in the backward pass (less memory, ~1/3 more FLOPs)


@dataclasses.dataclass
class CommConfig:
    # what crosses the network per step (docs/communication.md): none (float32 all-reduce) | bf16 |
    # powersgd (low-rank factors) | topk (largest entries by all-gather)
    compression: str = "none"
    rank: int = 4  # powersgd: rank r of the factors sent for each weight matrix
    topk_ratio: float = 0.01  # topk: fraction of each gradient tensor's entries sent per step
    error_feedback: bool = True  # powersgd/topk: add what compression left out to the next step's gradient
    sync_every: int = 1  # H: local steps per replica between parameter averages (local SGD); 1 = every step
    outer_optimizer: str = "sgd"  # local SGD's outer step on the averaged delta: sgd | nesterov (DiLoCo)
    outer_lr: float = 1.0  # outer step size (sgd with 1.0 = plain averaging; DiLoCo used 0.7 with nesterov)
    outer_momentum: float = 0.9  # nesterov: outer momentum

    def active(self) -> bool:
        """Whether anything but the plain float32 all-reduce runs: compression, or local SGD."""
        return self.compression != "none" or self.sync_every > 1


@dataclasses.dataclass
class Config:
    run_dir: str = "runs/tiny"  # local path or gs://bucket/path; re-using it resumes. A --config FILE that sets none: runs/<FILE's name>
    strategy: str = "auto"  # auto | tpu | mirrored | multi_worker | parameter_server | default
    tpu: str = ""  # "" (Colab/Kaggle, or TPU_NAME) | local (on a TPU VM) | a TPU name or grpc:// address
    cpu_devices: int = 1  # split the CPU into N logical devices and mirror over them (N > 1)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)  # multi-worker and ps
    precision: str = "auto"  # auto (mixed_bfloat16 on TPU, else float32) | float32 | mixed_bfloat16 | mixed_float16
    execution: str = "xla"  # xla (jit_compile the step) | graph (tf.function) | eager (debugging)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)  # model parallelism
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)  # gradient compression, local SGD
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Loading and validation


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None, base: Config | None = None) -> Config:
    """Defaults (or a copy of `base`) <- YAML file at `path` (or a preset's name) <- dotted `overrides`; validated."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    if path:
        path = config_file(path)
        data = read_yaml(path)
        if base is None and isinstance(data, dict) and "run_dir" not in data:
            # a config names its run: my_run.yaml trains in runs/my_run, not in the default run's runs/tiny
            cfg.run_dir = f"runs/{re.sub(r'[.]ya?ml$', '', os.path.basename(path))}"
        apply_mapping(cfg, data, source=path)
    for key, value in (overrides or {}).items():
        set_dotted(cfg, key, value, source="command line")
    validate(cfg)
    return cfg


def config_from_dict(data: dict, source: str) -> Config:
    cfg = Config()
    apply_mapping(cfg, data, source=source)
    validate(cfg)
    return cfg


def approx_params(m: ModelConfig) -> int:
    """The parameters of the model section `m`, from its sizes alone (norms and biases left out): what
    MAX_PARAMS bounds. vocab_size 0 (the tokenizer's) counts no table."""
    return spec.matrix_params(m, m.vocab_size)


def _validate_caps(cfg: Config) -> None:
    for key, (cap, why) in CAPS.items():
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        _check(value <= cap, lambda: f"{key}={value if len(str(value)) <= 30 else f'a {len(str(value))}-digit number'} "
                                     f"is more than its cap of {cap:,} ({why})")


def validate(cfg: Config) -> None:
    """A UserError naming the first value that is out of range or inconsistent with another (the caps first)."""
    m, d, t, c, s = cfg.model, cfg.data, cfg.train, cfg.checkpoint, cfg.sample
    _validate_caps(cfg)  # first: every later check may loop over, or print, these sizes
    _check(m.family in families.NAMES, f"model.family={m.family!r}; valid choices: {', '.join(families.NAMES)}")
    _validate_run(cfg)
    _validate_comm(cfg)
    _validate_model(m)
    _check(t.loss_chunk >= 0, f"train.loss_chunk={t.loss_chunk} must be >= 0 (0 = off)")
    _check(d.tokenizer in TOKENIZERS,
           f"data.tokenizer={d.tokenizer!r}; valid choices: {', '.join(TOKENIZERS)}")
    _check(d.format in DATA_FORMATS,
           f"data.format={d.format!r}; valid choices: {', '.join(DATA_FORMATS)}")
    _check(d.tokenizer != "sentencepiece" or bool(d.tokenizer_model),
           "data.tokenizer=sentencepiece needs data.tokenizer_model=PATH.model "
           "(make one with `tpu-llm tokenizer train`)")
    _check(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    _check(d.seq_len <= m.max_len,
           f"data.seq_len={d.seq_len} exceeds model.max_len={m.max_len}; "
           f"lower data.seq_len or raise model.max_len")
    _check(0.0 < d.validation_fraction < 1.0,
           f"data.validation_fraction={d.validation_fraction} must be in (0, 1)")
    _check(d.shuffle_buffer >= 1, f"data.shuffle_buffer={d.shuffle_buffer} must be >= 1")
    for name in ("steps", "batch_size", "grad_accum", "steps_per_loop", "eval_steps"):
        _check(getattr(t, name) >= 1, f"train.{name}={getattr(t, name)} must be >= 1")
    _check(t.batch_size % t.grad_accum == 0,
           lambda: f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; "
                   f"valid grad_accum values: {_divisors(t.batch_size)}")
    for name in ("warmup_steps", "decay_steps", "eval_every"):
        _check(getattr(t, name) >= 0, f"train.{name}={getattr(t, name)} must be >= 0")
    _check(t.lr > 0 and 0 <= t.min_lr <= t.lr, f"need 0 <= train.min_lr ({t.min_lr}) <= train.lr ({t.lr}), lr > 0")
    _check(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _check(t.weight_decay >= 0 and t.clip_norm >= 0, "train.weight_decay and train.clip_norm must be >= 0")
    _check(c.every_steps >= 0 and c.keep >= 1,
           f"checkpoint.every_steps ({c.every_steps}) must be >= 0 and checkpoint.keep ({c.keep}) >= 1")
    _check(c.every_minutes >= 0 and c.keep_every_hours >= 0,
           f"checkpoint.every_minutes ({c.every_minutes}) and checkpoint.keep_every_hours "
           f"({c.keep_every_hours}) must be >= 0 (0 = off)")
    _check(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    _check(t.max_bad_steps >= 0, f"train.max_bad_steps={t.max_bad_steps} must be >= 0 (0 = stop at the first)")
    spec.frozen_layers(t.freeze, m.n_layer)
    validate_lora(cfg)
    profile_range(t.profile_steps, t.steps)
    _check(t.on_bad_step in BAD_STEP_ACTIONS,
           f"train.on_bad_step={t.on_bad_step!r}; valid choices: {', '.join(BAD_STEP_ACTIONS)}")
    _check(s.temperature >= 0, f"sample.temperature={s.temperature} must be >= 0 (0 = greedy)")
    _check(0 < s.top_p <= 1, f"sample.top_p={s.top_p} must be in (0, 1]")
    _check(s.top_k >= 0 and s.max_new_tokens >= 0 and s.num_samples >= 0,
           "sample.top_k, sample.max_new_tokens and sample.num_samples must be >= 0")
    _check(s.seed >= -INT64, f"sample.seed={s.seed} must be >= -2**63 (a 64-bit seed)")
    _validate_beams(s)



def _validate_beams(s: SampleConfig) -> None:
    _check(1 <= s.num_beams <= MAX_BEAMS, f"sample.num_beams={s.num_beams} must be between 1 (off) and {MAX_BEAMS} "
                                          "(each beam is a row of the KV cache)")
    _check(s.early_stopping in EARLY_STOPPING,
           f"sample.early_stopping={REPR.repr(s.early_stopping)}; valid choices: {', '.join(EARLY_STOPPING)}")
    _check(1 <= s.num_return_sequences <= s.num_beams,
           f"sample.num_return_sequences={s.num_return_sequences} must be between 1 and sample.num_beams="
           f"{s.num_beams}: the best of the beams are returned")
    if s.num_beams > 1:  # transformers' beam search with do_sample=False; beam sampling is not supported
        _check(s.temperature == 0, f"sample.num_beams={s.num_beams} searches greedily: set sample.temperature=0 "
                                   f"(not {s.temperature}; beam sampling is not supported)")
        _check(s.num_samples <= 1, f"sample.num_samples={s.num_samples} with sample.num_beams={s.num_beams}: beam "
                                   "search is deterministic, every sample would be the same; set "
                                   "sample.num_samples=1 and sample.num_return_sequences for several beams")


def _validate_run(cfg: Config) -> None:
    """The strategy, the devices and the parallel layout."""
    _check(cfg.strategy in STRATEGIES,
           f"strategy={cfg.strategy!r}; valid choices: {', '.join(STRATEGIES)}")
    _check(bool(cfg.run_dir), "run_dir is empty; give a local path or gs://bucket/path")
    _check(cfg.cpu_devices >= 1, f"cpu_devices={cfg.cpu_devices} must be >= 1")
    _check(cfg.cpu_devices <= cfg.parallel.pipeline_stages or cfg.strategy in ("auto", "mirrored"),
           f"cpu_devices={cfg.cpu_devices} splits one CPU for strategy=mirrored (or auto); "
           f"strategy={cfg.strategy} runs one device per process, so drop cpu_devices")
    _check(cfg.cluster.communication in COMMUNICATIONS,
           f"cluster.communication={cfg.cluster.communication!r}; valid choices: {', '.join(COMMUNICATIONS)}")
    p = cfg.parallel
    _check(cfg.precision in PRECISIONS, f"precision={cfg.precision!r}; valid choices: {', '.join(PRECISIONS)}")
    _check(cfg.execution in EXECUTIONS, f"execution={cfg.execution!r}; valid choices: {', '.join(EXECUTIONS)}")
    _check(p.schedule in SCHEDULES,
           f"parallel.schedule={p.schedule!r}; valid choices: {', '.join(SCHEDULES)} (1F1B cannot be ordered in "
           "TensorFlow's dataflow graph: see docs/pipeline-tensor.md)")
    _check(1 <= p.pipeline_stages <= cfg.model.n_layer,
           f"parallel.pipeline_stages={p.pipeline_stages} must be between 1 and model.n_layer={cfg.model.n_layer}")
    _check(p.microbatches >= 1 and p.tensor >= 1, "parallel.microbatches and parallel.tensor must be >= 1")
    _check(p.tensor == 1 or cfg.model.n_head % p.tensor == 0,
           lambda: f"parallel.tensor={p.tensor} must divide model.n_head={cfg.model.n_head} (each device takes "
                   f"whole attention heads); valid values: {_divisors(cfg.model.n_head)}")
    kv = cfg.model.kv_heads()
    _check(p.tensor == 1 or kv % p.tensor == 0,
           lambda: f"parallel.tensor={p.tensor} must divide model.n_kv_head={kv} (each device takes whole "
                   f"key/value head groups); valid values: {_divisors(kv)}")
    _check(p.tensor == 1 or cfg.model.hidden() % p.tensor == 0,
           f"parallel.tensor={p.tensor} must divide the MLP's hidden size {cfg.model.hidden()}; set "
           f"model.mlp_hidden to a multiple of {p.tensor}")
    _check(cfg.cluster.timeout_seconds >= 0,
           f"cluster.timeout_seconds={cfg.cluster.timeout_seconds} must be >= 0 (0 = no timeout)")


def _validate_model(m: ModelConfig) -> None:
    for name in ("n_layer", "n_head", "n_embd", "max_len"):
        _check(getattr(m, name) >= 1, f"model.{name}={getattr(m, name)} must be >= 1")
    _check(m.n_embd % m.n_head == 0,
           lambda: f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; "
                   f"valid n_head values: {_divisors(m.n_embd, at_most=64)}")
    _validate_family(m)
    _check(approx_params(m) <= MAX_PARAMS,
           lambda: f"the model has about {approx_params(m):.2e} parameters (model.n_layer={m.n_layer}, "
                   f"model.n_embd={m.n_embd}, model.vocab_size={m.vocab_size}), more than the cap of {MAX_PARAMS:.0e}")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    _check(m.vocab_size >= 0, f"model.vocab_size={m.vocab_size} must be >= 0 (0 = the tokenizer's)")
    _check(m.attention in ATTENTIONS, f"model.attention={m.attention!r}; valid choices: {', '.join(ATTENTIONS)}")
    _check(m.attention_block >= 1, f"model.attention_block={m.attention_block} must be >= 1")
    _check(m.attention == "dense" or m.dropout == 0, f"model.attention=blockwise has no attention dropout; set "
           f"model.dropout=0 (now {m.dropout}) or model.attention=dense")


def _validate_family(m: ModelConfig) -> None:
    _check(m.n_kv_head >= 0 and m.mlp_hidden >= 0,
           f"model.n_kv_head ({m.n_kv_head}) and model.mlp_hidden ({m.mlp_hidden}) must be >= 0 (0 = the default)")
    _check(m.rope_theta > 0 and m.norm_eps > 0,
           f"model.rope_theta ({m.rope_theta}) and model.norm_eps ({m.norm_eps}) must be > 0")
    families.get(m.family).validate(m, _check)  # the family's own checks (model/families/)


def profile_range(text: str, steps: int) -> tuple[int, int] | None:
    """train.profile_steps as (START, END), steps counted from 1 as the logs count them; None when off."""
    if not text.strip():
        return None
    match = re.fullmatch(r"\s*(\d{1,10})\s*:\s*(\d{1,10})\s*", text, re.ASCII)  # (10 digits: above train.steps' cap)
    start, end = (int(match[1]), int(match[2])) if match else (0, 0)
    base60 = " (in a YAML file, quote it: profile_steps: \"10:20\"; unquoted, YAML reads 10:20 as 620)" \
        if text.strip().isdigit() else ""
    _check(bool(match) and 1 <= start <= end, f"train.profile_steps={REPR.repr(text)}; give START:END with 1 <= START "
                                              f"<= END, e.g. 10:20 (steps counted from 1; \"\" = off){base60}")
    _check(end <= steps, f"train.profile_steps={text.strip()} ends after train.steps={steps}; give an END <= {steps}")
    return start, end


def _validate_comm(cfg: Config) -> None:
    k = cfg.comm
    _check(k.compression in COMPRESSIONS,
           f"comm.compression={k.compression!r}; valid choices: {', '.join(COMPRESSIONS)}")
    _check(k.outer_optimizer in OUTER_OPTIMIZERS,
           f"comm.outer_optimizer={k.outer_optimizer!r}; valid choices: {', '.join(OUTER_OPTIMIZERS)}")
    _check(k.rank >= 1, f"comm.rank={k.rank} must be >= 1")
    _check(0 < k.topk_ratio <= 1, f"comm.topk_ratio={k.topk_ratio} must be in (0, 1], e.g. 0.01 for 1%")
    _check(k.sync_every >= 1, f"comm.sync_every={k.sync_every} must be >= 1 (1 = synchronous every step)")
    _check(k.outer_lr > 0 and 0 <= k.outer_momentum < 1,
           f"comm.outer_lr ({k.outer_lr}) must be > 0 and comm.outer_momentum ({k.outer_momentum}) in [0, 1)")
    _check(k.sync_every > 1 or (k.outer_optimizer == "sgd" and k.outer_lr == 1.0),
           "comm.outer_optimizer and comm.outer_lr act on local SGD's outer step: set comm.sync_every > 1")
    _check(k.compression == "none" or k.sync_every == 1,
           f"comm.compression={k.compression} compresses per-step gradients, and comm.sync_every={k.sync_every} "
           "sends none between syncs: choose one (set comm.compression=none or comm.sync_every=1)")
    if not k.active():
        return
    what = _comm_settings(k)
    refusal = comm_refusal(k, cfg.strategy)
    _check(refusal is None, refusal or "")
    _check(cfg.precision != "mixed_float16",
           f"{what} does not support precision=mixed_float16 (loss-scaled gradients); use float32 or mixed_bfloat16")
    _check(k.sync_every == 1 or cfg.parallel.pipeline_stages == 1,
           f"{what} (local SGD) runs without pipeline stages; set parallel.pipeline_stages=1")
    _check(cfg.parallel.tensor == 1, f"{what} is not supported with parallel.tensor={cfg.parallel.tensor} "
                                     "(untested); set parallel.tensor=1 or drop the comm settings")


def comm_refusal(k: CommConfig, strategy: str) -> str | None:
    """Why the comm settings `k` cannot run under `strategy`, or None. Compression and local SGD act on
    what synchronous replicas on CPUs/GPUs exchange: parameter-server workers apply their gradients
    asynchronously, and on TPU they are untested (its interconnect makes the plain all-reduce cheap).
    Checked here on the config's strategy, and by parallel/comm.py on the one strategy=auto chose."""
    if not k.active() or strategy not in ("parameter_server", "tpu"):
        return None
    return (f"{_comm_settings(k)} needs synchronous replicas on CPUs/GPUs; strategy={strategy} is not supported; "
            "use strategy=mirrored or multi_worker, or drop the comm settings")


def _comm_settings(k: CommConfig) -> str:
    """The comm setting in force, for a message."""
    return f"comm.compression={k.compression}" if k.compression != "none" else f"comm.sync_every={k.sync_every}"
