"""Memory and step-time planner: does a config fit an accelerator, and how fast would it train there?

`tpu-llm plan --config configs/gpt2_125m.yaml --accelerator v5p-16` answers on a laptop. Everything is
arithmetic on the config; nothing is compiled.

Where. Memory is given per chip, which is one TPU device as TensorFlow sees it (v4 and v5p chips run
their two TensorCores as one megacore device; v5e and v6e chips have one). Accelerator types count
TensorCores on v4/v5p and chips on v5e (v5litepod)/v6e: v5p-16 and v4-8 are 8 and 4 chips, v5litepod-8
and v6e-8 are 8. Per chip, bf16 peak and HBM: v4 275 TFLOP/s, 32 GiB; v5e 197, 16; v5p 459, 95; v6e
918, 32. A replica spans P pipeline stages x t tensor splits chips; the slice holds R = chips / (P t)
data-parallel replicas, each with the whole model (no sharded optimizer), so a chip holds one stage's
share and the most loaded stage decides. "cpu" is this machine: its measured float32 matmul peak, and
its RAM shared by all `cpu_devices` logical devices (R = cpu_devices / P, as distribute.py lays out).

Memory per chip of stage s (blocks n_s; a = 2 bytes under mixed precision, 4 in float32). A block's
parameters, FLOPs and activation bytes come from tpu_llm/spec.py, which the model, the config and
the stage partitioner read too; this docstring derives its activation terms.
  parameters   4 bytes x the stage's parameters (pipeline.partition), whole on the stage's first chip:
               tensor groups (tpu_llm/parallel/tensor.py) split the matmuls and activations, not the weights.
               LoRA: the adapters at 4 bytes beside them, and a frozen base stored in bfloat16
               (train.lora_base_dtype) holds the blocks' projection kernels at 2 bytes, int8 at 1 plus a
               float32 scale per output column (embeddings, head, norms and biases: 4)
  optimizer    8 bytes x the stage's trainable parameters: AdamW's m and v, float32. The layers
               train.freeze names (training/optimizer.py's freeze) have no optimizer slots
  gradients    4 bytes x the trainable parameters, twice with train.grad_accum > 1 (the running sum
               and the new one); frozen layers get none
  activations  what the backward pass reads, for every micro-batch in flight. GPipe runs all M
               forwards before the backwards, so a stage holds the activations of its whole share of
               a micro-step: b = B / (R A) sequences of T tokens. Per block and token:
                   C (8a + 12a) + H T (4 + a)         [+ 2 C + 5 H T bytes with dropout masks]
               8 C-wide tensors (block input, norm output, q, k, v, attention output, second block
               input, norm output), 3 MLP tensors 4C wide (GELU input, its tanh, its output) and
               the softmax of the scores, float32 in model/attention.py (4 bytes) plus its cast for P.V (a).
               Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
               Models") count C (34 + 5 H T / C) bytes in 16 bits: the same tensors with dropout,
               except that XLA keeps the GELU's tanh rather than recomputing it (a third 4C tensor,
               read in XLA:CPU's buffer assignment) and that our softmax is float32.
               llama blocks (docs/model-families.md) keep q, the rotated k and v (n_kv_head heads
               wide) and the SwiGLU's gate, up and product (model.mlp_hidden wide) in their place.
               LoRA (spec.lora_activation_bytes): XLA fuses an adapter's addition into the
               elementwise op reading an adapted gate, up or fc and keeps the base's and the adapter's
               outputs apart: 2 F a more per token for each (XLA:CPU's buffer assignment, docs/memory.md).
               remat (a recomputed block keeps only its input): n_s C a per token.
               First stage: the embedding output C a. Last stage: the final norm's input C a, the
               head's float32 input 4C, and the loss's logits 4V per token (float32; loss.py).
  workspace    transients at the step's peak, the largest of three phases (XLA:CPU's buffer
               assignment shows each): the loss's forward, its float32 exp of the logits (4V per
               token of one micro-batch); the head's backward, whose gradient takes the logits'
               place; one block's attention backward, with the gradients of its probabilities and
               scores (2 x 4 H T per token; 3 with fewer kv heads than query heads), which runs after
               the logits and that block's MLP tensors are freed, with remat that block recomputed
               for one micro-batch. With P > 1 the tied embedding table the head reads (a V C) and its
               gradient (4 V C); bf16 casts of the stage's weights. The head's gradient of a tied
               table is the table's gradient itself (the embedding's is added in place at the end),
               and until the head's backward writes it XLA lends its (V, C) room to the forward's exp
               when that fits (tokens <= C), which the planner counts; a frozen table (LoRA,
               train.freeze=embeddings) has no gradient to lend.
  chunked loss (train.loss_chunk = k, tpu_llm/model/loss.py): no 4V per token is kept; the head keeps
               the float32 tokens (4C per token, and their padded chunks 4C) and the log-sum-exp;
               forward and backward hold (k, V) float32 tiles (about three at XLA:CPU's peak) and
               the backward the running dX (2 x 4C per token); the table's gradient is written in
               place by vocabulary slices.
  blockwise attention (model.attention_block = b, tpu_llm/model/attention.py): instead of H T (4 + a)
               per token, the float32 output (4C, unless a = 4) and log-sum-exp (4H); the backward
               holds float32 copies of q, k, v, dO and dQ, dK, dV (7 x 4C per token; more in XLA:CPU:
               8 counted) and five (b x b) float32 tiles per head and sequence.
  Not modelled: XLA's padding to TPU tiles, HBM the runtime reserves, collective and transfer
  buffers, fragmentation. Treat more than ~90% of HBM as not fitting.

Time. Model FLOPs per token are 6N + 12 L C T (spec.flops_per_token: N without positions and an
untied head's input table, lookups rather than matmuls); a frozen weight (train.freeze; with LoRA every
weight but the adapters) has no weight gradient: 4N for those, 2N below the lowest trained layer, and
6 x the adapters' (spec.layer_flops_per_token); the trainer's MFU counts the same. A step
is B T tokens. remat executes one more forward of the blocks (x4/3 of their FLOPs). A stage's forward
on one micro-batch takes its FLOPs (pipeline.partition, / 3 for the forward, plus the adapters') over
t x peak x `mfu`, the fraction of peak a chip sustains while busy (an assumption: 0.4 by default); the
backward takes 2x that when every weight trains (about 1x for LoRA's frozen base; remat adds a forward). `simulate` plays GPipe's schedule on those times; a step is grad_accum
such pipelines. Not modelled: the gradient all-reduce, the optimizer update (~16 bytes of HBM traffic
per parameter), stage-to-stage transfers and input stalls: the time is optimistic for a given mfu.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Sequence

from tpu_llm.model import spec
from tpu_llm.config import Config
from tpu_llm.errors import UserError
from tpu_llm.parallel import pipeline
from tpu_llm.training import progress

GIB = 2.0**30
# HBM per chip, GiB (Cloud TPU documentation; ARCHITECTURE.md), keyed by device kind as tpu._TYPES spells it
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5p": 95, "TPU v6 lite": 32}
TIGHT = 0.9  # above this share of HBM a plan is flagged (and suggestions stay below it): padding, reserve
SUGGESTED_LOSS_CHUNK = 1024  # train.loss_chunk a refusal suggests: a (1024, V) float32 tile, e.g. 0.2 GiB at V = 50k
ASSUMED_SENTENCEPIECE_VOCAB = 50304  # configs/gpt2_125m.yaml's: GPT-2's 50,257 rounded up to a multiple of 64


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str  # as given: v5p-16, v4-8, cpu
    kind: str  # TPU v5p, TPU v5 lite, ..., CPU
    chips: int  # devices TensorFlow sees (TPU chips; 1 machine for cpu)
    peak_flops: float  # per chip: bf16 (TPU) or the measured float32 matmul rate (cpu)
    memory_bytes: float  # HBM per chip; RAM of the machine for cpu (0: unknown)
    note: str = ""

    @property
    def shared_memory(self) -> bool:  # logical CPU devices share one RAM
        return self.kind == "CPU"


def accelerator(name: str, cpu_peak_flops: float | None = None) -> Accelerator:
    """An accelerator type (v5p-16, v4-8, v5litepod-8, v6e-8) or "cpu" (measures the matmul peak)."""
    from tpu_llm import perf  # both import TensorFlow
    from tpu_llm.parallel import tpu

    name = str(name).strip().lower()
    if name == "cpu":
        try:  # POSIX; elsewhere the RAM check is skipped
            ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            ram = 0.0
        peak = cpu_peak_flops or perf.measured_matmul_flops()
        return Accelerator("cpu", "CPU", 1, peak, ram, "float32 matmul peak measured now")
    known = ", ".join(f"{p}-N" for p, kind, _ in tpu._TYPES if kind in HBM_GIB)
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    found = next((t for t in tpu._TYPES if match and t[0] == match.group(1)), None)
    if not found:
        raise UserError(f"--accelerator={name!r}: not an accelerator type; use cpu or one of {known} "
                        "(e.g. v5p-16, v4-8, v5litepod-8, v6e-8)")
    prefix, kind, per_chip = found
    if kind not in HBM_GIB:
        raise UserError(f"--accelerator={name}: no peak or HBM figures for {kind} here; plan for {known}")
    count = int(match.group(2))
    if count < per_chip or count % per_chip:
        raise UserError(f"--accelerator={name}: {prefix} types count TensorCores, 2 per chip; use an even "
                        f"number such as {prefix}-8")
    counts = "TensorCores, 2 per chip" if per_chip == 2 else "chips"
    return Accelerator(name, kind, count // per_chip, perf.tpu_peak_flops(kind), HBM_GIB[kind] * GIB,
                       f"{prefix} types count {counts}")


def simulate(stage_forward_seconds: Sequence[float], microbatches: int,
             backward_ratio: float | Sequence[float] = 2.0, transfer_seconds: float = 0.0,
             ) -> tuple[float, float, list[float]]:
    """GPipe's schedule played out: (step seconds, bubble fraction, busy fraction of each stage).

    Each stage's device runs its tasks in GPipe's order: forwards of micro-batches 0..M-1, then
    backwards M-1..0. A task starts once its device is free and its input has arrived: the previous
    stage's forward of that micro-batch (plus `transfer_seconds`), or the next stage's backward of it;
    the last stage turns straight from its last forward to the backwards. Backward time = forward
    time x `backward_ratio` (one number, or one per stage). The bubble is the idle share of all
    stages' time: (P-1)/(M+P-1) for equal stages. Compare with measured per-stage times to validate.
    """
    fwd = [float(t) for t in stage_forward_seconds]
    stages, m_count = len(fwd), int(microbatches)
    if not stages or m_count < 1 or min(fwd) < 0:
        raise ValueError("simulate needs >= 1 stage with non-negative times and >= 1 micro-batch")
    ratios = list(backward_ratio) if isinstance(backward_ratio, Sequence) else [backward_ratio] * stages
    bwd = [f * r for f, r in zip(fwd, ratios, strict=True)]
    free = [0.0] * stages  # when each stage's device is next idle
    fwd_done = [[0.0] * m_count for _ in range(stages)]
    bwd_done = [[0.0] * m_count for _ in range(stages)]
    # visiting tasks in this order, every task's inputs have already been timed
    for m in range(m_count):
        for s in range(stages):
            arrives = fwd_done[s - 1][m] + transfer_seconds if s else 0.0
            free[s] = fwd_done[s][m] = max(free[s], arrives) + fwd[s]
    for m in reversed(range(m_count)):
        for s in reversed(range(stages)):
            arrives = bwd_done[s + 1][m] + transfer_seconds if s < stages - 1 else fwd_done[s][m]
            free[s] = bwd_done[s][m] = max(free[s], arrives) + bwd[s]
    step = max(free)
    busy = [m_count * (f + b) / step if step else 1.0 for f, b in zip(fwd, bwd)]
    return step, 1.0 - sum(busy) / stages, busy


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on one chip (one device) at the peak of a training step."""
    parameters: float
    optimizer: float
    gradients: float
    activations: float
    workspace: float

    @property
    def total(self) -> float:
        return self.parameters + self.optimizer + self.gradients + self.activations + self.workspace

    def terms(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def block_activation_bytes(cfg: Config, act_bytes: int) -> tuple[float, float]:
    """(bytes per token a block saves for its backward, the same with remat): spec's, for the
    config's sequence length and tensor ways (the module docstring derives it)."""
    return spec.block_activation_bytes(cfg.model, cfg.data.seq_len, cfg.parallel.tensor, act_bytes)


def attention_bytes(cfg: Config, act_bytes: int) -> tuple[float, float]:
    """(bytes per token one block's attention keeps for its backward beyond q, k, v and its output,
    bytes per token its backward holds while it runs): spec's, for the config."""
    return spec.attention_bytes(cfg.model, cfg.data.seq_len, cfg.parallel.tensor, act_bytes)


def loss_bytes(cfg: Config, vocab: int, tokens_micro: float) -> tuple[float, float, float]:
    """(bytes per token the loss keeps for its backward, bytes its forward holds beyond them for one
    micro-batch, bytes its backward holds), tpu_llm/model/loss.py: the float32 logits and the forward's exp
    of them (the backward's gradient takes the logits' place); or the chunked loss's float32 input and
    log-sum-exp, (chunk, V) float32 tiles forward and backward (XLA:CPU's peak: about three), and the
    backward's running dX."""
    c, chunk = cfg.model.n_embd, cfg.train.loss_chunk
    if chunk:
        tiles = 3 * 4 * min(chunk, tokens_micro) * vocab  # logits, their exp; the heap's gaps around them
        return 2 * 4 * c + 4, tiles, tiles + 2 * 4 * c * tokens_micro
    return 4 * vocab, 4 * vocab * tokens_micro, 0.0


def frozen_params(cfg: Config, stage: pipeline.Stage, vocab: int) -> int:
    """The parameters of `stage` that train.freeze keeps as they are: the frozen blocks it holds, the
    embeddings (a tied table with them) on the first stage, an untied head's table on the last. With
    LoRA (train.lora_rank) all of them: only the adapters train."""
    if cfg.train.lora_rank:
        return stage.params
    if not cfg.train.freeze:
        return 0
    m = cfg.model
    named, blocks = spec.frozen_layers(cfg.train.freeze, m.n_layer)
    n = len(blocks & set(stage.blocks)) * spec.block_params(m)
    if stage.embed and "embeddings" in named:
        n += spec.embedding_params(m, vocab)
    if stage.head and "head" in named:  # tied: the config is refused when training starts (freeze embeddings)
        n += spec.count({k: s for k, s in spec.head_shapes(m, vocab).items() if k.startswith("lm_head")})
    return n


def adapter_params(cfg: Config, stage: pipeline.Stage) -> int:
    """LoRA's A and B in `stage`'s blocks: r (in + out) for each projection train.lora_targets adapts
    (model/lora.py), every block alike; 0 without LoRA."""
    return len(stage.blocks) * spec.adapters_per_block(cfg.model, cfg.train)


def stage_memory(cfg: Config, stage: pipeline.Stage, vocab: int, act_bytes: int, tokens: float,
                 tokens_micro: float, remat: bool) -> Memory:
    """Memory of the chip running `stage`, holding `tokens` tokens of activations (a micro-step of its
    replica) of which `tokens_micro` are one micro-batch."""
    m, stages = cfg.model, cfg.parallel.pipeline_stages
    c = m.n_embd
    n_blocks = len(stage.blocks)
    params = stage.params  # whole, also with tensor groups: they split compute and activations only
    full, kept = block_activation_bytes(cfg, act_bytes)
    # LoRA: XLA keeps an adapted MLP projection's base and adapter outputs apart (model/spec.py)
    adapted = spec.lora_activation_bytes(m, spec.adapted_layers(cfg.model, cfg.train), cfg.parallel.tensor, act_bytes)
    full += adapted
    per_token = n_blocks * (kept if remat else full)
    work = 2 * params if act_bytes == 2 else 0.0  # compute-dtype casts of the weights
    # Phases of the step, each with what is alive beyond the activations: the loss's forward, its
    # backward, one block's backward. The head's gradient of a tied table is added in place to the
    # embedding's: it is the table's gradient itself, written from the head's backward on (the chunked
    # loss starts it as zeros before its forward). Until then XLA puts the dense loss's exp of the
    # logits in that (V, C) room when it fits: no more tokens than C.
    phases = [0.0]
    # one block's backward: its attention's transients (and with remat the block recomputed), once the
    # loss's logits and the block's own MLP tensors are freed
    _, attention_work = attention_bytes(cfg, act_bytes)
    mlp = spec.mlp_activation_bytes(m, cfg.parallel.tensor, act_bytes) + adapted  # of `full`
    block_phase = (attention_work + (full if remat else 0) - mlp) * tokens_micro
    if stage.embed:
        per_token += c * act_bytes + (c if m.dropout > 0 else 0)
    if stage.head:
        loss_kept, forward, backward = loss_bytes(cfg, vocab, tokens_micro)
        per_token += c * act_bytes + 4 * c + loss_kept
        block_phase -= loss_kept * tokens_micro
        # only a table that trains has a gradient to lend: frozen (LoRA, train.freeze) the exp is temp
        table_trains = not cfg.train.lora_rank and "embeddings" not in spec.frozen_layers(cfg.train.freeze, m.n_layer)[0]
        if not cfg.train.loss_chunk and stage.embed and m.tie_embeddings and forward <= 4 * vocab * c and table_trains:
            forward = 0.0
        phases += [forward, backward]
    work += max(phases + [block_phase])
    if stage.head:
        if stages > 1 and m.tie_embeddings:  # the head reads the tied table held by the first stage: a copy and its gradient
            work += vocab * c * (act_bytes + 4)
    adapters = adapter_params(cfg, stage)  # LoRA: float32 variables beside the (frozen) weights
    trainable = params + adapters - frozen_params(cfg, stage, vocab)  # AdamW state and gradients: these only
    grads = 4 * trainable * (2 if cfg.train.grad_accum > 1 else 1)
    return Memory(parameter_bytes(cfg, stage, adapters), 8 * trainable, grads, per_token * tokens, work)


def parameter_bytes(cfg: Config, stage: pipeline.Stage, adapters: int) -> int:
    """Bytes of `stage`'s weights and `adapters`: 4 each, but a LoRA base stored in bfloat16 or int8
    (train.lora_base_dtype, model/lora.py's FrozenDense) holds its blocks' projection kernels at 2 bytes,
    or 1 plus a float32 scale per output column (Keras' int8 Dense: kernel_scale)."""
    full = 4 * (stage.params + adapters)
    base = cfg.train.lora_base_dtype if cfg.train.lora_rank else "float32"
    if base == "float32":
        return full
    kernels = [shape for path, shape in spec.block_shapes(cfg.model).items() if path.endswith("/kernel")]
    elements = len(stage.blocks) * sum(rows * cols for rows, cols in kernels)
    if base == "bfloat16":
        return full - 2 * elements
    return full - 3 * elements + 4 * len(stage.blocks) * sum(cols for _, cols in kernels)


def vocab_size(cfg: Config) -> tuple[int, str]:
    """The vocabulary the run would have, and how it was found."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    kind, path = cfg.data.tokenizer, cfg.data.tokenizer_model
    if kind == "byte":
        return 257, "byte tokenizer"
    if kind == "sentencepiece" and path and os.path.isfile(path):
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=path).get_piece_size(), path
    if kind == "sentencepiece":
        return ASSUMED_SENTENCEPIECE_VOCAB, f"assumed: {path or 'no tokenizer model'} not readable here; " \
                                            "set model.vocab_size"
    return 256, "assumed for the char tokenizer (set model.vocab_size)"


@dataclasses.dataclass
class Plan:
    cfg: Config
    acc: Accelerator
    vocab: int
    vocab_source: str
    precision: str
    replicas: int
    micro_batch: int  # sequences per micro-batch
    stages: list[pipeline.Stage]
    memory: list[Memory]  # per stage (one chip each)
    memory_remat: list[Memory]  # the same with remat flipped, for comparison
    model_flops_per_step: float
    executed_flops_per_step: float
    mfu: float
    step_seconds: float
    bubble: float
    busy: list[float]

    @property
    def worst(self) -> int:
        return max(range(len(self.memory)), key=lambda i: self.memory[i].total)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.data.seq_len

    def memory_needed(self) -> float:
        """Bytes against `acc.memory_bytes`: one chip, or the whole machine when memory is shared."""
        if self.acc.shared_memory:
            return self.replicas * sum(mem.total for mem in self.memory)
        return self.memory[self.worst].total

    def fits(self, share: float = 1.0) -> bool:
        return not self.acc.memory_bytes or self.memory_needed() <= share * self.acc.memory_bytes

    def check(self) -> None:
        """UserError naming the largest term (and a setting that fits) when the plan does not fit."""
        if self.fits():
            return
        mem, acc = self.memory[self.worst], self.acc
        device = "logical device" if acc.shared_memory else "chip"
        where = "RAM of this machine" if acc.shared_memory else f"HBM of a {acc.kind} chip"
        state = mem.parameters + mem.optimizer + mem.gradients
        if state > acc.memory_bytes:  # the model alone overflows, whatever the batch
            raise UserError(f"parameters, optimizer and gradients: {_size(state)} per {device} (stage {self.worst}: "
                            f"{_size(mem.parameters)} + {_size(mem.optimizer)} + {_size(mem.gradients)}) > "
                            f"{_size(acc.memory_bytes)} {where} before any activation; {self._fix()}")
        name = max(("activations", "workspace"), key=lambda k: getattr(mem, k))  # what the batch adds
        others = ", ".join(f"{k} {_size(v)}" for k, v in mem.terms().items() if k != name)
        total = f"{_size(self.memory_needed())} {'on this machine' if acc.shared_memory else 'per chip'}"
        raise UserError(f"{name}: {_size(getattr(mem, name))} per {device} (stage {self.worst}); with {others} "
                        f"the total is {total} > {_size(acc.memory_bytes)} {where}; {self._fix()}")

    def _fix(self) -> str:
        """The smallest change that fits: more grad_accum, then remat, then more pipeline stages; at each,
        first as it is, then with the chunked loss, then also with blockwise attention (docs/memory.md)."""
        p, t, chips = self.cfg.parallel, self.cfg.train, self.acc.chips
        stage_options = [p.pipeline_stages] + [s for s in range(p.pipeline_stages + 1, self.cfg.model.n_layer + 1)
                                               if self.acc.shared_memory or chips % (s * p.tensor) == 0]
        chunk = t.loss_chunk or SUGGESTED_LOSS_CHUNK
        attention = self.cfg.model.attention if self.cfg.model.dropout else "blockwise"  # blockwise: no dropout
        memory_options = list(dict.fromkeys([(t.loss_chunk, self.cfg.model.attention),
                                             (chunk, self.cfg.model.attention), (chunk, attention)]))
        for stages in stage_options:
            for remat in dict.fromkeys((p.remat, True)):
                for accum in range(t.grad_accum, t.batch_size + 1):
                    if t.batch_size % (accum * p.microbatches):
                        continue  # cannot split the batch (the rest of the check is plan's)
                    found = self._fits_with(stages, remat, accum, memory_options)
                    if found is None:
                        break  # more grad_accum cannot help (it adds a gradient buffer)
                    if found:
                        return found
        return ("no grad_accum, remat, pipeline_stages, loss_chunk or attention setting fits it here: use more chips "
                "or a smaller model")

    def _fits_with(self, stages: int, remat: bool, accum: int, memory_options: list) -> str | None:
        """'it fits with ...' for the first of `memory_options` (loss_chunk, attention) that fits with
        these settings, "" if none does, None if the model's state alone overflows."""
        p, t = self.cfg.parallel, self.cfg.train
        for loss_chunk, attention in memory_options:
            changes = {"train.grad_accum": accum, "parallel.remat": remat, "parallel.pipeline_stages": stages,
                       "train.loss_chunk": loss_chunk, "model.attention": attention}
            cfg = copy.deepcopy(self.cfg)
            cfg.train.grad_accum, cfg.parallel.remat, cfg.parallel.pipeline_stages = accum, remat, stages
            cfg.train.loss_chunk, cfg.model.attention = loss_chunk, attention
            if self.acc.shared_memory:
                cfg.cpu_devices = max(cfg.cpu_devices, stages) // stages * stages
                changes["cpu_devices"] = cfg.cpu_devices
            try:
                candidate = plan(cfg, self.acc, self.mfu, check=False)
            except UserError:  # the batch does not split this way
                return ""
            state = candidate.memory[candidate.worst]
            if state.parameters + state.optimizer + state.gradients > self.acc.memory_bytes:
                return None
            if candidate.fits(TIGHT):
                now = {"train.grad_accum": t.grad_accum, "parallel.remat": p.remat,
                       "parallel.pipeline_stages": p.pipeline_stages, "cpu_devices": self.cfg.cpu_devices,
                       "train.loss_chunk": t.loss_chunk, "model.attention": self.cfg.model.attention}
                setting = " and ".join(f"{k}={str(v).lower()}" for k, v in changes.items() if v != now[k])
                return (f"{self._takes(changes)}it fits with {setting} ({_size(candidate.memory_needed())}, "
                        f"{_seconds(candidate.step_seconds)} per step)")
        return ""

    def _takes(self, changes: dict) -> str:
        """What the memory options of a fix remove, on the most loaded stage: "the loss's logits take
        41.0 GiB, ..." (empty when the fix uses neither)."""
        cfg, act = self.cfg, 2 if self.precision != "float32" else 4
        tokens_micro = self.micro_batch * cfg.data.seq_len
        tokens = tokens_micro * cfg.parallel.microbatches
        stage = self.stages[self.worst]
        said = []
        if changes["train.loss_chunk"] != cfg.train.loss_chunk and stage.head:
            kept, forward, backward = loss_bytes(cfg, self.vocab, tokens_micro)
            said.append(f"the loss's logits take {_size(kept * tokens + max(forward, backward))}")
        if changes["model.attention"] != cfg.model.attention:
            kept, work = attention_bytes(cfg, act)
            said.append(f"attention's scores take {_size(kept * tokens * len(stage.blocks) + work * tokens_micro)}")
        return ", ".join(said) + (": " if said else "")

    def _flops_formula(self) -> str:
        """How the model FLOPs per token are counted (spec.layer_flops_per_token)."""
        if self.cfg.train.lora_rank:
            return "4N + 6 x the adapters' + 12 L C T per token: no weight gradient for the frozen base"
        if self.cfg.train.freeze:
            return ("6N trained + 4N frozen + 12 L C T per token, only the forward below the lowest trained "
                    "layer")
        return "6N + 12 L C T per token"

    def lines(self) -> list[str]:
        """The plan as `tpu-llm plan` prints it."""
        cfg, acc, p, t = self.cfg, self.acc, self.cfg.parallel, self.cfg.train
        peak = f"{acc.peak_flops / 1e12:.0f} TFLOP/s" if acc.peak_flops >= 1e12 else \
            f"{acc.peak_flops / 1e9:.1f} GFLOP/s"
        if acc.shared_memory:
            ram = _size(acc.memory_bytes) if acc.memory_bytes else "unknown"
            out = [f"target    cpu: this machine, {acc.note} {peak}, RAM {ram} shared by "
                   f"{self.replicas * p.pipeline_stages} logical device(s)"]
        else:
            out = [f"target    {acc.name} = {acc.chips} {acc.kind} chips ({acc.note}); per chip {peak} bf16 "
                   f"peak, {_size(acc.memory_bytes)} HBM"]
        out += [f"layout    {self.replicas} replica(s) x {p.pipeline_stages} pipeline stage(s) x {p.tensor} tensor "
                f"way(s); precision {self.precision}; remat {'on' if p.remat else 'off'}",
                f"batch     {t.batch_size} x {cfg.data.seq_len} = {self.tokens_per_step:,} tokens per step; per "
                f"replica {t.batch_size // self.replicas} = {t.grad_accum} grad_accum x {p.microbatches} "
                f"micro-batch(es) of {self.micro_batch}",
                f"model     {spec.params(cfg.model, self.vocab):,} parameters; vocabulary {self.vocab:,} "
                f"({self.vocab_source})"]
        out += ["partition " + line for line in pipeline.describe(self.stages)]
        full, kept = block_activation_bytes(cfg, 2 if self.precision != "float32" else 4)
        tokens_micro = self.micro_batch * cfg.data.seq_len
        out.append(f"block     activations of one block for one micro-batch: {_size(full * tokens_micro)} "
                   f"({_size(kept * tokens_micro)} with remat)")
        columns = [max(c, key=lambda mem: mem.total) for c in (self.memory, self.memory_remat)]
        heads = [f"remat {'on' if r else 'off'}, stage {c.index(m)}" for r, c, m in
                 zip((p.remat, not p.remat), (self.memory, self.memory_remat), columns)]
        if p.remat:
            columns, heads = columns[::-1], heads[::-1]
        device = "logical device" if acc.shared_memory else "chip"
        out.append(f"memory    per {device}, the most loaded stage" + "".join(f"{h:>20}" for h in heads))
        for name in [*Memory.__dataclass_fields__, "total"]:
            out.append(f"  {name:<36}" + "".join(f"{_size(getattr(c, name)):>20}" for c in columns))
        need, cap = self.memory_needed(), acc.memory_bytes
        share = f"{100 * need / cap:.0f}% of the {_size(cap)}" if cap else "RAM unknown:"
        devices = self.replicas * len(self.memory)
        whole = f"all {devices} logical devices: " if acc.shared_memory and devices > 1 else ""
        verdict = "" if self.fits(TIGHT) else ": tight (padding and reserved memory are not counted)" \
            if self.fits() else ": DOES NOT FIT"
        out.append(f"  this config (remat {'on' if p.remat else 'off'}): {whole}{_size(need)} = {share} "
                   f"{'RAM' if acc.shared_memory else 'HBM'}{verdict}")
        out.append(f"flops     {self.model_flops_per_step:.3g} per step (model: {self._flops_formula()}), "
                   f"{self.executed_flops_per_step:.3g} executed{' (remat: blocks forward twice)' if p.remat else ''}")
        busy = " / ".join(f"{100 * b:.0f}%" for b in self.busy)
        formula = (p.pipeline_stages - 1) / (p.microbatches + p.pipeline_stages - 1)
        out.append(f"pipeline  GPipe, {p.microbatches} micro-batch(es) x {p.pipeline_stages} stage(s): bubble "
                   f"{100 * self.bubble:.1f}% ((P-1)/(M+P-1) = {100 * formula:.1f}%); stages busy {busy}")
        effective = self.model_flops_per_step / (self.step_seconds * acc.peak_flops * acc.chips)
        out.append(f"time      {_seconds(self.step_seconds)} per step at {100 * self.mfu:.0f}% of peak while busy: "
                   f"{self.tokens_per_step / self.step_seconds:,.0f} tokens/s, MFU {100 * effective:.1f}% "
                   "(all-reduce, optimizer update and transfers not counted)")
        if acc.shared_memory and p.pipeline_stages > 1:
            out.append("note      logical CPUs share the cores: the bubble costs no time there; stages on several "
                       "devices run as a TF graph (not XLA), which keeps more intermediates than estimated")
        if acc.shared_memory and self.precision != "float32":
            out.append("note      XLA:CPU computes bfloat16 in float32 and keeps float32 copies: expect more memory")
        return out


def plan(cfg: Config, acc: Accelerator | str, mfu: float = 0.4, check: bool = True) -> Plan:
    """The plan for training `cfg` on `acc`; raises UserError if it cannot fit (unless check=False)."""
    from tpu_llm.training.build import check_batch_split

    acc = accelerator(acc) if isinstance(acc, str) else acc
    try:
        mfu = float(mfu)
    except (TypeError, ValueError):
        mfu = -1.0
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu={mfu} must be in (0, 1]: the fraction of peak a chip sustains while busy")
    p, t = cfg.parallel, cfg.train
    per_replica = p.pipeline_stages * p.tensor
    if acc.shared_memory:
        if p.tensor > 1:
            # off-TPU the weights stay whole on each replica's first device and its groups read
            # slices of them: the per-core memory model below (weights split T ways) does not apply
            raise UserError(f"parallel.tensor={p.tensor}: the planner models tensor parallelism on TPU chips "
                            "only; plan a TPU accelerator or set parallel.tensor=1")
        if cfg.cpu_devices % p.pipeline_stages or cfg.cpu_devices < p.pipeline_stages:
            raise UserError(f"cpu_devices={cfg.cpu_devices} must be a multiple of parallel.pipeline_stages="
                            f"{p.pipeline_stages} (one logical device per stage, per replica)")
        replicas = cfg.cpu_devices // p.pipeline_stages
    else:
        if acc.chips % per_replica:
            raise UserError(f"{acc.name} has {acc.chips} chips, which do not split into replicas of "
                            f"parallel.pipeline_stages={p.pipeline_stages} x parallel.tensor={p.tensor} = "
                            f"{per_replica} chips; use a slice with a multiple of {per_replica} chips")
        replicas = acc.chips // per_replica
    check_batch_split(t.batch_size, replicas, t.grad_accum, p.microbatches)
    precision = cfg.precision if cfg.precision != "auto" else (
        "float32" if acc.shared_memory else "mixed_bfloat16")
    act_bytes = 4 if precision == "float32" else 2
    vocab, source = vocab_size(cfg)
    seq = cfg.data.seq_len
    stages = pipeline.partition(cfg.model, vocab, seq, p.pipeline_stages)
    micro = t.batch_size // (replicas * t.grad_accum * p.microbatches)
    tokens_micro = micro * seq
    memory, memory_remat = ([stage_memory(cfg, s, vocab, act_bytes, tokens_micro * p.microbatches, tokens_micro,
                                          remat) for s in stages] for remat in (p.remat, not p.remat))

    # a frozen weight (train.freeze, or all but LoRA's adapters) has no weight gradient: 4N, not 6N
    frozen = spec.frozen_layers(t.freeze, cfg.model.n_layer) if t.freeze else ((), ())
    adapters = spec.adapters_per_block(cfg.model, cfg.train)
    layers, head = spec.layer_flops_per_token(cfg.model, vocab, seq, frozen, adapters)
    block_forward = spec.block_flops_per_token(cfg.model, seq) / 3 + 2 * adapters  # what remat repeats
    model_flops = progress.flops_per_token(cfg, vocab) * t.batch_size * seq
    executed = model_flops + (cfg.model.n_layer * block_forward * t.batch_size * seq if p.remat else 0.0)
    rate = acc.peak_flops * mfu * (p.tensor if not acc.shared_memory else 1)
    forward = [(s.flops_per_token / 3 + 2 * adapters * len(s.blocks)) * tokens_micro / rate for s in stages]
    # the backward over the forward: 2 when every weight trains, about 1 for a frozen base; remat adds the
    # blocks' forward again (the head is not recomputed)
    ratios = []
    for s, seconds in zip(stages, forward):
        parts = [layers[i] for i in s.blocks] + ([head] if s.head else [])
        ratio = sum(b for _, b in parts) / sum(f for f, _ in parts)
        ratios.append(ratio + (len(s.blocks) * block_forward * tokens_micro / rate / seconds if p.remat else 0.0))
    pipe_seconds, bubble, busy = simulate(forward, p.microbatches, ratios)
    step = t.grad_accum * pipe_seconds
    if acc.shared_memory:  # logical devices share the cores: idle stages leave them to the others
        step = executed / (acc.peak_flops * mfu)
    result = Plan(cfg, acc, vocab, source, precision, replicas, micro, stages, memory, memory_remat,
                  model_flops, executed, mfu, step, bubble, busy)
    if check:
        result.check()
    return result


def _params(cfg: Config, vocab: int) -> int:
    """GPT.num_params() of the config's model, as tools/bench.py prints it."""
    return spec.params(cfg.model, vocab)


def _size(x: float) -> str:
    for unit, scale in (("TiB", GIB * 1024), ("GiB", GIB), ("MiB", 2.0**20), ("KiB", 1024.0)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
