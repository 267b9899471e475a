"""Paths as a user gives them: options and arguments, environment variables (FIBCTL_DB,
FIBCTL_DATA, FIBCTL_RUNS_DIR) and a recipe's files."""

from __future__ import annotations

import os


def expanded(value: str | os.PathLike) -> str:
    """`value` with a `~` opening it as the home folder (`~user`: that user's), as a shell
    expands one unquoted: quoted (`--db '~/r.db'`, FIBCTL_DB="~/r.db", a recipe's path) it
    made a folder or file named `~` here. A file named `~` is `./~`. Every path fibctl
    takes from its user goes through here, so that each reads `~` alike."""
    return os.path.expanduser(value)
