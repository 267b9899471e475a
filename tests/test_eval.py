"""Evaluation at any length: perplexity, per-position loss, speed; idempotent rows."""

from __future__ import annotations

import math
import sqlite3
import sys

import pytest
import torch
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.config import SCHEDULES
from fibctl.flows.evaluation import evaluate
from fibctl.flows.worker import WorkerOptions, work
from fibctl.hashes import file_hash
from train_helpers import HELDOUT, micro_run, queued_db, write_data

torch.set_num_threads(1)
SHORT = dict(steps=10, eval_interval=10, checkpoint_interval=10)


class Quiet:
    def start(self, name, steps):
        return lambda p: None

    def warn(self, message):
        pass

    note = warn

    def finish(self, outcome):
        assert outcome.status == "done", outcome


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short `micro` run per schedule, plus one never trained."""
    root = tmp_path_factory.mktemp("eval")
    data = write_data(root / "data")
    engine = queued_db(root / "r.db", *(micro_run(s, s, **SHORT) for s in SCHEDULES))
    work(engine, WorkerOptions(data_dir=data, runs_dir=root / "runs"), Quiet())
    queued_db(root / "r.db", micro_run("untrained", **SHORT))
    return engine, data, root / "r.db"


def rows(db, sql):
    return sqlite3.connect(db).execute(sql).fetchall()


def test_eval_at_the_training_length_equals_the_training_time_evaluation(trained):
    engine, data, db = trained
    during = rows(db, "select dataset, tokens, loss from evaluations e join runs r on r.id = e.run_id "
                      "where r.name = 'learned' and step = 10 and eval_length = 64 order by dataset")
    positions = rows(db, "select count(*), sum(mean_loss) from position_losses p join runs r on r.id = p.run_id "
                         "where r.name = 'learned' and eval_length = 64")
    df = evaluate(engine, ["learned"], [64], data_dir=data, positions=True)
    assert sorted(zip(df.dataset, df.tokens, df.loss)) == during
    assert len(during) == len(HELDOUT) and during[0][1] == 64 * 64
    assert rows(db, "select count(*), sum(mean_loss) from position_losses p join runs r on r.id = p.run_id "
                    "where r.name = 'learned' and eval_length = 64") == positions
    assert positions[0][0] == 63 * len(HELDOUT)


def test_every_schedule_evaluates_at_four_times_the_training_length(trained):
    engine, data, db = trained
    df = evaluate(engine, list(SCHEDULES), [256], data_dir=data, datasets=["math_val"], tokens=2048)
    assert list(df.run) == list(SCHEDULES)
    assert set(df.tokens) == {8 * 256}  # the same 2048-token budget: 8 windows of 256 targets
    assert all(math.isfinite(p) and 1 < p < 2 * 512 for p in df.ppl)
    assert rows(db, "select count(*) from evaluations where eval_length = 256 and step = 10") == [(5,)]


def test_a_length_a_set_or_a_run_given_twice_is_measured_once(trained):
    engine, data, _ = trained
    df = evaluate(engine, ["fixed", "fixed"], [96, 96], data_dir=data, datasets=["math_val", "math_val"], tokens=960)
    assert list(zip(df.run, df.eval_length, df.dataset)) == [("fixed", 96, "math_val")]


def test_rerunning_the_command_replaces_rows_instead_of_duplicating_them(trained):
    engine, data, db = trained
    args = ["eval", "fixed", "dense", "--length", "64", "--length", "128", "--positions", "--speed",
            "--db", str(db), "--data", str(data), "--tokens", "4096"]  # the budget training recorded at 64
    counts = "select (select count(*) from evaluations), (select count(*) from position_losses), " \
             "(select count(*) from aux_metrics)"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "fixed" in result.output and "ppl" in result.output
    first = rows(db, counts)
    # --speed shows what it recorded: a row per run and length, with its tokens/s
    # and the slowest and fastest of its timed passes
    recorded = rows(db, "select r.name, a.name, a.value, lo.value, hi.value from aux_metrics a "
                        "join runs r on r.id = a.run_id "
                        "join aux_metrics lo on (lo.run_id, lo.name, lo.metric) = (a.run_id, a.name, 'tokens_per_s_min') "
                        "join aux_metrics hi on (hi.run_id, hi.name, hi.metric) = (a.run_id, a.name, 'tokens_per_s_max') "
                        "where a.metric = 'tokens_per_s' order by r.name, a.name")
    shown = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.output.splitlines()]
    assert len(recorded) == 4 and "tokens/s" in result.output
    for run, metric, value, slowest, fastest in recorded:
        assert slowest <= fastest
        assert [run, "10", metric.removeprefix("speed@"), "8", f"{value:,.0f}",
                f"{slowest:,.0f}-{fastest:,.0f}"] in shown, result.output
    assert CliRunner().invoke(app, args).exit_code == 0
    assert rows(db, counts) == first
    speed = rows(db, "select a.name, metric, value from aux_metrics a join runs r on r.id = a.run_id "
                     "where r.name = 'dense' order by a.name, metric")
    assert [(n, m) for n, m, _ in speed] == [
        (f"speed@{length}", metric) for length in (128, 64)
        for metric in ("batch", "latency_s", "tokens_per_s", "tokens_per_s_max", "tokens_per_s_min")]
    assert all(v > 0 for _, _, v in speed)
    assert rows(db, "select count(*) from position_losses p join runs r on r.id = p.run_id "
                    "where r.name = 'dense' and eval_length = 128") == [(127 * len(HELDOUT),)]


@pytest.mark.parametrize("args, message", [
    (["untrained", "--length", "64"], "run 'untrained' has no checkpoint yet"),
    (["nope", "--length", "64"], "no run named 'nope'"),
    (["fixed", "--length", "1"], "evaluation length 1 is below 2"),
    (["fixed", "--length", "64", "--dataset", "wiki_val"], "dataset 'wiki_val' is not in the data manifest"),
    # it said "no window ... fits in a budget of 8,192 tokens", naming neither the set nor the run
    (["fixed", "--length", "64", "--length", "8192"], "held-out set 'stories_val' holds 8,192 tokens, too few for "
                                                       "one window of 8,192 and its next token: evaluate it at "
                                                       "lengths up to 8,191"),
])
def test_bad_input_is_one_line_exit_2(trained, args, message, capsys, monkeypatch):
    from fibctl.cli import main
    _, data, db = trained
    before = rows(db, "select count(*) from evaluations")
    monkeypatch.setattr(sys, "argv", ["fibctl", "eval", *args, "--db", str(db), "--data", str(data)])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert rows(db, "select count(*) from evaluations") == before


def test_eval_refuses_a_checkpoint_of_another_config(trained, tmp_path):
    """A runs folder reused by a run of another config: eval names both hashes, writes nothing."""
    import json

    from fibctl.db.engine import connect
    from fibctl.errors import FibctlError

    engine, data, db = trained
    copy = tmp_path / "copy.db"
    con = sqlite3.connect(copy)
    sqlite3.connect(db).backup(con)  # the WAL's pages included
    config = json.loads(con.execute("select config_json from runs where name = 'fixed'").fetchone()[0])
    config["data_seed"] = 7  # the same name queued again with another seed
    con.execute("update runs set config_json = ?, config_hash = 'other' where name = 'fixed'", (json.dumps(config),))
    con.commit()
    before = con.execute("select count(*) from evaluations").fetchone()
    con.close()
    with pytest.raises(FibctlError, match="has config hash .* it is another run's"):
        evaluate(connect(str(copy)), ["fixed"], [128], data_dir=data)
    assert sqlite3.connect(copy).execute("select count(*) from evaluations").fetchone() == before


def test_the_runs_data_is_known_by_its_content_not_by_where_it_was_prepared(tmp_path):
    """A copy of the data (prepared again from the corpus moved to a cluster's disk, or
    touched: paths and times, so another inputs hash) evaluates and resumes the run trained
    on the original; streams of other tokens under the same names are refused. A checkpoint
    written before runs recorded the content hash holds the inputs hash, still accepted."""
    import json
    import shutil

    import numpy as np

    from fibctl.data.streams import load_manifest
    from fibctl.errors import FibctlError
    from fibctl.train import checkpoint as ckpt

    data = write_data(tmp_path / "data", hashed=True)
    engine = queued_db(tmp_path / "r.db", micro_run("fixed", **SHORT))
    work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs"), Quiet())
    original = load_manifest(data)
    assert rows(tmp_path / "r.db", "select data_hash from runs") == [(original.data_hash,)]
    assert original.data_hash != original.inputs_hash

    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "inputs_hash": "1" * 16}))
    assert load_manifest(copy).data_hash == original.data_hash
    assert len(evaluate(engine, ["fixed"], [64], data_dir=copy)) == len(HELDOUT)

    tokens = np.fromfile(copy / "math_val.bin", dtype=np.uint16)
    tokens[:10] = 7
    tokens.tofile(copy / "math_val.bin")  # another held-out set under the same name
    (copy / "manifest.json").write_text(json.dumps({**manifest, "inputs_hash": "1" * 16, "stream_hashes": {
        **manifest["stream_hashes"], "math_val": file_hash(copy / "math_val.bin")}}))
    with pytest.raises(FibctlError, match=f"trained on data {original.data_hash} but {copy} has data "
                                          f"{load_manifest(copy).data_hash}"):
        evaluate(engine, ["fixed"], [64], data_dir=copy)

    path = tmp_path / "runs" / "fixed" / "step_00000010.pt"
    state = ckpt.load_checkpoint(path)
    ckpt.save_checkpoint(tmp_path / "runs" / "fixed", 10, {**state, "data_hash": original.inputs_hash}, keep=2)
    assert len(evaluate(engine, ["fixed"], [64], data_dir=data)) == len(HELDOUT)  # an older checkpoint's hash


def test_eval_refuses_data_other_than_the_runs_own(trained, tmp_path):
    """Held-out sets of other data under the same names: their numbers would replace the
    run's recorded ones, so eval names both data hashes and writes nothing."""
    import json
    import shutil

    from fibctl.errors import FibctlError

    engine, data, db = trained
    other = tmp_path / "other"
    shutil.copytree(data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["inputs_hash"] = "1" * 16
    (other / "manifest.json").write_text(json.dumps(manifest))
    before = rows(db, "select step, dataset, eval_length, loss from evaluations order by 1, 2, 3")
    with pytest.raises(FibctlError, match=f"run 'fixed' was trained on data {'0' * 16} but {other} has data "
                                          f"{'1' * 16}: its results would replace"):
        evaluate(engine, ["fixed"], [64], data_dir=other)
    assert rows(db, "select step, dataset, eval_length, loss from evaluations order by 1, 2, 3") == before


NAN = lambda w: {k: torch.full_like(v, float("nan")) for k, v in w.items()}  # noqa: E731


@pytest.mark.parametrize("run,tamper,problem", [
    ("fixed", lambda w: {**w, "embed.weight": w["embed.weight"][:-1]},
     r"does not fit run 'fixed''s model \(size mismatch for embed.weight"),
    ("fixed", NAN, r"run 'fixed' has no loss to score: its checkpoint .* holds weights that are not finite "
                   r"\(embed.weight among them\)$"),
    # its rungs floored the NaN alpha: a ValueError traceback
    ("learned", NAN, r"run 'learned' has no loss to score: its checkpoint .* holds weights that are not finite"),
    ("learned", lambda w: {**w, "blocks.1.attn.theta": torch.tensor(float("nan"))},
     r"holds weights that are not finite \(blocks.1.attn.theta among them\)$"),
    # torch's TypeError from load_state_dict, a traceback
    ("fixed", lambda w: 5, r"checkpoint .* is damaged or not a checkpoint \(its model weights are an int, "
                           r"not a dict of named tensors\)$"),
    ("fixed", lambda w: {**w, "norm.weight": [1.0]}, r"is damaged or not a checkpoint \(its model weights hold a "
                                                     r"list under 'norm.weight', not a tensor\)$"),
])
def test_eval_names_a_checkpoint_changed_by_hand_and_records_nothing(trained, tmp_path, run, tamper, problem):
    from fibctl.errors import FibctlError

    engine, data, db = trained
    runs = _tampered_copy(trained, tmp_path, run, tamper)
    before = rows(db, "select * from evaluations order by id")
    with pytest.raises(FibctlError, match=problem):
        evaluate(engine, [run], [64], data_dir=data, runs_dir=runs)
    assert rows(db, "select * from evaluations order by id") == before


def _tampered_copy(trained, tmp_path, run: str, tamper):
    """A copy of the trained runs' folder whose `run` has its last checkpoint's weights
    replaced by `tamper(weights)`."""
    import shutil

    from fibctl.train.checkpoint import list_checkpoints, load_checkpoint

    runs = tmp_path / "runs"
    shutil.copytree(trained[2].parent / "runs", runs)
    path = list_checkpoints(runs / run)[-1]
    state = load_checkpoint(path)
    torch.save({**state, "model": tamper(state["model"])}, path)
    return runs


@pytest.mark.parametrize("run,tamper,said", [
    ("learned", NAN, "run 'learned' has no loss to score: its checkpoint"),
    ("learned", lambda w: 5, "is damaged or not a checkpoint (its model weights are an int"),
])
def test_fibctl_eval_says_a_damaged_checkpoint_in_one_line(trained, tmp_path, monkeypatch, capsys, run, tamper, said):
    """`fibctl eval learned --length 64` printed floor(nan)'s ValueError, and load_state_dict's
    TypeError for weights that are not a dict, each as a traceback."""
    from cli_helpers import refused

    engine, data, db = trained
    runs = _tampered_copy(trained, tmp_path, run, tamper)
    line = refused(monkeypatch, capsys, "eval", run, "--length", "64", "--db", str(db), "--data", str(data),
                   "--runs-dir", str(runs))
    assert line.startswith("error: ") and said in line, line


def test_eval_refuses_a_file_that_is_not_the_final_checkpoint_and_records_nothing(trained, tmp_path):
    """An earlier checkpoint copied over the final one was scored and recorded at its own step,
    where no report reads a finished run; a folder in the file's place was 'does not exist'."""
    import shutil

    from fibctl.errors import FibctlError
    from fibctl.train.checkpoint import list_checkpoints, load_checkpoint

    engine, data, db = trained
    runs = tmp_path / "runs"
    shutil.copytree(db.parent / "runs", runs)
    path = list_checkpoints(runs / "fixed")[-1]
    state = load_checkpoint(path)
    torch.save({**state, "step": state["step"] - 5}, path)
    before = rows(db, "select * from evaluations order by id")
    with pytest.raises(FibctlError, match=rf"holds step {state['step'] - 5}, but run 'fixed' finished at step "
                                          rf"{state['step']}: it is not the run's final checkpoint"):
        evaluate(engine, ["fixed"], [64], data_dir=data, runs_dir=runs)
    path.unlink()
    path.mkdir()
    with pytest.raises(FibctlError, match=r"its checkpoint .* is not a file$"):
        evaluate(engine, ["fixed"], [64], data_dir=data, runs_dir=runs)
    assert rows(db, "select * from evaluations order by id") == before


def test_eval_refuses_to_replace_a_result_over_another_budget(trained):
    """The final evaluation's row would be replaced by a quick look over fewer tokens: refused
    before anything is measured; the recorded budget again replaces it in place."""
    from fibctl.errors import FibctlError

    engine, data, db = trained
    query = "select dataset, tokens, loss from evaluations where run_id = (select id from runs where name = 'stagger') " \
            "and eval_length = 64 and step = 10 order by dataset"
    before = rows(db, query)
    assert {tokens for _, tokens, _ in before} == {4096}
    with pytest.raises(FibctlError, match=r"over 4,096 tokens; this one would score 128 and replace it: "
                                          r"give --tokens 4096 \(or more\) to measure it again"):
        evaluate(engine, ["stagger"], [64], data_dir=data, tokens=130)
    assert rows(db, query) == before
    evaluate(engine, ["stagger"], [64], data_dir=data, tokens=4096)
    assert rows(db, query) == before  # the same windows, the same numbers
    # a quick look first does not block the full measurement: a larger budget replaces it
    evaluate(engine, ["stagger"], [128], data_dir=data, tokens=256)
    evaluate(engine, ["stagger"], [128], data_dir=data, tokens=1024)
    assert {t for (t,) in rows(db, "select tokens from evaluations where eval_length = 128 and run_id = "
                                   "(select id from runs where name = 'stagger')")} == {1024}


def test_eval_whose_output_pipe_closes_stops_with_141_and_keeps_what_it_measured(trained, capsys, monkeypatch):
    """`fibctl eval ... | head -1` ended with 0, quietly, though lengths were left unmeasured: a
    script took it for done. It says it stopped, and exits 141 (128 + SIGPIPE); what it
    measured before is recorded."""
    from cli_helpers import close_stdout
    from fibctl.cli import main

    _, data, db = trained
    before = rows(db, "select count(*) from evaluations e join runs r on r.id = e.run_id "
                      "where r.name = 'stagger' and e.eval_length in (48, 96)")[0][0]
    close_stdout(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["fibctl", "eval", "stagger", "--length", "48", "--length", "96",
                                      "--db", str(db), "--data", str(data)])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 141 and err.startswith("the output's reader has gone: stopped; the results measured "
                                                       "before it are recorded"), err
    assert rows(db, "select count(*) from evaluations e join runs r on r.id = e.run_id "
                    "where r.name = 'stagger' and e.eval_length in (48, 96)")[0][0] == before + 1


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_run_in_training_is_measured_at_its_newest_checkpoint_when_the_recorded_one_is_gone(
        when, trained, tmp_path):
    """A run in training keeps only its newest checkpoints: the one its row named was deleted
    before eval looked (`before`), or while eval measured the runs before it (`during`), and
    eval stopped with `checkpoint ... does not exist` (`give the --runs-dir it was trained in`)."""
    import threading

    from fibctl.train.checkpoint import checkpoint_path

    _, data, _ = trained
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("first", **SHORT), micro_run("live", steps=40, checkpoint_interval=10,
                                                                   keep_checkpoints=3))
    work(engine, WorkerOptions(data_dir=data, runs_dir=runs, max_runs=1), Quiet())
    stop = threading.Event()

    class StopsAt23(Quiet):
        def start(self, name, steps):
            return lambda p: p.step == 23 and stop.set()

        def finish(self, outcome):
            pass
    work(engine, WorkerOptions(data_dir=data, runs_dir=runs), StopsAt23(), stop=stop)  # checkpoints 10, 20, 23
    with engine.begin() as conn:  # as its worker left it, training on
        conn.exec_driver_sql("UPDATE runs SET status = 'running' WHERE name = 'live'")
    recorded = checkpoint_path(runs / "live", 23)

    def prune(item, total):  # its worker moved on and deleted what the row named
        recorded.unlink(missing_ok=True)
    if when == "before":
        prune(None, 0)
    frame = evaluate(engine, ["first", "live"], [64], data_dir=data, datasets=["stories_val"],
                     on_start=prune if when == "during" else None)
    assert list(frame["run"]) == ["first", "live"] and list(frame["step"]) == [10, 20]


def test_eval_of_a_run_not_finished_says_which_step_it_measures(trained, tmp_path, capsys, monkeypatch):
    """A run stopped and released part-way was evaluated from that checkpoint without a word, its
    numbers then read as the run's own: one note on stderr names the status and the step; the
    exit code is eval's own (0), and a finished run gets no note."""
    import threading

    from fibctl.cli import main

    _, data, _ = trained
    db = tmp_path / "r.db"
    engine = queued_db(db, micro_run("half", steps=40, checkpoint_interval=10))
    stop = threading.Event()

    class StopsAt13(Quiet):
        def start(self, name, steps):
            return lambda p: p.step == 13 and stop.set()

        def finish(self, outcome):
            self.outcome = outcome

    display = StopsAt13()
    work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs"), display, stop=stop)
    assert display.outcome.status == "released" and display.outcome.step == 13, display.outcome

    def fibctl_eval(name: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["fibctl", "eval", name, "--length", "64", "--db", str(db), "--data",
                                          str(data), "--runs-dir", str(tmp_path / "runs")])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code or 0
        return code, capsys.readouterr().err

    code, err = fibctl_eval("half")
    assert code == 0 and err.splitlines() == [
        "note: run 'half' is not finished (status queued): measuring its checkpoint at step 13 of 40"], err
    assert rows(db, "select distinct e.step from evaluations e join runs r on r.id = e.run_id "
                    "where r.name = 'half' order by e.step") == [(10,), (13,)]  # training's, and eval's
    work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs"), Quiet())  # now to its end
    code, err = fibctl_eval("half")
    assert code == 0 and err == "", err


@pytest.mark.parametrize("again", [False, True], ids=["removed", "removed-and-queued-again"])
def test_a_run_removed_while_it_is_evaluated_ends_eval_in_one_line(trained, tmp_path, capsys, monkeypatch, again):
    """`fibctl queue rm` of a run that eval was measuring (or rm, then `queue add` of its name
    again: a new row) failed eval's next write on the missing row: a traceback of SQLite's
    FOREIGN KEY constraint failed. One line names the run and what happened, exit 2; what was
    measured of the run before it stays recorded."""
    from fibctl import queue
    from fibctl.cli import main
    from fibctl.cli import train as train_cli
    from fibctl.db.engine import connect

    _, data, db = trained
    mine = tmp_path / "r.db"
    with sqlite3.connect(mine) as copy:  # with what the -wal file holds
        sqlite3.connect(db).backup(copy)
    real = train_cli.EvalProgress.start

    def start(progress, item, total):  # the second run's first measurement: `queue rm` it
        if item["run"] == "dense":
            engine = connect(str(mine))
            queue.remove(engine, "dense")
            if again:
                queue.add_runs(engine, [micro_run("dense", "dense", **SHORT)])
            engine.dispose()
        return real(progress, item, total)
    monkeypatch.setattr(train_cli.EvalProgress, "start", start)
    monkeypatch.setattr(sys, "argv", ["fibctl", "eval", "fixed", "dense", "--length", "48", "--db", str(mine),
                                      "--data", str(data)])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("error: run 'dense' was removed from the database (fibctl queue rm) "
                                            "while eval measured it; nothing more of it can be recorded"), err
    assert rows(mine, "select count(*) from evaluations e join runs r on r.id = e.run_id "
                      "where r.name = 'fixed' and e.eval_length = 48")[0][0] == len(HELDOUT)
