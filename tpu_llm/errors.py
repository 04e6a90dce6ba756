"""The exception types the CLI turns into one line and an exit status.

Anything a user can fix (a bad config key, a missing file, a run directory made by another model) is
raised as `UserError` with a one-line message naming the culprit and the fix. The CLI prints it on one
line and exits with `EXIT_USER_ERROR`; it never shows a traceback for these. A run that stops early
for another reason (a signal, divergence, a lost cluster task: see tpu_llm/training/fault.py) raises
`RunStopped`, printed the same way with its own exit status.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input. The message is shown verbatim, on one line."""


class RunStopped(Exception):
    """The run stopped before train.steps, not by a user mistake. The CLI prints `{label}: {message}`
    on one line and exits with `exit_code` (the codes are listed in tpu_llm/training/fault.py)."""

    def __init__(self, message: str, exit_code: int, label: str = "error"):
        super().__init__(message)
        self.exit_code, self.label = exit_code, label
