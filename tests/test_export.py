"""`tpu-llm export`: a run's SavedModel and Keras weights reproduce the model `tpu-llm generate` restores.

The run is made here without training it (its config, tokenizer and a checkpoint written by the
trainer's own Checkpointer, with every weight moved away from its initial value), because tracing a
training loop costs ~20 s and the export only reads what the checkpoint holds. A really trained run
is exported and compared the same way in tests/test_notebook.py. The tests reload the export the way
a user would (tf.saved_model.load, Keras load_weights into a fresh GPT).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml
from helpers import snapshot, tiny_config

from tpu_llm.model.sampling import Sampler


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tpu_llm import cli
    from tpu_llm.model import GPT
    from tpu_llm.tokenizers import ByteTokenizer
    from tpu_llm.training.checkpoint import Checkpointer, load_for_generation
    from tpu_llm.training.run_directory import open_run_dir
    from tpu_llm.training.controller import weights_fingerprint
    from tpu_llm.training.optimizer import make_optimizer

    tmp = tmp_path_factory.mktemp("export")
    # max_len 16, so that samples soon run past the context and the cache refill is compared too
    cfg = tiny_config(tmp, **{"model.max_len": 16, "data.seq_len": 8})
    cfg.model.vocab_size = ByteTokenizer().vocab_size  # as build_run fills it in
    open_run_dir(cfg, ByteTokenizer())
    keras.utils.set_random_seed(0)
    trained = GPT(cfg.model, cfg.model.vocab_size).build_weights()
    rng = np.random.default_rng(0)  # a restore that missed a variable would leave it at its initial value
    trained.set_weights([w + rng.normal(0, 0.05, w.shape).astype(w.dtype) for w in trained.get_weights()])
    Checkpointer(cfg.run_dir, keep=3, model=trained, optimizer=make_optimizer(cfg.train, trained)).save(2)

    # One export, through the CLI, made to do the most: it replaces an earlier export (--overwrite),
    # under the dtype policy a TPU run leaves in its process (a notebook exports where it trained);
    # the tests below check that the result is float32 all the same. A fresh export (no earlier one)
    # is what tests/test_notebook.py makes.
    out = f"{cfg.run_dir}/export"
    os.makedirs(out)
    for name, text in (("export.json", '{"step": 0}'), ("stale.txt", "from the earlier export")):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    printed = io.StringIO()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with contextlib.redirect_stdout(printed):
            status = cli.main(["export", "--run_dir", cfg.run_dir, "--overwrite"])
        policy_after = keras.mixed_precision.global_policy().name
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert status == 0, printed.getvalue()
    model, tokenizer, run_cfg = load_for_generation(cfg.run_dir)  # what `tpu-llm generate` samples from
    assert weights_fingerprint(model) == weights_fingerprint(trained)
    return {"run_dir": cfg.run_dir, "output": out, "printed": printed.getvalue(), "policy_after": policy_after,
            "fingerprint": weights_fingerprint(trained), "model": model, "tokenizer": tokenizer, "cfg": run_cfg,
            "loaded": tf.saved_model.load(out), "sampler": Sampler(model, tokenizer.eos_id, tokenizer.vocab_size)}


TOKENS = tf.constant([[72, 101, 108, 108, 111, 32, 119], [0, 255, 256, 10, 9, 200, 31]], tf.int32)


def test_savedmodel_logits_match_the_restored_model(exported):
    expected = exported["model"](TOKENS).numpy()
    got = exported["loaded"].signatures["logits"](tokens=TOKENS)["logits"].numpy()
    assert got.shape == (2, 7, exported["tokenizer"].vocab_size) == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert np.abs(expected).max() > 0.1  # real logits, not an untrained zero model


def test_keras_weights_file_reloads_into_a_fresh_model(exported):
    from tpu_llm.model import GPT
    from tpu_llm.training.controller import weights_fingerprint

    cfg = exported["cfg"]
    fresh = GPT(cfg.model, cfg.model.vocab_size).build_weights()
    assert weights_fingerprint(fresh) != exported["fingerprint"]
    fresh.load_weights(f"{exported['output']}/model.weights.h5")
    assert weights_fingerprint(fresh) == exported["fingerprint"]  # the checkpoint's weights, bit for bit
    np.testing.assert_array_equal(fresh(TOKENS).numpy(), exported["model"](TOKENS).numpy())


def test_generate_signature_gives_the_ids_of_tpu_llm_generate(exported):
    # tpu-llm generate samples with generate.Sampler (samples.print_samples; sample 1 uses `seed`).
    # 24 new tokens after a 3-token prompt run past max_len=16, so the cache refill is compared too.
    tok = exported["tokenizer"]
    prompt = tok.encode("def")
    for temperature, top_k, top_p, seed in [(0.0, 0, 1.0, 0), (0.8, 5, 0.9, 3)]:
        expected = exported["sampler"].generate(prompt, 24, temperature, top_k, top_p, seed=seed)
        got = exported["loaded"].signatures["generate"](
            tokens=tf.constant([prompt], tf.int32), max_new_tokens=tf.constant(24),
            temperature=tf.constant(temperature), top_k=tf.constant(top_k), top_p=tf.constant(top_p),
            seed=tf.constant(seed, tf.int64))["ids"]
        assert got.shape == (1, 24)
        assert got.numpy()[0].tolist() == expected, (temperature, top_k, top_p, seed)


def test_generate_signature_edge_cases(exported):
    generate = exported["loaded"].signatures["generate"]
    args = {"temperature": tf.constant(0.0), "top_k": tf.constant(0), "top_p": tf.constant(1.0),
            "seed": tf.constant(0, tf.int64)}
    empty = generate(tokens=tf.zeros([1, 0], tf.int32), max_new_tokens=tf.constant(6), **args)["ids"]
    # an empty prompt starts after end-of-text, as in `tpu-llm generate` without --prompt
    assert empty.numpy()[0].tolist() == exported["sampler"].generate([], 6, 0.0)
    batch = generate(tokens=TOKENS, max_new_tokens=tf.constant(3), **args)["ids"]
    assert batch.shape == (2, 3)  # one row of new ids per prompt row
    assert generate(tokens=TOKENS, max_new_tokens=tf.constant(0), **args)["ids"].shape == (2, 0)


def test_export_is_self_contained(exported):
    from tpu_llm.tokenizers import load_tokenizer

    out = exported["output"]
    assert out == f"{exported['run_dir']}/export"
    meta = json.loads(tf.io.gfile.GFile(f"{out}/export.json").read())
    assert meta["step"] == 2 and meta["vocab_size"] == 257 and meta["eos_id"] == 256
    assert meta["checkpoint"] == f"{exported['run_dir']}/checkpoints/ckpt-2"
    assert load_tokenizer(out).spec() == exported["tokenizer"].spec()
    assert yaml.safe_load(tf.io.gfile.GFile(f"{out}/config.yaml").read())["model"] == exported["cfg"].to_dict()["model"]
    assert not tf.io.gfile.glob(f"{out}.tmp-*")  # the temporary directory was renamed into place


def test_cli_export_replaced_the_earlier_export_and_left_the_policy(exported):
    out = exported["output"]
    assert f"exported  {exported['run_dir']} at step 2 to {out}\n" in exported["printed"]
    assert not os.path.exists(f"{out}/stale.txt")  # replaced, not merged into
    assert not tf.io.gfile.glob(f"{out}.tmp-*")  # the temporary directory was renamed into place
    assert exported["policy_after"] == "mixed_bfloat16"  # float32 only while exporting


def test_cli_refuses_to_overwrite_without_the_flag(exported, capsys):
    from tpu_llm import cli

    out = exported["output"]
    before = tf.io.gfile.stat(f"{out}/saved_model.pb").mtime_nsec
    assert cli.main(["export", "--run_dir", exported["run_dir"]]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {out!r} already exists; pass --overwrite to replace it, or --output another directory\n"
    assert tf.io.gfile.stat(f"{out}/saved_model.pb").mtime_nsec == before


def test_overwrite_never_deletes_what_is_not_an_export(exported, tmp_path, capsys):
    from tpu_llm import cli

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    run = exported["run_dir"]
    for output, expected in [(str(other), "is not a tpu-llm export (no export.json)"),
                             (run, "is the run directory or holds it"),
                             (os.path.dirname(run), "is the run directory or holds it")]:
        assert cli.main(["export", "--run_dir", run, "--output", output, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    assert (other / "keep.txt").read_text() == "x"
    assert tf.io.gfile.exists(f"{run}/checkpoints/checkpoint")


def test_run_without_checkpoints_is_one_line(tmp_path, capsys):
    from tpu_llm import cli
    from tpu_llm.tokenizers import ByteTokenizer
    from tpu_llm.training.run_directory import open_run_dir

    cfg = tiny_config(tmp_path)
    cfg.model.vocab_size = 257
    open_run_dir(cfg, ByteTokenizer())  # config.yaml and tokenizer.json, as a run that never saved
    assert cli.main(["export", "--run_dir", cfg.run_dir]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {cfg.run_dir!r} has no checkpoint in checkpoints/ yet; train it first\n"
    assert not (tmp_path / "run" / "export").exists()
    assert cli.main(["export", "--run_dir", str(tmp_path / "nothing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_overwrite_through_a_symlink_is_refused_and_the_target_kept(exported, tmp_path, capsys):
    """Issue 28 #3: `--output` a link to a directory holding an export: --overwrite deleted the target's
    contents, then the rename failed ("Not a directory"), exit 2: the old export gone, no new one."""
    from tpu_llm import cli

    real = tmp_path / "real"
    shutil.copytree(exported["output"], real)
    link = tmp_path / "link"
    link.symlink_to(real)
    before = snapshot(real)
    assert cli.main(["export", "--run_dir", exported["run_dir"], "--output", str(link), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: writing the export to {str(link)!r} refused: it is a symbolic link (to {real}), and "
                   f"replacing it would delete through the link; pass the real path ({real}) or another "
                   "location\n"), err
    assert snapshot(real) == before and link.is_symlink()


def test_overwrite_replaces_never_destroys(exported, tmp_path, monkeypatch, capsys):
    """The old export goes only once the new one is in place: a failure to move the new one in
    (here, the rename) leaves the old one as it was, and no temporary directory."""
    from tpu_llm import cli

    out = tmp_path / "out"
    shutil.copytree(exported["output"], out)
    before = snapshot(out)
    real_rename = tf.io.gfile.rename

    def failing(src, dst, overwrite=False):
        if ".tmp-" in str(src):  # the new export moving into place
            raise tf.errors.PermissionDeniedError(None, None, f"{dst}; Permission denied")
        return real_rename(src, dst, overwrite)

    monkeypatch.setattr(tf.io.gfile, "rename", failing)
    assert cli.main(["export", "--run_dir", exported["run_dir"], "--output", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: writing the export to {str(out)!r} failed (") and err.count("\n") == 1, err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .tmp-* or .old-* beside it
