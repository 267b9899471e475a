"""TOML as fibctl reads it (matrix files, recipes, `--set` values): every way the text can fail
is one `TomlError` whose message says why, for the caller to prefix with what it was reading."""

from __future__ import annotations

import os
from pathlib import Path

from fibctl.errors import FibctlError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class TomlError(FibctlError):
    """Text that fibctl cannot read as TOML; the message says why, without saying what it read."""


class NotToml(TomlError):
    """The text breaks TOML's syntax (`--set` reads such a value as a bare word instead)."""


def loads(text: str) -> dict:
    """`text` parsed. Besides its syntax errors, the parser raised a RecursionError for a
    value nested thousands deep and int()'s ValueError for an integer of more than 4,300
    digits (Python's limit on converting text to int): both were tracebacks."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise NotToml(str(e)) from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise TomlError("it nests its values too deeply") from None
    except ValueError:
        raise TomlError("it holds an integer of too many digits to read") from None


def read(path: str | os.PathLike) -> str:
    """A TOML file's text: UTF-8, its byte-order mark (some editors save one) dropped; a byte
    that is not UTF-8 is a TomlError naming its offset. An OSError is left to the caller."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise TomlError(f"byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8; save it as UTF-8") from None
