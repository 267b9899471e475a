"""Run matrices: TOML files listing runs by their attention settings.

A matrix file has a `[matrix]` table (`description`, `preset`, optional `init_seed`) and one
`[[runs]]` table per run: `name`, `schedule`, and for sparse runs `window` and `base` (default
"fib"); `seed` (the data seed, default 42); optional `init_seed` (the seed of the initial
weights: the run's own, else the matrix's, else the run's `seed`) and `train` (overrides of the
preset's training recipe, e.g. `train = { steps = 100, optimizer = "adamw" }`). Shipped
matrices live in `fibctl/matrices/`; any other file is named by its path (one ending in
.toml or holding a '/'). Run names and the matrix name (the file's stem) follow
`fibctl.names.NAME_PATTERN`.

Dense runs carry base "fib" and window 0 in their config (unused by dense attention);
the runs table stores NULL for both.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fibctl.config import DEFAULT_SEED, SCHEDULES, RunConfig, TrainConfig
from fibctl.errors import FibctlError
from fibctl.names import NAME_RULE, check_name, is_name

MATRIX_KEYS = {"description", "preset", "init_seed"}
RUN_KEYS = {"name", "schedule", "base", "window", "seed", "init_seed", "train"}
TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


@dataclass(frozen=True)
class MatrixEntry:
    name: str
    schedule: str
    base: str
    window: int
    seed: int  # the data seed
    init_seed: int | None  # None: the matrix's, else `seed`
    train: dict


@dataclass(frozen=True)
class Matrix:
    name: str
    description: str
    preset: str
    source: str  # the file it was read from
    entries: tuple[MatrixEntry, ...]
    init_seed: int | None = None  # every run's init seed unless the run sets its own

    def resolve(self, preset: str | None = None, only: str | None = None) -> list[RunConfig]:
        """Each entry's resolved config, at `preset` (default: the matrix's), names matching
        the glob `only`."""
        entries = [e for e in self.entries if only is None or fnmatch.fnmatchcase(e.name, only)]
        if not entries:
            raise FibctlError(f"--only {only!r} matches no run of matrix {self.name!r}")
        return [
            RunConfig.resolve(e.name, self.name, preset or self.preset, schedule=e.schedule,
                              base=e.base, window=e.window, seed=e.seed,
                              init_seed=e.init_seed if e.init_seed is not None else self.init_seed,
                              **e.train)
            for e in entries
        ]


def shipped_matrices() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("fibctl.matrices").iterdir()
                  if p.name.endswith(".toml"))


def load_matrix(name_or_path: str) -> Matrix:
    """A shipped matrix by name, or a matrix file by path; validated (errors name the file)."""
    path = Path(name_or_path)
    # a shipped name wins over a folder or file of that name in the working directory
    if path.suffix == ".toml" or len(path.parts) > 1 or (path.is_file() and name_or_path not in shipped_matrices()):
        if not path.is_file():
            raise FibctlError(f"{path} is a folder, not a matrix file" if path.is_dir() else f"no matrix file {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FibctlError(f"cannot read matrix file {path}: {e}") from None
        return parse_matrix(text, check_name("matrix", path.stem), str(path))
    if name_or_path not in shipped_matrices():
        raise FibctlError(f"unknown matrix {name_or_path!r}; shipped: {', '.join(shipped_matrices())} "
                          "(or give the path of a .toml file)")
    res = resources.files("fibctl.matrices") / f"{name_or_path}.toml"
    return parse_matrix(res.read_text(), name_or_path, f"fibctl/matrices/{name_or_path}.toml")


def parse_matrix(text: str, name: str, source: str) -> Matrix:
    def bad(problem: str) -> FibctlError:
        return FibctlError(f"matrix file {source}: {problem}")

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise bad(f"not valid TOML ({e})") from None
    _check_keys(doc, {"matrix", "runs"}, "top level", bad)
    head = doc.get("matrix", {})
    _check_keys(head, MATRIX_KEYS, "[matrix]", bad)
    runs = doc.get("runs")
    if not isinstance(runs, list) or not runs:
        raise bad("no [[runs]] entries")
    entries = tuple(_entry(i, run, bad) for i, run in enumerate(runs, 1))
    names = [e.name for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise bad(f"duplicate run name(s) {', '.join(dupes)}")
    if "init_seed" in head and not _is_int(head["init_seed"]):
        raise bad("[matrix] `init_seed` must be an integer")
    matrix = Matrix(name=name, description=str(head.get("description", "")),
                    preset=head.get("preset", "paper"), source=source, entries=entries,
                    init_seed=head.get("init_seed"))
    try:
        matrix.resolve()  # settings out of range (unknown schedule, preset, ...)
    except FibctlError as e:
        raise bad(str(e)) from None
    return matrix


def _check_keys(table, allowed: set, where: str, bad) -> None:
    if not isinstance(table, dict):
        raise bad(f"{where} must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(allowed))}")


def _entry(i: int, run, bad) -> MatrixEntry:
    where = f"run {i}" + (f" ({run['name']})" if isinstance(run, dict) and "name" in run else "")
    _check_keys(run, RUN_KEYS, where, bad)
    for key in ("name", "schedule"):
        if not isinstance(run.get(key), str):
            raise bad(f"{where} needs a string `{key}`")
    if not is_name(run["name"]):
        raise bad(f"{where}: run names use {NAME_RULE}")
    if run["schedule"] not in SCHEDULES:  # before the settings that depend on it
        raise bad(f"{where}: unknown schedule {run['schedule']!r}; allowed: {', '.join(SCHEDULES)}")
    dense = run["schedule"] == "dense"
    if dense and ({"base", "window"} & set(run)):
        raise bad(f"{where}: a dense run has no base or window")
    if not dense and "window" not in run:
        raise bad(f"{where} needs a `window`")
    for key in ("window", "seed", "init_seed"):
        if key in run and not _is_int(run[key]):
            raise bad(f"{where}: `{key}` must be an integer")
    train = run.get("train", {})
    _check_keys(train, TRAIN_FIELDS, f"{where} train", bad)
    return MatrixEntry(name=run["name"], schedule=run["schedule"], base=run.get("base", "fib"),
                       window=run.get("window", 0), seed=run.get("seed", DEFAULT_SEED),
                       init_seed=run.get("init_seed"), train=dict(train))


def _is_int(value) -> bool:
    """An integer that fits the database's 64-bit columns."""
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63
