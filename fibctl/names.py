"""Names that become file or folder names: runs, matrices, data sources and held-out sets.

A name is 1 to 100 characters: a letter or digit, then letters, digits, '_', '-' or '.'
(`NAME_PATTERN`). That keeps every name a single path component: no '/', no '..', nothing
absolute, so a name from a recipe, a matrix or the database cannot reach outside its folder.
"""

from __future__ import annotations

import re

from fibctl.errors import FibctlError, shown_path

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
NAME_RULE = "1-100 letters, digits, '_', '-' or '.', starting with a letter or digit"
_NAME = re.compile(NAME_PATTERN)


def is_name(value) -> bool:
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def refuse_foreign(folder, own: re.Pattern, writer: str, then: str) -> None:
    """Refuse a folder fibctl would delete or replace whole when it holds an entry whose name
    `own` does not match (not written there by `writer`), naming the first one."""
    from pathlib import Path

    foreign = sorted(p.name for p in Path(folder).iterdir() if not own.fullmatch(p.name))
    if foreign:
        raise FibctlError(f"{shown_path(folder)} holds {len(foreign)} file(s) {writer} did not write there "
                          f"({foreign[0][:60]!r}{', ...' if len(foreign) > 1 else ''}); {then}")


def check_name(kind: str, value) -> str:
    """`value` if it is a valid name; FibctlError naming the `kind` of name otherwise."""
    if not is_name(value):
        raise FibctlError(f"{kind} name {value!r} is not allowed: use {NAME_RULE}")
    return value
