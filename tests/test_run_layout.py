"""tpu_llm/platform/run_layout.py: a checkpoint's step read from its name (names come from a directory listing, a
bucket listing or a path in a message: any text), Cloud Storage's checkpoint listing on top of it, and
docs/run-directory.md's list of a run directory's files against the module's names."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpu_llm.cloud import storage
from tpu_llm.errors import UserError
from tpu_llm.platform import run_layout
from tpu_llm.platform.run_layout import UNFINISHED_SUFFIX, checkpoint_name, checkpoint_step

PROPERTY = settings(max_examples=300, derandomize=True, database=None, deadline=None)
# pieces of names that sit near the edges: digits of other scripts, signs, the words of the layout
PIECES = st.sampled_from(["ckpt-", "ckpt", "-", "0", "7", "12", "\u0663", "\u00b2", "+1", " ", ".index", ".data-0",
                          UNFINISHED_SUFFIX, "/", "checkpoints", "run", "a.b", ""])
NAMES = st.lists(PIECES, max_size=8).map("".join) | st.text(max_size=20)
SUFFIXES = st.sampled_from(["", ".index", UNFINISHED_SUFFIX])


@PROPERTY
@given(step=st.integers(0, 10**30), folder=st.sampled_from(["", "runs/a/checkpoints/", "gs://b/ckpt-9/checkpoints/"]),
       suffix=SUFFIXES)
def test_the_step_of_a_checkpoint_name_is_read_back(step, folder, suffix):
    assert checkpoint_step(f"{folder}{checkpoint_name(step)}{suffix}", suffix) == step


@PROPERTY
@given(path=NAMES, suffix=SUFFIXES)
@example(path="checkpoints/ckpt-\u0663", suffix="")  # an Arabic-Indic 3: str.isdigit and int() take it
@example(path="ckpt-\u00b2.index", suffix=".index")  # a superscript 2: str.isdigit takes it, int() raises
@example(path="ckpt-+1", suffix="")
@example(path="ckpt-12_temp", suffix="")
def test_any_other_name_has_no_step(path, suffix):
    """A step only for a last component `ckpt-N` + suffix with N in ASCII digits (int() also takes '٣')."""
    match = re.fullmatch(r"ckpt-([0-9]+)" + re.escape(suffix), os.path.basename(path))
    assert checkpoint_step(path, suffix) == (int(match.group(1)) if match else None)


@PROPERTY
@given(rel=NAMES)
@example(rel="checkpoints/ckpt-5.index")
@example(rel="a/checkpoints/ckpt-12.index")
@example(rel="xcheckpoints/ckpt-5.index")
@example(rel="checkpoints/ckpt-5.data-00000-of-00001")
@example(rel="checkpoints/ckpt-5.index\n")
def test_a_bucket_listing_finds_what_the_former_pattern_found(rel):
    """cloud.storage's runs and checkpoints listing: the steps its regular expression found (ASCII names)."""
    former = re.search(r"/checkpoints/ckpt-([0-9]+)\.index$", "/" + rel)
    assert storage._index_step(rel) == (int(former.group(1)) if former and not rel.endswith("\n") else None)


def test_the_run_directory_page_lists_the_names_of_run_layout():
    """docs/run-directory.md's tree shows every top-level name of run_layout.NAMES, and no other, and the
    TensorBoard splits of logs/."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "run-directory.md").read_text()
    tree = page.split("```\nruns/tiny/\n", 1)[1].split("```", 1)[0]
    listed = [name for line in tree.splitlines() for name in re.split(r"\s{2,}", line.strip())[0].split(", ")]
    assert {name.split("/")[0] for name in listed} == set(run_layout.NAMES), listed
    assert [name.split("/")[1] for name in listed if name.count("/") == 1 and name.startswith(run_layout.LOGS_DIR)
            and "." not in name] == list(run_layout.LOG_SPLITS)


# deeper than the run's own trees, names of no list: a link anywhere is refused, not only at the listed names
ELSEWHERE = ["notes.txt", "config.yaml.tmp-1a2b3c4d", "checkpoints/old/ckpt-2.index", "tokenizer/vocab.json",
             "logs/validation/events.out.tfevents.1", "logs/train/plugins/profile/trace.json.gz",
             "export/variables/variables.index", "hf/model.safetensors", "a/b/c/d/e"]


@pytest.mark.parametrize("rel", [*run_layout.NAMES, *ELSEWHERE])
def test_a_link_anywhere_in_a_run_directory_is_refused_naming_it(rel, tmp_path):
    """Issue 40 #3: only the listed names were checked (hf_import.json was missed: its prefix was written
    "import.json"), and under them only checkpoints/ and logs/, so a link at another name or in another
    subdirectory was read or written through. The run directory itself may be a link (a disk mounted elsewhere)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("precious")
    real = tmp_path / "disk" / "run"
    for name in ["checkpoints/ckpt-2.index", "logs/train/events.out.tfevents.1", "config.yaml"]:
        (real / name).parent.mkdir(parents=True, exist_ok=True)
        (real / name).write_text("ours")
    (tmp_path / "run").symlink_to(real)
    run_layout.check_run_tree(str(tmp_path / "run"))  # no link inside it
    if (real / rel).is_dir():  # checkpoints/, logs/: the link replaces the directory
        shutil.rmtree(real / rel)
    elif (real / rel).exists():  # config.yaml: the link replaces the file
        (real / rel).unlink()
    (real / rel).parent.mkdir(parents=True, exist_ok=True)
    (real / rel).symlink_to(outside / "precious")
    with pytest.raises(UserError, match=f"holds a symbolic link, {re.escape(rel)} -> {re.escape(str(outside))}/"):
        run_layout.check_run_tree(str(tmp_path / "run"))
    if rel.split("/")[0] == run_layout.CHECKPOINT_DIR:  # before a save: checkpoints/ only
        with pytest.raises(UserError, match=re.escape(rel)):
            run_layout.check_run_tree(str(tmp_path / "run"), trees=(run_layout.CHECKPOINT_DIR,))
    else:
        run_layout.check_run_tree(str(tmp_path / "run"), trees=(run_layout.CHECKPOINT_DIR,))
