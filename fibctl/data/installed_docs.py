"""The `installed-docs` corpus: documentation already installed on this machine.

The language reference topics (`pydoc_data`) and the docstrings of the standard library and of
numpy, pandas, matplotlib, sqlalchemy and torch: real English technical prose that needs no
download. One document = one module, class or function docstring, titled with its dotted name.

Harvesting imports hundreds of modules, some of which print, warn, exit or change global state
on import, so each package is harvested in a child process (`python -m fibctl.data.installed_docs
OUT PACKAGE`, all packages side by side) with its output and warnings swallowed; the result is one
JSON string per line. Order is deterministic: packages in the given order, modules and members
sorted by name, duplicates (re-exported or inherited docstrings) kept at their first occurrence.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.progress import Progress

from fibctl.errors import FibctlError

PACKAGES = ("pydoc_data", "stdlib", "numpy", "pandas", "matplotlib", "sqlalchemy", "torch")
HARVEST_TIMEOUT_S = 600  # per package: a bound for a hung import, far above a normal harvest
MIN_CHARS = 120  # shorter docstrings ("Return self.") carry little prose
# Module name parts never imported: test suites, entry points, and modules that act on import
# (open a browser, start IDLE, print the Zen) or drag in GUI toolkits.
SKIP_PARTS = {"test", "tests", "testing", "conftest", "__main__", "antigravity", "this", "idlelib",
              "turtledemo", "backends", "_dynamo", "_inductor"}
# torch has thousands of submodules; below this depth they are internals with little prose.
MAX_DEPTH = {"torch": 2}
# Signatures of compiled functions show default objects with their memory address; drop it so the
# corpus is the same on every run.
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def package_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """What the corpus depends on: the Python version and each package's installed version."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in packages:
        if name in ("pydoc_data", "stdlib"):
            continue
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def harvest(path: Path, packages: tuple[str, ...] = PACKAGES, progress: Progress | None = None) -> None:
    """Write the corpus to `path` (JSON lines), one child process per package, run side by side.

    Documents repeated across packages (re-exports) are kept at their first occurrence.
    """
    unknown = [p for p in packages if p not in PACKAGES]
    if unknown:
        raise FibctlError(f"unknown installed-docs package(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(PACKAGES)}")
    progress = progress or Progress(disable=True)
    task = progress.add_task("harvest installed-docs", total=len(packages), unit="packages")
    parts = [path.with_name(f"{path.name}.{package}") for package in packages]

    def run_child(package: str, part: Path) -> None:
        cmd = [sys.executable, "-m", "fibctl.data.installed_docs", str(part), package]
        env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONWARNINGS": "ignore"}
        try:
            done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=HARVEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FibctlError(f"harvesting installed-docs from {package} took over {HARVEST_TIMEOUT_S} s; "
                              "leave it out of the recipe's packages") from None
        if done.returncode != 0 or not part.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise FibctlError(f"harvesting installed-docs from {package} failed: {tail}")
        progress.advance(task)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for future in [pool.submit(run_child, p, part) for p, part in zip(packages, parts)]:
            future.result()
    seen: set[bytes] = set()
    with open(path, "w", encoding="utf-8") as out:
        for part in parts:
            for text in read(part):
                key = hashlib.blake2b(text.split("\n\n", 1)[-1].encode(), digest_size=16).digest()
                if key not in seen:
                    seen.add(key)
                    out.write(json.dumps(text) + "\n")
            part.unlink()


def read(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


# ---- the child process -------------------------------------------------------------------------

def _quiet_import(name: str):
    """Import `name` with its prints and warnings swallowed; None if it fails in any way."""
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except (Exception, SystemExit):
        return None


def _module_names(root: str) -> Iterator[str]:
    """`root` and its public submodules, depth-first in sorted order, skipping SKIP_PARTS."""
    if any(part in SKIP_PARTS or (part.startswith("_") and i) for i, part in enumerate(root.split("."))):
        return
    module = _quiet_import(root)
    if module is None:
        return
    yield root
    depth = MAX_DEPTH.get(root.split(".")[0])
    if not hasattr(module, "__path__") or (depth is not None and root.count(".") >= depth):
        return
    try:
        children = sorted(m.name for m in pkgutil.iter_modules(module.__path__))
    except Exception:
        return
    for child in children:
        yield from _module_names(f"{root}.{child}")


def _stdlib_roots() -> list[str]:
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_"))


def _docstrings(module_name: str) -> Iterator[tuple[str, str]]:
    """(dotted name, docstring) for the module, its public classes and functions, and their methods."""
    module = sys.modules[module_name]
    yield module_name, getattr(module, "__doc__", None)
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        yield f"{module_name}.{name}", getattr(obj, "__doc__", None)
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_"):
                    yield f"{module_name}.{name}.{attr}", getattr(member, "__doc__", None)


def _documents(package: str) -> Iterator[str]:
    if package == "pydoc_data":
        from pydoc_data.topics import topics

        for topic in sorted(topics):
            yield f"Python language reference: {topic}\n\n{topics[topic].strip()}"
        return
    roots = _stdlib_roots() if package == "stdlib" else [package]
    for root in roots:
        for module_name in _module_names(root):
            for title, doc in _docstrings(module_name):
                if isinstance(doc, str) and len(doc) >= MIN_CHARS:
                    yield f"{title}\n\n{inspect.cleandoc(doc)}"


def _main(out: str, package: str) -> None:
    warnings.simplefilter("ignore")
    with open(out + ".part", "w", encoding="utf-8") as f:
        for text in _documents(package):
            f.write(json.dumps(ADDRESS.sub("", text)) + "\n")
    os.replace(out + ".part", out)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
