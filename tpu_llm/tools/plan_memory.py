"""The planner's memory model: the bytes on one chip (one device) at the peak of a training step,
per pipeline stage, for tpu_llm/tools/plan.py.

Memory per chip of stage s (blocks n_s; a = 2 bytes under mixed precision, 4 in float32). A block's
parameters, FLOPs and activation bytes come from tpu_llm/spec.py, which the model, the config and
the stage partitioner read too; this docstring derives its activation terms.
  parameters   4 bytes x the stage's parameters (pipeline.partition), whole on the stage's first chip:
               tensor groups (tpu_llm/parallel/tensor.py) split the matmuls and activations, not the weights.
               LoRA: the adapters at 4 bytes beside them, and a frozen base stored in bfloat16
               (train.lora_base_dtype) holds the blocks' projection kernels at 2 bytes, int8 at 1 plus a
               float32 scale per output column (embeddings, head, norms and biases: 4)
  optimizer    8 bytes x the stage's trainable parameters: AdamW's m and v, float32. The layers
               train.freeze names (training/optimizer.py's freeze) have no optimizer slots. With
               parallel.shard_optimizer=state each of the R replicas keeps 1/R of them (training/
               sharded_adamw.py: ceil(rows / R) rows of each variable; counted here as 8 / R bytes)
  gradients    4 bytes x the trainable parameters, twice with train.grad_accum > 1 (the running sum
               and the new one); frozen layers get none. parallel.shard_optimizer=grads: one micro-batch's
               whole gradients, the replica's rows of their reduced sum and, with grad_accum > 1, its
               rows of the running sum: 4 (1 + 2/R) bytes (4 (1 + 1/R) with grad_accum 1, no saving then;
               training/trainer.py divided_loss_and_grads). XLA's buffer assignment of the compiled TPU
               step saves between 0.3x and 1.1x of what this counts at 4 replicas (docs/memory.md (f))
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
               LoRA (spec.adapter_activation_bytes): XLA fuses an adapter's addition into the
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
"""

from __future__ import annotations

import dataclasses

from tpu_llm.config import Config
from tpu_llm.config.checks import adapted_layers, adapters_per_block
from tpu_llm.model import spec
from tpu_llm.parallel import pipeline

GIB = 2.0**30


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
    (model/adapters.py), every block alike; 0 without LoRA."""
    return len(stage.blocks) * adapters_per_block(cfg)


def trainable_params(cfg: Config, stage: pipeline.Stage, vocab: int) -> int:
    """The parameters of `stage` that have gradients and AdamW state: its weights and adapters, less what
    train.freeze (or LoRA) freezes."""
    return stage.params + adapter_params(cfg, stage) - frozen_params(cfg, stage, vocab)


def stage_memory(cfg: Config, stage: pipeline.Stage, vocab: int, act_bytes: int, tokens: float,
                 tokens_micro: float, remat: bool, replicas: int = 1) -> Memory:
    """Memory of the chip running `stage`, holding `tokens` tokens of activations (a micro-step of its
    replica) of which `tokens_micro` are one micro-batch; `replicas`: the data-parallel replicas, over
    which parallel.shard_optimizer=state divides AdamW's moments (and grads the gradients' running sum)."""
    m, stages = cfg.model, cfg.parallel.pipeline_stages
    c = m.n_embd
    n_blocks = len(stage.blocks)
    params = stage.params  # whole, also with tensor groups: they split compute and activations only
    full, kept = block_activation_bytes(cfg, act_bytes)
    # LoRA: XLA keeps an adapted MLP projection's base and adapter outputs apart (model/spec.py)
    adapted = spec.adapter_activation_bytes(m, adapted_layers(cfg), cfg.parallel.tensor, act_bytes)
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
        table_trains = not cfg.train.lora_rank and "embeddings" not in spec.frozen_layers(cfg.train.freeze,
                                                                                       m.n_layer)[0]
        if not cfg.train.loss_chunk and stage.embed and m.tie_embeddings and forward <= 4 * vocab * c and table_trains:
            forward = 0.0
        phases += [forward, backward]
    work += max(phases + [block_phase])
    if stage.head:
        if stages > 1 and m.tie_embeddings:  # the head reads the tied table held by the first stage: a copy and its gradient
            work += vocab * c * (act_bytes + 4)
    adapters = adapter_params(cfg, stage)  # LoRA: float32 variables beside the (frozen) weights
    trainable = trainable_params(cfg, stage, vocab)  # AdamW state and gradients: these only
    grads = 4 * trainable * (2 if cfg.train.grad_accum > 1 else 1)
    shards = replicas if cfg.parallel.shard_optimizer in ("state", "grads") else 1
    if cfg.parallel.shard_optimizer == "grads" and replicas > 1:  # a micro-batch's, the rows of its sum and
        grads = 4 * trainable * (1 + (2 if cfg.train.grad_accum > 1 else 1) / replicas)  # of the running sum
    return Memory(parameter_bytes(cfg, stage, adapters), 8 * trainable / shards, grads, per_token * tokens, work)


def parameter_bytes(cfg: Config, stage: pipeline.Stage, adapters: int) -> int:
    """Bytes of `stage`'s weights and `adapters`: 4 each, but a LoRA base stored in bfloat16 or int8
    (train.lora_base_dtype, model/adapters.py's FrozenDense) holds its blocks' projection kernels at 2 bytes,
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
