"""Blockwise causal attention (`model.attention: blockwise`): the flash-attention recurrence in plain TF.

Dense attention (model.attend) builds the (B, H, T, S) scores and their softmax, and the backward pass
keeps the softmax: memory grows with T x S. Here the queries are cut into blocks of `block` rows and
the keys into blocks of `block` columns; for each query block a loop walks the key blocks with an
online softmax (Rabe & Staats 2021; Dao et al. 2022): a running row maximum m, normaliser l and
weighted sum acc, each new block rescaled by exp(m_old - m_new). Only one (B, H, block, block) score
tile exists at a time, and the forward keeps just the output and the log-sum-exp per row.

The backward pass is a custom gradient that recomputes each tile's probabilities from the saved
log-sum-exp (flash attention's backward): dV += P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ += dS K,
dK += dS^T Q. Nothing of size T x S is kept, in the forward or the backward.

Key blocks that no query of a block can see (all in its future) are never visited: the inner loop
stops at the last key block the block's last query may see (i + 1 blocks in training, where the
queries start at position 0), which halves the work of a causal pass.

Grouped keys and values: k and v may have Hkv heads, Hkv dividing H; query head h reads kv head
h // (H // Hkv). Positions: query i sits at pos + i (pos an int, or a tensor while decoding with the
KV cache) and sees keys at positions <= its own, exactly as model.attend. Scores and the softmax are
float32; the matmuls of the forward run in the inputs' dtype (bfloat16 under mixed precision), the
backward in float32.

Attention dropout is not implemented: config validation refuses model.attention=blockwise with
model.dropout > 0 (a mask per tile would have to be regenerated identically in the backward pass).
"""

from __future__ import annotations

import functools
import math

import tensorflow as tf

MASKED = -1e9  # the score of a key a query may not see


def for_config(cfg):
    """The attention function the config selects; same signature as model.attend."""
    if cfg.attention == "blockwise":
        return functools.partial(blockwise_attend, block=cfg.attention_block)
    return attend


def attend(q, k, v, pos, dropout, training):
    """Causal attention of queries q (B, H, T, hd) at positions pos.. over keys/values (B, Hkv, S, hd),
    Hkv dividing H: query head h reads key/value head h // (H / Hkv) (grouped-query attention; HF's
    repeat_kv order). Returns the heads side by side, (B, T, H * hd). Softmax in float32."""
    B, H, T, hd = tf.shape(q)[0], q.shape[1], tf.shape(q)[2], q.shape[3]
    Hkv = k.shape[1]
    # grouped: the H/Hkv query heads reading one kv head side by side as rows, instead of repeating k
    # and v; multi-head keeps the 4-D form, for which XLA holds one copy of the scores fewer (measured:
    # tests/test_plan.py's "attention" config). Batched matmuls, not tf.einsum: TF's TPU compiler keeps
    # a matmul's core assignment (pipeline stages, tensor groups), and drops an Einsum's.
    grouped = Hkv < H
    if grouped:
        q = tf.reshape(q, [B, Hkv, (H // Hkv) * T, hd])  # (B, Hkv, H/Hkv T, hd): heads g*H/Hkv.. share kv head g
    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(hd))  # (B, Hkv, H/Hkv T, S) or (B, H, T, S)
    if grouped:
        scores = tf.reshape(scores, [B, Hkv, H // Hkv, T, -1])  # (B, Hkv, H/Hkv, T, S)
    # query i sits at position pos + i and may see keys at positions <= its own
    allowed = tf.range(tf.shape(k)[2])[None, :] <= (pos + tf.range(T))[:, None]  # (T, S)
    scores = tf.where(allowed, tf.cast(scores, tf.float32), MASKED)
    probs = tf.cast(dropout(tf.nn.softmax(scores, axis=-1), training=training), v.dtype)
    if grouped:
        probs = tf.reshape(probs, [B, Hkv, (H // Hkv) * T, -1])  # (B, Hkv, H/Hkv T, S)
    y = tf.reshape(tf.matmul(probs, v), [B, H, T, hd])  # (B, H, T, hd)
    return tf.reshape(tf.transpose(y, [0, 2, 1, 3]), [B, T, H * hd])  # (B, T, H * hd)


def blockwise_attend(q, k, v, pos, dropout, training, block: int = 128):
    """model.attend's contract: queries q (B, H, T, hd) at positions pos.., keys/values (B, Hkv, S, hd);
    returns (B, T, H * hd)."""
    if training and dropout is not None and getattr(dropout, "rate", 0) > 0:
        raise ValueError("blockwise attention has no attention dropout (config validation refuses it)")
    B, H, T, hd = tf.shape(q)[0], q.shape[1], tf.shape(q)[2], q.shape[3]
    y = _flash(q, k, v, pos, int(block))  # (B, H, T, hd)
    return tf.reshape(tf.transpose(y, [0, 2, 1, 3]), [B, T, H * hd])


def _blocks(x, n, size):
    """(B, ..., n * size - pad, hd) -> (n, B, ..., size, hd), zero-padded at the end of axis -2."""
    rank = len(x.shape)
    pad = n * size - tf.shape(x)[-2]
    x = tf.pad(x, [[0, 0]] * (rank - 2) + [[0, pad], [0, 0]])
    shape = tf.concat([tf.shape(x)[:-2], [n, size, x.shape[-1]]], 0)
    x = tf.reshape(x, shape)  # (B, ..., n, size, hd)
    perm = [rank - 2] + list(range(rank - 2)) + [rank - 1, rank]
    return tf.transpose(x, perm)


def _unblock(x, length):
    """(n, B, ..., size, hd) -> (B, ..., length, hd)."""
    rank = len(x.shape)
    perm = list(range(1, rank - 2)) + [0, rank - 2, rank - 1]
    x = tf.transpose(x, perm)  # (B, ..., n, size, hd)
    s = tf.shape(x)
    x = tf.reshape(x, tf.concat([s[:-3], [s[-3] * s[-2], x.shape[-1]]], 0))
    return x[..., :length, :]


def _flash(q, k, v, pos, block):
    """The blockwise attention (B, H, T, hd) of the module docstring, with its own backward.

    Long because it is one custom gradient: the forward pass and its backward share the blocking, the
    mask and the saved log-sum-exp as closures; apart, each loop body would take a dozen arguments."""
    H, Hkv, hd = q.shape[1], k.shape[1], q.shape[3]
    if H % Hkv:
        raise ValueError(f"{Hkv} key/value heads do not divide {H} query heads")
    G = H // Hkv
    T, S = tf.shape(q)[2], tf.shape(k)[2]
    static_t, static_s = q.shape[2], k.shape[2]
    bq = min(block, static_t) if static_t else block
    bk = min(block, static_s) if static_s else block
    nq, nk = (T + bq - 1) // bq, (S + bk - 1) // bk
    pos = tf.cast(pos, tf.int32)
    scale = 1.0 / math.sqrt(hd)
    dtype = q.dtype

    def visible(i):
        """Key blocks query block i may see: up to the one holding its last query's position."""
        return tf.minimum(nk, (pos + (i + 1) * bq - 1) // bk + 1)

    def tile(i, j, qi, kj):
        """float32 scores (B, Hkv, G, bq, bk) of query block i against key block j, masked."""
        s = tf.cast(tf.einsum("bkgtd,bksd->bkgts", qi, kj), tf.float32) * scale
        allowed = (j * bk + tf.range(bk))[None, :] <= (pos + i * bq + tf.range(bq))[:, None]  # (bq, bk)
        return tf.where(allowed, s, MASKED)

    @tf.custom_gradient
    def attention(q, k, v):
        qb = _blocks(tf.reshape(q, [-1, Hkv, G, T, hd]), nq, bq)  # (nq, B, Hkv, G, bq, hd)
        kb, vb = _blocks(k, nk, bk), _blocks(v, nk, bk)  # (nk, B, Hkv, bk, hd)
        row = tf.zeros(tf.shape(qb)[1:-1], tf.float32)  # (B, Hkv, G, bq)

        def query_block(i, outs, lses):
            qi = tf.gather(qb, i)

            def key_block(j, m, l, acc):
                s = tile(i, j, qi, tf.gather(kb, j))
                m_new = tf.maximum(m, tf.reduce_max(s, axis=-1))
                p = tf.exp(s - m_new[..., None])
                rescale = tf.exp(m - m_new)  # the running sums were relative to the old maximum
                pv = tf.cast(tf.einsum("bkgts,bksd->bkgtd", tf.cast(p, dtype), tf.gather(vb, j)), tf.float32)
                return j + 1, m_new, l * rescale + tf.reduce_sum(p, -1), acc * rescale[..., None] + pv

            start = (tf.constant(0), row + MASKED, row, tf.zeros(tf.shape(qi), tf.float32))
            _, m, l, acc = tf.while_loop(lambda j, *_: j < visible(i), key_block, start)
            return i + 1, outs.write(i, acc / l[..., None]), lses.write(i, m + tf.math.log(l))

        arrays = [tf.TensorArray(tf.float32, size=nq, element_shape=shape)
                  for shape in (qb.shape[1:], qb.shape[1:-1])]
        _, outs, lses = tf.while_loop(lambda i, *_: i < nq, query_block, (tf.constant(0), *arrays))
        out, lse = outs.stack(), lses.stack()  # (nq, B, Hkv, G, bq, hd), (nq, B, Hkv, G, bq)
        y = tf.reshape(_unblock(out, T), tf.shape(q))

        def grad(dy):
            f32 = functools.partial(tf.cast, dtype=tf.float32)
            qf, kf, vf = _blocks(f32(tf.reshape(q, [-1, Hkv, G, T, hd])), nq, bq), _blocks(f32(k), nk, bk), \
                _blocks(f32(v), nk, bk)
            do = _blocks(f32(tf.reshape(dy, [-1, Hkv, G, T, hd])), nq, bq)  # (nq, B, Hkv, G, bq, hd)
            delta = tf.reduce_sum(do * out, axis=-1)  # rowsum(dO * O): (nq, B, Hkv, G, bq)

            def query_block(i, dqs, dk, dv):
                qi, doi, lse_i, delta_i = (tf.gather(t, i) for t in (qf, do, lse, delta))

                def key_block(j, dq, dk, dv):
                    kj, vj = tf.gather(kf, j), tf.gather(vf, j)
                    p = tf.exp(tile(i, j, qi, kj) - lse_i[..., None])  # (B, Hkv, G, bq, bk); masked: 0
                    dp = tf.einsum("bkgtd,bksd->bkgts", doi, vj)
                    ds = p * (dp - delta_i[..., None]) * scale
                    at = [[j]]
                    dv = tf.tensor_scatter_nd_add(dv, at, tf.einsum("bkgts,bkgtd->bksd", p, doi)[None])
                    dk = tf.tensor_scatter_nd_add(dk, at, tf.einsum("bkgts,bkgtd->bksd", ds, qi)[None])
                    return j + 1, dq + tf.einsum("bkgts,bksd->bkgtd", ds, kj), dk, dv

                _, dq, dk, dv = tf.while_loop(lambda j, *_: j < visible(i), key_block,
                                              (tf.constant(0), tf.zeros_like(qi), dk, dv))
                return i + 1, dqs.write(i, dq), dk, dv

            dqs = tf.TensorArray(tf.float32, size=nq, element_shape=qf.shape[1:])
            _, dqs, dk, dv = tf.while_loop(lambda i, *_: i < nq, query_block,
                                           (tf.constant(0), dqs, tf.zeros_like(kf), tf.zeros_like(vf)))
            dq = tf.reshape(_unblock(dqs.stack(), T), tf.shape(q))
            return tuple(tf.cast(g, x.dtype) for g, x in ((dq, q), (_unblock(dk, S), k), (_unblock(dv, S), v)))

        return tf.cast(y, dtype), grad

    return attention(q, k, v)
