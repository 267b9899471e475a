"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""

import textwrap


class FibctlError(Exception):
    """Bad input: the message names the problem (and, where it helps, the fix)."""


class DamagedDatabase(FibctlError):
    """A query met a damaged page of the database (or a file that is no database): no part of
    the work can go on, so nothing catches it to carry on without one table, say."""


class WorkerError(FibctlError):
    """The worker's setup (its data, runs folder or database) is at fault, not the run it
    claimed: the run goes back to the queue as it was and the worker stops."""


def first_line(e: BaseException, width: int = 160) -> str:
    """The first line of another library's message, cut at a word, to quote in one of ours."""
    line = (str(e).strip().splitlines() or ["no detail"])[0]
    return textwrap.shorten(line, width, placeholder=" ...")
