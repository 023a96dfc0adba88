"""Errors a user can cause or fix. The CLI prints each as one line and exits with status 2."""


class QevalError(Exception):
    """Bad input or a failed stage: the message names the thing and the fix."""
