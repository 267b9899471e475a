"""A module imported on first use: pandas costs a quarter of a second, and `fibctl --help`,
`queue ls` or `sql` should not pay it."""

from __future__ import annotations

import importlib


class LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._name)
        return getattr(module, attr)


pandas = LazyModule("pandas")
