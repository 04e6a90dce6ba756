"""A run whose parts contradict each other (issue 40 #5), second round: shard token ids past the model's
vocabulary whatever their meta.json says (checked as the ids leave the input pipeline), and a tokenizer
that no longer matches the one the model was trained with, on train, resume, generate and export. Each
is one `error:` line, exit 2, and nothing in the run directory changed (tests/test_trust_boundaries.py
holds the first round; `Refusal` is tests/helpers.py's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import TINY_FLAGS, Refusal, trained_run, write_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_llm.data import reading, sources
from tpu_llm.errors import UserError
from tpu_llm.training import run_directory

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


# ---- a run's files against each other: links, tokenizer -------------------------------------------------

SNOWMAN = "\u2603"  # in no corpus of the tests: a character the run's vocabulary does not hold
FLAGS = [*TINY_FLAGS, "--checkpoint.every_steps=2", "--data.tokenizer=char", "--execution=graph",
         "--model.vocab_size=128"]  # room for a larger vocabulary: the ids alone cannot tell two apart


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run (char vocabulary of ~117 ids in an embedding of 128, checkpoints at steps 2 and 4), its flags."""
    return trained_run(tmp_path_factory.mktemp("trained"), FLAGS)


def commands(run: Path, flags: list, tmp_path: Path) -> dict[str, list]:
    """Each command that reads the run: a resumed train, generate, export, report."""
    return {"train": ["train", f"--run_dir={run}", *flags, "--train.steps=6"],
            "generate": ["generate", "--run_dir", run, "--prompt", "a", "--max_new_tokens", "4"],
            "export": ["export", "--run_dir", run, "--output", tmp_path / "export"],
            "report": ["report", "--run_dir", run]}


@pytest.mark.parametrize("rel", ["tokenizer/vocab.json", "checkpoints/old/ckpt-2.index", "export/variables/x",
                                 "notes.txt"])
def test_a_link_anywhere_in_the_run_directory_is_refused_by_every_command(run_copy, tmp_path, capsys, rel):
    """Issue 40 #3: a link at a name of no list, or in a subdirectory other than checkpoints/ and logs/, was
    read or written through (report.png, under a link, got the plot written into the link's target)."""
    run, flags = run_copy
    (tmp_path / "outside").write_text("precious")
    (run / rel).parent.mkdir(parents=True, exist_ok=True)
    (run / rel).symlink_to(tmp_path / "outside")
    for command, args in commands(run, flags, tmp_path).items():
        r = Refusal(capsys, args, run, tmp_path)
        r.assert_refused(f"holds a symbolic link, {rel} -> {tmp_path / 'outside'}; tpu-llm never reads or writes")
    assert (tmp_path / "outside").read_text() == "precious"


def replace_tokenizer(run: Path, more: bool) -> None:
    """The run's char vocabulary with one character more (`more`), or one character swapped: the same size."""
    spec = json.loads((run / "tokenizer.json").read_text())
    spec["chars"] = spec["chars"] + SNOWMAN if more else spec["chars"][:-1] + SNOWMAN
    (run / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


REFUSED = "was trained with another tokenizer than"


@pytest.mark.parametrize("more", [False, True])
def test_generate_and_export_refuse_a_tokenizer_the_checkpoint_was_not_trained_with(run_copy, tmp_path, capsys, more):
    """Issue 40 #5: a tokenizer.json replaced by another vocabulary that fits the embedding (the same size, or
    a larger one within model.vocab_size) generated garbage with exit 0; the checkpoint records the
    tokenizer's content hash."""
    run, flags = run_copy
    replace_tokenizer(run, more)
    for command in ("generate", "export"):
        Refusal(capsys, commands(run, flags, tmp_path)[command], run, tmp_path).assert_refused(
            f"checkpoint {run}/checkpoints/ckpt-4 {REFUSED} {run}/tokenizer.json (sha256 ")


def test_a_resume_refuses_a_tokenizer_the_checkpoint_was_not_trained_with(run_copy, tmp_path, capsys):
    """Issue 40 #5: a resumed run took a replaced tokenizer.json that covers its data and fits the embedding
    (one character more), and trained on with every id meaning another character."""
    run, flags = run_copy
    replace_tokenizer(run, more=True)
    Refusal(capsys, commands(run, flags, tmp_path)["train"], run).assert_refused(
        f"checkpoint {run}/checkpoints/ckpt-4 {REFUSED} {run}/tokenizer.json")


def test_init_from_refuses_a_run_whose_tokenizer_was_replaced_since_its_checkpoint(run_copy, tmp_path, capsys):
    """Issue 40 #5: train.init_from compares the source's tokenizer.json with this run's; a source whose
    tokenizer.json was replaced (here by the vocabulary of this run's data) passed that and started from
    weights trained on other ids."""
    run, flags = run_copy
    replace_tokenizer(run, more=True)
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    (corpus / "snowman.txt").write_text(SNOWMAN + "\n")
    new = tmp_path / "new"
    args = ["train", f"--run_dir={new}", f"--data.train={corpus / '*.txt'}", *FLAGS, f"--train.init_from={run}"]
    Refusal(capsys, args, run).assert_refused(f"checkpoint {run}/checkpoints/ckpt-4 {REFUSED} {run}/tokenizer.json")
    assert not new.exists()  # issue 50 #2: a refusal creates nothing (it left `new` holding its lock)


# ---- records of a run or shard directory from elsewhere: read, or one line ----------------------------

KEYS = st.sampled_from(["model", "max_id", "shard_records", "shard_tokens", "shard_bytes", "a.tfrecord", "n_layer"])
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS | st.text(max_size=4), inner,
                                                                                   max_size=4), max_leaves=12)
RECORDS = VALUES.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=120)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(raw=RECORDS)
def test_property_a_run_config_and_a_shards_meta_json_are_read_or_one_line(tmp_path_factory, raw):
    """config.yaml and a shard directory's meta.json come with directories copied from anywhere: whatever
    they hold, they are read (meta.json's unusable parts ignored) or refused in one UserError line."""
    folder = tmp_path_factory.mktemp("records")
    for name in ("config.yaml", "meta.json"):
        (folder / name).write_bytes(raw)
    try:
        saved = run_directory.read_saved_config(str(folder))
        assert isinstance(saved, dict) and isinstance(saved.get("model", {}), dict)
    except UserError as e:
        assert "\n" not in str(e) and "config.yaml" in str(e)
    shard = str(folder / "a.tfrecord")
    assert isinstance(reading.read_meta(str(folder)), dict)
    recorded = reading._shard_meta([shard])
    assert all(isinstance(n, int) and n >= 0 for counts in recorded.values() for n in counts), recorded
    try:
        reading.check_shard_ids([shard], 300)
    except UserError as e:
        assert "\n" not in str(e) and "past the model's 300 ids" in str(e)


def test_a_shard_id_equal_to_the_vocabulary_size_is_refused_and_one_below_passes(tmp_path):
    """Issue 50 (a test that could not fail): the boundary of both id checks, which no test held. Id
    `vocab_size` is one past the embedding's last row; this fails for `>` instead of `>=` in check_shard_ids
    and for `<=` instead of `<` in bounded_ids (both mutants tried)."""
    from tpu_llm.data.input_checks import bounded_ids

    shard = str(tmp_path / "a.tfrecord")
    (tmp_path / "meta.json").write_text(json.dumps({"max_id": 12}))
    with pytest.raises(UserError, match="hold token id 12 .*past the model's 12 ids"):
        reading.check_shard_ids([shard], 12)
    reading.check_shard_ids([shard], 13)
    assert bounded_ids(tf.constant([[0, 11]]), 12).numpy().tolist() == [[0, 11]]
    with pytest.raises(tf.errors.InvalidArgumentError):
        bounded_ids(tf.constant([[0, 12]]), 12)
