"""Training: the controller that builds and drives a run (controller.py, Orbit's Controller), the compiled
loops (trainer.py, N steps per tf.function), the optimizer and schedule (optimizer.py), checkpoints and
the run directory (checkpoint.py) and fault handling (fault.py: signals, non-finite steps, lost tasks)."""
