"""tpu_llm/platform/files.py: a file written whole or not at all, never through a link, nothing left beside it."""

from __future__ import annotations

import os
import stat

import pytest
import tensorflow as tf

from tpu_llm.platform.files import write_atomically


def test_the_file_is_replaced_whole_with_the_mode_open_gives(tmp_path):
    path = tmp_path / "config.yaml"
    write_atomically(str(path), "model:\n  n_layer: 2\n")
    write_atomically(str(path), "é\n")  # text as UTF-8
    assert path.read_bytes() == "é\n".encode()
    write_atomically(str(path), b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    (tmp_path / "opened").write_text("")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "opened").stat().st_mode)
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "opened"]  # no temporary file left


def test_a_link_at_the_name_is_replaced_never_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "config.yaml"
    link.symlink_to(outside)
    write_atomically(str(link), "new")
    assert outside.read_text() == "keep" and not link.is_symlink() and link.read_text() == "new"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()  # a directory where the file goes: the rename fails
    with pytest.raises(OSError):
        write_atomically(str(tmp_path / "taken"), "text")
    assert os.listdir(tmp_path) == ["taken"] and os.listdir(tmp_path / "taken") == []


def test_another_filesystem_goes_through_tf_io_gfile():
    path = "ram://files-test/config.yaml"  # TensorFlow's in-memory filesystem, as gs:// would be
    write_atomically(path, "old")
    write_atomically(path, "new")
    with tf.io.gfile.GFile(path) as f:
        assert f.read() == "new"
    assert tf.io.gfile.listdir("ram://files-test/") == ["config.yaml"]
