"""notebooks/quickstart.ipynb runs end to end on the CPU, as committed, with tiny settings.

Like papermill, the test adds a cell after the one tagged `parameters` that sets tiny values (a
1-layer model, 4 steps, a run directory in tmp_path), then executes every cell with nbclient in a
fresh ipykernel of this interpreter. Everything else is the committed notebook, so a cell that stops
working fails here. The install cell takes its "already importable" branch (tpu_llm is installed in
this environment); the TPU branches cannot run without a TPU. The run it trains and exports is then
checked here: the export's logits equal those of the run's checkpoint.
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


def test_notebook_runs_end_to_end_on_the_cpu(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    run_dir = tmp_path / "run"
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(
        f"RUN_DIR = {str(run_dir)!r}\nSTEPS = 4\nEXTRA = {TINY_EXTRA!r}\nPROMPT = 'def '\nNEW_TOKENS = 20\n"
        "COPY_TO = ''"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its output, if any cell fails

    code = [c for c in nb.cells if c.cell_type == "code"]
    printed = [text_of(c) for c in code]
    everything = "\n".join(printed)
    assert "already importable" in everything
    assert "strategy  default (strategy=auto: one CPU device" in everything
    # one CPU device: no replicas to compare, nothing for model parallelism to split
    assert "doctor    7 passed, 0 failed, 2 skipped" in everything
    assert "SKIP  model parallel 1 logical CPU(s): nothing to split" in everything
    assert "done      step 4: train loss" in everything
    assert "2 training and 1 validation points" in everything
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # the loss curve
    assert "--- sample 1 (temperature 0.8, top_k 0, top_p 1.0, seed 0)\ndef " in everything
    assert f"exported  {run_dir} at step 4 to {run_dir}/export" in everything
    assert "20 new tokens:\ndef " in printed[-1]
    assert "Traceback" not in everything and "error:" not in everything

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
