"""Trust boundaries, second round (issue 40): special files where a regular file is expected (a FIFO, a
device such as /dev/zero), hard links out of a run directory, the run directory's own files damaged or
from elsewhere, `data prepare` into a directory it does not own, a run whose parts contradict each
other, non-finite weights on import. Each refusal is one `error:` line, exit 2, nothing in the
directory changed (and nothing outside it); each case failed (or hung) before its fix.

The commands run through `cli.main` in this process, on copies of one tiny trained run (char
vocabulary, checkpoints at steps 2 and 4). A FIFO is never opened by the test itself (`state` below
hashes regular files only): a reader that blocks on it would hang the test, which `time_limit` turns
into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_FLAGS, Refusal, time_limit, trained_run, write_gpt2, write_safetensors
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_llm import cli
from tpu_llm.errors import UserError
from tpu_llm.interop import safetensors_io
from tpu_llm.platform import files
from tpu_llm.tools import report
from tpu_llm.training import line_log

FLAGS = [*TINY_FLAGS, "--checkpoint.every_steps=2", "--data.tokenizer=char", "--execution=graph"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The module's run (4 steps, checkpoints at 2 and 4) and the flags that trained it."""
    return trained_run(tmp_path_factory.mktemp("trained"), FLAGS)


def resume(run: Path, flags: list) -> list:
    return ["train", f"--run_dir={run}", *flags, "--train.steps=6"]


# ---- 1. special files and hard links ---------------------------------------------------------------


def test_open_regular_refuses_a_fifo_a_device_a_link_and_with_single_link_a_hard_link(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("text")
    os.link(tmp_path / "file", tmp_path / "hard")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with time_limit(5):
        for path, flags, words in [("fifo", os.O_RDONLY, "is a named pipe (FIFO)"),
                                   ("fifo", os.O_WRONLY | os.O_APPEND, "is a named pipe (FIFO)"),
                                   ("/dev/zero", os.O_RDONLY, "is a character device"),
                                   ("link", os.O_RDONLY, "is a symbolic link"), (".", os.O_RDONLY, "is a directory")]:
            with pytest.raises(UserError, match=re.escape(words)):
                files.open_regular(str(tmp_path / path), "the file", flags)
        with pytest.raises(UserError, match="has 2 hard links"):
            files.open_regular(str(tmp_path / "hard"), "the file", os.O_WRONLY | os.O_APPEND, single_link=True)
    os.close(files.open_regular(str(tmp_path / "hard"), "the file"))  # read only: a hard link is harmless
    os.close(files.open_regular(str(tmp_path / "link"), "the file", follow_links=True))


def test_read_regular_is_bounded_for_a_file_whose_size_reads_as_0():
    assert os.stat("/proc/self/maps").st_size == 0
    with pytest.raises(UserError, match="holds more than 10 bytes"):
        files.read_regular("/proc/self/maps", 10, "the file")
    assert files.read_regular("/proc/self/maps", 1 << 24, "the file").count(b"\n") > 3


def test_generate_refuses_dev_zero_as_prompt_file_in_one_line(run_copy, capsys):
    run, _ = run_copy
    r = Refusal(capsys, ["generate", "--run_dir", run, "--prompt_file", "/dev/zero"], run, seconds=30)
    r.assert_refused("--prompt_file /dev/zero is a character device, not a regular file")


@pytest.mark.parametrize("name", [".tpu-llm-lock", "metrics.jsonl", "goodput.jsonl", "config.yaml"])
def test_a_fifo_in_the_run_directory_is_refused_not_waited_on(run_copy, capsys, name):
    """Issue 40 #1: a FIFO at the lock or at metrics.jsonl blocked a resumed `train` forever."""
    run, flags = run_copy
    (run / name).unlink()
    os.mkfifo(run / name)
    r = Refusal(capsys, resume(run, flags), run, seconds=60)
    r.assert_refused(f"holds a named pipe (FIFO), {name}, where only regular files")  # the run directory's check


@pytest.mark.parametrize("name", ["goodput.jsonl", "metrics.jsonl", ".tpu-llm-lock"])
def test_a_log_hard_linked_out_of_the_run_directory_is_refused_never_appended_to(run_copy, tmp_path, capsys, name):
    """Issue 40 #2: a goodput.jsonl hard-linked to a file elsewhere was appended to on resume."""
    run, flags = run_copy
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(run / name, outside / "victim")
    r = Refusal(capsys, resume(run, flags), run, outside)
    r.assert_refused(f"{run / name} has 2 hard links")


TF_OPENS = ["checkpoints/checkpoint", "checkpoints/ckpt-4.index", "checkpoints/ckpt-4.data-00000-of-00001",
            "logs/goodput/EVENTS"]


def command(name: str, run: Path, flags: list, tmp_path: Path) -> list:
    """Every command that restores or reads a run: train (a resume), generate, export, report."""
    return {"train": resume(run, flags), "generate": ["generate", "--run_dir", run, "--prompt", "a"],
            "export": ["export", "--run_dir", run, "--output", tmp_path / "export"],
            "report": ["report", "--run_dir", run, "--plot", tmp_path / "r.png"]}[name]


@pytest.mark.parametrize("rel", TF_OPENS)
@pytest.mark.parametrize("name", ["train", "generate", "export", "report"])
def test_a_fifo_where_tensorflow_opens_a_file_itself_is_refused_by_every_command(run_copy, tmp_path, capsys, rel, name):
    """Issue 50 #3: a FIFO at the checkpoint state file, a ckpt-N.index or data file, or an event file hung
    train and generate forever (TF opens them itself; files.open_regular never sees those opens)."""
    run, flags = run_copy
    if rel.endswith("EVENTS"):
        rel = str(next((run / "logs" / "goodput").glob("events.out.tfevents.*")).relative_to(run))
    (run / rel).unlink()
    os.mkfifo(run / rel)
    r = Refusal(capsys, command(name, run, flags, tmp_path), run, seconds=60)
    r.assert_refused(f"holds a named pipe (FIFO), {rel}, where only regular files and directories belong")


@pytest.mark.parametrize("rel", ["checkpoints", "logs"])
def test_a_resume_with_checkpoints_or_logs_a_regular_file_is_refused_and_changes_nothing(run_copy, capsys, rel):
    """Issue 50 #2 and #6: checkpoints/ a regular file made a resume drop metrics.jsonl's lines (6 to 1),
    then exit 2 at its first save; logs/ a regular file was a traceback."""
    run, flags = run_copy
    shutil.rmtree(run / rel)
    (run / rel).write_text("not a directory")
    Refusal(capsys, resume(run, flags), run).assert_refused(f"holds {rel} as a regular file, where tpu-llm keeps a "
                                                            "directory")


@pytest.mark.parametrize("source", ["missing", "not-a-run", "nul"])
def test_a_refused_init_from_creates_nothing(run_copy, tmp_path, capsys, source):
    """Issue 50 #2: a refused train.init_from left a new run directory holding its lock (and its parents)."""
    run, flags = run_copy
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "not-a-run" / "notes.txt").write_text("someone else's")
    new = tmp_path / "parent" / "new"
    given = f"{tmp_path}/a\0b" if source == "nul" else str(tmp_path / source)
    r = Refusal(capsys, ["train", f"--run_dir={new}", *flags, f"--train.init_from={given}"], tmp_path)
    r.assert_refused("train.init_from=")
    assert not (tmp_path / "parent").exists()


# ---- 2. the run directory's own line files ----------------------------------------------------------


BAD_LINES = ['{"split": "train", "step": Infinity, "loss": 1.0}', '{"split": "train", "step": NaN, "loss": 1.0}',
             '{"split": ["train"], "step": 3, "loss": 1.0}', '{"split": "train", "step": "3", "loss": 1.0}',
             '{"split": "train", "step": 1e999, "loss": 1e999}', '[1, 2]', 'not json', '{"split": {}, "step": 2}',
             '{"split": "train", "step": 5, "loss": 1' + "0" * 400 + '}', "[" * 100_000]


def test_report_skips_malformed_metrics_lines(run_copy, capsys):
    """Issue 40 #5: a non-finite step or a non-string split in metrics.jsonl was a traceback in `report`."""
    run, _ = run_copy
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n".join(BAD_LINES) + "\n")
    with open(run / "goodput.jsonl", "a") as f:
        f.write("not json\n")
    capsys.readouterr()
    assert cli.main(["report", "--run_dir", str(run), "--plot", str(run / "r.png")]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "loss" in out
    # issue 50 #9: the partial table was shown as whole; now it says how many lines it left out, and why
    total = len((run / "metrics.jsonl").read_text().splitlines())
    assert f"warning   {run / 'metrics.jsonl'}: {len(BAD_LINES)} of {total} lines skipped (line {total - 9}, ...): " \
           "not a JSON object with a text split, a whole step and (train, validation) a numeric loss" in err, err
    assert f"warning   {run / 'goodput.jsonl'}: 1 of " in err and "lines skipped" in err, err


def test_a_resumed_train_drops_malformed_metrics_lines(run_copy, capsys):
    """Issue 40 #5: the same lines were a traceback in a resumed `train`; now they go with the torn ones."""
    run, flags = run_copy
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n".join(BAD_LINES) + "\n")
    capsys.readouterr()
    assert cli.main(resume(run, flags)) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if e["split"] == "train"] == [2, 4, 6]


SCALARS = st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats(allow_nan=True) | st.text(max_size=4)
JSON = st.recursive(SCALARS,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=8)
ENTRY = st.fixed_dictionaries({}, optional={"split": st.sampled_from(["train", "validation", "summary"]) | JSON,
                                            "step": st.integers(-5, 50) | JSON, "loss": st.floats() | JSON})
LINE = (ENTRY.map(json.dumps) | JSON.map(json.dumps) | st.text(max_size=30)).map(lambda line: line.replace("\n", " "))


@settings(max_examples=150, derandomize=True, deadline=None)
@given(lines=st.lists(LINE, max_size=10), tail=st.binary(max_size=30))
def test_property_any_metrics_file_is_read_line_by_line_never_raising(tmp_path_factory, lines, tail):
    """metrics.jsonl comes with the run directory (copied, edited, torn by a kill): whatever its lines hold,
    `report` and the resume's cut (logged_step) keep the sound lines and skip the others, never raising."""
    run = tmp_path_factory.mktemp("metrics")
    (run / "metrics.jsonl").write_bytes("".join(line + "\n" for line in lines).encode() + tail)
    curves = report.losses(str(run))
    for split, points in curves.items():
        assert all(type(step) is int and type(loss) is float for step, loss in points), points
    kept = [line for line in line_log.read_lines(str(run / "metrics.jsonl"))
            if (step := line_log.logged_step(line)) is not None and step <= 20]
    for line in kept:  # what a resume at step 20 keeps: JSON objects with a text split and a whole step <= 20
        entry = json.loads(line)
        assert isinstance(entry["split"], str) and int(entry["step"]) == entry["step"] <= 20
    try:
        report.report(str(run), str(run / "r.png"), say=lambda _: None)
    except UserError as e:  # nothing sound in it: one line
        assert "holds no goodput.jsonl and no metrics.jsonl" in str(e)


def test_train_holds_the_lock_before_it_reads_the_newest_checkpoint(run_copy, monkeypatch, capsys):
    """Issue 40 #8: the lock was taken after the newest checkpoint was read; another trainer could save
    in between. Now a second open of the lock file cannot take it while the checkpoint is read."""
    import fcntl

    from tpu_llm.training.checkpoint import Checkpointer

    run, flags = run_copy
    real, held = Checkpointer.restore_latest, []

    def reading(self, *args, **kwargs):
        fd = os.open(run / ".tpu-llm-lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "restore_latest", reading)
    assert cli.main(resume(run, flags)) == 0
    assert held == [True]


# ---- 4. a run whose parts contradict each other ----------------------------------------------------


@pytest.mark.parametrize("spec, words", [
    ({"kind": "byte"}, "holds a byte tokenizer, but the run was trained with data.tokenizer=char"),
    ({"kind": "char", "chars": "".join(map(chr, range(0x4E00, 0x4E00 + 500)))},
     "has 502 ids, the model's embedding 117 rows")])
def test_generate_and_export_refuse_a_tokenizer_that_contradicts_the_model(run_copy, tmp_path, capsys, spec, words):
    """Issue 40 #5: a tokenizer.json replaced (by data prepare into the run directory) made generate die with
    an InvalidArgumentError traceback, or print garbage with exit 0."""
    run, _ = run_copy
    (run / "tokenizer.json").write_text(json.dumps(spec))
    Refusal(capsys, ["generate", "--run_dir", run, "--prompt", "a"], run).assert_refused(words)
    Refusal(capsys, ["export", "--run_dir", run, "--output", tmp_path / "export"], tmp_path).assert_refused(words)


def test_shard_ids_past_the_vocabulary_are_refused_before_training(trained, tmp_path, capsys):
    """Issue 40 #5: shards whose ids pass the vocabulary trained silently under XLA (a finite loss of
    nonsense). data prepare records the largest id in meta.json; train (and --dry_run) compares it."""
    out = tmp_path / "shards"
    assert cli.main([str(a) for a in prepare_args(trained, out, "--tokenizer", "byte")]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["max_id"] == 256  # the byte tokenizer's end-of-text
    (out / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": "abcdefghij"}))  # 12 ids
    args = ["train", "--run_dir", tmp_path / "run", f"--data.train={out / 'data-00000-of-00002.tfrecord'}",
            f"--data.validation={out / 'data-00001-of-00002.tfrecord'}", *FLAGS]
    for dry in ([], ["--dry_run"]):
        Refusal(capsys, [*args, *dry], tmp_path).assert_refused(f"hold token id {meta['max_id']:,} (their meta.json), "
                                                                "past the model's 12 ids")


def test_an_hf_tokenizer_id_of_4e9_is_refused_before_the_library_reads_it(trained, gpt2_dir, tmp_path, capsys):
    """Issue 40 #6: a 4 KB tokenizer.json with one id of 4e9 made import allocate until killed, and ids past
    config.CAPS' vocabulary were accepted by data prepare and train --dry_run (shards of that tokenizer)."""
    source = tmp_path / "gpt2"
    shutil.copytree(gpt2_dir, source)
    shards = tmp_path / "shards"
    hf = ["--tokenizer", "hf", "--tokenizer_model", source]
    assert cli.main([str(a) for a in prepare_args(trained, shards, *hf)]) == 0
    spec = json.loads((source / "tokenizer.json").read_text())
    spec["model"]["vocab"][next(iter(spec["model"]["vocab"]))] = 4_000_000_000
    (source / "tokenizer.json").write_text(json.dumps(spec))
    capped = "a vocabulary id of 4000000000 passes tpu-llm's cap of 10,000,000 ids"
    r = Refusal(capsys, ["import", "--from", source, "--run_dir", tmp_path / "run"], tmp_path, seconds=60)
    r.assert_refused(capped)
    r = Refusal(capsys, prepare_args(trained, tmp_path / "more", *hf), tmp_path, seconds=60)
    r.assert_refused(capped)
    shutil.copy(source / "tokenizer.json", shards / "hf_tokenizer.json")  # the shards' copy, likewise
    train, validation = sorted(shards.glob("*.tfrecord"))
    r = Refusal(capsys, ["train", "--run_dir", tmp_path / "run", f"--data.train={train}",
                         f"--data.validation={validation}", "--data.tokenizer=hf", *TINY_FLAGS, "--dry_run"], tmp_path,
                seconds=60)
    r.assert_refused("passes tpu-llm's cap of 10,000,000 ids")


# ---- 3. data prepare --output ----------------------------------------------------------------------


def prepare_args(trained, output: Path, *more) -> list:
    run, _ = trained
    return ["data", "prepare", "--input", run.parent / "corpus" / "*.txt", "--output", output, "--shards", "2", *more]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_data_prepare_never_writes_into_a_run_directory(trained, run_copy, capsys, overwrite):
    """Issue 40 #4: the run's char vocabulary was replaced by {"kind": "byte"}; resume was then refused."""
    run, _ = run_copy
    r = Refusal(capsys, prepare_args(trained, run, *overwrite), run)
    r.assert_refused(f"--output {str(run)!r} is a tpu-llm run directory (it holds ")


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_data_prepare_names_another_tools_folder_as_what_it_is(trained, tmp_path, capsys, overwrite):
    """Issue 50 #10: a folder of another tool holding a config.yaml and a checkpoints/ was refused as "a
    tpu-llm run directory"; it is not one, and the message says what it is."""
    out = tmp_path / "theirs"
    (out / "checkpoints").mkdir(parents=True)
    (out / "config.yaml").write_text("learning_rate: 0.1\n")
    r = Refusal(capsys, prepare_args(trained, out, *overwrite), tmp_path)
    line = r.assert_refused(f"--output {str(out)!r} is not empty and not a tpu-llm data directory (it holds ")
    assert "run directory" not in line


def test_data_prepare_refuses_its_earlier_output_without_overwrite_even_without_shards(trained, tmp_path, capsys):
    """Issue 40 #4: a directory's own tokenizer.json and meta.json were overwritten without --overwrite."""
    out = tmp_path / "shards"
    assert cli.main([str(a) for a in prepare_args(trained, out)]) == 0
    for shard in out.glob("*.tfrecord"):
        shard.unlink()
    r = Refusal(capsys, prepare_args(trained, out, "--tokenizer", "char"), out)
    r.assert_refused("already holds files of an earlier data prepare (meta.json, tokenizer.json); pass --overwrite")


def test_data_prepare_never_writes_through_a_link_and_with_overwrite_only_its_own_files(trained, tmp_path, capsys):
    """Issue 40 #4: a symlinked meta.json had the next prepare write into the file outside."""
    out, victim = tmp_path / "shards", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious")
    (out / "meta.json").symlink_to(victim)
    (out / "notes.tfrecord").write_text("someone else's")
    r = Refusal(capsys, prepare_args(trained, out, "--overwrite"), out, tmp_path)
    r.assert_refused("holds a symbolic link, meta.json; data prepare never writes through a link")
    (out / "meta.json").unlink()
    r = Refusal(capsys, prepare_args(trained, out), out)
    r.assert_refused("already holds 1 other files (notes.tfrecord); pass --overwrite")
    assert cli.main([str(a) for a in prepare_args(trained, out, "--overwrite")]) == 0
    assert (out / "notes.tfrecord").read_text() == "someone else's" and victim.read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == ["data-00000-of-00002.tfrecord", "data-00001-of-00002.tfrecord",
                                                     "meta.json", "notes.tfrecord", "tokenizer.json"]


# ---- 5. import: non-finite tensors, special files; export: the import record -----------------------

WTE = "transformer.wte.weight"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers", reason="the checkpoint carries an hf tokenizer: pip install -e '.[hf]'")
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    write_gpt2(folder)
    return folder


def with_nan(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    reader = safetensors_io.Reader(str(target))
    tensors = {name: reader.get(name).copy() for name in reader.where}
    tensors[WTE][3, :] = np.nan
    tensors[WTE][5, 1] = np.inf
    write_safetensors(target / "model.safetensors", tensors)
    return target


def test_import_refuses_non_finite_tensors_naming_them_unless_allowed(gpt2_dir, tmp_path, capsys):
    """Issue 40 #7: an embedding of NaN imported with exit 0; generate then printed the prompt only."""
    source = with_nan(gpt2_dir, tmp_path / "nan")
    r = Refusal(capsys, ["import", "--from", source, "--run_dir", tmp_path / "run"], tmp_path)
    r.assert_refused(f"tensor {WTE} holds 33 non-finite values (NaN or infinity)", "--allow_non_finite")
    assert not (tmp_path / "run").exists()
    capsys.readouterr()
    assert cli.main(["import", "--from", str(source), "--run_dir", str(tmp_path / "run"), "--allow_non_finite"]) == 0
    assert capsys.readouterr().err.count(f"warning: {source / 'model.safetensors'}: tensor {WTE} holds 33") == 1


def test_import_refuses_a_fifo_as_model_safetensors(gpt2_dir, tmp_path, capsys):
    """Issue 40 #1: a FIFO as the HF directory's model.safetensors blocked `import`."""
    source = tmp_path / "gpt2"
    shutil.copytree(gpt2_dir, source)
    (source / "model.safetensors").unlink()
    os.mkfifo(source / "model.safetensors")
    r = Refusal(capsys, ["import", "--from", source, "--run_dir", tmp_path / "run"], tmp_path, seconds=60)
    r.assert_refused("model.safetensors is a named pipe (FIFO), not a regular file")


@pytest.fixture(scope="module")
def imported(gpt2_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("imported") / "run"
    assert cli.main(["import", "--from", str(gpt2_dir), "--run_dir", str(run)]) == 0
    return run


@pytest.mark.parametrize("content, words", [
    ("{not json", "hf_import.json is not valid JSON"),
    ('{"dtype": "float8"}', "hf_import.json: dtype \"float8\" is none export writes (float32, bfloat16, float16)"),
    ('{"dtype": ["bfloat16"]}', "hf_import.json: dtype [\"bfloat16\"] is none export writes"),
    ("link", "holds a symbolic link, hf_import.json ->")])
def test_export_refuses_a_damaged_or_linked_import_record_in_one_line(imported, tmp_path, capsys, content, words):
    """Issue 40 #3: a malformed hf_import.json was a traceback in `export --format hf`, and a linked one
    was read through the link."""
    run = tmp_path / "run"
    shutil.copytree(imported, run)
    record = run / "hf_import.json"
    if content == "link":
        (tmp_path / "elsewhere.json").write_text('{"dtype": "float16"}')
        record.unlink()
        record.symlink_to(tmp_path / "elsewhere.json")
    else:
        record.write_text(content)
    r = Refusal(capsys, ["export", "--run_dir", run, "--format", "hf", "--output", tmp_path / "hf"], tmp_path)
    r.assert_refused(words)


# ---- 6. imported adapters: untrusted like imported weights (issue 50 #4) -------------------------------


def write_adapter(gpt2_dir: Path, folder: Path, tensor_edit=None, **config_edit) -> Path:
    """A PEFT LoRA adapter (rank 2 on c_attn) for write_gpt2's checkpoint, as save_pretrained lays it out,
    without torch: adapter_config.json and random adapter_model.safetensors; then the edits."""
    from tpu_llm.config.reading import set_dotted
    from tpu_llm.interop import hf_config
    from tpu_llm.interop import peft as peft_format

    cfg = hf_config.run_config(hf_config.read_config(str(gpt2_dir)), str(gpt2_dir), "unused")
    for key, value in {"train.lora_rank": 2, "train.lora_alpha": 4.0, "train.lora_targets": "c_attn"}.items():
        set_dotted(cfg, key, value, source="test")
    rng = np.random.default_rng(0)
    tensors = {name: rng.normal(0, 0.1, shape).astype(np.float32)
               for name, shape in peft_format.adapter_shapes(cfg).items()}
    if tensor_edit:
        tensor_edit(tensors)
    folder.mkdir()
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({**peft_format.adapter_config(cfg), **config_edit}))
    return folder


def poisoned(tensors: dict) -> None:
    first = sorted(tensors)[0]
    tensors[first][0, :3] = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("edit, words", [
    ({"r": 0}, "adapter_config.json: r=0 is no LoRA rank (1 or more)"),
    ({"r": -2}, "adapter_config.json: r=-2 is no LoRA rank (1 or more)"),
    ({"r": 2**40}, "adapter_config.json: train.lora_rank=1099511627776 is more than its cap"),  # (refused before)
    ({"lora_alpha": 0}, "adapter_config.json: train.lora_alpha=0.0 must be > 0"),  # (refused before)
    ({"lora_alpha": float("inf")}, "adapter_config.json: lora_alpha=Infinity is not a finite number"),
    ({"lora_alpha": float("nan")}, "adapter_config.json: lora_alpha=NaN is not a finite number"),
    ({"target_modules": ["c_attn", "q_proj"]}, "target_modules [\"c_attn\", \"q_proj\"] is not a list of gpt2 "
                                               "modules"),  # (refused before)
    ("nan", "tensor base_model.model.transformer.h.0.attn.c_attn.lora_A.weight holds 3 non-finite values"),
])
def test_an_imported_adapter_is_checked_like_imported_weights(gpt2_dir, tmp_path, capsys, edit, words):
    """Issue 50 #4: NaN or infinity in an adapter's tensors imported with exit 0; r: 0 and a non-finite
    lora_alpha were not refused in words of their own. Each is one line, nothing written."""
    adapter = write_adapter(gpt2_dir, tmp_path / "adapter", poisoned if edit == "nan" else None,
                            **({} if edit == "nan" else edit))
    r = Refusal(capsys, ["import", "--from", gpt2_dir, "--adapter", adapter, "--run_dir", tmp_path / "run"], tmp_path)
    r.assert_refused(words)
    assert not (tmp_path / "run").exists()


def test_a_sound_adapter_imports(gpt2_dir, tmp_path, capsys):
    adapter = write_adapter(gpt2_dir, tmp_path / "adapter")
    args = ["import", "--from", str(gpt2_dir), "--adapter", str(adapter), "--run_dir", str(tmp_path / "run")]
    assert cli.main(args) == 0


@pytest.mark.parametrize("head", ["other", "equal"])
def test_a_tied_head_saved_with_other_values_is_refused_not_dropped(gpt2_dir, tmp_path, capsys, head):
    """Issue 50 #4: config.json says tie_word_embeddings and the file holds an lm_head.weight unlike the table:
    transformers 5 unties them (checked here: its warning, and its head the file's), tpu-llm dropped the head
    for the table. Now refused; a head equal to the table (save_pretrained may write both) imports."""
    source = tmp_path / "gpt2"
    shutil.copytree(gpt2_dir, source)
    reader = safetensors_io.Reader(str(source))
    tensors = {name: reader.get(name).copy() for name in reader.names()}
    tensors["lm_head.weight"] = tensors[WTE].copy()
    if head == "other":
        tensors["lm_head.weight"][7, :] += 1.0
    write_safetensors(source / "model.safetensors", tensors)
    args = ["import", "--from", source, "--run_dir", tmp_path / "run"]
    if head == "equal":
        assert cli.main([str(a) for a in args]) == 0
        return
    r = Refusal(capsys, args, tmp_path)
    r.assert_refused(f"lm_head.weight differs from the embedding table {WTE} (32 of its 9,600 values), but "
                     "config.json says tie_word_embeddings: true")
