"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class FibctlError(Exception):
    """Bad input: the message names the problem (and, where it helps, the fix)."""
