"""notebooks/quickstart.ipynb runs end to end on the CPU, as committed, with tiny settings.

Like papermill, the test adds a cell after the one tagged `parameters` that sets tiny values (a
1-layer model, 4 steps, a run directory in tmp_path), then executes every cell with nbclient in a
fresh ipykernel of this interpreter. Everything else is the committed notebook, so a cell that stops
working fails here. The install cell takes its "already importable" branch (tpu_llm is installed in
this environment); the TPU branches cannot run without a TPU. The run it trains and exports is then
checked here: the export's logits equal those of the run's checkpoint. The same cell sets `HF_MODEL` to
scripts/tiny_hf.py's random Qwen2, so the LoRA sections (import, plan, a 2-step fine-tune, a sample, the
PEFT export) run too, in the same kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbclient  # the dev extra (pyproject.toml): a missing one fails here rather than skipping the test
import nbformat
import pytest

pytestmark = pytest.mark.slow  # a Jupyter kernel process runs the notebook

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
TINY_EXTRA = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.max_len=32",
              "--data.seq_len=16", "--train.batch_size=4", "--train.steps_per_loop=2", "--train.warmup_steps=1",
              "--train.eval_every=0", "--train.eval_steps=1", "--checkpoint.every_steps=0",
              "--execution=graph"]  # XLA compilation of the step is tested elsewhere and costs seconds here


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    # every code cell is introduced by a markdown cell saying what it does and prints
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", []):
            assert nb.cells[i - 1].cell_type == "markdown" and "rint" in nb.cells[i - 1].source, i


def text_of(cell) -> str:
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


# section 9's LoRA fine-tune, kept short: 2 steps of 4 sequences of 32 tokens, no evaluation
LORA_EXTRA = ["--data.seq_len=32", "--train.batch_size=4", "--train.steps_per_loop=2", "--train.warmup_steps=1",
              "--train.eval_every=0", "--train.eval_steps=1", "--checkpoint.every_steps=0", "--execution=graph"]


def tiny_qwen2(folder: Path) -> str:
    """scripts/tiny_hf.py's random Qwen2 (Qwen2.5's shape, 300 ids) for HF_MODEL; '' (section 9 off) without
    transformers (the reference extra), so that the rest of the notebook is still tested."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return ""
    subprocess.run([sys.executable, str(NOTEBOOK.parent.parent / "scripts" / "tiny_hf.py"), "qwen2", str(folder)],
                   check=True, capture_output=True, timeout=300)
    return str(folder)


def test_notebook_runs_end_to_end_on_the_cpu(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    run_dir = tmp_path / "run"
    hf_model = tiny_qwen2(tmp_path / "Qwen2.5-tiny")
    text = tmp_path / "text.txt"  # LORA_TEXT: a small file, not the standard library's sources
    text.write_text((Path(json.__file__)).read_text())
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(
        f"RUN_DIR = {str(run_dir)!r}\nSTEPS = 4\nEXTRA = {TINY_EXTRA!r}\nPROMPT = 'def '\nNEW_TOKENS = 20\n"
        f"COPY_TO = ''\nHF_MODEL = {hf_model!r}\nLORA_TEXT = {str(text)!r}\nLORA_STEPS = 2\nLORA_EXTRA = {LORA_EXTRA!r}"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its output, if any cell fails

    code = [c for c in nb.cells if c.cell_type == "code"]
    printed = [text_of(c) for c in code]
    everything = "\n".join(printed)
    assert "already importable" in everything
    assert "strategy  default (strategy=auto: one CPU device" in everything
    # one CPU device: no replicas to compare, nothing for model parallelism to split
    assert "doctor    7 passed, 0 failed, 4 skipped" in everything
    assert "SKIP  model parallel 1 logical CPU(s): nothing to split" in everything
    assert "SKIP  shard state    one replica: nothing to divide" in everything
    assert "SKIP  shard grads    one replica: nothing to divide" in everything
    assert "done      step 4: train loss" in everything
    assert "2 training and 1 validation points" in everything
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # the loss curve
    assert "--- sample 1 (temperature 0.8, top_k 0, top_p 1.0, seed 0)\ndef " in everything
    assert f"exported  {run_dir} at step 4 to {run_dir}/export" in everything
    assert any(p.startswith("20 new tokens:\ndef ") for p in printed)  # section 8
    assert "Traceback" not in everything and "error:" not in everything
    if hf_model:  # sections 9 to 11: the tiny Qwen2 imported, its LoRA fine-tune, a sample, the PEFT export
        assert f"imported  {hf_model} (qwen2, " in everything
        assert "memory    per chip" in everything  # the plan's table, for PLAN_FOR
        assert "LoRA rank 16, alpha 32 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in everything
        assert f"weights   from {run_dir}-base/checkpoints/ckpt-0 (train.init_from)" in everything
        assert "done      step 2: train loss" in everything
        assert "saved     14 LoRA adapters of rank 16 in PEFT's format" in everything
        assert (Path(f"{run_dir}-lora") / "peft" / "adapter_model.safetensors").is_file()
    else:
        assert everything.count("HF_MODEL is not set") == 3

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [2, 4]

    # the trained run's export computes what the run's checkpoint computes (tests/test_export.py
    # checks the export in detail on a checkpoint made without training)
    import numpy as np
    import tensorflow as tf

    from tpu_llm.training.checkpoint import load_for_generation

    model, tokenizer, _ = load_for_generation(str(run_dir))
    tokens = tf.constant([tokenizer.encode("def main():")], tf.int32)
    served = tf.saved_model.load(str(run_dir / "export"))
    np.testing.assert_allclose(served.signatures["logits"](tokens=tokens)["logits"].numpy(),
                               model(tokens).numpy(), rtol=0, atol=1e-5)
