"""lm-evaluation-harness tasks inside the training loop (train.eval_tasks; docs/evaluation.md).

`check` runs when the run starts (tpu_llm.train), before anything is built: the include path's folder and
every task name against lm-eval's index (tpu_llm/eval/run.py's checks), so a misspelt task stops the run in
seconds, not at its first evaluation hours later. Its `Tasks` goes to the controller, whose EvalTasks action
(training/actions.py) makes a `TasksOnWeights` at the first evaluation; that evaluates the live model: one
host copy of the weights (training/samples.local_copy, as the end-of-run samples read them) and one TpuLM on
it, both kept, so that XLA compiles the scoring of each padded length once for the whole run; each
evaluation only copies the newest weights in. `metrics` turns lm-eval's results into the flat record
metrics.jsonl holds.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np

from tpu_llm.errors import UserError
from tpu_llm.eval import require_lm_eval

BATCH_SIZE = 8  # rows scored at once: `tpu-llm eval`'s default (the numbers do not depend on it)


def check(cfg, say=print) -> "Tasks | None":
    """train.eval_tasks checked (None when it is empty); a one-line UserError for a missing lm_eval, include
    path or task. `say` hears a line first: indexing lm-eval's own tasks takes ~15 s."""
    from tpu_llm.eval import run as eval_run

    t = cfg.train
    if not t.eval_tasks:
        return None
    require_lm_eval()
    if t.eval_include_path and not os.path.isdir(t.eval_include_path):
        raise UserError(f"train.eval_include_path={t.eval_include_path!r} is not a directory (give the folder of "
                        "your task YAML files; a relative path is read from where `tpu-llm train` runs)")
    names = eval_run.task_list(t.eval_tasks)
    say(f"starting  checking train.eval_tasks={t.eval_tasks} against lm-eval's tasks ...")
    manager = eval_run.task_manager(t.eval_include_path, names)
    eval_run.check_tasks(names, manager, flag="train.eval_tasks", include="train.eval_include_path=DIR")
    return Tasks(names, manager)


def metrics(results: dict) -> dict[str, float]:
    """{"<task>/<metric>": value} of lm-eval's results: "acc,none" is "tiny_choice/acc", another filter
    than "none" stays in the name ("gsm8k/exact_match_strict-match"); standard errors and values that are
    not numbers (lm-eval's "N/A") are left out."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not kind or metric.endswith("_stderr") or not number:
                continue
            out[f"{task}/{metric}" if kind == "none" else f"{task}/{metric}_{kind}"] = float(value)
    return out


def line(step: int, values: dict[str, float]) -> str:
    """The progress line: `tasks     step 20: tiny_choice acc 0.375, tiny_choice acc_norm 0.5`."""
    shown = ", ".join(f"{name.replace('/', ' ', 1)} {number(v)}" for name, v in values.items())
    return f"tasks     step {step}: {shown or 'no numeric metric'}"


def number(value: float) -> str:
    return f"{value:.4g}" if not math.isfinite(value) or abs(value) < 1e4 else f"{value:.1f}"


class Tasks:
    """What the training loop's EvalTasks action gets: the checked task names and lm-eval's TaskManager."""

    def __init__(self, names: list[str], manager):
        self.names, self.manager = names, manager
        self.line = line

    def on_weights(self, cfg, tokenizer, say) -> "TasksOnWeights":
        return TasksOnWeights(cfg, tokenizer, self.names, self.manager, say)


class TasksOnWeights:
    """The tasks of `check` on a model's current weights, with lm-eval's defaults and train.eval_tasks_limit
    documents per task (the same numbers `tpu_llm.load(run_dir).evaluate` gives on a checkpoint of them)."""

    def __init__(self, cfg, tokenizer, names: list[str], manager, say):
        self.cfg, self.tokenizer, self.names, self.manager, self.say = cfg, tokenizer, names, manager, say
        self.limit = cfg.train.eval_tasks_limit or None
        self.copy = self.lm = None

    def __call__(self, model) -> dict[str, float]:
        from tpu_llm.eval import run as eval_run
        from tpu_llm.eval.backend import TpuLM
        from tpu_llm.training.samples import local_copy

        if self.lm is None:
            self.copy = local_copy(model, self.cfg)
            self.lm = TpuLM(self.copy, self.tokenizer, self.cfg, batch_size=BATCH_SIZE, say=self.say, bars=False)
        else:
            self.copy.set_weights(model.get_weights())  # the compiled scorers read these same variables
        # lm-eval seeds Python's and numpy's global generators: training's own draws must not change with it
        states = random.getstate(), np.random.get_state()
        try:
            results = eval_run.evaluate(self.lm, self.names, self.manager, limit=self.limit, bootstrap_iters=0,
                                         environment=False)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
        return metrics(results)
