"""Errors a user can fix, and the helpers their messages quote with. The CLI prints them as
one line and exits with code 2."""

import difflib
import os
import re
import shlex
import textwrap
from collections.abc import Iterable


class FibctlError(Exception):
    """Bad input: the message names the problem (and, where it helps, the fix)."""


class DamagedDatabase(FibctlError):
    """A query met a damaged page of the database (or a file that is no database): no part of
    the work can go on, so nothing catches it to carry on without one table, say."""


class WorkerError(FibctlError):
    """The worker's setup (its data, runs folder or database) is at fault, not the run it
    claimed: the run goes back to the queue as it was and the worker stops."""


def unknown(what: str, value: object, allowed: Iterable[str]) -> str:
    """'unknown WHAT VALUE; allowed: ...', with the closest allowed name first where one is
    near (a typo: 'extrapolaton' names extrapolation)."""
    allowed = list(allowed)
    close = difflib.get_close_matches(str(value), allowed, n=1)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {value!r}{meant}; allowed: {', '.join(allowed)}"


def first_line(e: BaseException, width: int = 160) -> str:
    """The first line of another library's message, cut at a word, to quote in one of ours."""
    line = (str(e).strip().splitlines() or ["no detail"])[0]
    return textwrap.shorten(line, width, placeholder=" ...")


# The one set of characters fibctl never prints as they are, in text it did not write (names,
# paths, errors, a database's values), each shown as Python escapes it (\x1b, \u202e): what a
# terminal would obey or a reader be misled by. The C0 controls (ESC starts colours and screen
# clears, CR overwrites the line, a line break ends a one-line message), DEL and the C1
# controls (0x9b is CSI to some terminals); the line and paragraph separators (a line break to
# some terminals and editors); the bidi embedding, override and isolate controls, which
# reorder what follows them so that one name reads as another; and a lone surrogate (an
# undecodable byte of a file name), which no output encoding takes.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str, *, lines: bool = False) -> str:
    """`text` as fibctl shows text it did not write: every character of _UNPRINTABLE escaped
    (\\n, \\x1b, \\u202e, \\udcff). `lines`: its line breaks kept, for a table's cell or note
    of several lines."""
    if lines:
        return "\n".join(map(printable, text.split("\n")))
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def unprintable(text: str) -> bool:
    """Whether `text` holds a character `printable` escapes."""
    return _UNPRINTABLE.search(text) is not None


def shown_path(path: str | os.PathLike) -> str:
    """A path as messages show it: on one line, `printable`; quoted as a shell word where it is
    empty or a blank begins or ends it (`'data '`), which would not show otherwise."""
    text = printable(os.fspath(path))
    return shlex.quote(text) if not text or text != text.strip() else text


def shell_word(path: str | os.PathLike) -> str:
    """A path as a command to paste names it: `printable`, and one shell word (`'a b'`, where
    shown_path's `a b` pasted would be two arguments)."""
    return shlex.quote(printable(os.fspath(path)))
