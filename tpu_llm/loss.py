"""Chunked cross-entropy (`train.loss_chunk`): the output head and the loss without the (B, T, V) logits.

The plain loss (model.loss_fn on model.head's logits) holds float32 logits for every token, and the
backward pass their softmax and gradient as well: 4 V bytes per token each, which at a 50k-128k
vocabulary is most of a small model's activation memory. Here the tokens are flattened and taken
`chunk` at a time: the head's matmul, the log-sum-exp and the picked logit of one chunk, inside a
loop, so one (chunk, V) tile exists at a time. The backward pass is a custom gradient that recomputes
each chunk's logits (one more head matmul: 2 N V C FLOPs on top of the 6 N V C of forward and
backward) and forms dX = (softmax - onehot) W and dW += (softmax - onehot)^T X chunk by chunk.

The last chunk is padded with zero rows that a mask leaves out of the sum; the mean is over the real
tokens. Everything here is float32, as the logits are in model.head.
"""

from __future__ import annotations

import tensorflow as tf


def chunked_loss(x, weights, targets, chunk: int):
    """Mean next-token cross entropy of the head `weights` (V, C) applied to x (..., C) (the final
    norm's output), against int targets (...); float32, equal to model.loss_fn(model.head(...))."""
    c = x.shape[-1]
    x = tf.reshape(tf.cast(x, tf.float32), [-1, c])  # (N, C)
    targets = tf.reshape(tf.cast(targets, tf.int32), [-1])  # (N,)
    if x.shape[0] is not None:  # no padding beyond the tokens there are
        chunk = min(int(chunk), x.shape[0])
    return _loss(x, tf.cast(weights, tf.float32), targets, int(chunk))


def _loss(x, w, targets, chunk):
    n, c = tf.shape(x)[0], x.shape[-1]
    k = (n + chunk - 1) // chunk  # chunks
    pad = k * chunk - n
    xb = tf.reshape(tf.pad(x, [[0, pad], [0, 0]]), [k, chunk, c])  # (K, chunk, C)
    yb = tf.reshape(tf.pad(targets, [[0, pad]]), [k, chunk])
    real = tf.reshape(tf.cast(tf.range(k * chunk) < n, tf.float32), [k, chunk])  # padding: 0
    count = tf.cast(n, tf.float32)

    def logits(i):
        return tf.matmul(tf.gather(xb, i), w, transpose_b=True)  # (chunk, V), float32

    @tf.custom_gradient
    def loss(x, w):
        def body(i, total):
            z = logits(i)
            nll = tf.reduce_logsumexp(z, axis=-1) - tf.gather(z, tf.gather(yb, i), batch_dims=1)
            return i + 1, total + tf.reduce_sum(nll * tf.gather(real, i))

        _, total = tf.while_loop(lambda i, _: i < k, body, (tf.constant(0), tf.constant(0.0)))

        def grad(upstream):
            scale = upstream / count

            def body(i, dxs, dw):
                z = logits(i)
                g = tf.nn.softmax(z) - tf.one_hot(tf.gather(yb, i), tf.shape(w)[0], dtype=tf.float32)
                g *= tf.gather(real, i)[:, None] * scale  # (chunk, V): d loss / d logits
                return i + 1, dxs.write(i, tf.matmul(g, w)), dw + tf.matmul(g, tf.gather(xb, i), transpose_a=True)

            dxs = tf.TensorArray(tf.float32, size=k, element_shape=[chunk, c])
            _, dxs, dw = tf.while_loop(lambda i, *_: i < k, body, (tf.constant(0), dxs, tf.zeros_like(w)))
            return tf.reshape(dxs.stack(), [-1, c])[:n], dw

        return total / count, grad

    return loss(x, w)
