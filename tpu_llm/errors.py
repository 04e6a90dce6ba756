"""The one exception type for user mistakes.

Anything a user can fix (a bad config key, a missing file, a run directory made by another model) is
raised as `UserError` with a one-line message naming the culprit and the fix. The CLI prints it on one
line and exits with `EXIT_USER_ERROR`; it never shows a traceback for these.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input. The message is shown verbatim, on one line."""
