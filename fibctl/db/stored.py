"""Reading numbers and times as SQLite stores them.

SQLite keeps any value in any column: a database edited by hand (or written by another tool)
can hold text where the schema says a number or a time. SQLAlchemy's reader of a time then
fails with a bare ValueError, and a number's hands the text on to whatever formats or divides
it. The schema's number and time columns have the types below, which check each value as it
is read, on SQLite only (PostgreSQL keeps a column to its type):

- text that reads as a number is that number: `inf` and `nan` (SQLite stores a real number
  of that spelling as text) are a diverged evaluation's perplexity, and reports show them;
- a time with a UTC offset is that time in UTC (the schema's times are naive UTC);
- anything else is one line naming the column and the value (`FibctlError`).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import DateTime, Float, MetaData
from sqlalchemy.types import TypeDecorator

from fibctl.errors import FibctlError


class Checked(TypeDecorator):
    """A column whose values are checked as they are read (see the module's docstring)."""

    cache_ok = True
    kind = "?"  # what a value must be, for the message
    column = "?"  # the column's name, and the tables that have it: set by `name_columns`
    tables: tuple[str, ...] = ()

    def convert(self, value):
        """The value as the column's type; TypeError or ValueError where it is not."""
        raise NotImplementedError

    def result_processor(self, dialect, coltype):
        read = super().result_processor(dialect, coltype)
        if dialect.name != "sqlite":
            return read

        def checked(value):
            if value is None:
                return None
            try:
                return self.convert(read(value) if read is not None else value)
            except (TypeError, ValueError, OverflowError):
                raise self.refused(value) from None

        return checked

    def refused(self, value) -> FibctlError:
        where = " or ".join(f"{t}.{self.column}" for t in self.tables) or self.column
        literal = _sql_literal(value)
        literal = literal if len(literal) <= 60 else literal[:57] + "..."
        return FibctlError(f"{where} holds {literal}, not {self.kind} (the database was edited by hand?): "
                           f"correct it where {self.column} = {literal}, e.g. with the sqlite3 shell")


def _sql_literal(value) -> str:
    """The value as SQL would write it, to find its row by."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, bytes):
        return f"X'{value.hex()}'"
    return repr(value)


class Number(Checked):
    impl = Float
    cache_ok = True  # SQLAlchemy asks each class: its state (the column's name) only names it
    kind = "a number"

    def convert(self, value):
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, str):  # 'abc' is a ValueError, as a BLOB is a TypeError
            return float(value)
        raise TypeError(value)


class Time(Checked):
    impl = DateTime
    cache_ok = True
    kind = "a time"

    def convert(self, value: datetime) -> datetime:  # SQLite's reader made text a datetime
        if not isinstance(value, datetime):
            raise TypeError(value)
        return value.astimezone(timezone.utc).replace(tzinfo=None) if value.tzinfo else value


def name_columns(metadata: MetaData) -> dict[str, Number]:
    """Name each checked column's type after its table and column, for its message. Returns a
    number type for each number column's name, for SQL written as text (the reports'), whose
    result SQLAlchemy cannot type: a result column of such a name is read as that column is
    (one of two tables' `loss`, say: the message names both)."""
    tables: dict[str, list[str]] = {}
    for table in metadata.tables.values():
        for column in table.columns:
            if isinstance(column.type, Checked):
                column.type.column, column.type.tables = column.name, (table.name,)
                if isinstance(column.type, Number):
                    tables.setdefault(column.name, []).append(table.name)
    by_name = {}
    for name, where in tables.items():
        by_name[name] = Number()
        by_name[name].column, by_name[name].tables = name, tuple(where)
    return by_name
