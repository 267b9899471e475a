"""`fibctl demo --quick`: the whole pipeline from data to figures, and its resumption."""

import sqlite3
import subprocess
import sys

import pytest

from fibctl.reports import figures
from sqlalchemy import text

from fibctl.flows import demo
from fibctl.db.engine import connect

from cli_helpers import refused


def fibctl(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, cwd=cwd)


def test_quick_demo_runs_the_whole_pipeline(quick_demo):
    out, log = quick_demo
    for heading in ("Table 1", "Table 3", "Table 4", "total time"):
        assert heading in log
    # a line of its own in a log file (for grep), not folded at 80 columns with trailing spaces
    assert f"all of them on one page: {out / 'report' / 'index.html'}); database: {out / 'results.db'}" in log
    assert [line for line in log.splitlines() if line != line.rstrip()] == []
    # how to go on from this shell: other commands read ./results.db unless told
    assert log.splitlines()[-4:-1] == [f"  export FIBCTL_DB={out / 'results.db'}", f"  export FIBCTL_DATA={out / 'data'}",
                                       f"  export FIBCTL_RUNS_DIR={out / 'runs'}"], log
    db = sqlite3.connect(out / "results.db")
    runs = dict(db.execute("SELECT name, status FROM runs"))
    assert runs == {n: "done" for n in ("dense", "fib_fixed_w8", "fib_stagger_w8")}
    lengths = {r[0] for r in db.execute("SELECT DISTINCT eval_length FROM evaluations")}
    assert lengths == {64, 128, 256, 512}
    # per-position losses at every length, 4x included (the 'loss past T' view)
    assert db.execute("SELECT COUNT(*) FROM position_losses WHERE eval_length = 256").fetchone()[0] == 3 * 255
    for figure in figures.FIGURES:
        assert (out / "report" / f"{figure}.png").stat().st_size > 5000
    assert (out / "report" / "table3.tex").read_text().count("\\midrule") == 1


def test_the_demo_log_says_each_evaluation_as_it_is_measured(quick_demo):
    """--plain (and a log file) said nothing between the evaluation's heading and `evaluated
    3 run(s)`: 3 min 35 s of silence in the full demo."""
    _, log = quick_demo
    lines = [line for line in log.splitlines() if " docs_val: ppl " in line]
    assert len(lines) == 12 and lines[0].startswith("dense length 64 docs_val: ppl "), log
    assert "(1/12, ETA " in lines[0] and lines[-1].endswith("(12/12)"), lines


def test_second_run_resumes_and_skips_finished_work(quick_demo):
    out, _ = quick_demo
    before = sqlite3.connect(out / "results.db").execute("SELECT COUNT(*) FROM train_steps").fetchone()[0]
    again = fibctl("demo", "--quick", "--out", str(out), "--plain")
    assert again.returncode == 0, again.stderr
    assert f"queued 0 run(s); 3 already present in {out / 'results.db'}" in again.stdout  # as queue add says it
    assert "every run is trained already" in again.stdout and "ms per training step" not in again.stdout
    assert "evaluated 0 run(s)" in again.stdout
    after = sqlite3.connect(out / "results.db").execute("SELECT COUNT(*) FROM train_steps").fetchone()[0]
    assert after == before


def test_demo_refuses_a_folder_that_is_not_a_demo(tmp_path, monkeypatch, capsys):
    (tmp_path / "thesis.tex").write_text("precious")
    assert "holds files that are not a fibctl demo" in refused(monkeypatch, capsys, "demo", "--quick", "--out",
                                                                str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]


def test_demo_refuses_the_other_plans_folder_before_changing_it(quick_demo, monkeypatch, capsys):
    """A full demo over a --quick one would rebuild its data and then refuse its runs."""
    import hashlib

    out, _ = quick_demo
    # SQLite's -wal and -shm come and go with this test process's own connections to the database
    state = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*")  # noqa: E731
                     if p.is_file() and not p.name.endswith(("-wal", "-shm"))}
    before = state()
    err = refused(monkeypatch, capsys, "demo", "--out", str(out), "--plain")
    assert err.strip().splitlines() == [
        f"error: --out {out} holds a `fibctl demo --quick`; run that to resume it, or choose another folder"]
    assert state() == before


@pytest.mark.parametrize("timings,threads", [({1: 317.0, 2: 179.0}, 2), ({1: 2380.0, 2: 7270.0}, 1),
                                             ({1: 99_999.0, 128: 99_999.0}, 128)])
def test_the_threads_measurement_fits_80_columns(timings, threads):
    """At 81 characters (a loaded 2-core VM) the chosen count wrapped onto a line of its own."""
    line = demo.threads_line(timings, threads)
    assert len(line) <= 80 and line.endswith(f"training with {threads}")
    assert all(f"{ms:,.0f}" in line for ms in timings.values())


def _db_with(tmp_path, ppl: dict[str, tuple[float, float]]):
    """A demo database whose runs have the given perplexity at 1x and 4x (T = 128)."""
    engine = connect(str(tmp_path / "h.db"))
    from fibctl import queue
    from fibctl.matrix import load_matrix
    queue.add_runs(engine, load_matrix("demo").resolve())
    with engine.begin() as conn:
        for name, (p1, p4) in ppl.items():
            run_id = conn.execute(text("SELECT id FROM runs WHERE name = :n"), {"n": name}).scalar_one()
            conn.execute(text("UPDATE runs SET status = 'done', final_step = 600 WHERE id = :i"), {"i": run_id})
            for length, p in ((128, p1), (512, p4)):
                conn.execute(text("INSERT INTO evaluations (run_id, step, dataset, eval_length, tokens, loss, ppl) "
                                  "VALUES (:i, 600, 'docs_val', :l, 1000, ln(:p), :p)"), {"i": run_id, "l": length, "p": p})
    return engine


def test_headline_check(tmp_path):
    holds = demo.headline(_db_with(tmp_path, {"dense": (72.4, 83.5), "fib_fixed_w8": (81.1, 81.5),
                                              "fib_stagger_w8": (79.0, 79.9)}), "docs_val", 128)
    assert holds.holds and holds.dense_change == pytest.approx(15.33, abs=0.01)
    assert "holds at this scale" in " ".join(demo.describe(holds))


@pytest.mark.parametrize("ppl", [
    {"dense": (72.4, 78.0), "fib_fixed_w8": (81.1, 81.5)},  # dense rises < 10 %
    {"dense": (72.4, 83.5), "fib_fixed_w8": (81.1, 86.0)},  # a sparse model beyond 5 %
])
def test_headline_fails_when_any_condition_fails(tmp_path, ppl):
    assert not demo.headline(_db_with(tmp_path, ppl), "docs_val", 128).holds


def test_the_ranking_at_1x_is_reported_beside_the_length_claim_not_a_condition_of_it(tmp_path):
    """The verdict states the paper's length claim and its thresholds; whether dense is the
    best at the training length (a margin of about 1 % at the demo's scale, which another
    draw of the same initial-weight distributions reversed) is said on its own line."""
    h = demo.headline(_db_with(tmp_path, {"dense": (82.0, 95.0), "fib_fixed_w8": (81.1, 81.5)}), "docs_val", 128)
    said = demo.describe(h)
    assert h.holds and not h.dense_best_at_1x
    assert "The dense model was NOT the best at the training length." in said
    assert any("holds at this scale" in line for line in said)


@pytest.mark.parametrize("sent, code, said", [("SIGINT", 130, ["interrupted; run the same command again to resume"]),
                                              ("SIGTERM", 143, [])])
def test_a_signal_python_drops_still_stops_the_demo_as_it_stops_any_command(sent, code, said, tmp_path):
    """A signal whose exception lands in a weakref's callback is dropped by Python. The demo's
    own handlers left it printed as 'Exception ignored' with a traceback; noted as every
    command notes it, it stops the demo at its next step: 130 and one line after a Ctrl-C,
    143 and nothing after a SIGTERM, as other commands end."""
    from test_encoding_and_interrupts import CALLBACK, _fibctl_with

    done = _fibctl_with(CALLBACK.replace("SIGINT", sent) + "from fibctl.flows import demo\n"
                        "demo.plan = in_a_callback(demo.plan)\n", "demo", "--quick", "--plain", "--out",
                        str(tmp_path / "out"))
    assert (done.returncode, done.stderr.splitlines()) == (code, said), done.stderr[-3000:]
    assert "data ready" not in done.stdout  # stopped after its first step


def test_a_ctrl_c_that_fails_the_demo_s_figure_writer_is_taken_as_the_ctrl_c(tmp_path):
    """Stopped mid-write, matplotlib's PDF writer fails its clean-up with AttributeError: the
    demo ends as any Ctrl-C ends it, with its own line."""
    from test_encoding_and_interrupts import IN_THE_PDF_WRITER, _fibctl_with

    done = _fibctl_with(IN_THE_PDF_WRITER, "demo", "--quick", "--plain", "--out", str(tmp_path / "out"))
    said = ["interrupted; run the same command again to resume"]
    assert (done.returncode, done.stderr.splitlines()) == (130, said), done.stderr[-3000:]


def test_a_signal_during_training_exits_128_plus_it_and_says_how_to_resume(tmp_path):
    """SIGTERM mid-training checkpoints the run and exits 143, as train and worker do (it was 1,
    the code of a failed run)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "fibctl", "demo", "--quick", "--plain", "--out",
                             str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "3/5 train" in line:
            break
    for line in proc.stdout:  # the first run's first progress line: training has begun
        lines.append(line)
        if "dense" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, "".join(lines) + rest + err
    # on stderr, one line (it was two on stdout)
    assert "training stopped before every run finished; run the same command again to resume" not in rest
    assert ("training stopped before every run finished; run the same command again to resume from the "
            "checkpoints") in err.splitlines(), err


def test_a_demo_whose_output_pipe_closes_stops_with_141(tmp_path, monkeypatch, capsys):
    """`fibctl demo | head -1` ended with 0 at its next line, the demo unfinished: a script took
    it for done. It says it stopped, and exits 141 (128 + SIGPIPE)."""
    from cli_helpers import close_stdout
    from fibctl.cli import main

    close_stdout(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["fibctl", "demo", "--quick", "--plain", "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 141 and "the output's reader has gone: stopped" in err, err


def _marked_running(out, worker: str) -> None:
    """The dense run as a demo killed mid-run left it (or as a live one trains it): running,
    a fresh heartbeat, no evaluation at the demo's lengths yet."""
    db = sqlite3.connect(out / "results.db")
    with db:
        db.execute("UPDATE runs SET status = 'running', worker = ?, heartbeat_at = CURRENT_TIMESTAMP "
                   "WHERE name = 'dense'", (worker,))
        db.execute("DELETE FROM evaluations WHERE run_id = (SELECT id FROM runs WHERE name = 'dense') "
                   "AND eval_length > 64")
    db.close()


def test_a_demo_run_again_after_a_kill_takes_back_the_run_its_dead_worker_held(quick_demo, tmp_path):
    """The killed demo's worker, on this machine, is gone: its run is queued again at once (its
    heartbeat is still fresh), trained to its end from its checkpoint, evaluated and reported."""
    import shutil
    import socket

    out = tmp_path / "out"
    shutil.copytree(quick_demo[0], out)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    _marked_running(out, f"{socket.gethostname()}:{ended.pid}")
    again = fibctl("demo", "--quick", "--out", str(out), "--plain")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr
    assert "queued again dense: its worker, an earlier demo, has ended" in again.stdout
    assert "evaluated 1 run(s); 2 already evaluated" in again.stdout
    db = sqlite3.connect(out / "results.db")
    assert db.execute("SELECT status FROM runs WHERE name = 'dense'").fetchone() == ("done",)
    assert db.execute("SELECT COUNT(DISTINCT eval_length) FROM evaluations e JOIN runs r ON r.id = e.run_id "
                      "WHERE r.name = 'dense'").fetchone() == (4,)


def test_a_demo_whose_run_a_live_process_trains_says_so_and_exits_1(quick_demo, tmp_path):
    import os
    import shutil
    import socket

    out = tmp_path / "out"
    shutil.copytree(quick_demo[0], out)
    _marked_running(out, f"{socket.gethostname()}:{os.getpid()}")  # this test's process: alive
    again = fibctl("demo", "--quick", "--out", str(out), "--plain")
    assert again.returncode == 1, again.stdout[-2000:] + again.stderr
    assert f"dense (worker {socket.gethostname()}:{os.getpid()}) still training in another process" in " ".join(
        (again.stdout + again.stderr).split())
    assert "Table 1" not in again.stdout  # no tables without it
