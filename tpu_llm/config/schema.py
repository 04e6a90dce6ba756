"""The run configuration's schema: one dataclass per section, every default and every key's meaning
defined once (the meaning is the field's comment; docs/configuration.md is generated from them), the
valid choices of the string keys and the caps of the sizes and counts. config/checks.py checks the
values; config/__init__.py loads a config (YAML, `--section.key` overrides) onto these.
"""

from __future__ import annotations

import dataclasses

import yaml

from tpu_llm.model import families

TOKENIZERS = ("byte", "char", "sentencepiece", "hf")
DATA_FORMATS = ("auto", "text", "tfrecord")
STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "parameter_server", "default")
COMMUNICATIONS = ("auto", "ring", "nccl")
BAD_STEP_ACTIONS = ("skip", "rollback")
PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
EXECUTIONS = ("xla", "graph", "eager")
SCHEDULES = ("gpipe",)
# parallel.shard_optimizer, each dividing more than the one before (the planner tries them in this order):
# state = ZeRO-1, grads = ZeRO-2 (docs/memory.md)
SHARD_OPTIMIZER = ("none", "state", "grads")
COMPRESSIONS = ("none", "bf16", "powersgd", "topk")
OUTER_OPTIMIZERS = ("sgd", "nesterov")
ATTENTIONS = ("dense", "blockwise")
EARLY_STOPPING = ("false", "true", "never")  # sample.early_stopping: transformers' False, True, "never"
# each beam is a row of the KV cache (num_beams contexts in memory); published beam searches use 1 to 10
MAX_BEAMS = 64
# beam search's length ** length_penalty, in float32, for lengths up to MAX_NEW_TOKENS (10^6): 10^24 at 4 keeps
# every score finite (transformers' usual values are 0.6 to 2); 1e39 overflowed float32 to inf
MAX_LENGTH_PENALTY = 4.0

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
    "model.head_dim": (WIDTH, "widths: 2^20; the widest published heads are 256"),
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
    "train.eval_tasks_every": (COUNT, "steps: 10^9"),
    "train.eval_tasks_limit": (COUNT, "documents: 10^9"),
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
    bias: bool = True  # the family's biases: gpt2 Dense and LayerNorm, qwen2 q/k/v; llama, mistral and qwen3 have none (false)
    vocab_size: int = 0  # 0: the tokenizer's size; larger pads the table (e.g. to a multiple of 128)
    # gpt2 (LayerNorm, learned positions, GELU) | llama (RMSNorm, rotary, SwiGLU, GQA) | qwen2 (llama's with q/k/v biases)
    family: str = "gpt2"  # | mistral (llama's, as Mistral's checkpoints name it) | qwen3 (llama's with per-head q/k RMSNorm); docs/model-families.md
    n_kv_head: int = 0  # the rotary families: key/value heads (grouped-query attention), dividing n_head; 0 = n_head, 1 = multi-query
    head_dim: int = 0  # each attention head's width; 0 = n_embd / n_head (Qwen3 and some Mistral checkpoints give their own)
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
        """Each attention head's width: model.head_dim, or n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

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
    # lm-evaluation-harness tasks on the live weights during training (the `eval` extra; docs/evaluation.md):
    eval_tasks: str = ""  # lm-eval task names, comma-separated, e.g. hellaswag,arc_easy; "" = off
    eval_tasks_every: int = 0  # steps between task evaluations; 0 = only at the end
    eval_tasks_limit: int = 100  # documents per task (lm-eval's --limit: a sample, the in-loop cost); 0 = all
    eval_include_path: str = ""  # a folder of your own task YAML (lm-eval's --include_path); "" = lm-eval's tasks
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

    def without_adapters(self) -> "TrainConfig":
        """This section for the model with its adapters folded in (what export writes): none, a float32 base."""
        return dataclasses.replace(self, lora_rank=0, lora_base_dtype="float32")


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
    # none | state: AdamW's moments divided over the data-parallel replicas (ZeRO-1), 8/R bytes per parameter |
    # grads: the moments and the accumulated gradients (ZeRO-2), each micro-batch's gradients reduced to each
    # replica's rows
    shard_optimizer: str = "none"


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
