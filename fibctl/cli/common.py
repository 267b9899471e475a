"""Options and output helpers shared by the command modules."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from fibctl.errors import FibctlError

console = Console()
err_console = Console(stderr=True)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="FIBCTL_DB",
        help="Results database: a SQLAlchemy URL, or a bare path meaning SQLite.",
        show_default=True,
    ),
]
DEFAULT_DB = "results.db"


def plain(value) -> Text:
    """A table cell shown as written: names, paths and errors from data are never rich markup."""
    return Text("" if value is None else str(value))


def sqlite_int(param: typer.CallbackParam, value: int | None) -> int | None:
    """Option callback: an integer that goes into SQL must fit a 64-bit column."""
    if value is not None and not -2**63 <= value < 2**63:
        raise FibctlError(f"--{param.name.replace('_', '-')} {value} does not fit a 64-bit integer")
    return value
