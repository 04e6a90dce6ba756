"""What a model holds and costs, from its config alone: every variable's shape, parameters, training
FLOPs per token and activation bytes per token of a block. No TensorFlow.

This is the one place that arithmetic lives. The config (config/checks.py) bounds a config's size with it before anything
is built (MAX_PARAMS), the stage partitioner balances stages by it (parallel/pipeline.py), the planner
counts memory and time with it (tools/plan.py), the model reports its FLOPs per token by it
(model/transformer.py) and `tpu-llm import` checks a checkpoint's shapes by it before building anything
(interop/hf.py). tests/test_model_spec.py checks every shape against a built model's variables and each
tensor group's slices against what the layers cut.

Importing it loads no TensorFlow (tpu_llm/model/__init__.py imports the layers lazily), so the CLI can
check a config before TensorFlow starts. The block's layout is the family's (model/families/): which
norm, MLP, projections, positions and biases it has.

`m` below is a config.ModelConfig; C = n_embd, H = n_head, Hkv = kv_heads(), hd = head_size(), F =
hidden(), L = n_layer, V the vocabulary, T the sequence length. Shapes are keyed by Keras path (model/
transformer.py's docstring), below `block_i/` for a block.
"""

from __future__ import annotations

import math

from tpu_llm.errors import UserError
from tpu_llm.model import families


def head_dim(m) -> int:
    """Each head's width: model.head_dim, or C / H (a model section from before model.head_dim: C / H)."""
    return getattr(m, "head_dim", 0) or m.n_embd // max(m.n_head, 1)


def attention_width(m) -> int:
    """The width of q and of the attention's output, H hd (C unless model.head_dim says otherwise)."""
    return m.n_head * head_dim(m)


def _norm(m, name: str) -> dict[str, tuple[int, ...]]:
    """LayerNormalization's gamma (and beta with the family's biases), or RMSNorm's scale."""
    block = families.of(m).block
    if block.norm == "rms":
        return {f"{name}/scale": (m.n_embd,)}
    return {f"{name}/gamma": (m.n_embd,), **({f"{name}/beta": (m.n_embd,)} if m.bias and block.bias == "all" else {})}


def _dense(m, name: str, inputs: int, units: int) -> dict[str, tuple[int, ...]]:
    """A Dense layer's kernel and, where the family has one there (Block.dense_bias), its bias."""
    bias = families.of(m).block.dense_bias(name.rsplit("/", 1)[-1], m.bias)
    return {f"{name}/kernel": (inputs, units), **({f"{name}/bias": (units,)} if bias else {})}


def block_shapes(m) -> dict[str, tuple[int, ...]]:
    """Every variable of one block."""
    block = families.of(m).block
    c, f, hd = m.n_embd, m.hidden(), head_dim(m)
    q, kv = m.n_head * hd, m.kv_heads() * hd
    if block.qkv == "separate":  # k and v Hkv heads wide
        attn = {**_dense(m, "attn/q", c, q), **_dense(m, "attn/k", c, kv), **_dense(m, "attn/v", c, kv)}
    else:  # q, k, v side by side
        attn = _dense(m, "attn/qkv", c, 3 * c)
    if block.qk_norm:  # one RMSNorm over each head's hd dimensions, for q and for k
        attn.update({"attn/q_norm/scale": (hd,), "attn/k_norm/scale": (hd,)})
    if block.mlp == "swiglu":
        mlp = {**_dense(m, "mlp/gate", c, f), **_dense(m, "mlp/up", c, f), **_dense(m, "mlp/down", f, c)}
    else:
        mlp = {**_dense(m, "mlp/fc", c, f), **_dense(m, "mlp/proj", f, c)}
    return {**_norm(m, "ln1"), **attn, **_dense(m, "attn/proj", q, c), **_norm(m, "ln2"), **mlp}


def embedding_shapes(m, vocab: int) -> dict[str, tuple[int, ...]]:
    """The token table, and learned positions (gpt2's)."""
    learned = families.of(m).block.positions == "learned"
    positions = {"wpe/embeddings": (m.max_len, m.n_embd)} if learned else {}
    return {"wte/embeddings": (vocab, m.n_embd), **positions}


def head_shapes(m, vocab: int) -> dict[str, tuple[int, ...]]:
    """The final norm, and an untied head's own table (tied: the head reads wte)."""
    table = {} if m.tie_embeddings else {"lm_head/embeddings": (vocab, m.n_embd)}
    return {**_norm(m, "ln_f"), **table}


def shapes(m, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every variable of the model, by its path below the model (block_i/attn/q/kernel, wte/embeddings)."""
    blocks = {f"block_{i}/{path}": shape for i in range(m.n_layer) for path, shape in block_shapes(m).items()}
    return {**embedding_shapes(m, vocab), **blocks, **head_shapes(m, vocab)}


def group_shapes(m, ways: int) -> dict[str, tuple[int, ...]]:
    """The weight slices one of `ways` tensor groups reads (every group alike; config validation makes
    `ways` divide H, Hkv and F): what CausalSelfAttention.group_weights and MLP.group_weights cut."""
    block = families.of(m).block
    c, hd = m.n_embd, head_dim(m)
    h, kv, units = m.n_head // ways, m.kv_heads() // ways, m.hidden() // ways
    if block.qkv == "separate":
        attn = {**_dense(m, "attn/q", c, h * hd), **_dense(m, "attn/k", c, kv * hd), **_dense(m, "attn/v", c, kv * hd)}
    else:  # the group's heads of each of q, k and v, side by side: (C, 3 h hd)
        attn = _dense(m, "attn/qkv", c, 3 * h * hd)
    if block.mlp == "swiglu":
        mlp = {**_dense(m, "mlp/gate", c, units), **_dense(m, "mlp/up", c, units), "mlp/down/kernel": (units, c)}
    else:
        mlp = {**_dense(m, "mlp/fc", c, units), "mlp/proj/kernel": (units, c)}
    return {**attn, "attn/proj/kernel": (h * hd, c), **mlp}  # output projections: rows, no bias (added once)


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


# ---- parameters ------------------------------------------------------------------------------------

def block_params(m) -> int:
    return count(block_shapes(m))


def block_matmul_params(m) -> int:
    """A block's Dense kernels: the weights its matmuls multiply by (no norms, no biases)."""
    return count({k: s for k, s in block_shapes(m).items() if k.endswith("/kernel")})


def embedding_params(m, vocab: int) -> int:
    return count(embedding_shapes(m, vocab))


def head_params(m, vocab: int) -> int:
    return count(head_shapes(m, vocab))


def params(m, vocab: int) -> int:
    """Every parameter of the model: GPT.num_params() of a built one."""
    return embedding_params(m, vocab) + m.n_layer * block_params(m) + head_params(m, vocab)


def matrix_params(m, vocab: int) -> int:
    """The model's matrices (kernels and tables; norms and biases left out): what config.MAX_PARAMS bounds."""
    tables = {**embedding_shapes(m, vocab), **head_shapes(m, vocab)}
    return count({k: s for k, s in tables.items() if len(s) == 2}) + m.n_layer * block_matmul_params(m)


def lookup_params(m, vocab: int) -> int:
    """Parameters read by a lookup, not a matmul: gpt2's positions and, untied, the input table."""
    tables = embedding_shapes(m, vocab)
    if m.tie_embeddings:  # the head's matmul reads it
        del tables["wte/embeddings"]
    return count(tables)


# ---- what trains: train.freeze's layers, or the adapters and nothing else ---------------------------

def frozen_layers(text: str, n_layer: int) -> tuple[set, set]:
    """train.freeze as (names of whole layers: embeddings, head; block indices); a UserError if malformed."""
    named, blocks = set(), set()
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if item in ("embeddings", "head"):
            named.add(item)
            continue
        first, _, last = item.removeprefix("blocks:").partition("-")
        ok = item.startswith("blocks:") and first.isdigit() and (last.isdigit() or not last)
        low, high = (int(first), int(last or first)) if ok else (0, -1)
        if not (ok and low <= high < n_layer):
            raise UserError(f"config: train.freeze item {item!r}; give embeddings, head, blocks:A-B or blocks:N, "
                            f"comma-separated, with block numbers from 0 to model.n_layer - 1 = {n_layer - 1}")
        blocks.update(range(low, high + 1))
    return named, blocks


def run_flops_per_token(m, vocab: int, seq_len: int, freeze: str = "", adapters: int = 0) -> int:
    """Training FLOPs per token of a run, the MFU numerator: 6N + 12 L C T when every weight trains; no
    weight gradient for the layers train.freeze (`freeze`) keeps or, with `adapters` parameters per block
    (`adapter_params`), for every weight but the adapters (layer_flops_per_token). `tpu-llm plan` counts
    the same."""
    frozen = frozen_layers(freeze, m.n_layer) if freeze else ((), ())
    return training_flops_per_token(m, vocab, seq_len, frozen, adapters)


# ---- training FLOPs per token (forward + backward) -------------------------------------------------

def attention_flops_per_token(m, seq_len: int) -> int:
    """One block's attention scores and weighted sum, forward and backward: 12 C T (12 H hd T)."""
    return 12 * attention_width(m) * seq_len


def flops_per_token(m, vocab: int, seq_len: int, n_params: int | None = None) -> int:
    """The model's: 6 N + 12 L C T, N the parameters (default: all of `params`) less the lookups: every
    weight trained (`training_flops_per_token` counts frozen ones)."""
    n = params(m, vocab) if n_params is None else n_params
    return 6 * (n - lookup_params(m, vocab)) + m.n_layer * attention_flops_per_token(m, seq_len)


def adapter_params(m, rank: int, layers) -> int:
    """The adapters' A (in, r) and B (r, out) in one block: r (in + out) for each adapted projection
    (`layers`: paths below a block, e.g. attn/q; model/adapters.py)."""
    shapes = block_shapes(m)
    return sum(rank * sum(shapes[f"{path}/kernel"]) for path in layers)


def layer_flops_per_token(m, vocab: int, seq_len: int, frozen: tuple = ((), ()), adapters: int = 0,
                          ) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(forward, backward) training FLOPs per token of each block and of the head when some weights stay
    as they are: `frozen` is frozen_layers' (layer names, block indices) of train.freeze, and
    `adapters` > 0 (the adapters' parameters per block, `adapter_params`) freezes every weight but them.

    Per weight 2 FLOPs forward, 2 for the gradient of the layer's input, 2 for its own gradient: 6N when
    everything trains. A frozen weight has no weight gradient (4N); below every trained weight the
    backward does not run at all (2N: train.freeze of the first blocks with the embeddings). Attention
    (12 C T, no weights) is 4 C T forward and 8 C T backward. The adapters train: 6 x theirs. The head's
    matmul reads the (V, C) table, tied or not; the lookup of the input table is no matmul, but when that
    table trains its gradient needs the blocks' backward. Convention: a block with trained weights is
    counted with its whole backward (its first matmuls' input gradient, needed only from below, too)."""
    names, blocks = frozen
    adapted = adapters > 0
    p, attention = block_params(m), attention_flops_per_token(m, seq_len)
    through = not adapted and "embeddings" not in names  # the input table trains: the backward reaches block 0
    layers = []
    for i in range(m.n_layer):
        trains = not adapted and i not in blocks
        through = through or trains or adapted
        backward = (2 * p + 2 * attention // 3 if through else 0) + (2 * p if trains else 0) + 4 * adapters
        layers.append((2 * p + attention // 3 + 2 * adapters, backward))
    table = vocab * m.n_embd
    norm = head_params(m, vocab) - (0 if m.tie_embeddings else table)  # the final norm
    table_trains = not adapted and ("embeddings" if m.tie_embeddings else "head") not in names
    head = (2 * (table + norm),
            (2 * (table + norm) if through else 0) + 2 * table * table_trains + 2 * norm * (not adapted))
    return layers, head


def training_flops_per_token(m, vocab: int, seq_len: int, frozen: tuple = ((), ()), adapters: int = 0) -> int:
    """The model's training FLOPs per token with train.freeze's `frozen` layers or the `adapters`
    (`layer_flops_per_token`): `flops_per_token` when everything trains. The MFU numerator the trainer
    prints (training/progress.py) and `tpu-llm plan`'s model FLOPs."""
    layers, head = layer_flops_per_token(m, vocab, seq_len, frozen, adapters)
    return sum(f + b for f, b in layers) + sum(head)


def block_flops_per_token(m, seq_len: int) -> float:
    """One block's, as the stage partitioner balances them: 6 x its matmul weights + attention."""
    return 6.0 * block_matmul_params(m) + float(attention_flops_per_token(m, seq_len))


def head_flops_per_token(m, vocab: int) -> float:
    """The output head's matmul with the (V, C) table, forward and backward."""
    return 6.0 * vocab * m.n_embd


# ---- activation bytes per token of a block (tools/plan.py's docstring derives them) ----------------

def block_activation_bytes(m, seq_len: int, ways: int, act_bytes: int) -> tuple[float, float]:
    """(bytes per token a block saves for its backward, the same with remat: its input only), with its
    heads and units split `ways` ways and `act_bytes` per activation (2 mixed precision, 4 float32)."""
    c, h, q = m.n_embd, m.n_head, attention_width(m)
    # replicated over the tensor ways: both norms' inputs and outputs; split: q, k, v, attention output, MLP
    # (gpt2: GELU input, tanh, output; llama: gate and up outputs, their SwiGLU product), k and v
    # Hkv heads wide (llama: the rotated q and k; rotation is linear, its backward needs no input); with
    # q/k norms (qwen3) also their inputs, q and k before the norm
    kv = 2 * m.kv_heads() * head_dim(m)
    normed = q + kv // 2 if families.of(m).block.qk_norm else 0
    linear = 4 * c * act_bytes + (2 * q + kv + normed + 3 * m.hidden()) * act_bytes / ways
    scores, _ = attention_bytes(m, seq_len, ways, act_bytes)
    if m.dropout > 0:  # 1-byte masks on both residual branches and the probabilities, and dropped probs
        linear, scores = linear + 2 * c, scores + h * seq_len * 5 / ways
    return linear + scores, c * act_bytes


def adapter_activation_bytes(m, layers, ways: int, act_bytes: int) -> float:
    """Bytes per token a block keeps beyond `block_activation_bytes` with adapters on `layers` (paths
    below a block): only an elementwise op (SwiGLU, GELU) reads an adapted MLP input projection's (gate,
    up; gpt2: fc) output, so XLA fuses the adapter's addition into its readers and keeps the base's output
    and the adapter's apart. 2 x the width for each, as XLA:CPU's buffer assignment shows it for the
    Llama-3.2-1B block (4.6 F per block with gate and up adapted) and GPT-2 small's (docs/memory.md)."""
    hidden = [path for path in layers if path in ("mlp/gate", "mlp/up", "mlp/fc")]
    return 2 * len(hidden) * m.hidden() * act_bytes / ways


def mlp_activation_bytes(m, ways: int, act_bytes: int) -> float:
    """Of block_activation_bytes' split tensors, those the planner counts as freed before the block's
    attention backward runs: the MLP's three (F wide) and two C wide."""
    return (2 * m.n_embd + 3 * m.hidden()) * act_bytes / ways


def attention_bytes(m, seq_len: int, ways: int, act_bytes: int) -> tuple[float, float]:
    """(bytes per token one block's attention keeps for its backward beyond q, k, v and its output,
    bytes per token its backward holds while it runs): dense or blockwise (model.attention)."""
    h, seq, c = m.n_head / ways, seq_len, attention_width(m) / ways
    if m.attention == "blockwise":
        block = min(m.attention_block, seq)
        return 4 * c * (act_bytes != 4) + 4 * h, 8 * 4 * c + 5 * 4 * h * block * block / seq
    # the backward's gradients of the probabilities and the scores; with fewer kv heads (the 5-D einsum
    # of model.attend) XLA:CPU holds a third scores-sized buffer there
    copies = 2 if m.kv_heads() == m.n_head else 3
    return h * seq * (4 + (act_bytes if act_bytes != 4 else 0)), copies * 4 * h * seq
