"""Crash consistency: an interrupted save leaves no temporary file for good, a run whose
checkpoints are damaged has one way out, and rerunning after an interruption finishes the
job as an uninterrupted run would (bit for bit, on the CPU)."""

from __future__ import annotations

import shutil
import sqlite3
import sys
import threading
from pathlib import Path

import pytest
import torch

from fibctl.data.streams import load_manifest
from fibctl.flows.worker import WorkerOptions, work
from fibctl.train import checkpoint as ckpt
from fibctl.train.trainer import Trainer
from train_helpers import HELDOUT, NullReporter, Quiet, micro_run, queued_db, write_data

torch.set_num_threads(1)
# checkpoints every 10 steps, keeping 2; light evaluations every 10, a full one at each checkpoint
LONG = dict(steps=30, eval_interval=10, checkpoint_interval=10, keep_checkpoints=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """Final weights of an uninterrupted run, and the rows it records (from a worker)."""
    path = tmp_path_factory.mktemp("ref")
    engine = queued_db(path / "r.db", micro_run("run", **LONG))
    [outcome] = work(engine, WorkerOptions(data_dir=data, runs_dir=path / "runs"), Quiet())
    assert outcome.status == "done"
    return ckpt.load_checkpoint(outcome.checkpoint)["model"], rows(path / "r.db"), path


def rows(db) -> dict:
    """Every metric row of the database, without times: what a report reads."""
    c = sqlite3.connect(db)
    return {"train_steps": c.execute("select step, loss, lr, grad_norm from train_steps order by step").fetchall(),
            "evaluations": c.execute("select step, dataset, eval_length, tokens, loss from evaluations "
                                     "order by step, dataset, eval_length").fetchall(),
            "position_losses": c.execute("select step, dataset, position, mean_loss from position_losses "
                                         "order by step, dataset, position").fetchall(),
            "alphas": c.execute("select step, layer, alpha from alphas order by step, layer").fetchall()}


def assert_same_run(db, weights, reference):
    ref_weights, ref_rows, _ = reference
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], ref_weights[k]), k
    assert rows(db) == ref_rows


def opts(data, tmp_path):
    return WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs")


def run_row(db):
    return sqlite3.connect(db).execute("select status, attempts, error, checkpoint_path, final_step from runs").fetchone()


def cli(args, capsys, monkeypatch) -> tuple[int, str, str]:
    from fibctl.cli import main
    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


# ----------------------------------------------------------------------------- temporaries


def test_a_second_ctrl_c_mid_save_leaves_no_temporary_and_the_rerun_is_the_same_run(data, tmp_path, monkeypatch,
                                                                                      reference):
    """KeyboardInterrupt inside torch.save left step_N.pt.tmp beside the checkpoints for good."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    real_save = torch.save

    def interrupted(state, f):
        if state["step"] == 20:
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt
        real_save(state, f)
    monkeypatch.setattr(ckpt.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        work(engine, opts(data, tmp_path), Quiet())
    folder = tmp_path / "runs" / "run"
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000010.pt"]
    assert run_row(tmp_path / "r.db")[:2] == ("queued", 0)
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    [outcome] = work(engine, opts(data, tmp_path), Quiet())
    assert outcome.status == "done"
    assert_same_run(tmp_path / "r.db", ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)


def test_a_killed_saves_temporary_goes_at_the_next_resume_and_another_runs_stays(data, tmp_path):
    """A kill mid-write (no handler runs) left step_N.pt.tmp, at a step no later save rewrote."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path), Quiet(lambda p: p.step == 13 and stop.set()), stop=stop)
    folder, other = tmp_path / "runs" / "run", tmp_path / "runs" / "other"
    other.mkdir()
    for f in (folder, other):
        (f / "step_00000017.pt.tmp").write_bytes(b"a kill mid-write")
    resumed = []
    trainer = Trainer(micro_run("run", **LONG), load_manifest(data), folder, NullReporter())
    trainer.on_progress = lambda p: (resumed.append(sorted(x.name for x in folder.iterdir())), stop.set())
    trainer.stop = stop = threading.Event()
    assert trainer.run().status == "stopped"
    assert resumed[0] == ["step_00000010.pt", "step_00000013.pt"]  # gone before the first step
    assert (other / "step_00000017.pt.tmp").is_file()  # not this run's


def test_a_save_removes_a_temporary_an_earlier_attempt_left(tmp_path):
    (tmp_path / "step_00000003.pt.tmp").write_bytes(b"x")
    ckpt.save_checkpoint(tmp_path, 5, {"model": {}, "step": 5}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005.pt"]


# ----------------------------------------------------------------------------- damaged checkpoints


def _stop_at(engine, data, tmp_path, step):
    stop = threading.Event()
    [outcome] = work(engine, opts(data, tmp_path), Quiet(lambda p: p.step == step and stop.set()), stop=stop)
    assert outcome.status == "released"


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_finishes_the_same(data, tmp_path, reference):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    _stop_at(engine, data, tmp_path, 23)  # checkpoints 20 and 23
    newest = tmp_path / "runs" / "run" / "step_00000023.pt"
    newest.write_bytes(newest.read_bytes()[:500])
    recorded = []  # what the database records as the run's checkpoint once it resumed
    record = lambda p: recorded or recorded.append(  # noqa: E731
        sqlite3.connect(tmp_path / "r.db").execute("select checkpoint_path from runs").fetchone()[0])
    [outcome] = work(engine, opts(data, tmp_path), Quiet(record))
    assert outcome.status == "done", outcome.error
    assert recorded == ["run/step_00000020.pt"]  # not the one moved aside: eval would look for it
    assert_same_run(tmp_path / "r.db", ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)
    names = sorted(p.name for p in newest.parent.iterdir())
    # the two newest that load are kept; the damaged one, apart, is not counted among them
    assert names == ["step_00000020.pt", "step_00000023.pt.damaged", "step_00000030.pt"]


def test_a_run_whose_only_checkpoint_is_damaged_has_one_way_out(data, tmp_path, capsys, monkeypatch, reference):
    """It failed, `queue retry` failed it again, and deleting the file left the worker refusing
    it ("give the --runs-dir it was trained with"): only `queue rm` and adding it again helped,
    losing every row."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **{**LONG, "keep_checkpoints": 1}))
    _stop_at(engine, data, tmp_path, 13)
    only = tmp_path / "runs" / "run" / "step_00000013.pt"
    assert ckpt.list_checkpoints(only.parent) == [only]
    only.write_bytes(b"")
    db = tmp_path / "r.db"
    sqlite3.connect(db).execute("insert into aux_metrics (run_id, name, metric, value) values (1, 'speed@64', "
                                "'tokens_per_s', 5.0)").connection.commit()
    [failed] = work(engine, opts(data, tmp_path), Quiet())
    assert failed.status == "failed"
    assert failed.error.endswith("no checkpoint of run 'run' loads (moved aside as step_N.pt.damaged): "
                                 "`fibctl queue retry run --from-start` trains it again from step 0"), failed.error
    # eval names the way out; `eval --all` passes it by, as a run with no checkpoint
    code, out, err = cli(["eval", "run", "--length", "64", "--db", str(db), "--data", str(data)], capsys, monkeypatch)
    assert code == 2 and err == ("error: run 'run': its checkpoint step_00000013.pt was damaged; no checkpoint of "
                                 "run 'run' loads (moved aside as step_N.pt.damaged): `fibctl queue retry run "
                                 "--from-start` trains it again from step 0\n"), err
    code, out, err = cli(["eval", "--all", "--length", "64", "--db", str(db), "--data", str(data)], capsys, monkeypatch)
    assert code == 2 and "no run in the database has a checkpoint to evaluate" in err, err
    # a plain retry fails it the same way, whichever worker claims it: the folder is not at fault
    code, out, err = cli(["queue", "retry", "run", "--db", str(db)], capsys, monkeypatch)
    assert code in (0, None)
    [again] = work(engine, opts(data, tmp_path), Quiet())
    assert again.status == "failed" and "`fibctl queue retry run --from-start`" in again.error
    before = rows(db)
    assert [s for s, *_ in before["train_steps"]] == [5, 10] and {s for s, *_ in before["evaluations"]} == {10}
    code, out, err = cli(["queue", "retry", "run", "--from-start", "--db", str(db)], capsys, monkeypatch)
    assert code in (0, None), err
    assert " ".join(out.split()) == ("queued run again from step 0; deleted what it recorded past step 0: 2 train steps, "
                                     "2 evaluations, 1 aux metrics")
    assert all(len(line) <= 80 for line in out.splitlines())
    after = rows(db)
    assert after["train_steps"] == [] and after["evaluations"] == []
    assert after["alphas"] == before["alphas"] == [r for r in before["alphas"] if r[0] == 0]
    c = sqlite3.connect(db)
    # measured of the discarded weights (Table 2 would pair a probe's scores with the step-0 alphas)
    assert c.execute("select count(*) from aux_metrics").fetchone() == (0,)
    assert c.execute("select status, attempts, checkpoint_path, tokens_trained from runs").fetchone() == \
        ("queued", 0, None, None)
    assert "retried" in [k for (k,) in c.execute("select kind from events")]
    [outcome] = work(engine, opts(data, tmp_path), Quiet())
    assert outcome.status == "done"
    assert_same_run(db, ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)


def test_retry_from_start_refuses_while_a_checkpoint_is_there_and_changes_nothing(data, tmp_path, capsys,
                                                                                  monkeypatch):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    _stop_at(engine, data, tmp_path, 13)
    db = tmp_path / "r.db"
    code, _, err = cli(["queue", "retry", "run", "--from-start", "--db", str(db)], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and "cannot retry run 'run': it is queued" in err, err
    sqlite3.connect(db).execute("update runs set status = 'failed'").connection.commit()
    before = rows(db)
    code, _, err = cli(["queue", "retry", "run", "--from-start", "--db", str(db)], capsys, monkeypatch)
    newest = tmp_path / "runs" / "run" / "step_00000013.pt"
    assert code == 2 and f"{newest} is still there: `fibctl queue retry run` resumes from it" in err, err
    assert "Traceback" not in err
    assert rows(db) == before and run_row(db)[0] == "failed"
    code, _, err = cli(["queue", "retry", "--all-failed", "--from-start", "--db", str(db)], capsys, monkeypatch)
    assert code == 2 and "--from-start takes one run by name" in err


def test_retry_from_start_refuses_a_runs_dir_that_is_not_a_folder(data, tmp_path, capsys, monkeypatch):
    """A mistyped --runs-dir found no checkpoint there and deleted the rows; a worker given the
    real folder then resumed from its checkpoint with the steps before it gone."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    _stop_at(engine, data, tmp_path, 13)
    db = tmp_path / "r.db"
    sqlite3.connect(db).execute("update runs set status = 'failed'").connection.commit()
    before = rows(db)
    code, _, err = cli(["queue", "retry", "run", "--from-start", "--runs-dir", str(tmp_path / "rnus"),
                        "--db", str(db)], capsys, monkeypatch)
    assert code == 2 and f"--runs-dir {tmp_path / 'rnus'} is not a folder" in err, err
    assert rows(db) == before and run_row(db)[0] == "failed"


# ----------------------------------------------------------------------------- a kill at any write


class Killed(BaseException):
    """What SIGKILL does to a worker, in-process: nothing after it runs (no release, no
    cleanup handler: train_claimed catches Exception and KeyboardInterrupt, not this)."""


def _killed_at(monkeypatch, where: str, n: int):
    """Kill the worker at its `n`th database write of the run's results (inside the
    transaction, before it commits), or inside its `n`th checkpoint save, half written."""
    from fibctl.db import store
    count = [0]
    if where == "write":
        real = store.write_retrying

        def write_retrying(engine, write):
            def dying(conn):
                result = write(conn)
                count[0] += 1
                if count[0] == n:
                    raise Killed
                return result
            return real(engine, dying)
        monkeypatch.setattr(store, "write_retrying", write_retrying)
    else:
        real_save = torch.save

        def save(state, f):
            count[0] += 1
            if count[0] == n:
                f.write(b"half")
                raise Killed
            real_save(state, f)
        monkeypatch.setattr(ckpt.torch, "save", save)


def _consistent(db):
    """What a report may read is whole: each evaluation's perplexity is its loss's, and each
    position-loss set has one row per position of its length."""
    c = sqlite3.connect(db)
    assert c.execute("select count(*) from evaluations where abs(ppl - exp(loss)) > 1e-9 * ppl").fetchone() == (0,)
    assert c.execute("select count(*) from (select eval_length, count(*) n, max(position) m from position_losses "
                     "group by run_id, step, dataset, eval_length) where n != eval_length - 1 "
                     "or m != eval_length - 2").fetchone() == (0,)


# the run's writes, in order: 1 its row at the start, 3 the first step's metrics, 7 and 9 the
# first evaluation (two held-out sets), 11 the checkpoint event, 12 its path on the row, 27
# and 29 the final evaluation with its position losses, 33 the final row, 34 the final step;
# saves 1 and 3 are the checkpoints of steps 10 and 30
KILLS = [("write", n) for n in (1, 3, 7, 9, 11, 12, 27, 29, 33, 34)] + [("save", 1), ("save", 3)]


@pytest.mark.parametrize("where,n", KILLS, ids=[f"{w}{n}" for w, n in KILLS])
def test_a_worker_killed_at_any_write_or_save_finishes_as_an_uninterrupted_run(where, n, data, tmp_path,
                                                                               monkeypatch, reference):
    from fibctl.flows.worker import train_named
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    with monkeypatch.context() as m:
        _killed_at(m, where, n)
        with pytest.raises(Killed):
            work(engine, opts(data, tmp_path), Quiet())
    _consistent(tmp_path / "r.db")
    assert run_row(tmp_path / "r.db")[0] == "running"  # as a kill leaves it: the next claim takes it
    outcome = train_named(engine, "run", WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs",
                                                        heartbeat_timeout_s=0), Quiet())
    assert outcome.status == "done"
    assert_same_run(tmp_path / "r.db", ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)
    names = sorted(p.name for p in (tmp_path / "runs" / "run").iterdir())
    assert names == ["step_00000020.pt", "step_00000030.pt"]  # no temporary left, the two newest kept
    status, attempts, error, path, final = run_row(tmp_path / "r.db")
    assert (status, error, path, final) == ("done", None, "run/step_00000030.pt", 30)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_an_evaluation_killed_mid_write_leaves_whole_rows_and_its_rerun_the_same_rows(n, data, tmp_path,
                                                                                       monkeypatch, reference):
    """`fibctl eval` at two lengths with positions writes 4 evaluations (2 lengths x 2 sets),
    each, perplexity and positions, in one transaction: killed at the nth, the ones before
    stay, the one in progress is not half there, and running it again gives the rows of a
    run that was not interrupted."""
    from fibctl.flows.evaluation import evaluate
    from fibctl.db.engine import connect
    for name in ("killed", "whole"):
        shutil.copytree(reference[2], tmp_path / name)
    args = dict(data_dir=data, positions=True)
    whole = connect(str(tmp_path / "whole" / "r.db"))
    evaluate(whole, ["run"], [64, 128], **{**args, "runs_dir": tmp_path / "whole" / "runs"})  # copies: moved
    killed = connect(str(tmp_path / "killed" / "r.db"))
    with monkeypatch.context() as m:
        _killed_at(m, "write", n)
        with pytest.raises(Killed):
            evaluate(killed, ["run"], [64, 128], **{**args, "runs_dir": tmp_path / "killed" / "runs"})
    _consistent(tmp_path / "killed" / "r.db")
    assert len(rows(tmp_path / "killed" / "r.db")["evaluations"]) >= len(reference[1]["evaluations"])
    evaluate(killed, ["run"], [64, 128], **{**args, "runs_dir": tmp_path / "killed" / "runs"})
    assert rows(tmp_path / "killed" / "r.db") == rows(tmp_path / "whole" / "r.db")


def _evaluations(db) -> dict:
    """Each evaluation's rows by key (dataset, length): its perplexity row and its positions."""
    c = sqlite3.connect(db)
    out = {}
    for dataset, length, tokens, loss in c.execute("select dataset, eval_length, tokens, loss from evaluations "
                                                   "where eval_length = 128"):
        out[dataset, length] = (tokens, loss, c.execute(
            "select position, mean_loss, windows from position_losses where dataset = ? and eval_length = ? "
            "order by position", (dataset, length)).fetchall())
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_an_evaluation_killed_between_its_perplexity_and_positions_leaves_either_set_whole(
        n, data, tmp_path, monkeypatch, reference):
    """Measured again over more tokens, an evaluation replaces its perplexity and its position
    losses. They were two transactions: a kill between them left the new perplexity beside
    the positions of the old measurement. Now each key holds the old set or the new one."""
    from fibctl.flows.evaluation import evaluate
    from fibctl.db.engine import connect
    for name in ("killed", "whole"):
        shutil.copytree(reference[2], tmp_path / name)
    args = dict(data_dir=data, positions=True)
    before = None
    for name in ("killed", "whole"):  # a quick look first: 8 windows of 128 per held-out set
        engine = connect(str(tmp_path / name / "r.db"))
        evaluate(engine, ["run"], [128], tokens=1024, runs_dir=tmp_path / name / "runs", **args)
        before = _evaluations(tmp_path / name / "r.db")
    whole = connect(str(tmp_path / "whole" / "r.db"))
    evaluate(whole, ["run"], [128], runs_dir=tmp_path / "whole" / "runs", **args)
    after = _evaluations(tmp_path / "whole" / "r.db")
    assert before.keys() == after.keys() and len(after) == 2
    assert all(before[k][0] < after[k][0] for k in after)  # a larger budget: every row differs
    killed = connect(str(tmp_path / "killed" / "r.db"))
    with monkeypatch.context() as m:
        _killed_at(m, "write", n)
        with pytest.raises(Killed):
            evaluate(killed, ["run"], [128], runs_dir=tmp_path / "killed" / "runs", **args)
    left = _evaluations(tmp_path / "killed" / "r.db")
    assert left.keys() == after.keys()
    for key, rows_ in left.items():
        assert rows_ in (before[key], after[key]), key
    # the sets before the kill are the new ones, the one it stopped and those after it the old
    assert [left[d, 128] == after[d, 128] for d in HELDOUT] == [i < n - 1 for i in range(2)]


# ----------------------------------------------------------------------------- report files


def test_report_all_removes_what_a_report_killed_mid_write_left_and_nothing_else(tmp_path, capsys, monkeypatch):
    """A kill mid-write left `.table1.HEX.part.csv` in the report's folder for good."""
    import os
    db = tmp_path / "r.db"
    shutil.copy(Path(__file__).resolve().parent.parent / "results.db.example", db)
    out = tmp_path / "report"
    out.mkdir()
    dead = 2**22 + 1  # above any pid_max: no process has it
    left = [out / f".table1.{dead}-0123abcd.part.csv", out / f".index.{dead}-0123abcd.part.html"]
    kept = [out / f".table1.{os.getpid()}-0123abcd.part.csv",  # a report still writing it
            out / ".table1.notes.part.csv", out / f".mine.{dead}-0123abcd.part.csv"]  # not a report's
    for f in left + kept:
        f.write_text("x")
    code, _, err = cli(["report", "all", "--db", str(db), "--out", str(out)], capsys, monkeypatch)
    assert code in (0, None), err
    assert (out / "table1.csv").is_file()
    assert not any(f.exists() for f in left) and all(f.exists() for f in kept)
    assert not [f for f in out.iterdir() if ".part" in f.name and f not in kept]



def _paused(module: str, function: str, args: list[str]):
    """`fibctl ARGS` in a process of its own, paused in `module.function` (say
    `fibctl.reports.html.page`) until its stdin closes: returned once it has said so."""
    import subprocess

    process = subprocess.Popen([sys.executable, "-c", (
        f"import sys\nimport {module} as module\nwrapped = module.{function}\n"
        "def paused(*args, **kwargs):\n    print('paused', file=sys.stderr, flush=True)\n    sys.stdin.read()\n"
        f"    return wrapped(*args, **kwargs)\nmodule.{function} = paused\n"
        f"sys.argv = ['fibctl', *{args!r}]\n"
        "from fibctl.__main__ import main\nmain()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stderr.readline()
    if line != "paused\n":
        process.kill()
        raise AssertionError(line + process.stderr.read())
    return process


def _example(tmp_path: Path) -> Path:
    db = tmp_path / "r.db"
    shutil.copy(Path(__file__).resolve().parent.parent / "results.db.example", db)
    return db


REPORT_BUSY = "another `fibctl report all`, or a `fibctl figure`, is writing there now"


def test_a_second_report_all_into_a_folder_being_written_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """Two `report all` into one new folder at once: the one with fewer tables removed the
    other's files as stale (posloss.png), which then failed ("cannot write the report into
    rep: No such file or directory") and, cleaning up, removed both reports' files. While one
    process writes a report there, a second is refused, touching nothing; the first ends whole."""
    from fibctl.reports import export

    db = _example(tmp_path)
    out = tmp_path / "rep"
    # the first report, paused after its tables and figures (before its page) until stdin closes
    first = _paused("fibctl.reports.html", "page",
                    ["report", "all", "--all-runs", "--db", str(db), "--out", str(out)])
    try:
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        code, _, err = cli(["report", "all", "--db", str(db), "--out", str(out)], capsys, monkeypatch)
        after = {p.name: p.read_bytes() for p in out.iterdir()}
    finally:
        stdout, stderr = first.communicate(timeout=120)  # closes its stdin: it goes on
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{out}: {REPORT_BUSY}" in err
    assert after == before  # none of the first's files removed
    assert first.returncode == 0 and stdout.startswith("wrote "), stderr
    listed = (out / export.MANIFEST).read_text().split()
    assert "posloss.png" in listed and all((out / name).is_file() for name in listed)
    code, _, err = cli(["report", "all", "--db", str(db), "--out", str(out)], capsys, monkeypatch)
    assert code in (0, None), err  # the folder is free once that one has ended


@pytest.mark.parametrize("name", ["posloss.png", "mine.svg"])
def test_a_figure_into_a_folder_a_report_all_is_writing_is_refused_at_once(name, tmp_path, capsys, monkeypatch):
    """`figure --out rep/posloss.png` while `report all --out rep` ran: the report replaced the
    figure with its own, or removed it as stale. Refused at once, one line; the report ends whole."""
    db = _example(tmp_path)
    out = tmp_path / "rep"
    report = _paused("fibctl.reports.html", "page", ["report", "all", "--db", str(db), "--out", str(out)])
    try:
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        code, _, err = cli(["figure", "posloss", "--db", str(db), "--out", str(out / name)], capsys, monkeypatch)
        after = {p.name: p.read_bytes() for p in out.iterdir()}
    finally:
        stdout, stderr = report.communicate(timeout=120)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{out}: a `fibctl report all` is writing a report there now" in err
    assert after == before
    assert report.returncode == 0 and stdout.startswith("wrote "), stderr
    code, _, err = cli(["figure", "posloss", "--db", str(db), "--out", str(out / name)], capsys, monkeypatch)
    assert code in (0, None) and (out / name).is_file(), err  # free once the report has ended


def test_a_report_all_into_a_folder_a_figure_is_writing_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """The other way round: a report started while a figure is written into its folder is
    refused, touching nothing, and the figure ends whole."""
    db = _example(tmp_path)
    out = tmp_path / "rep"
    out.mkdir()
    figure = _paused("fibctl.reports.figures", "replace_file",
                     ["figure", "coverage", "--preset", "micro", "--out", str(out / "coverage.png")])
    try:
        code, _, err = cli(["report", "all", "--db", str(db), "--out", str(out)], capsys, monkeypatch)
        after = sorted(p.name for p in out.iterdir())
    finally:
        stdout, stderr = figure.communicate(timeout=120)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{out}: {REPORT_BUSY}" in err
    assert after == []
    assert figure.returncode == 0 and (out / "coverage.png").is_file(), stderr


def test_a_folder_that_cannot_be_locked_still_gets_its_report(tmp_path, capsys, monkeypatch):
    """NFS may refuse to lock a folder opened read-only: the report is written unguarded, as
    before there was a lock, rather than never."""
    import errno
    import fcntl

    def refused(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", refused)
    db = tmp_path / "r.db"
    shutil.copy(Path(__file__).resolve().parent.parent / "results.db.example", db)
    code, _, err = cli(["report", "all", "--db", str(db), "--out", str(tmp_path / "rep")], capsys, monkeypatch)
    assert code in (0, None) and (tmp_path / "rep" / "index.html").is_file(), err


def test_a_report_leaves_the_temporary_file_of_another_pid_space_alone(tmp_path):
    """A temporary's name held its writer's PID alone: a report in a container of the same
    host name, writing into the shared folder, took another's live one for a killed one's and
    deleted it, the other's rename then failing. The name says the writer's PID space too."""
    from fibctl import durable
    from fibctl.reports.output import remove_leftovers, replace_file

    dead = 2**22 + 1  # above any pid_max: no process has it here
    other = tmp_path / f".t.{dead}-0123456789ab-0123abcd.part.csv"  # alive in its own container
    ours = tmp_path / f".t.{dead}-{durable.pid_space()}-0123abcd.part.csv"
    for f in (other, ours):
        f.write_text("x")
    assert remove_leftovers([tmp_path / "t.csv"]) == [ours] and other.exists()
    seen = []
    replace_file(tmp_path / "u.csv", lambda tmp: (seen.append(tmp.name), tmp.write_text("y")))
    assert seen[0].startswith(f".u.{durable.owner()}-") and (tmp_path / "u.csv").read_text() == "y"


def test_report_all_killed_before_its_index_is_finished_by_the_next_one(tmp_path, capsys, monkeypatch):
    """The report's list of its files was written last: one killed after its tables left them
    unlisted, and the next `report all` refused them as the user's files."""
    from fibctl.reports import export

    db = tmp_path / "r.db"
    shutil.copy(Path(__file__).resolve().parent.parent / "results.db.example", db)
    out = tmp_path / "a" / "report"
    with monkeypatch.context() as m:
        def killed(*args, **kwargs):
            raise KeyboardInterrupt
        m.setattr(export.html, "page", killed)
        code, _, err = cli(["report", "all", "--db", str(db), "--out", str(out)], capsys, monkeypatch)
    assert code == 130 and (out / "table1.txt").is_file() and not (out / "index.html").exists(), err
    code, _, err = cli(["report", "all", "--db", str(db), "--out", str(out)], capsys, monkeypatch)
    assert code in (0, None) and (out / "index.html").is_file(), err
    listed = (out / export.MANIFEST).read_text().split()
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != export.MANIFEST)


def test_report_all_with_no_data_leaves_no_folder_and_no_list(tmp_path, capsys, monkeypatch):
    from fibctl.db.engine import connect

    connect(str(tmp_path / "empty.db"))
    code, _, err = cli(["report", "all", "--db", str(tmp_path / "empty.db"), "--out", str(tmp_path / "a" / "b")],
                       capsys, monkeypatch)
    assert not (tmp_path / "a").exists(), err
    (tmp_path / "mine").mkdir()
    cli(["report", "all", "--db", str(tmp_path / "empty.db"), "--out", str(tmp_path / "mine")], capsys, monkeypatch)
    assert list((tmp_path / "mine").iterdir()) == []


def test_retry_from_start_loads_torch_before_it_takes_the_write_lock(tmp_path):
    """The checkpoint module (torch: seconds to import) was imported inside the transaction,
    every worker's heartbeat and log write waiting on the write lock meanwhile."""
    import subprocess

    from fibctl import queue

    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    queue.fail(engine, queue.claim_next(engine, "w").id, "it failed")
    engine.dispose()
    script = ("import sys\n"
              "from fibctl import queue\n"
              "real = queue.retry_from_start\n"
              "def spy(*a, **k):\n"
              "    print('torch loaded:', 'torch' in sys.modules)\n"
              "    return real(*a, **k)\n"
              "queue.retry_from_start = spy\n"
              "from fibctl.cli import main\n"
              f"sys.argv = ['fibctl', 'queue', 'retry', 'run', '--from-start', '--db', {str(tmp_path / 'r.db')!r}]\n"
              "main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torch loaded: True"), done.stdout
