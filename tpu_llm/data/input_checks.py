"""The input pipeline's own checks in tf.data: every batch's token ids against the model's vocabulary
as they leave the pipeline (`bounded_ids`, an assertion on the host), and `input_error`, the one line
for a host call that one of the pipeline's assertions stopped (the lanes' empty-data guard, lanes.py,
is one too). What a shard folder's meta.json records of its ids is checked before training, where it
is read (reading.check_shard_ids).
"""

from __future__ import annotations

import re

import tensorflow as tf

from tpu_llm.data.sources import Source
from tpu_llm.errors import UserError

# The pipeline's own assertions start their message with INPUT_CHECK; `input_error` turns the TensorFlow
# error they end a host call with into one line (training/actions.user_errors).
INPUT_CHECK = "tpu-llm input check: "
IDS_CHECK = "token ids outside the vocabulary"


def bounded_ids(windows: tf.Tensor, vocab_size: int) -> tf.Tensor:
    """`windows` (a batch of token windows), once every id in it is in [0, vocab_size): checked on the host,
    in tf.data, as the ids leave the pipeline. A shard's ids index the embedding, and XLA gathers an id past
    it without an error (on TPU: rows of garbage, a finite loss of nonsense); check_shard_ids trusts what
    meta.json records, this holds when it lies or is missing. Two reductions over the batch: about 30 us per
    batch of 64 x 1025 ids (docs/data.md)."""
    top, bottom = tf.reduce_max(windows), tf.reduce_min(windows)
    check = tf.debugging.Assert(tf.logical_and(bottom >= 0, top < vocab_size), [INPUT_CHECK + IDS_CHECK, top, bottom])
    with tf.control_dependencies([check]):
        return tf.identity(windows)


def input_error(error: Exception, split: str, source: Source, vocab_size: int) -> UserError | None:
    """The one line for a host call that one of the pipeline's own assertions stopped (`error` a TensorFlow
    error), else None (another error: not the pipeline's to explain)."""
    found = re.search(re.escape(INPUT_CHECK) + r"([^\]]*)\]((?: \[-?\d+\])*)", getattr(error, "message", "") or "")
    if not found:
        return None
    what, values = found.group(1), [int(v) for v in re.findall(r"-?\d+", found.group(2))]
    data = f"the {split} data ({source.description or ', '.join(source.files[:3])})"
    if what == IDS_CHECK and len(values) == 2:
        top, bottom = values
        bad = top if top >= vocab_size else bottom
        return UserError(f"{data} holds token id {bad:,}, outside the model's {vocab_size:,} ids (model.vocab_size, "
                         "or the tokenizer's): the shards were made by another tokenizer (their meta.json does not "
                         "say so, or is missing); prepare them again with this run's tokenizer")
    return UserError(f"{data}: {what}")
