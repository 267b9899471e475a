"""A worker's start and end: data that cannot train or evaluate a run is the worker's fault
(one line, exit 2, the run queued as it was), a stop by signal exits 128 + the signal, and
a --plain log line stays one line in a file."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fibctl.train.checkpoint import load_checkpoint
from train_helpers import HELDOUT, micro_run, queued_db, write_data

REPO = Path(__file__).resolve().parent.parent
SHORT = dict(steps=10, eval_interval=10, checkpoint_interval=10)


def cli(args, capsys, monkeypatch) -> tuple[int, str]:
    """Run `fibctl ARGS` in-process: (exit code, stderr)."""
    from fibctl.cli import main
    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, capsys.readouterr().err


def runs(db: Path) -> list[tuple]:
    return sqlite3.connect(db).execute("select name, status, attempts, started_at, error, checkpoint_path "
                                       "from runs order by id").fetchall()


def spawn(args: list[str], cwd: Path) -> subprocess.Popen:
    # no COLUMNS: the width rich gives output that is not a terminal (80)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "fibctl", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- data at fault


def short_train(d: Path) -> Path:
    return write_data(d, train_tokens=40)


def short_heldout(d: Path) -> Path:
    return write_data(d, heldout_tokens=40)


def without_heldout(d: Path) -> Path:
    """A folder whose manifest lists only the train split (made by hand, or damaged)."""
    write_data(d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["heldout"] = []
    for name in HELDOUT:
        del manifest["tokens"][name]
        (d / f"{name}.bin").unlink()
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


@pytest.mark.parametrize("command", [["worker"], ["train", "run"], pytest.param(
    ["train", "run", "--nproc", "2", "--device", "cpu"],  # refused before torchrun starts the ranks
    marks=pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="gloo runs one process per CPU; this has 1"))])
@pytest.mark.parametrize("make, words", [
    (short_train, "the train stream of {d} holds 40 tokens; seq_len 64 needs at least 66: prepare more data "
                  "(the recipe's train_tokens, or more documents)"),
    (short_heldout, f"the {HELDOUT[0]} stream of {{d}} holds 40 tokens; seq_len 64 needs at least 65: prepare "
                    "more data (the recipe's heldout_tokens or its source's heldout_fraction, or more documents)"),
    # preparing the same recipe again makes none: the line says to give a source one
    (without_heldout, "records evaluations on held-out sets, but {d} has no held-out set (its manifest lists "
                      "only 'train'): give a source of recipe "),
])
def test_data_that_cannot_train_or_evaluate_the_run_leaves_it_queued(command, make, words, tmp_path, capsys,
                                                                    monkeypatch):
    data, db = make(tmp_path / "data"), tmp_path / "r.db"
    queued_db(db, micro_run("run", **SHORT)).dispose()
    before = runs(db)
    code, err = cli([*command, "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                     "--plain"], capsys, monkeypatch)
    assert code == 2 and words.format(d=data) in err and len(err.strip().splitlines()) == 1, err
    assert runs(db) == before  # queued, the attempt not counted, nothing recorded
    assert sqlite3.connect(db).execute("select count(*) from evaluations").fetchone() == (0,)
    assert not (tmp_path / "runs" / "run").exists()


# ----------------------------------------------------------------------------- exit codes


def test_ctrl_c_checkpoints_requeues_and_exits_130(tmp_path):
    data = write_data(tmp_path / "data")
    # far more steps than the time the signal takes to arrive: the run cannot end first
    queued_db(tmp_path / "r.db", micro_run("run", steps=5000, eval_interval=5000, checkpoint_interval=10)).dispose()
    proc = spawn(["train", "run", "--db", "r.db", "--data", str(data), "--runs-dir", "runs", "--plain"], tmp_path)
    wait_for(tmp_path / "runs" / "run" / "step_00000010.pt", proc)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "Traceback" not in out, out
    status, path = sqlite3.connect(tmp_path / "r.db").execute("select status, checkpoint_path from runs").fetchone()
    assert status == "queued" and "run: released at step" in out, out
    # and how training goes on, which "released" alone left to guess
    assert "hint: queued again; run the same command to resume run from step" in out, out
    assert load_checkpoint(tmp_path / "runs" / path)["step"] >= 10


def test_a_launcher_exits_128_plus_the_signal_only_when_every_process_stopped_as_asked():
    from fibctl.flows.worker import stopped_code

    sigint, sigterm = int(signal.SIGINT), int(signal.SIGTERM)
    assert stopped_code([143, 0], [sigint]) == 130  # one worker stopped, one had nothing queued
    assert stopped_code([0], [sigterm, sigint]) == 143  # a torchrun group: the first signal counts
    assert stopped_code([143, 2], [sigint]) == 143  # a worker that refused: the worst code
    assert stopped_code([1, 0], []) == 1 and stopped_code([], []) == 0


def test_an_option_not_given_is_not_named_in_the_refusal(tmp_path, capsys, monkeypatch):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    code, err = cli(["worker", "--db", str(db), "--max-attempts", "0"], capsys, monkeypatch)
    assert code == 2 and err.strip() == "error: --max-attempts (0) must be >= 1", err
    code, err = cli(["worker", "--db", str(db), "--max-runs", "0", "--max-attempts", "0"], capsys, monkeypatch)
    assert code == 2 and err.strip() == "error: --max-attempts (0) and --max-runs (0) must be >= 1", err


# ----------------------------------------------------------------------------- log lines


def test_plain_log_lines_stay_one_line_in_a_file(tmp_path):
    data, name = write_data(tmp_path / "data"), "a_run_whose_name_alone_is_wider_than_eighty_columns_" + "x" * 40
    queued_db(tmp_path / "r.db", micro_run(name, **SHORT)).dispose()
    done = spawn(["worker", "--db", "r.db", "--data", str(data), "--runs-dir", "runs", "--plain"], tmp_path)
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    # steps 1 and 10, an evaluation line per held-out set, the outcome with its checkpoint,
    # the worker's summary, what to run next (sampling the run): each whole, on its line
    assert [line.split(" ")[0] for line in lines] == ([name] * (2 + len(HELDOUT))
                                                      + [f"{name}:", "worker:", "next:"]), out
    assert all(name in line for line in lines), out
    assert lines[-3].startswith(f"{name}: done at step 10 in ")
    assert lines[-3].endswith(f" (runs/{name}/step_00000010.pt)")


def test_plain_log_lines_say_what_the_database_records(tmp_path):
    """nanoGPT's line (step, loss, lr, time per step, tokens/s, ETA) at step 1, every 10 steps
    and the last; a line per held-out set when the run evaluates; at the end one line with
    the time taken and the final perplexities. Each number is the one the database holds."""
    import math
    import re

    data = write_data(tmp_path / "data")
    queued_db(tmp_path / "r.db", micro_run("run", steps=20, eval_interval=10, checkpoint_interval=20)).dispose()
    done = spawn(["worker", "--db", "r.db", "--data", str(data), "--runs-dir", "runs", "--plain"], tmp_path)
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    db = sqlite3.connect(tmp_path / "r.db")
    losses = dict(db.execute("SELECT step, loss FROM train_steps"))
    lr = dict(db.execute("SELECT step, lr FROM train_steps"))
    evals = {(step, dataset): loss for step, dataset, loss in db.execute("SELECT step, dataset, loss FROM evaluations")}
    number = r"[0-9.]+(?:e-?[0-9]+)?"
    steps = [re.fullmatch(rf"run (\d+)/20 loss ({number}) lr ({number}) {number}m?s {number}[kM]? tok/s"
                          rf"(?: ETA \d+(?:m\d\d)?s)?", line) for line in out.splitlines()
             if re.match(r"run \d+/20 loss", line)]
    assert all(steps) and [int(m[1]) for m in steps] == [1, 10, 20], out
    for m in steps[1:]:  # the steps the database logged (every log_interval = 5)
        step = int(m[1])
        assert float(m[2]) == pytest.approx(losses[step], abs=5e-4) and float(m[3]) == pytest.approx(lr[step], rel=0.05)
    assert "ETA" in out.splitlines()[0] and "ETA" not in [line for line in out.splitlines() if "run 20/20 loss" in line][0]
    shown = re.findall(r"^run (\d+)/20 eval (\w+) loss ([0-9.]+) ppl ([0-9.]+)$", out, re.M)
    assert sorted((int(s), d) for s, d, _, _ in shown) == sorted(evals), out
    for step, dataset, loss, ppl in shown:
        assert float(loss) == pytest.approx(evals[int(step), dataset], abs=5e-4)
        assert float(ppl) == pytest.approx(math.exp(evals[int(step), dataset]), abs=5e-3)
    [summary] = [line for line in out.splitlines() if line.startswith("run: ")]
    final = ", ".join(f"{d} {math.exp(evals[20, d]):.2f}" for d in HELDOUT)
    assert re.fullmatch(rf"run: done at step 20 in \d+s; final ppl {final} \(runs/run/step_00000020.pt\)",
                        summary), summary


def test_a_paper_runs_log_line_fits_80_columns():
    from fibctl.cli.train import progress_line
    from fibctl.train.trainer import Progress

    slow = Progress(12_000, 13_000, 3.45678, 512_345.0, 3600.0, 3.0e-5, 1.2345, 5025.0)
    fast = Progress(9, 13_000, 10.3, 999.7, 3.0, 2.7e-6, 0.0123, 3.0e5)
    assert progress_line("f13__fib_stagger_w12", slow) == \
        "f13__fib_stagger_w12 12000/13000 loss 3.457 lr 3.0e-5 1.23s 512k tok/s ETA 1h23m"
    assert progress_line("f13__fib_stagger_w12", fast) == \
        "f13__fib_stagger_w12 9/13000 loss 10.300 lr 2.7e-6 12.3ms 1.00k tok/s ETA 83h20m"
    assert len(progress_line("f13__fib_stagger_w12", slow)) <= 80


def test_the_log_lines_numbers_keep_three_significant_figures():
    """'22k tok/s' and '60ms' beside '21.6k' and '54.3ms' the line before: a value that came
    out round lost its trailing zeros, and the numbers of one log changed width and precision."""
    from fibctl.cli.train import progress_line
    from fibctl.train.trainer import Progress

    line = progress_line("run", Progress(5, 10, 3.0, 22_000.0, 5.0, 1e-3, 0.060, 5.0))
    assert " 60.0ms 22.0k tok/s " in line, line
    line = progress_line("run", Progress(5, 10, 3.0, 812.0, 5.0, 1e-3, 0.5, 5.0))
    assert " 500ms 812 tok/s " in line, line  # three digits: no trailing point
    assert " 1.00M tok/s " in progress_line("run", Progress(5, 10, 3.0, 1e6, 5.0, 1e-3, 0.5, 5.0))


def test_a_step_just_under_a_second_is_written_in_seconds_not_as_1e03ms():
    from fibctl.cli.train import progress_line
    from fibctl.train.trainer import Progress

    for step_s, shown in ((0.9997, " 1.00s "), (0.9995, " 1.00s "), (0.9994, " 999ms "), (1.0, " 1.00s ")):
        line = progress_line("run", Progress(5, 10, 3.0, 1000.0, 5.0, 1e-3, step_s, 5.0))
        assert shown in line and "e+" not in line, line


def test_a_rank_that_finished_its_loop_outlives_torchruns_sigterm_to_report():
    """torchrun sends SIGTERM to the group once a rank has ended; rank 0, its loop over, is
    then saying why the run is queued again: the signal is noted, not fatal. Elsewhere the
    handlers are restored as they were."""
    from fibctl.flows.worker import StopRequest, stop_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest()
        with stop_on_signals(stop, rank=True):
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # would end this process under the default handler
        assert stop.is_set()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    with stop_on_signals(StopRequest()):
        pass
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("in_slurm_job", [False, True])
def test_a_rank_of_a_slurm_job_takes_a_repeated_sigterm_for_the_same_stop(monkeypatch, in_slurm_job):
    """scancel's SIGTERM reaches a SLURM job's ranks from SLURM, their task and torchrun: the
    second is not the abort (no checkpoint) it is elsewhere, where a second Ctrl-C or SIGTERM
    forces the stop; SIGINT forces it in both."""
    from fibctl.flows.torchrun import JOB_TASK
    from fibctl.flows.worker import StopRequest, stop_on_signals

    monkeypatch.delenv(JOB_TASK, raising=False)
    if in_slurm_job:
        monkeypatch.setenv(JOB_TASK, "12 0 0")
    def sent(signum: int) -> str:
        try:
            os.kill(os.getpid(), signum)
        except KeyboardInterrupt:
            return "forced"
        return "noted"

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest()
        with stop_on_signals(stop, rank=True):
            assert sent(signal.SIGTERM) == "noted" and stop.signal == signal.SIGTERM
            again = "noted" if in_slurm_job else "forced"
            assert [sent(signal.SIGTERM), sent(signal.SIGTERM), sent(signal.SIGINT)] == [again, again, "forced"]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_resumed_runs_first_step_has_a_line(capsys):
    """Resumed from step 100, the first line was at 110: nothing said where the run resumed."""
    from fibctl.cli.train import RunDisplay
    from fibctl.flows.worker import Outcome
    from fibctl.train.trainer import Progress

    display = RunDisplay(plain=True)
    show = display.start("run", 300)
    for step in range(101, 121):
        show(Progress(step, 300, 3.0, 5000.0, 10.0, 1e-3, 0.1, 20.0))
    display.finish(Outcome("run", "released", 120))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["101/300", "110/300", "120/300"], lines
    assert lines[-1] == "run: released at step 120"  # no time or perplexity: it did not finish
    display.finish(Outcome("run", "failed", 120, "step 121 gave a loss of nan", hint="lower the lr"))
    out = capsys.readouterr()
    assert out.out == "run: failed at step 120: step 121 gave a loss of nan\n" and out.err == "hint: lower the lr\n"


@pytest.mark.parametrize("name", ["f13__fib_stagger_w12", "fixed_w4"])
def test_the_bar_on_an_80_column_terminal_cuts_no_number(monkeypatch, name):
    """The bar's columns (bar, step count, loss, tokens/s, elapsed, ETA) were wider than 80
    columns with a paper run's name, and rich cut them: '60…', 'ETA 0:0…'. The bar now has
    the room the log line leaves, or is left out."""
    import io
    import re

    from rich.console import Console

    from fibctl.cli import train as cli_train
    from fibctl.flows.worker import Outcome
    from fibctl.train.trainer import Progress

    screen = io.StringIO()
    monkeypatch.setattr(cli_train, "console", Console(file=screen, width=80, force_terminal=True,
                                                      color_system=None))
    display = cli_train.RunDisplay(plain=False)
    show = display.start(name, 13_000)
    for step in (1, 6000, 12_000):
        show(Progress(step, 13_000, 3.4567, 512_345.0, 100.0, 3e-4, 0.1, 5025.0,
                      {"fineweb_edu_val": 3.3} if step == 6000 else {}))
        display.progress.refresh()
    display.finish(Outcome(name, "released", 12_000))
    frames = [line for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()))
              if line.strip()]
    assert "…" not in screen.getvalue() and all(len(line) <= 80 for line in frames), frames
    assert any(line.startswith(name) and line.endswith(" 12000/13000 loss 3.457 lr 3.0e-4 100ms 512k tok/s "
                                                        "ETA 1h23m") for line in frames), frames
    assert f"{name} 6000/13000 eval fineweb_edu_val loss 3.300 ppl 27.11" in frames


def test_the_worker_s_last_line_is_folded_on_a_terminal_and_whole_in_a_file(monkeypatch):
    """It was printed unwrapped on a terminal too: 132 columns for two paper runs at 80."""
    import io

    from rich.console import Console

    from fibctl.cli import train as cli_train
    from fibctl.flows.worker import Outcome

    outcomes = [Outcome(f"f{i:02d}__fib_stagger_w12", "done", 13_000) for i in range(4)]
    for terminal in (True, False):
        out = io.StringIO()
        monkeypatch.setattr(cli_train, "console", Console(file=out, width=80, force_terminal=terminal,
                                                          color_system=None))
        cli_train._summary(outcomes, "unread.db", 600)  # with runs taken, the database is not read
        lines = out.getvalue().splitlines()
        assert (len(lines) > 1 and all(len(line) <= 80 for line in lines)) if terminal else len(lines) == 1, lines
        assert " ".join(out.getvalue().split()).startswith("worker: 4 run(s): f00__fib_stagger_w12 done, f01__")


def test_training_that_empties_the_queue_ends_with_the_next_commands(tmp_path, monkeypatch, capsys):
    """`worker: 2 run(s): a done, b done` ended the command, and a user who came from nanoGPT
    had to find eval, the reports and sample in the docs: once the queue is trained (not
    before: --max-runs), the worker names them, at 4x the runs' training length (micro: 64),
    and `train NAME` names them for its run; after probe runs, Table 2."""
    from cli_helpers import ran

    data = write_data(tmp_path / "data")
    db = tmp_path / "r.db"
    short = dict(steps=2, warmup_steps=1, eval_interval=2, checkpoint_interval=2)
    queued_db(db, micro_run("a", **short), micro_run("b", **short)).dispose()
    common = ["--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--plain"]
    code, out, err = ran(monkeypatch, capsys, "worker", "--max-runs", "1", *common)
    assert code == 0 and out.splitlines()[-1] == "worker: 1 run(s): a done", err + out  # b waits
    code, out, err = ran(monkeypatch, capsys, "worker", *common)
    assert code == 0, err
    assert out.splitlines()[-1] == ("next: `fibctl eval --all --length 256` measures past the training length "
                                    "(4x), then `fibctl report table3`; `fibctl sample b` writes text"), out
    queued_db(db, micro_run("c", **short)).dispose()
    code, out, err = ran(monkeypatch, capsys, "train", "c", *common)
    assert code == 0, err
    assert out.splitlines()[-1].startswith("next: `fibctl eval c --length 256` measures past"), out
    # probe runs have no text to measure or sample: Table 2 reads them
    assert ran(monkeypatch, capsys, "probe", "--db", str(db), "--depth", "2", "--init", "uniform", "--seed", "0",
               "--steps", "2", "--length", "64", "--distance", "20", "--distance", "35",
               "--eval-sequences", "2")[0] == 0
    code, out, err = ran(monkeypatch, capsys, "worker", *common)
    assert (code, out.splitlines()[-1]) == (0, "next: `fibctl report table2` reads the probe's runs"), err + out
