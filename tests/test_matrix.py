"""Run matrices: the shipped paper and demo matrices, presets, and malformed files."""

from __future__ import annotations

import re

import pytest

from fibctl.errors import FibctlError
from fibctl.matrix import load_matrix, shipped_matrices
from fibctl.db.store import run_row

# The paper matrix (docs/method.md, "The run matrix"), written out: name -> (base, schedule, W, seed)
PAPER = {
    "f01__fib_learned_w6": ("fib", "learned", 6, 42), "f02__fib_learned_w8": ("fib", "learned", 8, 42),
    "f03__fib_learned_w10": ("fib", "learned", 10, 42), "f04__fib_learned_w12": ("fib", "learned", 12, 42),
    "f05__fib_fixed_w6": ("fib", "fixed", 6, 42), "f06__fib_fixed_w8": ("fib", "fixed", 8, 42),
    "f07__fib_fixed_w10": ("fib", "fixed", 10, 42), "f08__fib_fixed_w12": ("fib", "fixed", 12, 42),
    "f09__logsparse_w8": ("pow2", "fixed", 8, 42),
    "f10__fib_stagger_w6": ("fib", "stagger", 6, 42), "f11__fib_stagger_w8": ("fib", "stagger", 8, 42),
    "f12__fib_stagger_w10": ("fib", "stagger", 10, 42), "f13__fib_stagger_w12": ("fib", "stagger", 12, 42),
    "f14__fib_hdc_w6": ("fib", "coprime", 6, 42), "f15__fib_hdc_w8": ("fib", "coprime", 8, 42),
    "f16__fib_hdc_w10": ("fib", "coprime", 10, 42), "f17__fib_hdc_w12": ("fib", "coprime", 12, 42),
    "f18__logsparse_stagger_w6": ("pow2", "stagger", 6, 42),
    "f19__logsparse_stagger_w8": ("pow2", "stagger", 8, 42),
    "f20__logsparse_stagger_w10": ("pow2", "stagger", 10, 42),
    "f21__logsparse_stagger_w12": ("pow2", "stagger", 12, 42),
    "g01__fib_fixed_w12_s43": ("fib", "fixed", 12, 43), "g02__fib_learned_w12_s43": ("fib", "learned", 12, 43),
    "g03__fib_stagger_w12_s43": ("fib", "stagger", 12, 43), "g04__fib_hdc_w12_s43": ("fib", "coprime", 12, 43),
    "g05__logsparse_stagger_w12_s43": ("pow2", "stagger", 12, 43),
    "h01__fib_fixed_w12_s44": ("fib", "fixed", 12, 44), "h02__fib_stagger_w12_s44": ("fib", "stagger", 12, 44),
    "h03__fib_hdc_w12_s44": ("fib", "coprime", 12, 44),
    "h04__logsparse_stagger_w12_s44": ("pow2", "stagger", 12, 44),
    "ref_e0000": (None, "dense", None, 42),
}


def test_paper_matrix_is_the_studys():
    configs = load_matrix("paper").resolve()
    rows = {r["name"]: (r["base"], r["schedule"], r["window"], r["seed"]) for r in map(run_row, configs)}
    assert rows == PAPER
    assert len(configs) == 31
    assert {c.preset for c in configs} == {"paper"} and {c.matrix for c in configs} == {"paper"}
    assert all(c.model.seq_len == 1024 and c.model.n_layers == 16 for c in configs)
    assert len({c.config_hash for c in configs}) == 31  # every run trains something different


def test_dense_run_has_no_base_or_window_in_the_runs_table():
    (dense,) = load_matrix("paper").resolve(only="ref_*")
    assert (dense.model.schedule, dense.model.base, dense.model.window) == ("dense", "fib", 0)
    row = run_row(dense)
    assert (row["base"], row["window"], row["train_length"]) == (None, None, 1024)


def test_demo_matrix_trains_tiny_models():
    configs = load_matrix("demo").resolve()
    assert [(c.name, c.model.schedule, c.model.window) for c in configs] == [
        ("dense", "dense", 0), ("fib_fixed_w8", "fixed", 8), ("fib_stagger_w8", "stagger", 8)]
    assert {c.preset for c in configs} == {"tiny"}
    assert set(shipped_matrices()) >= {"paper", "demo"}


def test_preset_override_and_only_glob():
    configs = load_matrix("paper").resolve(preset="micro", only="g*")
    assert [c.name for c in configs] == [n for n in PAPER if n.startswith("g")]
    assert {(c.preset, c.model.seq_len) for c in configs} == {("micro", 64)}
    with pytest.raises(FibctlError, match="matches no run"):
        load_matrix("paper").resolve(only="zzz*")


def test_matrix_file_by_path_with_train_overrides(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "stagger"\nwindow = 4\n'
                    'base = "pow2"\nseed = 7\ntrain = { steps = 3 }\n')
    (cfg,) = load_matrix(str(path)).resolve()
    assert (cfg.name, cfg.matrix, cfg.model.base, cfg.model.window, cfg.seed, cfg.train.steps) == (
        "a", "mine", "pow2", 4, 7, 3)


def test_unknown_matrix_names_the_shipped_ones():
    with pytest.raises(FibctlError, match="unknown matrix 'nosuch'.*demo, paper"):
        load_matrix("nosuch")


@pytest.mark.parametrize("body, problem", [
    ("[[runs]\nname = 'a'", "not valid TOML"),
    ("[matrix]\npreset = 'micro'\n", "no \\[\\[runs\\]\\] entries"),
    ("[[runs]]\nname = 'a'\nschedule = 'fixed'\nwindow = 8\ncolour = 'red'\n", "unknown key.*colour"),
    ("[[runs]]\nname = 'a'\nschedule = 'fixed'\n", "needs a `window`"),
    ("[[runs]]\nname = 'a'\nschedule = 'dense'\nwindow = 8\n", "dense run has no base or window"),
    ("[[runs]]\nname = 'a'\nschedule = 'fixed'\nwindow = 'eight'\n", "`window` must be an integer"),
    ("[[runs]]\nname = 'a'\nschedule = 'sideways'\nwindow = 8\n", "unknown schedule 'sideways'"),
    ("[[runs]]\nname = 'a'\nschedule = 'zzz'\n", "unknown schedule 'zzz'; allowed: dense, "),  # not "needs a window"
    ("[[runs]]\nname = 'a'\nschedule = 'fixed'\nwindow = 8\n[[runs]]\nname = 'a'\nschedule = 'dense'\n",
     "duplicate run name.*a"),
    ("[matrix]\npreset = 'huge'\n[[runs]]\nname = 'a'\nschedule = 'dense'\n", "unknown preset 'huge'"),
    ("[[runs]]\nname = 'a b'\nschedule = 'dense'\n", "run names use"),
    ("[[runs]]\nname = 'a'\nschedule = 'dense'\ntrain = { stepz = 3 }\n", "unknown key.*stepz"),
    ("x = " + "[" * 50_000 + "]" * 50_000, "not valid TOML \\(it nests its values too deeply\\)"),  # a RecursionError
])
def test_malformed_matrix_file_names_file_and_problem(tmp_path, body, problem):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(FibctlError, match=f"matrix file {re.escape(str(path))}: .*{problem}"):
        load_matrix(str(path))


def test_a_sweep_from_the_command_line_sets_training_settings_and_names_new_runs(tmp_path, monkeypatch, capsys):
    """`queue add demo --only dense --set train.lr=1e-3 --suffix _lr1e-3`: the demo's dense run
    at that learning rate, as a run of its own beside the demo's."""
    import json
    import sqlite3
    import sys

    from fibctl.cli import main

    def fibctl(*args):
        monkeypatch.setattr(sys, "argv", ["fibctl", *args, "--db", str(tmp_path / "r.db")])
        with pytest.raises(SystemExit) as done:
            main()
        return done.value.code, capsys.readouterr()

    code, out = fibctl("queue", "add", "demo", "--only", "dense", "--set", "train.lr=1e-3", "--set",
                       "train.steps=200", "--set", "train.optimizer=adamw", "--suffix", "_lr1e-3")
    assert code == 0 and "queued 1 run(s)" in out.out, out.err
    name, config = sqlite3.connect(tmp_path / "r.db").execute("SELECT name, config_json FROM runs").fetchone()
    train = json.loads(config)["train"]
    assert name == "dense_lr1e-3" and (train["lr"], train["steps"], train["optimizer"]) == (1e-3, 200, "adamw")
    demo = {c.name: c for c in load_matrix("demo").resolve()}
    assert {k: v for k, v in train.items() if k not in ("lr", "steps", "optimizer")} == \
        {k: v for k, v in demo["dense"].to_dict()["train"].items() if k not in ("lr", "steps", "optimizer")}
    for args, line in [
        (["--set", "train.lr=abc"], "error: run dense: train.lr = 'abc' must be a finite number"),
        (["--set", "lr=1"], "error: --set 'lr=1': give train.KEY=VALUE, KEY one of batch_size,"),
        (["--set", "train.bogus=1"], "error: --set 'train.bogus=1': give train.KEY=VALUE"),
        # nanoGPT's spelling, or a typo: the setting meant is named
        (["--set", "lr=1e-3"], "warmup_steps, weight_decay; did you mean train.lr=1e-3?"),
        (["--set", "train.stpes=9"], "; did you mean train.steps=9?"),
        (["--set", "train.lr=[1]"], "error: --set 'train.lr=[1]': the value must be a number, true/false or a "
                                    "string"),
        (["--suffix", "/x"], "error: run name 'dense/x' is not allowed"),
        (["--set", "train.lr=1e-2", "--suffix", "_lr1e-3"],
         "error: already queued with a different config: dense_lr1e-3 differs in train.lr"),
    ]:
        code, out = fibctl("queue", "add", "demo", "--only", "dense", *args)
        said = out.err.rstrip("\n")  # where the line is said: its start, or (a hint) its end
        assert code == 2 and (said.startswith(line) or said.endswith(line)) and len(out.err.splitlines()) == 1, out.err
    assert sqlite3.connect(tmp_path / "r.db").execute("SELECT count(*) FROM runs").fetchone() == (1,)


def test_the_line_that_queues_a_run_again_keeps_its_settings(tmp_path, monkeypatch, capsys):
    """A diverged run's hint said `fibctl queue add MATRIX --only NAME --set train.lr=LOWER`: for
    a sweep's run (dense_boom, queued with --preset micro --set train.steps=40 --suffix _boom)
    --only matched no run of the matrix, and the preset and steps were lost. The line for a
    shipped matrix's run, run as given, queues its config again with only the lr changed."""
    import json
    import shlex
    import sqlite3
    import sys

    from fibctl.cli import main
    from fibctl.matrix import queue_again

    [boom] = load_matrix("demo").resolve("micro", "dense", {"lr": 1e4, "steps": 40, "optimizer": "adamw"}, "_boom")
    line = queue_again(boom, "_lowlr", lr="1e-4")
    assert line == ("fibctl queue add demo --only dense --preset micro --set train.steps=40 --set train.lr=1e-4 "
                    "--suffix _boom_lowlr")  # optimizer: the micro preset's own
    monkeypatch.setattr(sys, "argv", [*shlex.split(line), "--db", str(tmp_path / "r.db")])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0, capsys.readouterr()
    name, config = sqlite3.connect(tmp_path / "r.db").execute("SELECT name, config_json FROM runs").fetchone()
    again = json.loads(config)
    assert name == "dense_boom_lowlr" and again["train"] == {**boom.to_dict()["train"], "lr": 1e-4}
    assert {k: v for k, v in again.items() if k not in ("name", "train")} == \
        {k: v for k, v in boom.to_dict().items() if k not in ("name", "train")}
    # a run of a matrix file (not known here): the template, with the run's name
    [own] = load_matrix("demo").resolve(None, "dense")
    own = own.__class__(**{**own.__dict__, "matrix": "mine"})
    assert queue_again(own, "_lowlr", lr="LOWER") == \
        "fibctl queue add MATRIX --only dense --set train.lr=LOWER --suffix _lowlr"
