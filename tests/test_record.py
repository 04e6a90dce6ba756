"""The metrics record of a host call (training/record.py) and the trainer's output it is made from: the
figures metrics.jsonl, TensorBoard, the progress line and the summary take, and when intervals are due."""

from __future__ import annotations

import json
import math

import pytest

from tpu_llm.training.record import CallRecord, Throughput, done_line, run_summary
from tpu_llm.training.trainer import call_output

RATES = Throughput(tokens_per_step=2048, flops_per_token=5.7e6, peak=4e10)


def output(steps=3, bad_steps=0, loss=4.5, grad_norm=2.5, staleness=0.0, staleness_max=0.0, first_bad_step=-1):
    return dict(steps=steps, bad_steps=bad_steps, loss=loss, staleness=staleness, grad_norm=grad_norm,
                staleness_max=staleness_max, first_bad_step=first_bad_step)


def test_a_calls_train_entry_keeps_its_keys_order_and_figures():
    record = CallRecord.of(output(), step=9, end=12, total=20, seconds=1.5, first=False, lr=3e-4, rates=RATES,
                           asynchronous=False)
    assert record.step == 12 and record.steps == 3
    values = record.values()
    assert list(values) == ["loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "ms_per_step"]
    assert values["tokens_per_sec"] == 3 * 2048 / 1.5 and values["ms_per_step"] == 1000 * 1.5 / 3
    assert values["mfu"] == values["tokens_per_sec"] * 5.7e6 / 4e10
    assert json.dumps({"split": "train", "step": record.step, **values}).startswith(
        '{"split": "train", "step": 12, "loss": 4.5, "lr": 0.0003, "grad_norm": 2.5, "tokens_per_sec": 4096.0')
    assert record.progress_text() == "loss 4.5000 | lr 3.00e-04 | gnorm 2.50 | 4.1k tok/s | MFU 58.4%"


def test_asynchronous_calls_add_their_staleness():
    record = CallRecord.of(output(staleness=0.4, staleness_max=2.0), 0, 3, 6, 1.0, True, 1e-3, RATES, True)
    assert list(record.values())[-2:] == ["staleness", "staleness_max"]
    assert record.progress_text().endswith(" | stale 0.4 (max 2)")


def test_a_call_stopped_before_its_first_step_has_no_figures():
    record = CallRecord.of(output(steps=0, loss=math.nan), 4, 8, 8, 0.2, True, math.nan, RATES, False)
    assert record.step == 4 and record.steps == 0 and math.isnan(record.loss) and not record.due(4)


@pytest.mark.parametrize("step, end, every, due", [
    (8, 8, 4, True),     # a multiple, reached
    (8, 9, 4, False),    # reached 8 only because a signal or a rollback stopped the call short of 9
    (6, 6, 4, False),    # cut at 6 for another interval: not a multiple of 4
    (10, 10, 4, True),   # train.steps: always due
    (10, 10, 0, True),   # every=0: at the end only ...
    (8, 8, 0, False),    # ... never before
])
def test_intervals_are_due_at_their_multiples_and_the_end_only_when_the_call_got_there(step, end, every, due):
    record = CallRecord(step=step, end=end, total=10, steps=2, seconds=1.0, first=False)
    assert record.due(every) is due
    assert record.last is (step == end == 10)


def test_the_summary_leaves_out_the_compiling_call_and_keeps_its_keys_order():
    first = CallRecord.of(output(steps=2), 0, 2, 6, 30.0, True, 1e-4, RATES, False)
    later = [CallRecord.of(output(steps=2, loss=loss), s, s + 2, 6, 1.0, False, 1e-4, RATES, False)
             for s, loss in ((2, 4.0), (4, 3.5))]
    about = {"params": 10, "run_dir": "r", "strategy": "default", "replicas": 1}
    summary = run_summary(6, [first, *later], 3.25, RATES, about, False, {"comm": "topk"}, "abc")
    assert list(summary) == ["step", "train_loss", "val_loss", "tokens_per_sec", "ms_per_step", "params", "run_dir",
                             "strategy", "replicas", "comm", "mfu", "fingerprint"]
    assert summary["train_loss"] == 3.5 and summary["ms_per_step"] == 500.0  # 4 steps in 2 s
    assert summary["tokens_per_sec"] == 4 * 2048 / 2.0
    assert done_line(summary, 3, "goodput 50% of 40.0 s") == (
        "done      step 6: train loss 3.5000, validation loss 3.2500; 4.1k tok/s, 500.0 ms/step, MFU 58.4% "
        "(after the first, compiling, call); goodput 50% of 40.0 s")
    stale = CallRecord.of(output(steps=2, staleness=0.5, staleness_max=1.0), 0, 2, 6, 30.0, True, 1e-4, RATES, True)
    alone = run_summary(2, [stale], None, RATES, about, True, {}, "abc")  # one call: compilation included
    assert alone["ms_per_step"] == 15000.0 and (alone["staleness"], alone["staleness_max"]) == (0.5, 1.0)
    none = run_summary(0, [], None, RATES, about, False, {}, "abc")
    assert none["tokens_per_sec"] is None and "mfu" not in none and math.isnan(none["train_loss"])


def test_a_calls_output_folds_its_loops():
    """Parameter-server training runs several loops per host call: the loss is the mean over the applied
    steps, the first skipped step a step number (its loop gives the 0-based optimizer step)."""
    loops = [dict(steps=3, bad_steps=1.0, loss=2.0, grad_norm=1.0, staleness=1.0, staleness_max=2.0, first_bad_step=4),
             dict(steps=2, bad_steps=0.0, loss=5.0, grad_norm=3.0, staleness=0.5, staleness_max=1.0, first_bad_step=-1)]
    out = call_output(loops)
    assert out == dict(steps=5, bad_steps=1, loss=(2 * 2.0 + 2 * 5.0) / 4, staleness=(3 * 1.0 + 2 * 0.5) / 5,
                       grad_norm=3.0, staleness_max=2.0, first_bad_step=5)
    assert math.isnan(call_output([dict(loops[0], steps=1, bad_steps=1.0)])["loss"])  # nothing applied
