"""Issue 13, item 12 (and 2, 4, 7, 9): every class of bad input the audit found, fed to the
CLI. Each must end in one line naming the problem, exit code 2, no traceback, and no file
changed or created (checksums of the whole folder before and after)."""

from __future__ import annotations

import importlib.util

import hashlib
import io
import json
import os
import shutil
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fibctl.db.engine import connect, upgrade
from train_helpers import micro_run, queued_db, write_data

RECIPE = """vocab_size = 512
train_tokens = 1000

[[sources]]
name = {name}
kind = "generated"
share = 1.0
{source}
"""


def recipe(tmp: Path, file: str, *, name='"g"', source="") -> str:
    path = tmp / file
    path.write_text(RECIPE.format(name=name, source=source))
    return str(path)


def matrix(tmp: Path, file: str, train: str) -> str:
    path = tmp / file
    path.write_text(f'[matrix]\npreset = "micro"\n\n[[runs]]\nname = "r"\nschedule = "fixed"\nwindow = 4\n'
                    f"train = {{ {train} }}\n")
    return str(path)


def matrix_file(path: Path, run: str, head: str = 'preset = "micro"') -> str:
    """A matrix of `head` and one run "r" of fib fixed with `run`'s keys."""
    path.write_text(f'[matrix]\n{head}\n\n[[runs]]\nname = "r"\nschedule = "fixed"\n{run}\n')
    return str(path)


def checkpoint_db(tmp: Path, name: str, content: bytes, data: Path) -> str:
    """A database whose one run records a checkpoint holding `content`."""
    db = tmp / f"{name}.db"
    engine = queued_db(db, micro_run("run"))
    with engine.begin() as conn:
        conn.exec_driver_sql("update runs set status = 'done', checkpoint_path = 'run/step_00000010.pt', "
                             "runs_dir = ?", (str(tmp / f"{name}_runs"),))
    engine.dispose()
    (tmp / f"{name}_runs" / "run").mkdir(parents=True)
    (tmp / f"{name}_runs" / "run" / "step_00000010.pt").write_bytes(content)
    return str(db)


def _saved(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def build(tmp: Path) -> dict[str, str]:
    """Every bad input, written once; names -> paths."""
    p = {}
    data = write_data(tmp / "data")
    p["data"] = str(data)
    p["good_db"] = str(tmp / "good.db")
    queued_db(tmp / "good.db", micro_run("run")).dispose()
    shutil.copy(Path(__file__).parents[1] / "results.db.example", tmp / "results.db")  # the demo's numbers
    p["results_db"] = str(tmp / "results.db")
    # the demo's numbers edited in the sqlite3 shell: SQLite holds no column to its type
    for label, change in {"heartbeat": "UPDATE runs SET heartbeat_at = 'garbage', status = 'running'",
                          "created": "UPDATE runs SET created_at = '2026-13-45 99:99:99'",
                          "wall": "UPDATE runs SET wall_seconds = 'abc'",
                          "ppl": "UPDATE evaluations SET ppl = 'abc' WHERE run_id = 2",
                          "final": "UPDATE runs SET final_step = 'x'"}.items():
        shutil.copy(tmp / "results.db", tmp / f"{label}.db")
        with sqlite3.connect(tmp / f"{label}.db") as con:
            con.execute(change)
        con.close()
        p[f"{label}_db"] = str(tmp / f"{label}.db")
    # alembic_version edited by hand: a blob, an integer (stored as text '42' in the table's text
    # column; as 42 in one made again without a type): each was "written by a newer fibctl"
    for label, change in {"rev_blob": ["UPDATE alembic_version SET version_num = X'00ff'"],
                          "rev_42": ["UPDATE alembic_version SET version_num = 42"],
                          "rev_int": ["DROP TABLE alembic_version", "CREATE TABLE alembic_version (version_num)",
                                      "INSERT INTO alembic_version VALUES (8)"]}.items():
        shutil.copy(tmp / "good.db", tmp / f"{label}.db")
        with sqlite3.connect(tmp / f"{label}.db") as con:
            for statement in change:
                con.execute(statement)
        con.close()
        p[f"{label}_db"] = str(tmp / f"{label}.db")
    # a view in a table's place: one of endless rows (WITH RECURSIVE) held `db copy` for ever,
    # in SQLite's C code where not even Ctrl-C stops it; this one has none
    shutil.copy(tmp / "results.db", tmp / "view.db")
    with sqlite3.connect(tmp / "view.db") as con:
        columns = ", ".join(f"NULL AS {r[1]}" for r in con.execute("PRAGMA table_info(train_steps)"))
        con.execute("DROP TABLE train_steps")
        con.execute(f"CREATE VIEW train_steps AS SELECT {columns} WHERE 0")
    con.close()
    p["view_db"] = str(tmp / "view.db")
    (tmp / "empty.db").write_bytes(b"")
    p["empty_db"] = str(tmp / "empty.db")
    os.mkfifo(tmp / "pipe.db")  # nothing ever writes to it: opening it to read would wait forever
    p["fifo"] = str(tmp / "pipe.db")
    corrupt = bytearray((tmp / "good.db").read_bytes())
    corrupt[100:4096 * 3] = os.urandom(4096 * 3 - 100)  # the header survives, the pages do not
    (tmp / "corrupt.db").write_bytes(bytes(corrupt))
    p["corrupt_db"] = str(tmp / "corrupt.db")
    upgrade(str(tmp / "old.db"), "0001")
    p["old_db"] = str(tmp / "old.db")
    for kind, content in {"zero": b"", "truncated": b"PK\x03\x04\x14\x00\x00\x00\x08\x00",
                          "random": np.random.default_rng(0).bytes(5000),
                          "hash": _saved({"model": {}, "step": 10, "config_hash": torch.zeros(3)})}.items():
        p[f"{kind}_ckpt_db"] = checkpoint_db(tmp, kind, content, data)
    for kind, text in {"list": "[1, 2, 3]", "nokey": '{"format": 1, "recipe": "x"}'}.items():
        (tmp / f"manifest_{kind}").mkdir()
        (tmp / f"manifest_{kind}" / "manifest.json").write_text(text)
        p[f"manifest_{kind}"] = str(tmp / f"manifest_{kind}")
    big = write_data(tmp / "bigids", train_tokens=4_000, heldout_tokens=1_024)
    stream = np.fromfile(big / "math_val.bin", dtype=np.uint16)
    stream[5] = 60_000  # beyond the vocabulary of 512
    stream.tofile(big / "math_val.bin")
    p["bigids"] = str(big)
    changed = write_data(tmp / "changed", train_tokens=4_000, heldout_tokens=1_024, hashed=True)
    stream = np.fromfile(changed / "math_val.bin", dtype=np.uint16)
    stream[5] = (stream[5] + 1) % 512  # within the vocabulary and the size: the hash alone tells
    stream.tofile(changed / "math_val.bin")
    p["changed"] = str(changed)
    (tmp / "sources_str.toml").write_text('vocab_size = 512\ntrain_tokens = 1000\nsources = "oops"\n')
    p["sources_str"] = str(tmp / "sources_str.toml")
    p["text_int"] = recipe(tmp, "text_int.toml", source="text = 5")
    p["heldout_up"] = recipe(tmp, "heldout_up.toml", source='heldout = "../victim/train"')
    p["heldout_abs"] = recipe(tmp, "heldout_abs.toml", source=f'heldout = "{tmp}/abs"')
    p["source_up"] = recipe(tmp, "source_up.toml", name='"../../x"')
    (tmp / "victim").mkdir()
    (tmp / "victim" / "train.bin").write_bytes(b"someone else's data")
    (tmp / "afile").write_text("a file, not a folder\n")
    shutil.copytree(data, tmp / "noheld")
    manifest = json.loads((tmp / "noheld" / "manifest.json").read_text())
    (tmp / "noheld" / "manifest.json").write_text(json.dumps({**manifest, "heldout": []}))
    p["noheld"] = str(tmp / "noheld")
    for label, train in {"steps0": "steps = 0", "steps_neg": "steps = -5", "steps_str": 'steps = "20"',
                         "ckpt0": "checkpoint_interval = 0", "log0": "log_interval = 0", "batch0": "batch_size = 0",
                         "lr_nan": "lr = nan"}.items():
        p[f"m_{label}"] = matrix(tmp, f"m_{label}.toml", train)
    (tmp / "m_window_big.toml").write_text('[matrix]\npreset = "micro"\n\n[[runs]]\nname = "r"\n'
                                          'schedule = "fixed"\nwindow = 99999999999999999999\n')
    p["m_window_big"] = str(tmp / "m_window_big.toml")
    (tmp / "m seed.toml").write_text('[matrix]\npreset = "micro"\n\n[[runs]]\nname = "r"\nschedule = "dense"\n'
                                     "seed = -1\n")
    p["m_seed"] = str(tmp / "m seed.toml")
    # matrix files: wrong types, numbers too large to train or to record, names, odd files
    micro = 'preset = "micro"\n'
    for label, run, head in [
            ("preset_list", "", 'preset = ["micro"]'), ("preset_table", "", "preset = { a = 1 }"),
            ("batch_huge", "train = { batch_size = 1000000000000 }", micro),
            ("lr_huge", "train = { lr = 1e300 }", micro),
            ("steps_huge", "train = { steps = 99999999999999999999999 }", micro),
            ("init_seed_huge", "", micro + "init_seed = 99999999999999999999"),
            ("description_esc", "", micro + 'description = "\\u001b]0;title\\u0007"')]:
        p[f"m_{label}"] = matrix_file(tmp / f"m_{label}.toml", f"window = 4\n{run}", head)
    p["m_window_max"] = matrix_file(tmp / "m_window_max.toml", "window = 9223372036854775807")
    p["m_case"] = matrix_file(tmp / "m_case.toml", 'window = 4\n[[runs]]\nname = "R"\nschedule = "dense"')
    os.mkfifo(tmp / "m_fifo.toml")
    p["m_fifo"] = str(tmp / "m_fifo.toml")
    (tmp / "m_zero.toml").symlink_to("/dev/zero")
    p["m_zero"] = str(tmp / "m_zero.toml")
    (tmp / "mine").mkdir()
    p["m_paper"] = matrix_file(tmp / "mine" / "paper.toml", "window = 4")
    return p


# (args, words the one line must contain); {name} is filled from build()
CASES = [
    # a read command on an empty, corrupt or old-schema database
    (["queue", "ls", "--db", "{empty_db}"], "no fibctl schema"),
    (["db", "copy", "--from", "{view_db}", "--to", "{tmp}/copied.db"],
     "view.db lacks table train_steps: it was changed outside fibctl; restore it from a copy"),
    (["report", "table1", "--db", "{view_db}"], "view.db lacks table train_steps"),
    (["status", "--db", "{empty_db}"], "no fibctl schema (an empty database); this command reads revision"),
    (["report", "table1", "--db", "{empty_db}"], "no fibctl schema"),
    (["figure", "curves", "--db", "{empty_db}", "--out", "{tmp}/c.png"], "no fibctl schema"),
    (["queue", "ls", "--db", "{corrupt_db}"], "database"),
    (["report", "table3", "--db", "{corrupt_db}"], "database"),
    (["sql", "select count(*) from events", "--db", "{corrupt_db}"], "database"),
    (["queue", "ls", "--db", "{old_db}"], "schema revision 0001"),
    (["report", "table1", "--db", "{old_db}"], "schema revision 0001"),
    (["figure", "posloss", "--db", "{old_db}", "--out", "{tmp}/p.png"], "schema revision 0001"),
    (["report", "table4", "--db", "{good_db}", "--window", "99999999999999999999"], "--window"),
    # a schema revision no fibctl writes: damaged, not a newer fibctl's
    *[([*command, "--db", "{rev_blob_db}"], "alembic_version.version_num holds X'00ff', not a schema revision's text")
      for command in (["db", "current"], ["db", "upgrade"], ["queue", "ls"], ["queue", "add", "demo"])],
    *[([*command, "--db", "{rev_42_db}"], "has schema revision '42', which no fibctl writes (this one's are 0001 to")
      for command in (["db", "current"], ["db", "upgrade"], ["status"], ["queue", "add", "demo"])],
    (["db", "current", "--db", "{rev_int_db}"], "alembic_version.version_num holds 8, not a schema revision's text"),
    # a mistyped database
    (["queue", "ls", "--db", "{tmp}/typo.db"], "no database at"),
    (["worker", "--db", "{tmp}/typo.db", "--data", "{data}", "--runs-dir", "{tmp}/runs"], "no database at"),
    (["queue", "retry", "run", "--db", "{tmp}/typo.db"], "no database at"),
    # ... says where the database may be, and how one is made (it said only "no database at")
    (["status", "--db", "{tmp}/typo.db"], "typo.db; name yours with --db or FIBCTL_DB (the demo's: fibctl-demo/"),
    (["train", "run", "--db", "{tmp}/typo.db"], "or make one with `fibctl queue add MATRIX`"),
    (["report", "table1", "--db", "{good_db}", "--compare", "{tmp}/typo.db"], "typo.db (--compare)"),
    # drivers and URLs
    (["queue", "ls", "--db", "postgresql+pg8000://fib:s3cret@localhost/fib"], "driver is not installed"),
    (["sql", "select 1", "--db", "postgresql+pg8000://fib:s3cret@localhost/fib"], "driver is not installed"),
    # an unreachable server (with psycopg installed; without it, the missing driver is the line)
    (["queue", "ls", "--db", "postgresql+psycopg://fib:s3cret@127.0.0.1:1/fib"],
     "is not a usable database" if importlib.util.find_spec("psycopg") else "driver is not installed"),
    (["queue", "add", "demo", "--db", "nosuchdb://x/y"], "unknown database kind"),
    (["queue", "ls", "--db", "nosuchdb://x/y"], "supports SQLite and PostgreSQL"),
    (["queue", "ls", "--db", "sqlite://x:y:z@@/"], "database"),
    # checkpoints: empty, truncated, random
    (["eval", "run", "--length", "64", "--db", "{zero_ckpt_db}", "--data", "{data}"], "damaged or not a checkpoint"),
    (["eval", "run", "--length", "64", "--db", "{truncated_ckpt_db}", "--data", "{data}"], "damaged or not a"),
    (["eval", "run", "--length", "64", "--db", "{random_ckpt_db}", "--data", "{data}"], "checkpoint"),
    (["sample", "run", "--db", "{good_db}", "--data", "{data}"], "run 'run' has no checkpoint yet (status queued)"),
    (["sample", "runn", "--db", "{good_db}", "--data", "{data}"], "did you mean 'run'?"),
    (["sample", "run", "--db", "{old_db}", "--data", "{data}"], "schema revision 0001"),
    # the tests' stand-in tokenizer ("{}"), which training never reads: no text to decode with
    (["sample", "run", "--db", "{random_ckpt_db}", "--data", "{data}"], "tokenizer.json no longer matches the hash"),
    # a hash that is not text: comparing it with the run's was a RuntimeError traceback
    (["eval", "run", "--length", "64", "--db", "{hash_ckpt_db}", "--data", "{data}"],
     "is damaged or not a checkpoint (its config_hash is a Tensor, not text)"),
    # manifests and token streams
    (["data", "show", "{manifest_list}"], "not a valid data manifest"),
    (["data", "show", "{manifest_nokey}"], "not a valid data manifest"),
    (["worker", "--db", "{good_db}", "--data", "{manifest_list}", "--runs-dir", "{tmp}/runs"], "not a valid data"),
    (["eval", "run", "--length", "64", "--db", "{good_db}", "--data", "{manifest_nokey}"], "not a valid data"),
    (["worker", "--db", "{good_db}", "--data", "{bigids}", "--runs-dir", "{tmp}/runs"], "beyond the vocabulary"),
    # a --data folder that is not there is named, with the recipe of the run's vocabulary
    (["train", "run", "--db", "{good_db}", "--data", "{tmp}/nodata", "--runs-dir", "{tmp}/runs"],
     "nodata does not exist: prepare it (`fibctl data prepare quick --data "),
    (["eval", "run", "--length", "64", "--db", "{random_ckpt_db}", "--data", "{bigids}"], "beyond the vocabulary"),
    # a stream changed since it was prepared was trained and scored on as the recorded data
    (["worker", "--db", "{good_db}", "--data", "{changed}", "--runs-dir", "{tmp}/runs"],
     "math_val.bin no longer matches the hash its manifest records (changed since it was prepared)"),
    (["eval", "run", "--length", "64", "--db", "{random_ckpt_db}", "--data", "{changed}"], "no longer matches"),
    (["data", "show", "{changed}"], "math_val.bin no longer matches the hash its manifest records"),
    # a --data file: they suggested `fibctl data prepare RECIPE --data afile`, which is refused in turn
    (["eval", "run", "--length", "64", "--db", "{good_db}", "--data", "{tmp}/afile"],
     "afile is a file, not a data folder (one `fibctl data prepare` wrote)"),
    (["worker", "--db", "{good_db}", "--data", "{tmp}/afile", "--runs-dir", "{tmp}/runs"], "afile is a file, not a"),
    (["train", "run", "--db", "{good_db}", "--data", "{tmp}/afile", "--runs-dir", "{tmp}/runs"], "is a file, not a"),
    # recipes: wrong types, names that would leave --out
    (["data", "prepare", "{sources_str}", "--out", "{tmp}/out"], "[[sources]] tables"),
    (["data", "prepare", "{text_int}", "--out", "{tmp}/out"], "text must be a string or a list"),
    (["data", "prepare", "{heldout_up}", "--out", "{tmp}/out"], "held-out set name '../victim/train'"),
    (["data", "prepare", "{heldout_abs}", "--out", "{tmp}/out"], "held-out set name"),
    (["data", "prepare", "{source_up}", "--out", "{tmp}/out"], "source name '../../x' is not allowed"),
    # reports into a file
    (["report", "all", "--db", "{good_db}", "--out", "{tmp}/afile"], "cannot write the report into"),
    # a folder that cannot be made: the error line alone, no progress bar left above it
    (["report", "all", "--db", "{results_db}", "--out", "/proc/fibctl-nope"],
     "cannot write the report into /proc/fibctl-nope: No such file or directory"),
    (["figure", "coverage", "--out", "{tmp}/afile/cov.png"], "cannot write"),
    # integers too large for SQLite
    (["report", "table1", "--db", "{good_db}", "--seed", "99999999999999999999"], "--seed"),
    (["figure", "extrapolation", "--db", "{good_db}", "--seed", "-99999999999999999999",
      "--out", "{tmp}/e.png"], "--seed"),
    (["report", "table3", "--db", "{good_db}", "--seed", "9223372036854775808"], "--seed"),
    (["report", "table1", "--db", "{good_db}", "--seed", "-1"], "--seed = -1 must be an integer from 0 to 2**32 - 1"),
    # matrix overrides and names, option values
    (["queue", "add", "{m_steps0}", "--db", "{good_db}"], "train.steps = 0 must be >= 1"),
    (["queue", "add", "{m_steps_neg}", "--db", "{good_db}"], "train.steps = -5"),
    (["queue", "add", "{m_steps_str}", "--db", "{good_db}"], "must be an integer"),
    (["queue", "add", "{m_ckpt0}", "--db", "{good_db}"], "train.checkpoint_interval = 0"),
    (["queue", "add", "{m_log0}", "--db", "{good_db}"], "train.log_interval = 0"),
    (["queue", "add", "{m_batch0}", "--db", "{good_db}"], "train.batch_size = 0"),
    (["queue", "add", "{m_lr_nan}", "--db", "{good_db}"], "train.lr = nan must be a finite number"),
    (["queue", "add", "{m_seed}", "--db", "{good_db}"], "matrix name 'm seed' is not allowed"),
    (["worker", "--db", "{good_db}", "--data", "{data}", "--heartbeat-timeout", "0"], "--heartbeat-timeout 0"),
    # above 0, yet every live run abandoned at once: two workers trained each
    (["worker", "--db", "{good_db}", "--data", "{data}", "--heartbeat-timeout", "1e-300"],
     "--heartbeat-timeout 1e-300 must be a number of seconds of at least 1 and at most 1,000,000,000"),
    # a line break in a path (FIBCTL_DB pasted with one) took the error onto two lines
    (["queue", "ls", "--db", "{tmp}/a\nb.db"], "/a\\nb.db"),
    # a date 1e15 s back overflowed in the claim: a traceback
    (["worker", "--db", "{good_db}", "--data", "{data}", "--heartbeat-timeout", "1e15"], "at most 1,000,000,000"),
    (["train", "run", "--db", "{good_db}", "--data", "{data}", "--heartbeat-timeout", "-1"], "--heartbeat-timeout"),
    (["sql", "select 1", "--db", "{good_db}", "--max-rows", "0"], "--max-rows"),
    (["worker", "--db", "{good_db}", "--data", "{data}", "--max-runs", "-1"], "--max-runs (-1) must be >= 1"),
    (["worker", "--db", "{good_db}", "--data", "{data}", "--max-attempts", "0"], "--max-attempts (0)"),
    (["queue", "add", "{m_window_big}", "--db", "{good_db}"], "window W=99999999999999999999 is too large"),
    (["matrix", "show", "{m_preset_list}"], "[matrix]: `preset` must be a string, not an array"),
    (["queue", "add", "{m_preset_table}", "--db", "{good_db}"], "`preset` must be a string, not a table"),
    (["queue", "add", "{m_batch_huge}", "--db", "{good_db}"], "train.batch_size = 1000000000000 is too large"),
    (["queue", "add", "{m_lr_huge}", "--db", "{good_db}"], "train.lr = 1e+300 is too large"),
    (["queue", "add", "{m_steps_huge}", "--db", "{good_db}"], "train.steps = 99999999999999999999999 is too large"),
    (["queue", "add", "{m_window_max}", "--db", "{good_db}"], "at most T - 2 = 62"),
    (["queue", "add", "{m_init_seed_huge}", "--db", "{good_db}"], "`init_seed` = 99999999999999999999 is too large"),
    (["matrix", "show", "{m_description_esc}"], "`description` holds the control character \\x1b"),
    (["queue", "add", "{m_case}", "--db", "{good_db}"], "run names 'r' and 'R' differ only by case"),
    (["matrix", "show", "{m_fifo}"], "m_fifo.toml is not a regular file"),
    (["queue", "add", "{m_zero}", "--db", "{good_db}"], "m_zero.toml is not a regular file"),
    (["queue", "add", "{m_paper}", "--db", "{good_db}"], "'paper' names a matrix of fibctl's own; rename the file"),
    (["figure", "coverage", "--layers", "0", "--out", "{tmp}/cov.png"], "coverage needs --layers >= 1"),
    (["figure", "coverage", "--window", "-1", "--out", "{tmp}/cov.png"], "coverage needs"),
    (["bench", "attention", "--length", "8", "--repeats", "0"], "--repeats 0 must be >= 1"),
    (["eval", "x", "--length", "8", "--threads", "0", "--db", "{good_db}", "--data", "{data}"],
     "--threads must be from 1 to this machine's"),
    (["eval", "x", "--length", "8", "--threads", "999999", "--db", "{good_db}", "--data", "{data}"],
     "CPUs, got 999999"),
    (["status", "--watch", "--every", "nan", "--db", "{good_db}"], "--every must be above 0"),
    (["status", "--watch", "--every", "inf", "--db", "{good_db}"], "at most a day"),
    (["queue", "ls", "--db", ""], "--db is empty; name a database"),
    (["sql", "select 1", "--db", " "], "--db is empty"),
    (["queue", "ls", "--db", "{tmp}/" + "a" * 300 + "/r.db"], "File name too long"),
    (["matrix", "show", "{tmp}/" + "a" * 300 + ".toml"], "File name too long"),
    (["queue", "ls", "--db", "{fifo}"], "is not a regular file"),
    (["figure", "coverage", "--layers", "100000", "--out", "{tmp}/cov.png"], "draws at most 128 layers"),
    (["figure", "coverage", "--window", "5000", "--length", "100000", "--out", "{tmp}/cov.png"], "window of 4,096"),
    (["coverage", "--layers", "100000"], "--layers 100000: at most 1,024 layers"),
    (["queue", "rm", "x" * 100_000, "--db", "{good_db}"], "no run named '" + "x" * 59 + "... (100,002 characters)"),
    (["import-study", "{tmp}/nope.db", "--db", "{tmp}/pub.db"], "nope.db: no such file (expected the study's"),
    (["import-study", "{tmp}", "--db", "{tmp}/pub.db"], "is a folder, not a file (expected the study's SQLite"),
    (["import-study", "{good_db}", "--lenextrap", "/dev/null", "--db", "{tmp}/pub.db"],
     "/dev/null is not a regular file (expected the study's lenextrap.json)"),
    # devices torch names but fibctl does not run on, empty values that meant the default
    (["train", "run", "--device", "meta", "--db", "{good_db}", "--data", "{data}", "--runs-dir", "{tmp}/runs"],
     "unknown device 'meta'; use cpu, cuda, cuda:N or auto"),
    (["worker", "--device", "xpu", "--db", "{good_db}", "--data", "{data}", "--runs-dir", "{tmp}/runs"],
     "unknown device 'xpu'"),
    (["eval", "run", "--length", "64", "--device", "", "--db", "{good_db}", "--data", "{data}"],
     "--device is empty"),
    (["bench", "attention", "--length", "8", "--device", "mps"], "unknown device 'mps'"),
    (["worker", "--gpus", "", "--db", "{good_db}", "--data", "{data}", "--runs-dir", "{tmp}/runs"],
     "--gpus is empty"),
    (["worker", "--gpus", "all", "--device", "cpu", "--db", "{good_db}", "--data", "{data}", "--runs-dir",
      "{tmp}/runs"], "--gpus and --device: choose one"),
    (["bench", "attention", "--length", "8", "--threads", "999"], "--threads must be from 1 to this machine's"),
    (["probe", "--db", "{tmp}/p.db", "--depth", "100000"], "--depth 100000 must be from 1 to 1024"),
    (["probe", "--db", "{tmp}/p.db", "--eval-sequences", "1000000000000"], "--eval-sequences 1000000000000 must"),
    (["eval", "run", "--length", "64", "--db", "{good_db}", "--data", "{noheld}"],
     "noheld has no held-out set (its manifest lists only 'train'): give a source of recipe"),
    (["eval", "runn", "--all", "--length", "64", "--db", "{good_db}", "--data", "{data}"],
     "name runs or pass --all, not both (got --all and 'runn')"),
    # no run named is said first: the missing data (or database) had been, which is no use without one
    (["eval", "--length", "64", "--db", "{good_db}", "--data", "{tmp}/nodata"], "name at least one run, or pass --all"),
    (["eval", "--length", "64", "--db", "{tmp}/none.db"], "name at least one run, or pass --all"),
    (["import-study", "", "--db", "{tmp}/pub.db"], "an empty path where the study's SQLite database"),
    (["demo", "--quick", "--out", ""], "--out is empty; name the folder for the demo"),
    # Path('') is the current folder: a worker trained into it
    (["worker", "--runs-dir", "", "--db", "{good_db}", "--data", "{data}"], "--runs-dir is empty; name the folder"),
    (["train", "run", "--runs-dir", " ", "--db", "{good_db}", "--data", "{data}"], "--runs-dir is empty"),
    (["eval", "run", "--length", "64", "--runs-dir", "", "--db", "{good_db}", "--data", "{data}"],
     "--runs-dir is empty"),
    (["queue", "retry", "run", "--from-start", "--runs-dir", "", "--db", "{good_db}"], "--runs-dir is empty"),
    (["queue", "rm", "run", "--checkpoints", "--runs-dir", "", "--db", "{good_db}"], "--runs-dir is empty"),
    # and so is a blank data folder: `no data manifest in  ;` showed no name at all
    (["data", "show", " "], "DATA_DIR is empty; name a prepared data folder"),
    (["data", "prepare", "demo", "--data", ""], "--data is empty; name the prepared data folder"),
    (["worker", "--data", " ", "--db", "{good_db}", "--runs-dir", "{tmp}/runs"], "--data is empty"),
    (["eval", "run", "--length", "64", "--data", "", "--db", "{good_db}"], "--data is empty"),
    # a blank that begins or ends a path is quoted, which it would not show otherwise
    (["data", "show", "{tmp}/nowhere "], "no data manifest in '"),
    (["queue", "add", "demo", "--preset", "", "--db", "{tmp}/new.db"], "unknown preset ''; allowed: paper"),
    # fewer steps than tiny's 30 warm-up steps: the learning rate never reached train.lr
    (["queue", "add", "demo", "--set", "train.steps=20", "--db", "{tmp}/new.db"],
     "run dense: train.warmup_steps = 30 is above train.steps = 20: the learning rate would never reach train.lr"),
    # a suffix of dots or dashes alone queued dense.. beside dense: a name that tells no sweep apart
    (["queue", "add", "demo", "--suffix", "..", "--db", "{tmp}/new.db"],
     "--suffix '..' holds no letter or digit; name the sweep, e.g. --suffix _lr1e-3"),
    (["matrix", "show", "demo", "--preset", ""], "unknown preset ''"),
    # lengths `coverage` refuses, refused by its figure too (it drew a title of T=99999999999)
    (["figure", "coverage", "--length", "99999999999", "--out", "{tmp}/cov.png"], "must be from 2 to 1,048,576"),
    (["figure", "coverage", "--length", "2", "--out", "{tmp}/cov.png"], "window W=8 is too large"),
    # options that would do nothing where they were typed
    (["status", "--every", "3", "--db", "{good_db}"], "--every goes with --watch"),
    (["queue", "retry", "run", "--runs-dir", "{tmp}", "--db", "{good_db}"], "--runs-dir goes with --from-start"),
    (["queue", "rm", "run", "--runs-dir", "{tmp}", "--db", "{good_db}"], "--runs-dir goes with --checkpoints"),
    (["figure", "extrapolation", "--layers", "5", "--db", "{results_db}", "--out", "{tmp}/e.png"],
     "--layers does not apply to the extrapolation figure"),
    (["figure", "coverage", "--run", "foo", "--out", "{tmp}/c.png"], "--run does not apply to the coverage figure"),
    # a value edited by hand that is not of its column's type: a ValueError or TypeError where it was read
    *[([*command, "--db", "{heartbeat_db}"], "runs.heartbeat_at holds 'garbage', not a time")
      for command in (["queue", "ls"], ["queue", "ls", "--json"], ["queue", "show", "dense"],
                      ["queue", "show", "dense", "--json"], ["status"], ["status", "--json"],
                      ["compare", "dense", "fib_fixed_w8"])],
    *[([*command, "--db", "{created_db}"], "runs.created_at holds '2026-13-45 99:99:99', not a time")
      for command in (["queue", "ls"], ["queue", "show", "dense"], ["queue", "show", "dense", "--json"])],
    (["queue", "show", "dense", "--db", "{wall_db}"],
     "runs.wall_seconds holds 'abc', not a number (the database was edited by hand?): correct it where "
     "wall_seconds = 'abc'"),
    (["queue", "show", "fib_fixed_w8", "--db", "{ppl_db}"], "evaluations.ppl holds 'abc', not a number"),
    (["report", "table1", "--db", "{ppl_db}"], "evaluations.ppl holds 'abc', not a number"),
    (["report", "table3", "--db", "{ppl_db}"], "evaluations.ppl holds 'abc', not a number"),
    (["figure", "extrapolation", "--db", "{ppl_db}", "--out", "{tmp}/e.png"], "evaluations.ppl holds 'abc'"),
    *[([*command, "--db", "{final_db}"], "runs.final_step holds 'x', not a whole number")
      for command in (["queue", "show", "dense"], ["queue", "show", "dense", "--json"],
                      ["compare", "dense", "fib_fixed_w8"])],
]


def _digests(root: Path) -> dict[str, str]:
    """Every file's checksum, but for SQLite's shared-memory index and an empty write-ahead log:
    a reader's connection makes those (a test's stay open until it ends), and they hold no data."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith("-shm")
            and not (p.name.endswith("-wal") and p.stat().st_size == 0)}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    paths = build(tmp)
    return tmp, {**paths, "tmp": str(tmp)}


@pytest.mark.parametrize("args, words", CASES, ids=[" ".join(a[:2]) + f" {i}" for i, (a, _) in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_no_traceback_nothing_changed(args, words, inputs, capsys, monkeypatch):
    from fibctl.cli import main
    tmp, paths = inputs
    before = _digests(tmp)
    monkeypatch.chdir(tmp)
    monkeypatch.setattr(sys, "argv", ["fibctl", *(a.format(**paths) for a in args)])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2, out
    assert "Traceback" not in out.err + out.out
    assert len(out.err.strip().splitlines()) == 1 and words in out.err, out.err
    assert "s3cret" not in out.err + out.out  # item 4: passwords are masked
    assert _digests(tmp) == before


def test_the_real_entry_point_prints_no_traceback_either(inputs):
    import subprocess
    tmp, paths = inputs
    chosen = [next(c for c in CASES if c[1] == words)
              for words in ("no fibctl schema", "damaged or not a checkpoint", "driver is not installed")]
    for args, words in chosen:
        proc = subprocess.run([sys.executable, "-m", "fibctl", *(a.format(**paths) for a in args)],
                              capture_output=True, text=True, timeout=120, cwd=tmp)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and words in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- item 9: paths and names


def test_a_database_path_with_url_characters_is_taken_whole(tmp_path, monkeypatch, capsys):
    from fibctl.cli import main
    folder = tmp_path / "a?b#c"
    folder.mkdir()
    db = str(folder / "x.db")
    monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "add", "demo", "--db", db, "--preset", "micro"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0, capsys.readouterr()
    assert sqlite3.connect(db).execute("select count(*) from runs").fetchone() == (3,)
    assert not (tmp_path / "a").exists()


def test_a_refused_foreign_database_is_not_switched_to_wal(tmp_path):
    from fibctl.errors import FibctlError
    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE metrics (x)")
    con.commit()
    con.close()
    with pytest.raises(FibctlError, match="not a fibctl database"):
        connect(str(db))
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone() == ("delete",)


@pytest.mark.parametrize("extra, words", [
    (["--dataset", "nope", "--data", "{data}"], "dataset 'nope' is not in the data manifest"),
    (["--data", "{tmp}/nowhere"], "no data manifest in"),
    (["--data", "{data}", "--runs-dir", "{tmp}"], "does not exist; give the --runs-dir it was trained in"),
])
def test_a_refused_eval_leaves_a_rollback_journal_database_as_it_was(tmp_path, monkeypatch, capsys, extra, words):
    """Refused after the database was opened for writing, eval switched it to WAL mode."""
    from fibctl.cli import main

    db = tmp_path / "results.db"
    shutil.copy(Path(__file__).parents[1] / "results.db.example", db)
    sqlite3.connect(db).execute("PRAGMA journal_mode=delete").fetchone()
    before = db.read_bytes()
    data = write_data(tmp_path / "data")
    monkeypatch.setattr(sys, "argv", ["fibctl", "eval", "dense", "--length", "64", "--db", str(db),
                                      *(a.format(data=data, tmp=tmp_path) for a in extra)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert db.read_bytes() == before and not (tmp_path / "results.db-wal").exists()


def test_a_folder_named_like_a_shipped_matrix_does_not_shadow_it(tmp_path, monkeypatch):
    from fibctl.matrix import load_matrix
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_matrix("demo").source == "fibctl/matrices/demo.toml"


@pytest.mark.parametrize("folder, line", [
    (".", "error: --data .: name the data folder itself (e.g. --data data), not ."),
    ("", "error: --data is empty; name the prepared data folder (fibctl data prepare)"),
])
def test_data_prepare_into_the_current_folder_is_refused_naming_the_option(folder, line, tmp_path, monkeypatch,
                                                                            capsys):
    """`--data .` (or an empty one) has no name to put the lock and work folder beside it
    under: it was refused for holding its own lock file ('..lock')."""
    from fibctl.cli import main
    path = recipe(tmp_path, "r.toml", source='heldout = "g_val"')
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    monkeypatch.setattr(sys, "argv", ["fibctl", "data", "prepare", path, "--data", folder])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip() == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "r.toml"] and not any((tmp_path / "here").iterdir())


# ----------------------------------------------------------------------------- items 4 and 8: what is printed


def test_passwords_are_masked_in_messages_and_kept_off_command_lines(monkeypatch):
    from fibctl.db.engine import shown
    from fibctl.flows import worker
    assert shown("postgresql://fib:s3cret@db.example/fib") == "postgresql://fib:***@db.example/fib"
    assert shown("runs/a?b.db") == "runs/a?b.db"
    started = []

    class Child:
        def __init__(self, args, env, start_new_session):
            started.append((args, env))
            self.pid = 1

        def wait(self):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(worker.subprocess, "Popen", Child)
    assert worker.launch_per_gpu([0, 1], ["--data", "d"], env={"FIBCTL_DB": "postgresql://fib:s3cret@h/fib"}) == 0
    assert all("s3cret" not in " ".join(args) and env["FIBCTL_DB"].endswith("@h/fib") for args, env in started)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in started] == ["0", "1"]


def test_a_password_in_the_urls_query_is_masked_too():
    """libpq takes the password in the query as well (?password=, ?sslpassword= for a key's):
    SQLAlchemy's masking knew only user:password@, and messages printed these in clear."""
    from fibctl.db.engine import has_password, resolve_url, shown

    url = "postgresql+psycopg://fib@db.example/fib?password=s3cret&sslpassword=s3cret2&connect_timeout=5"
    assert shown(url) == ("postgresql+psycopg://fib@db.example/fib?connect_timeout=5&password=***"
                          "&sslpassword=***")
    assert has_password(resolve_url(url)) and not has_password(resolve_url("postgresql://fib@db.example/fib"))
    assert shown("postgresql://fib:s3cret@h/fib?password=s3cret") == "postgresql://fib:***@h/fib?password=***"


def test_a_blank_data_folder_from_the_environment_is_named_as_such(monkeypatch, capsys, tmp_path):
    """`FIBCTL_DATA=' ' fibctl data show` said `no data manifest in  ; run ... --data  `."""
    from fibctl.cli import main
    from fibctl.errors import shown_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FIBCTL_DATA", " ")
    monkeypatch.setattr(sys, "argv", ["fibctl", "data", "show"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == "error: DATA_DIR is empty; name a prepared data folder\n"
    assert [shown_path(p) for p in ("data ", "", " x", "a b", "a\nb")] == ["'data '", "''", "' x'", "a b", "a\\nb"]
    assert list(tmp_path.iterdir()) == []


def test_markup_in_input_and_data_is_printed_as_it_is(tmp_path, capsys, monkeypatch):
    from fibctl.cli import common, main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["fibctl", *args])
        with pytest.raises(SystemExit) as exit_:
            main()
        return exit_.value.code, capsys.readouterr()

    code, out = run("data", "show", "[/]")
    assert code == 2 and "no data manifest in [/]" in out.err
    (tmp_path / "m.toml").write_text("[matrix]\ndescription = 'none'\n")
    code, out = run("matrix", "show", str(tmp_path / "m.toml"))
    assert code == 2 and "no [[runs]] entries" in out.err, out.err
    monkeypatch.setattr(common.console, "_width", 300)  # the whole error on one table line
    db = tmp_path / "r.db"
    engine = queued_db(db, micro_run("run"))
    with engine.begin() as conn:
        conn.exec_driver_sql("update runs set status = 'failed', error = '[bold red]boom[/bold red] in [[runs]]'")
    code, out = run("queue", "ls", "--db", str(db))
    assert code == 0 and "[bold red]boom[/bold red] in [[runs]]" in out.out


def test_a_damaged_checkpoint_quotes_the_readers_words_whole(tmp_path):
    """torch's first line is quoted up to 160 characters, cut at a word with ' ...' (it was cut
    mid-word)."""
    from fibctl.errors import FibctlError
    from fibctl.train.checkpoint import load_checkpoint
    path = tmp_path / "step_00000010.pt"
    path.write_bytes(b"PK\x03\x04\x14\x00\x00\x00\x08\x00")
    with pytest.raises(FibctlError) as e:
        load_checkpoint(path)
    quoted = str(e.value).split(" (", 1)[1].removesuffix(")").split(": ", 1)[1]
    try:
        torch.load(path, weights_only=True)
    except Exception as raw:
        first = str(raw).strip().splitlines()[0]
    assert len(quoted) <= 160
    assert quoted == first or (quoted.endswith(" ...") and first.startswith(quoted.removesuffix(" ...") + " "))
