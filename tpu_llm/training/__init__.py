"""Training: the controller that drives a run (controller.py, Orbit's Controller) with its train actions
(actions.py) and one metrics record per host call (record.py), a run built from its config (build.py),
the compiled loops (trainer.py, N steps per tf.function), the optimizer and schedule (optimizer.py),
checkpoints (checkpoint.py), the run directory (run_directory.py) and fault handling (fault.py:
signals, non-finite steps, lost tasks)."""
