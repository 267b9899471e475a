"""Errors a user can fix, and the helpers their messages quote with. The CLI prints them as
one line and exits with code 2."""

import os
import re
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


# what would break a message's line or be obeyed by a terminal: control characters (the line
# break too), line and paragraph separators, and an undecodable byte of a file name (a surrogate)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def unprintable(text: str) -> bool:
    """Whether `text` holds a character `shown_path` would escape."""
    return _UNPRINTABLE.search(text) is not None


def shown_path(path: str | os.PathLike) -> str:
    """A path as messages show it: on one line, its control characters escaped (\\n, \\x1b)
    and an undecodable byte of its name as Python escapes it (\\udcff)."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], os.fspath(path))
