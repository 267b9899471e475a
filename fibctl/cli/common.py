"""Options and output helpers shared by the command modules."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

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
