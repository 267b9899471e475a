"""Run matrices: the shipped paper and demo matrices, presets, and malformed files."""

from __future__ import annotations

import re

import pytest

from fibctl.errors import FibctlError
from fibctl.matrix import load_matrix, shipped_matrices
from fibctl.db.store import run_row

from cli_helpers import ran

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
                    'base = "pow2"\nseed = 7\ntrain = { steps = 3, warmup_steps = 3 }\n')
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
    # int()'s ValueError past 4,300 digits, a traceback
    ("[[runs]]\nname = 'a'\nschedule = 'fixed'\nwindow = " + "9" * 5000,
     "not valid TOML \\(it holds an integer of too many digits to read\\)"),
])
def test_malformed_matrix_file_names_file_and_problem(tmp_path, body, problem):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(FibctlError, match=f"matrix file {re.escape(str(path))}: .*{problem}"):
        load_matrix(str(path))


def test_a_matrix_file_is_read_as_utf8_with_or_without_a_byte_order_mark(tmp_path):
    """A byte-order mark (some editors save one) was "not valid TOML (Invalid statement (at line
    1, column 1))", though recipes took it; a byte that is not UTF-8 is named by its offset."""
    text = "[matrix]\npreset = 'micro'\n[[runs]]\nname = 'a'\nschedule = 'dense'\n"
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert [c.name for c in load_matrix(str(tmp_path / "bom.toml")).resolve()] == ["a"]
    (tmp_path / "latin1.toml").write_bytes(b"[matrix]\ndescription = 'caf\xe9'\n")
    with pytest.raises(FibctlError, match=f"cannot read matrix file {re.escape(str(tmp_path / 'latin1.toml'))}: "
                                          "byte 0xe9 at offset 27 is not UTF-8; save it as UTF-8$"):
        load_matrix(str(tmp_path / "latin1.toml"))


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
        # a value the TOML parser failed on with a traceback (RecursionError, int()'s ValueError)
        (["--set", "train.steps=" + "[" * 5000 + "]" * 5000], "it nests its values too deeply"),
        (["--set", "train.steps=" + "9" * 5000], "it holds an integer of too many digits to read"),
        # a line break in the value: its first line was set, the rest dropped without a word
        (["--set", "train.lr=1e-3\ntrain.steps=5"],
         "error: --set 'train.lr=1e-3\\ntrain.steps=5': the value must be one TOML value, on one line"),
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


SEEDED = "[matrix]\npreset = 'micro'\n{head}\n[[runs]]\nname = 'a'\nschedule = 'fixed'\nwindow = 4\n{run}"


@pytest.mark.parametrize("head, run, init_seed", [
    ("", "", 43),  # no init_seed anywhere: the run's seed draws its weights too
    ("init_seed = 5", "", 5),  # the matrix's, as in `paper`: the replicates differ in their data alone
    ("init_seed = 5", "init_seed = 9\n", 9),  # the run's own
])
def test_seed_resolves_each_run_as_a_matrix_files_seed_would(tmp_path, head, run, init_seed):
    """`queue add --seed 43` gives each run the config a matrix file with `seed = 43` in that
    run gives it: the data seed 43, the init seed as that file's would be."""
    mine, theirs = tmp_path / "mine.toml", tmp_path / "their" / "mine.toml"
    mine.write_text(SEEDED.format(head=head, run=run))
    theirs.parent.mkdir()
    theirs.write_text(SEEDED.format(head=head, run=run + "seed = 43\n"))
    [seeded] = load_matrix(str(mine)).resolve(seeds=[43])
    [written] = load_matrix(str(theirs)).resolve()
    assert (seeded.name, seeded.seed, seeded.data_seed, seeded.init_seed) == ("a_s43", 43, 43, init_seed)
    assert seeded.config_hash == written.config_hash and seeded.to_dict() == {**written.to_dict(), "name": "a_s43"}


def test_queue_add_seed_queues_replicates_under_distinct_names(tmp_path, monkeypatch, capsys):
    """`--seed` takes the seeds the matrix file's [[runs]] seed does, into the runs table;
    at a run's own seed it is that run (queued once), at another its name ends with _s<seed>
    (before --suffix), so that replicates never share a name."""
    import sqlite3

    db = str(tmp_path / "r.db")
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "demo", "--only", "dense", "--seed", "42",
                             "--seed", "43", "--seed", "43", "--seed", "4294967295", "--db", db)
    assert code == 0 and "queued 3 run(s); 0 already present" in out, err
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "demo", "--only", "dense", "--db", db)
    assert code == 0 and "queued 0 run(s); 1 already present" in out, err  # the matrix's own dense
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "paper", "--only", "f13*", "--preset", "micro",
                             "--seed", "44", "--suffix", "_lr1e-3", "--set", "train.lr=1e-3", "--db", db)
    assert code == 0 and "queued 1 run(s)" in out, err
    rows = sqlite3.connect(db).execute("SELECT name, seed, data_seed, init_seed FROM runs ORDER BY id").fetchall()
    assert rows == [("dense", 42, 42, 42), ("dense_s43", 43, 43, 43), ("dense_s4294967295",) + (2**32 - 1,) * 3,
                    ("f13__fib_stagger_w12_s44_lr1e-3", 44, 44, 42)]  # paper keeps init_seed 42
    # the preview shows the names and seeds queue add would queue
    code, out, _ = ran(monkeypatch, capsys, "matrix", "show", "demo", "--only", "dense", "--seed", "43")
    assert code == 0 and "dense_s43" in out and " 43 " in out
    with pytest.raises(FibctlError, match="--seed: runs f04__fib_learned_w12_s43 and g02__fib_learned_w12_s43 "
                                          "would train one config; pick the runs with --only"):
        load_matrix("paper").resolve(seeds=[43])  # its seed-42 runs re-seeded are its replicates
    clash = tmp_path / "clash.toml"
    clash.write_text("[[runs]]\nname = 'a'\nschedule = 'dense'\n[[runs]]\nname = 'a_s43'\nschedule = 'dense'\n"
                     "seed = 43\ntrain = { steps = 9, warmup_steps = 9 }\n")
    with pytest.raises(FibctlError, match="--seed: duplicate run name.*a_s43; pick the runs with --only"):
        load_matrix(str(clash)).resolve(seeds=[43])


def test_seed_replaces_a_names_own_seed_suffix(tmp_path, monkeypatch, capsys):
    """paper's g01__fib_fixed_w12_s43 (seed 43) at --seed 45 was g01__fib_fixed_w12_s43_s45:
    a name ending in `_s<its own seed>` has that suffix replaced, in `queue add` and
    `matrix show` alike; a name whose `_sN` is not its seed keeps it."""
    import sqlite3

    from fibctl.matrix import queue_again

    runs = load_matrix("paper").resolve("micro", "g01*", seeds=[42, 45])
    assert [(c.name, c.seed) for c in runs] == [("g01__fib_fixed_w12_s42", 42), ("g01__fib_fixed_w12_s45", 45)]
    mine = tmp_path / "mine.toml"
    mine.write_text("[matrix]\npreset = 'micro'\n[[runs]]\nname = 'a_s7'\nschedule = 'dense'\n")
    assert [c.name for c in load_matrix(str(mine)).resolve(seeds=[43])] == ["a_s7_s43"]  # seed 42's run
    options = ["paper", "--preset", "micro", "--only", "g01*", "--seed", "45", "--suffix", "_x"]
    monkeypatch.setenv("COLUMNS", "200")
    code, shown, err = ran(monkeypatch, capsys, "matrix", "show", *options)
    assert code == 0 and "g01__fib_fixed_w12_s45_x " in shown and "_s43" not in shown, err
    db = tmp_path / "r.db"
    assert ran(monkeypatch, capsys, "queue", "add", *options, "--db", str(db))[0] == 0
    assert sqlite3.connect(db).execute("SELECT name, seed FROM runs").fetchall() == [("g01__fib_fixed_w12_s45_x", 45)]
    # the line that queues it again names its entry and seed, the suffix after the seed's
    [run] = load_matrix("paper").resolve("micro", "g01*", suffix="_x", seeds=[45])
    assert queue_again(run, "_y") == ("fibctl queue add paper --only g01__fib_fixed_w12_s43 --seed 45 "
                                      "--preset micro --suffix _x_y")


def test_matrix_show_previews_a_sweep_as_queue_add_would_queue_it(tmp_path, monkeypatch, capsys):
    """`matrix show` took --only and --seed but not --set or --suffix, so a sweep could not be
    seen before it was queued. With the same options it names the runs, their lr and the
    config hashes that `queue add` stores."""
    import sqlite3

    options = ["demo", "--preset", "micro", "--set", "train.lr=1e-3", "--suffix", "_lr1e-3", "--seed", "43"]
    monkeypatch.setenv("COLUMNS", "200")
    code, shown, err = ran(monkeypatch, capsys, "matrix", "show", *options)
    assert code == 0, err
    code, out, err = ran(monkeypatch, capsys, "queue", "add", *options, "--db", str(tmp_path / "r.db"))
    assert code == 0, err
    queued = sqlite3.connect(tmp_path / "r.db").execute("SELECT name, config_hash FROM runs").fetchall()
    assert len(queued) == 3  # the demo's three runs at seed 43
    for name, config_hash in queued:
        assert re.search(rf"│ {re.escape(name)} +│.*│ +0\.001 │ {config_hash} │", shown), (name, shown)
    assert "dense_s43_lr1e-3" in shown


def test_queue_add_seed_refuses_a_run_whose_config_another_name_holds(tmp_path, monkeypatch, capsys):
    """`paper --only 'f*' --seed 43` after `paper`: f08's seed-43 run is the matrix's g01, which
    would be trained twice, and Table 5 refuses two runs of one cell."""
    import sqlite3

    from cli_helpers import refused

    db = str(tmp_path / "r.db")
    micro = ["--preset", "micro", "--db", db]
    assert ran(monkeypatch, capsys, "queue", "add", "paper", "--only", "g01*", *micro)[0] == 0
    line = refused(monkeypatch, capsys, "queue", "add", "paper", "--only", "f0[68]*", "--seed", "43", *micro)
    assert line.strip() == ("error: --seed: run 'f08__fib_fixed_w12_s43' would train the config of run "
                            "'g01__fib_fixed_w12_s43', already queued; pick the runs with --only")
    assert sqlite3.connect(db).execute("SELECT name FROM runs").fetchall() == [("g01__fib_fixed_w12_s43",)]
    # the same runs queued again are present, not a clash
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "paper", "--only", "f06*", "--seed", "43", *micro)
    assert code == 0 and "queued 1 run(s)" in out, err
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "paper", "--only", "f06*", "--seed", "43", *micro)
    assert code == 0 and "queued 0 run(s); 1 already present" in out, err


@pytest.mark.parametrize("seed, line", [
    ("-1", "error: --seed = -1 must be an integer from 0 to 2**32 - 1"),
    ("4294967296", "error: --seed = 4294967296 must be an integer from 0 to 2**32 - 1"),
    ("x", "error: Invalid value for '--seed'"),
    ("4.5", "error: Invalid value for '--seed'"),
])
def test_a_seed_out_of_range_or_not_a_number_is_one_line(tmp_path, monkeypatch, capsys, seed, line):
    from cli_helpers import refused

    for command in (["queue", "add", "demo", "--db", str(tmp_path / "r.db")], ["matrix", "show", "demo"]):
        assert refused(monkeypatch, capsys, *command, "--seed", "43", f"--seed={seed}").startswith(line)
    assert not (tmp_path / "r.db").exists()


def test_the_line_that_queues_a_run_again_keeps_its_seed(tmp_path, monkeypatch, capsys):
    """A replicate queued with --seed 43 (dense_s43_boom): the line that queues it again at a
    lower lr says --seed 43, and run as given queues seed 43 with only the lr changed."""
    import json
    import shlex
    import sqlite3

    from fibctl.matrix import queue_again

    [boom] = load_matrix("demo").resolve("micro", "dense", {"steps": 40}, "_boom", seeds=[43])
    line = queue_again(boom, "_lowlr", lr="1e-4")
    assert line == ("fibctl queue add demo --only dense --seed 43 --preset micro --set train.steps=40 "
                    "--set train.lr=1e-4 --suffix _boom_lowlr")
    code, _, err = ran(monkeypatch, capsys, *shlex.split(line)[1:], "--db", str(tmp_path / "r.db"))
    assert code == 0, err
    name, config = sqlite3.connect(tmp_path / "r.db").execute("SELECT name, config_json FROM runs").fetchone()
    again = json.loads(config)
    assert name == "dense_s43_boom_lowlr" and again == {**boom.to_dict(), "name": name,
                                                         "train": {**boom.to_dict()["train"], "lr": 1e-4}}
    # a matrix file's run (its entry not known here): the template keeps the seed too
    mine = boom.__class__(**{**boom.__dict__, "matrix": "mine"})
    assert queue_again(mine, "_lowlr", lr="LOWER") == \
        "fibctl queue add MATRIX --only dense_s43_boom --seed 43 --set train.lr=LOWER --suffix _lowlr"


def test_report_table5_reads_replicates_queued_with_seed(tmp_path, monkeypatch, capsys):
    """The way table5's refusal names: `queue add --seed`, trained by a worker, is Table 5."""
    from train_helpers import write_data

    db, data = str(tmp_path / "r.db"), str(write_data(tmp_path / "data"))
    code, _, err = ran(monkeypatch, capsys, "queue", "add", "demo", "--preset", "micro", "--only", "fib_*",
                           "--set", "train.steps=3", "--set", "train.warmup_steps=1", "--seed", "42", "--seed",
                           "43", "--db", db)
    assert code == 0, err
    code, out, err = ran(monkeypatch, capsys, "worker", "--db", db, "--data", data, "--runs-dir",
                             str(tmp_path / "runs"), "--device", "cpu", "--threads", "1", "--plain")
    assert code == 0 and "4 run(s)" in out, out + err
    code, out, err = ran(monkeypatch, capsys, "report", "table5", "--window", "8", "--format", "csv",
                             "--db", db)
    assert code == 0, err
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(out)))
    assert sorted(r["Schedule"] for r in rows) == ["fixed", "stagger"], out
    assert all(float(r["seed 42"]) > 0 and float(r["seed 43"]) > 0 and r["Varied"] == "init + data" for r in rows)
