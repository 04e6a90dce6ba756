"""A run whose parts contradict each other (issue 40 #5), second round: shard token ids past the model's
vocabulary whatever their meta.json says (checked as the ids leave the input pipeline), and a tokenizer
that no longer matches the one the model was trained with, on train, resume, generate and export. Each
is one `error:` line, exit 2, and nothing in the run directory changed (tests/test_trust_boundaries.py
holds the first round; `Refusal` comes from there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import TINY_FLAGS
from test_trust_boundaries import Refusal

from tpu_llm.data import sources

CHARS = "abcdefghij"  # a char tokenizer of 12 ids: the 10 characters, end-of-text and unknown


def write_shard(path: Path, docs: list[list[int]]) -> None:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for doc in docs:
            feature = tf.train.Feature(int64_list=tf.train.Int64List(value=doc))
            writer.write(tf.train.Example(features=tf.train.Features(
                feature={sources.TFRECORD_FEATURE: feature})).SerializeToString())


@pytest.mark.parametrize("execution, meta, split", [("xla", "lies", "training"), ("graph", "missing", "validation")])
def test_a_shard_id_past_the_vocabulary_stops_the_run_in_one_line_whatever_meta_json_says(tmp_path, capsys, execution,
                                                                                          meta, split):
    """Issue 40 #5: shards whose ids pass the vocabulary trained silently under XLA (on TPU an out-of-range
    gather reads garbage) and ended in a traceback under --execution=graph. meta.json's max_id is checked
    before training (test_trust_boundaries); when it lies or is missing, the batches' ids are checked as
    they leave the input pipeline."""
    shards = tmp_path / "shards"
    shards.mkdir()
    good, bad = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4] * 3, [[3, 4, 40, 5, 6, 7, 8, 9] * 4] * 3  # 40: 12 ids
    write_shard(shards / "train.tfrecord", bad if split == "training" else good)
    write_shard(shards / "validation.tfrecord", bad if split == "validation" else good)
    (shards / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": CHARS}))
    if meta == "lies":
        (shards / "meta.json").write_text(json.dumps({"max_id": 10}))
    run = tmp_path / "run"
    r = Refusal(capsys, ["train", "--run_dir", run, f"--data.train={shards / 'train.tfrecord'}",
                         f"--data.validation={shards / 'validation.tfrecord'}", "--data.tokenizer=char", *TINY_FLAGS,
                         f"--execution={execution}"], shards)
    last = r.stderr.splitlines()[-1]  # after the progress lines of the steps before an evaluation
    assert r.code == 2 and last.startswith("error: ") and "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert all(w in last for w in (f"the {split} data (", "holds token id 40, outside the model's 12 ids",
                                   "prepare them again with this run's tokenizer")), last
    assert not r.changed
    assert not list((run / "checkpoints").glob("ckpt-*")), "a checkpoint was saved"
