"""The loss: next-token cross entropy from the head's logits (`cross_entropy`), or, with
`train.loss_chunk`, from the head's input without the (B, T, V) logits (`chunked_loss`).

cross_entropy keeps the float32 logits (4 V bytes per token) and the log-sum-exp for its backward,
which forms the gradient softmax - onehot in one pass over the logits, in place of them. TF's fused
op (tf.nn.sparse_softmax_cross_entropy_with_logits) computes that gradient in the forward pass, so
its logits and softmax are alive together, and XLA:CPU then also kept the softmax and its scaled copy
apart: 4 logits-sized buffers at the head for GPT-2's shape. This one takes the compiled step's
temporary memory down 29-39% on the rows of tpu-llm bench memory (docs/memory.md), at the same speed,
with the same values and gradients (tests/test_memory.py).

At a 50k-128k vocabulary the logits are still most of a small model's activation memory. The chunked
loss flattens the tokens (N of them) and never holds a tile larger than (chunk, V) floats:

- forward, over token chunks: the head's matmul, the log-sum-exp and the picked logit of `chunk`
  tokens at a time; the log-sum-exp of every token (N floats) is kept for the backward;
- backward (a custom gradient), over vocabulary slices of Vs = chunk V / N ids: recompute the slice's
  logits (N, Vs) from the kept log-sum-exp, g = softmax - onehot, dX += g W_s and write
  dW_s = g^T X into its rows of dW. Each row of the table's gradient is written once, in place: a
  loop over token chunks would instead add a (V, C) partial gradient per chunk, and XLA:CPU then keeps
  three (V, C) float32 buffers alive in the loop (the sum, the partial and the new sum: 3 GiB for a
  128k x 2048 table; tpu-llm bench memory).

One more head matmul than the plain loss (2 N V C FLOPs on top of the 6 N V C of forward and
backward). The forward's last chunk is padded with zero rows that a mask leaves out of the sum; the
backward's last slice is moved back to end at V, and the ids it shares with the slice before it are
left out of dX (dW gets the same rows written twice, with the same values). The mean is over the
real tokens. Everything here is float32, as the logits are in model.head.
"""

from __future__ import annotations

import tensorflow as tf


def cross_entropy(logits, targets):
    """Mean next-token cross entropy of logits (..., V) against int targets (...), float32."""
    v = logits.shape[-1]
    z = tf.reshape(tf.cast(logits, tf.float32), [-1, v])  # (N, V)
    y = tf.reshape(tf.cast(targets, tf.int32), [-1])  # (N,)

    @tf.custom_gradient
    def loss(z):
        lse = tf.reduce_logsumexp(z, axis=-1)  # (N,)
        nll = lse - tf.gather(z, y, batch_dims=1)

        def grad(upstream):
            scale = upstream / tf.cast(tf.shape(z)[0], tf.float32)
            # d loss / d z = (softmax - onehot) / N, written as two scaled terms: XLA:CPU then forms it
            # in one fused pass (with (softmax - onehot) * scale it kept the softmax apart as well)
            return tf.exp(z - lse[:, None]) * scale - tf.one_hot(y, v, dtype=tf.float32) * scale

        return tf.reduce_mean(nll), grad

    return loss(z)


LANES = 128  # vocabulary slices are a multiple of this (a TPU vector register's lanes), unless V is smaller


def chunked_loss(x, weights, targets, chunk: int):
    """Mean next-token cross entropy of the head `weights` (V, C) applied to x (..., C) (the final
    norm's output), against int targets (...); float32, equal to model.loss_fn(model.head(...))."""
    c = x.shape[-1]
    x = tf.reshape(tf.cast(x, tf.float32), [-1, c])  # (N, C)
    targets = tf.reshape(tf.cast(targets, tf.int32), [-1])  # (N,)
    if x.shape[0] is not None:  # no padding beyond the tokens there are
        chunk = min(int(chunk), x.shape[0])
    return _loss(x, tf.cast(weights, tf.float32), targets, int(chunk))


def vocab_slice(chunk: int, tokens: int, vocab: int) -> int:
    """Ids per slice of the backward: a (tokens, slice) tile about as large as the forward's (chunk, V)."""
    ids = -(-chunk * vocab // max(tokens, 1))
    return vocab if ids >= vocab else min(vocab, -(-ids // LANES) * LANES)


def _loss(x, w, targets, chunk):
    n, c = tf.shape(x)[0], x.shape[-1]
    v = w.shape[0]
    k = (n + chunk - 1) // chunk  # token chunks of the forward
    pad = k * chunk - n
    xb = tf.reshape(tf.pad(x, [[0, pad], [0, 0]]), [k, chunk, c])  # (K, chunk, C)
    yb = tf.reshape(tf.pad(targets, [[0, pad]]), [k, chunk])
    real = tf.reshape(tf.cast(tf.range(k * chunk) < n, tf.float32), [k, chunk])  # padding: 0
    count = tf.cast(n, tf.float32)

    @tf.custom_gradient
    def loss(x, w):
        def body(i, total, lses):
            z = tf.matmul(tf.gather(xb, i), w, transpose_b=True)  # (chunk, V), float32
            lse = tf.reduce_logsumexp(z, axis=-1)  # (chunk,)
            nll = lse - tf.gather(z, tf.gather(yb, i), batch_dims=1)
            return i + 1, total + tf.reduce_sum(nll * tf.gather(real, i)), lses.write(i, lse)

        lses = tf.TensorArray(tf.float32, size=k, element_shape=[chunk])
        _, total, lses = tf.while_loop(lambda i, *_: i < k, body, (tf.constant(0), tf.constant(0.0), lses))
        lse = tf.reshape(lses.stack(), [-1])[:n]  # (N,): all the backward keeps besides x and w

        def grad(upstream):
            scale = upstream / count
            if x.shape[0] is not None:
                vs = vocab_slice(chunk, x.shape[0], v)
            else:  # unknown token count: slices of chunk's worth of ids
                vs = min(v, -(-chunk // LANES) * LANES)
            slices = -(-v // vs)

            def body(j, dx, dw):
                start = tf.minimum(j * vs, v - vs)  # the last slice ends at V
                ws = tf.slice(w, [start, 0], [vs, c])  # (Vs, C)
                z = tf.matmul(x, ws, transpose_b=True)  # (N, Vs)
                g = (tf.exp(z - lse[:, None]) - tf.one_hot(targets - start, vs, dtype=tf.float32)) * scale
                new = tf.cast(start + tf.range(vs) >= j * vs, tf.float32)  # ids no earlier slice had
                dx += tf.matmul(g * new, ws)  # (N, C)
                rows = (start + tf.range(vs))[:, None]  # the slice's rows of dW, written in place
                return j + 1, dx, tf.tensor_scatter_nd_update(dw, rows, tf.matmul(g, x, transpose_a=True))

            _, dx, dw = tf.while_loop(lambda j, *_: j < slices, body, (tf.constant(0), tf.zeros_like(x), tf.zeros_like(w)))
            return dx, dw

        return total / count, grad

    return loss(x, w)
