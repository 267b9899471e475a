"""Reading numbers and times as SQLite stores them.

SQLite keeps any value in any column: a database edited by hand (or written by another tool)
can hold text where the schema says a number or a time. SQLAlchemy's reader of a time then
fails with a bare ValueError, and a number's hands the text on to whatever formats or divides
it. The schema's number and time columns (keys aside) have the types below, which check each value as it
is read, on SQLite only (PostgreSQL keeps a column to its type):

- text that reads as a number is that number: `inf` and `nan` (SQLite keeps these spellings
  as text) are a diverged evaluation's perplexity, and reports show them;
- a time with a UTC offset is that time in UTC (the schema's times are naive UTC);
- anything else is one line naming the column and the value (`FibctlError`).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import BigInteger, DateTime, Float, Integer, MetaData
from sqlalchemy.types import TypeDecorator

from fibctl.errors import FibctlError


class Checked(TypeDecorator):
    """A column whose values are checked as they are read (see the module's docstring)."""

    cache_ok = True
    kind = "?"  # what a value must be, for the message
    stored: type | None = None  # the class SQLite hands back for a value of the column's type, if final
    column = "?"  # the column's name, and the tables that have it: set by `name_columns`
    tables: tuple[str, ...] = ()

    @property
    def python_type(self):  # the stored type's (TypeDecorator says `object`): `db copy` finds floats by it
        return self.impl_instance.python_type

    def convert(self, value):
        """The value as the column's type; TypeError or ValueError where it is not."""
        raise NotImplementedError

    def result_processor(self, dialect, coltype):
        read = super().result_processor(dialect, coltype)
        if dialect.name != "sqlite":
            return read
        stored, convert = self.stored, self.convert

        def checked(value):
            if value is None or value.__class__ is stored:  # nearly every value: at once (a report reads millions)
                return value
            try:
                return convert(read(value) if read is not None else value)
            except (TypeError, ValueError, OverflowError):
                raise self.refused(value) from None

        return checked

    def refused(self, value) -> FibctlError:
        where = " or ".join(f"{t}.{self.column}" for t in self.tables) or self.column
        literal = sql_literal(value)
        return FibctlError(f"{where} holds {literal}, not {self.kind} (the database was edited by hand?): "
                           f"correct it where {self.column} = {literal}, e.g. with the sqlite3 shell")


def sql_literal(value) -> str:
    """The value as SQL would write it, to find its row by; past 60 characters, cut short."""
    if isinstance(value, str):
        literal = "'" + value.replace("'", "''") + "'"
    elif isinstance(value, bytes):
        literal = f"X'{value.hex()}'"
    else:
        literal = repr(value)
    return literal if len(literal) <= 60 else literal[:57] + "..."


class Number(Checked):
    impl = Float
    cache_ok = True  # SQLAlchemy asks each class: its state (the column's name) only names it
    kind = "a number"
    stored = float

    def convert(self, value):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # 'abc' is a ValueError, as a BLOB is a TypeError
            return float(value)
        raise TypeError(value)


class Whole(Checked):
    impl = Integer
    cache_ok = True
    kind = "a whole number"
    stored = int

    def convert(self, value):  # SQLite stores '8' and 8.0 as 8: what it leaves ('x', 8.5) is not one
        raise TypeError(value)


class BigWhole(Whole):
    impl = BigInteger
    cache_ok = True


class Time(Checked):
    impl = DateTime
    cache_ok = True
    kind = "a time"

    def convert(self, value: datetime) -> datetime:  # SQLite's reader made text a datetime, or raised
        return value.astimezone(timezone.utc).replace(tzinfo=None) if value.tzinfo else value


def name_columns(metadata: MetaData) -> dict[str, Checked]:
    """Name each checked column's type after its table and column, for its message. Returns a
    type for each number column's name, for SQL written as text (the reports'), whose result
    SQLAlchemy cannot type: a result column of such a name is read as that column is (one of
    several tables' `step`, say: the message names them all)."""
    numbers: dict[str, list[Checked]] = {}
    for table in metadata.tables.values():
        for column in table.columns:
            if isinstance(column.type, Checked):
                column.type.column, column.type.tables = column.name, (table.name,)
                if isinstance(column.type, (Number, Whole)):
                    numbers.setdefault(column.name, []).append(column.type)
    by_name = {}
    for name, types in numbers.items():
        kind = Whole if all(isinstance(t, Whole) for t in types) else Number  # a whole number is a number
        by_name[name] = kind()
        by_name[name].column, by_name[name].tables = name, tuple(t for typ in types for t in typ.tables)
    return by_name
