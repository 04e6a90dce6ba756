"""tpu_llm/run_layout.py: a checkpoint's step read from its name (names come from a directory listing, a
bucket listing or a path in a message: any text), Cloud Storage's checkpoint listing on top of it, and
docs/run-directory.md's list of a run directory's files against the module's names."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpu_llm import run_layout
from tpu_llm.cloud import storage
from tpu_llm.errors import UserError
from tpu_llm.run_layout import UNFINISHED_SUFFIX, checkpoint_name, checkpoint_step

PROPERTY = settings(max_examples=300, derandomize=True, database=None, deadline=None)
# pieces of names that sit near the edges: digits of other scripts, signs, the words of the layout
PIECES = st.sampled_from(["ckpt-", "ckpt", "-", "0", "7", "12", "\u0663", "\u00b2", "+1", " ", ".index", ".data-0",
                          UNFINISHED_SUFFIX, "/", "checkpoints", "run", "a.b", ""])
NAMES = st.lists(PIECES, max_size=8).map("".join) | st.text(max_size=20)
SUFFIXES = st.sampled_from(["", ".index", UNFINISHED_SUFFIX])
# written only by `report` and `export`, never read by a run (`export` refuses a link at its --output)
UNGUARDED = (run_layout.REPORT_FILE, run_layout.EXPORT_DIR, run_layout.HF_EXPORT_DIR, run_layout.PEFT_EXPORT_DIR)


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


@pytest.mark.parametrize("name", [n for n in run_layout.NAMES if n not in UNGUARDED] + ["config.yaml.tmp-1a2b3c4d"])
def test_a_link_at_any_name_tpu_llm_reads_or_writes_is_refused(name, tmp_path):
    """Every file of a run that train, generate and export read or write (hf_import.json was missed: its
    prefix was written "import.json"), with its temporary siblings; another name is not the run's."""
    (tmp_path / "outside").write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").symlink_to(tmp_path / "outside")
    run_layout.check_no_links(str(tmp_path / "run"))
    (tmp_path / "run" / name).symlink_to(tmp_path / "outside")
    with pytest.raises(UserError, match=f"holds a symbolic link, {re.escape(name)} -> "):
        run_layout.check_no_links(str(tmp_path / "run"))
