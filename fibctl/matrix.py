"""Run matrices: TOML files listing runs by their attention settings.

A matrix file has a `[matrix]` table (`description`, `preset`, optional `init_seed`) and one
`[[runs]]` table per run: `name`, `schedule`, and for sparse runs `window` and `base` (default
"fib"); `seed` (the data seed, default 42); optional `init_seed` (the seed of the initial
weights: the run's own, else the matrix's, else the run's `seed`) and `train` (overrides of the
preset's training recipe, e.g. `train = { steps = 100, optimizer = "adamw" }`). Shipped
matrices live in `fibctl/matrices/`; any other file is named by its path (one ending in
.toml or holding a '/'). Run names and the matrix name (the file's stem) follow
`fibctl.names.NAME_PATTERN`; a file's matrix name may not be a shipped matrix's (nor the
probe's), and its run names may not differ only by case (one checkpoint folder on a
case-insensitive filesystem).

Dense runs carry base "fib" and window 0 in their config (unused by dense attention);
the runs table stores NULL for both.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fibctl.config import (DEFAULT_SEED, SCHEDULES, SEED_MAX, ConfigError, RunConfig, TrainConfig, check_seed,
                           get_preset)
from fibctl import tomls
from fibctl.errors import FibctlError, printable, shown_path, unknown
from fibctl.names import NAME_RULE, check_name, is_name
from fibctl.paths import expanded
from fibctl.probe.cells import PROBE_MATRIX

# each key and the type its value must have (train's own keys: TrainConfig.validate checks them)
MATRIX_KEYS = {"description": str, "preset": str, "init_seed": int}
RUN_KEYS = {"name": str, "schedule": str, "base": str, "window": int, "seed": int, "init_seed": int, "train": dict}
TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
# TOML's word for each type a value can have
_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
               dict: "a table"}


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

    def resolve(self, preset: str | None = None, only: str | None = None, train: dict | None = None,
                suffix: str = "", seeds: Sequence[int] = ()) -> list[RunConfig]:
        """Each entry's resolved config, at `preset` (default: the matrix's), names matching
        the glob `only`; `train` overrides every run's training settings (over its own), and
        `suffix` ends every run's name (a sweep's runs are other runs). `seeds` gives each
        entry once per seed, all runs of one seed together, as if its `seed` said it (its
        init seed stays the entry's or the matrix's where one is set, else it is that seed);
        at a seed other than the entry's own the name gets `_s<seed>` (`_seeded_name`), before
        `suffix`."""
        entries = [e for e in self.entries if only is None or fnmatch.fnmatchcase(e.name, only)]
        if not entries:
            raise FibctlError(f"--only {only!r} matches no run of matrix {self.name!r}")
        preset = self.preset if preset is None else preset  # '' is a preset name, refused below
        get_preset(preset)  # an unknown preset is no one run's problem
        for seed in seeds:
            check_seed(seed, "--seed")
        if seeds:  # a seed given twice is one replicate
            entries = [dataclasses.replace(e, seed=seed, name=check_name("run", _seeded_name(e, seed)))
                       for seed in dict.fromkeys(seeds) for e in entries]
            clash = _name_clash([e.name for e in entries])
            if clash:  # a matrix holding both `a` and `a_s43`, say
                raise FibctlError(f"--seed: {clash}; pick the runs with --only")
        if suffix:
            if not re.search("[A-Za-z0-9]", suffix):  # `..`, `-`: runs named `dense..`, no sweep told apart
                raise FibctlError(f"--suffix {suffix!r} holds no letter or digit; name the sweep, e.g. --suffix _lr1e-3")
            entries = [dataclasses.replace(e, name=check_name("run", e.name + suffix)) for e in entries]
        if train:
            entries = [dataclasses.replace(e, train={**e.train, **train}) for e in entries]
        configs = [self._resolve(e, preset) for e in entries]
        if seeds:  # `paper --seed 43`: its seed-42 and seed-44 W=12 runs become its own seed-43 ones
            _refuse_repeats(configs)
        return configs

    def _resolve(self, e: MatrixEntry, preset: str) -> RunConfig:
        try:
            config = RunConfig.resolve(e.name, self.name, preset, schedule=e.schedule, base=e.base,
                                       window=e.window, seed=e.seed,
                                       init_seed=e.init_seed if e.init_seed is not None else self.init_seed,
                                       **e.train)
            train = config.train
            # fewer steps than the warm-up (`--set train.steps=20` at tiny's 30): the lr never
            # reaches train.lr nor decays. Refused when queued; a run already queued still trains
            if train.warmup_steps > train.steps:
                raise ConfigError(f"train.warmup_steps = {train.warmup_steps} is above train.steps = {train.steps}: "
                                  "the learning rate would never reach train.lr; lower train.warmup_steps")
            return config
        except ConfigError as err:  # which run, at a preset other than the one it was read at
            raise ConfigError(f"run {e.name}: {err}") from None


def _refuse_repeats(configs: list[RunConfig]) -> None:
    """Two runs of one config (names aside) would train the same model twice, and Table 5
    would take them for two runs of one cell: refused."""
    named = {}  # config hash -> the names of its runs
    for c in configs:
        named.setdefault(c.config_hash, []).append(c.name)
    same = next((names for names in named.values() if len(names) > 1), None)
    if same:
        raise FibctlError(f"--seed: runs {' and '.join(same)} would train one config; pick the runs with --only")


def _seeded_name(entry: MatrixEntry, seed: int) -> str:
    """The name `queue add --seed` gives `entry`'s run at `seed`: its own at its own seed;
    else with `_s<seed>`, in place of the name's own `_s<its seed>` where it ends so (paper's
    g01__fib_fixed_w12_s43 at seed 45 is g01__fib_fixed_w12_s45, not ..._s43_s45)."""
    if seed == entry.seed:
        return entry.name
    return entry.name.removesuffix(f"_s{entry.seed}") + f"_s{seed}"


def _name_clash(names: Sequence[str]) -> str | None:
    """What makes `names` not a matrix's run names: one given twice, or two that differ only
    by case (one checkpoint folder on a case-insensitive filesystem); None when none does."""
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        return f"duplicate run name(s) {', '.join(dupes)}"
    first = {}  # each name folded to lower case -> the first run name folding to it
    for n in names:
        if first.setdefault(n.lower(), n) != n:
            return (f"run names {first[n.lower()]!r} and {n!r} differ only by case "
                    "(one checkpoint folder on a case-insensitive filesystem)")
    return None


def parse_settings(settings: list[str]) -> dict:
    """`--set train.KEY=VALUE` options as training overrides; VALUE is read as a TOML value
    (`1e-3`, `200`, `true`, `"adamw"`), and a bare word as a string (`adamw`)."""
    train = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        field = key.strip().removeprefix("train.")
        if not equals or not key.startswith("train.") or field not in TRAIN_FIELDS:
            # `lr=1e-3` (nanoGPT's spelling) or a typo: the setting meant, after the list
            close = difflib.get_close_matches(field, sorted(TRAIN_FIELDS), n=1)
            meant = f"; did you mean train.{close[0]}={value}?" if equals and close else ""
            raise FibctlError(f"--set {setting!r}: give train.KEY=VALUE, KEY one of "
                              f"{', '.join(sorted(TRAIN_FIELDS))}{meant}")
        try:
            doc = tomls.loads(f"v = {value.strip()}")
        except tomls.NotToml:
            doc = {"v": value.strip()}
        except tomls.TomlError as e:
            raise FibctlError(f"--set {setting!r}: {e}") from None
        if len(doc) > 1:  # `train.lr=1e-3<newline>train.steps=5` set lr alone, without a word
            raise FibctlError(f"--set {setting!r}: the value must be one TOML value, on one line")
        train[field] = doc["v"]
        if not isinstance(train[field], (bool, int, float, str)):
            raise FibctlError(f"--set {setting!r}: the value must be a number, true/false or a string")
    return train


def queue_again(config: RunConfig, suffix: str, **train) -> str:
    """The `fibctl queue add` line that queues `config` again as a new run named with `suffix`,
    with `train` changed (e.g. lr="LOWER"): for a run of a shipped matrix, its entry (a sweep's
    run is named ENTRY + `_s<seed>` at a seed not the entry's + its own suffix), its seed and
    preset where the matrix's differ, and every training setting it was queued with beyond the
    entry's; else a template naming the run and its seed (its matrix file is not known here)."""
    m = load_matrix(config.matrix) if config.matrix in shipped_matrices() else None
    entries = [e for e in (m.entries if m else ()) if config.name.startswith(_seeded_name(e, config.seed))]
    if m is None or not entries:
        seed = f" --seed {config.seed}" if config.seed != DEFAULT_SEED else ""
        sets = "".join(f" --set train.{k}={v}" for k, v in train.items())
        return f"fibctl queue add MATRIX --only {config.name}{seed}{sets} --suffix {suffix}"
    entry = max(entries, key=lambda e: len(_seeded_name(e, config.seed)))  # dense_lr1e-3's is dense
    queued = dataclasses.asdict(config.train)
    default = dataclasses.asdict(m._resolve(entry, config.preset).train)
    # a setting left unset (None) has no --set spelling; the preset's default stands for it
    sets = {k: v for k, v in queued.items() if v != default[k] and v is not None} | train
    words = ["fibctl queue add", m.name, "--only", entry.name]
    words += ["--seed", str(config.seed)] if config.seed != entry.seed else []
    words += ["--preset", config.preset] if config.preset != m.preset else []
    words += [f"--set train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sets.items()]
    # --seed names it as it did: the suffix is what follows that
    own = config.name[len(_seeded_name(entry, config.seed)):]
    return " ".join([*words, "--suffix", own + suffix])


def shipped_matrices() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("fibctl.matrices").iterdir()
                  if p.name.endswith(".toml"))


def load_matrix(name_or_path: str) -> Matrix:
    """A shipped matrix by name, or a matrix file by path (`~` opening it: the home folder, as
    a recipe's); validated (errors name the file)."""
    path = Path(expanded(name_or_path))
    # a shipped name wins over a folder or file of that name in the working directory
    if path.suffix == ".toml" or len(path.parts) > 1 or (path.is_file() and name_or_path not in shipped_matrices()):
        if path.is_dir():
            raise FibctlError(f"{shown_path(path)} is a folder, not a matrix file")
        if not path.exists():
            raise FibctlError(f"no matrix file {shown_path(path)}")
        if not path.is_file():  # a FIFO would block the read, a device never end it
            raise FibctlError(f"{shown_path(path)} is not a regular file, not a matrix file")
        name = check_name("matrix", path.stem)
        if name in (*shipped_matrices(), PROBE_MATRIX) and not _is_shipped(path, name):
            raise FibctlError(f"matrix file {shown_path(path)}: {name!r} names a matrix of fibctl's own; rename the "
                              "file, or its runs would mix into that matrix's tables")
        try:
            text = tomls.read(path)
        except (OSError, tomls.TomlError) as e:
            raise FibctlError(f"cannot read matrix file {shown_path(path)}: {e}") from None
        return parse_matrix(text, name, str(path))
    if name_or_path not in shipped_matrices():
        raise FibctlError(f"unknown matrix {name_or_path!r}; shipped: {', '.join(shipped_matrices())} "
                          "(or give the path of a .toml file)")
    res = resources.files("fibctl.matrices") / f"{name_or_path}.toml"
    return parse_matrix(res.read_text(), name_or_path, f"fibctl/matrices/{name_or_path}.toml")


def _is_shipped(path: Path, name: str) -> bool:
    """Whether `path` is the shipped matrix `name`'s file itself (e.g. read from a checkout)."""
    try:
        return os.path.samefile(path, str(resources.files("fibctl.matrices") / f"{name}.toml"))
    except OSError:  # no such shipped file (the probe's), or not on disk
        return False


def parse_matrix(text: str, name: str, source: str) -> Matrix:
    def bad(problem: str) -> FibctlError:
        return FibctlError(f"matrix file {shown_path(source)}: {problem}")

    try:
        doc = tomls.loads(text)
    except tomls.TomlError as e:
        raise bad(f"not valid TOML ({e})") from None
    _check_keys(doc, {"matrix", "runs"}, "top level", bad)
    head = doc.get("matrix", {})
    _check_keys(head, MATRIX_KEYS, "[matrix]", bad)
    _check_seeds(head, "[matrix]", bad)
    # a character `printable` escapes, line breaks too: a description is one line of a table's title
    control = next((c for c in head.get("description", "") if printable(c) != c), None)
    if control:
        raise bad(f"[matrix]: `description` holds the control character {printable(control)}; "
                  "a terminal would obey it, not show it")
    runs = doc.get("runs")
    if not isinstance(runs, list) or not runs:
        raise bad("no [[runs]] entries")
    entries = tuple(_entry(i, run, bad) for i, run in enumerate(runs, 1))
    clash = _name_clash([e.name for e in entries])
    if clash:
        raise bad(clash)
    matrix = Matrix(name=name, description=head.get("description", ""),
                    preset=head.get("preset", "paper"), source=source, entries=entries,
                    init_seed=head.get("init_seed"))
    try:
        matrix.resolve()  # settings out of range (unknown schedule, preset, ...)
    except FibctlError as e:
        raise bad(str(e)) from None
    return matrix


def _check_keys(table, allowed, where: str, bad) -> None:
    """`table` is a table of `allowed` keys; where `allowed` maps each to a type, each value has it."""
    if not isinstance(table, dict):
        raise bad(f"{where} must be a table")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(allowed))}")
    if isinstance(allowed, dict):
        for key, value in table.items():
            if type(value) is not allowed[key]:  # not isinstance: a boolean is an int to Python
                raise bad(f"{where}: `{key}` must be {_TOML_TYPES[allowed[key]]}, not "
                          f"{_TOML_TYPES.get(type(value), 'a date or time')}")


def _check_seeds(table: dict, where: str, bad) -> None:
    for key in ("seed", "init_seed"):
        if table.get(key, 0) > SEED_MAX:  # a negative one: RunConfig.resolve says the range
            raise bad(f"{where}: `{key}` = {table[key]} is too large: at most 2**32 - 1, "
                      "what numpy's generator takes")


def _entry(i: int, run, bad) -> MatrixEntry:
    where = f"run {i}" + (f" ({run['name']})" if isinstance(run, dict) and is_name(run.get("name")) else "")
    for key in ("name", "schedule"):
        if isinstance(run, dict) and key not in run:
            raise bad(f"{where} needs a string `{key}`")
    _check_keys(run, RUN_KEYS, where, bad)
    _check_seeds(run, where, bad)
    if not is_name(run["name"]):
        raise bad(f"{where}: run names use {NAME_RULE}")
    if run["schedule"] not in SCHEDULES:  # before the settings that depend on it
        raise bad(f"{where}: {unknown('schedule', run['schedule'], SCHEDULES)}")
    dense = run["schedule"] == "dense"
    if dense and ({"base", "window"} & set(run)):
        raise bad(f"{where}: a dense run has no base or window")
    if not dense and "window" not in run:
        raise bad(f"{where} needs a `window`")
    train = run.get("train", {})
    _check_keys(train, TRAIN_FIELDS, f"{where} train", bad)
    return MatrixEntry(name=run["name"], schedule=run["schedule"], base=run.get("base", "fib"),
                       window=run.get("window", 0), seed=run.get("seed", DEFAULT_SEED),
                       init_seed=run.get("init_seed"), train=dict(train))
