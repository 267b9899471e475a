"""A terminal that cannot show every character, and a Ctrl-C wherever it lands: one line at
most on stderr, never a traceback; 130 after a Ctrl-C, whatever the code it landed in did
with its KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import Terminal

EXAMPLE = str(Path(__file__).resolve().parent.parent / "results.db.example")
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8")}
ENV.update(COLUMNS="80", TERM="dumb", NO_COLOR="1")


def _run(args, env, timeout=120, python=()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python, "-m", "fibctl", *args], capture_output=True, env=env,
                          timeout=timeout)


# --- output encodings ---------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_report_table3_prints_on_a_terminal_without_delta(encoding):
    """Table 3's `Δ at 4x` column failed the whole command with UnicodeEncodeError (exit 1)."""
    done = _run(["report", "table3", "--db", EXAMPLE, "--all-runs"], {**ENV, "PYTHONIOENCODING": encoding})
    err = done.stderr.decode(encoding, "replace")
    assert done.returncode == 0 and "Traceback" not in err, err[-2000:]
    out = done.stdout.decode(encoding)  # every byte in the terminal's encoding
    assert "? at 4x" in out and "+----" in out  # the character it lacks, and rich's ASCII boxes


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_sql_shows_a_character_the_terminal_lacks_as_a_question_mark(encoding):
    done = _run(["sql", "--db", EXAMPLE, "select 'Δ' as v, 'x' as w"], {**ENV, "PYTHONIOENCODING": encoding})
    err = done.stderr.decode(encoding, "replace")
    assert done.returncode == 0 and "Traceback" not in err, err[-2000:]
    out = done.stdout.decode(encoding)
    assert "?" in out and "x" in out


def test_in_the_c_locale_report_all_prints_and_writes_its_files_as_utf8(tmp_path):
    """LANG=C without Python's UTF-8 mode: stdout is ASCII, and so was every file the report
    wrote (open()'s default): table3.md failed with UnicodeEncodeError, exit 1."""
    env = {**ENV, "LANG": "C", "LC_ALL": "C"}
    out = tmp_path / "rep"
    done = _run(["report", "all", "--db", EXAMPLE, "--out", str(out)], env, python=("-X", "utf8=0"))
    err = done.stderr.decode("ascii", "replace")
    assert done.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert done.stdout.decode("ascii").startswith("wrote ")
    for name in ("table3.md", "table3.txt", "table3.csv", "index.html"):
        assert "Δ" in (out / name).read_text(encoding="utf-8"), name
    done = _run(["report", "table3", "--db", EXAMPLE], env, python=("-X", "utf8=0"))
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    done.stdout.decode("ascii")


# --- Ctrl-C ------------------------------------------------------------------------------

def _fibctl_with(patch: str, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """`fibctl ARGS` as the program runs (fibctl.__main__, its SIGINT handler), after `patch`,
    Python that sends the Ctrl-C from wherever it makes it land. `stdout`: where its output
    goes (a pty's end: a terminal), read by the caller if not a pipe."""
    script = ("import functools, os, signal, sys, weakref\n"
              + patch
              + f"sys.argv = ['fibctl', *{list(args)!r}]\n"
              "from fibctl.__main__ import main\n"
              "main()\n")
    return subprocess.run([sys.executable, "-c", script], stdout=stdout, stderr=subprocess.PIPE, text=True, env=ENV,
                          timeout=120)


# `in_a_callback(f)`: f, whose calls first send a Ctrl-C that lands in a weakref's callback,
# where Python prints "Exception ignored" and runs on
CALLBACK = """
class Thing:
    pass
def in_a_callback(build):
    @functools.wraps(build)
    def built(*args, **kwargs):
        thing = Thing()
        ref = weakref.ref(thing, lambda ref: os.kill(os.getpid(), signal.SIGINT))
        del thing  # its callback runs here
        return build(*args, **kwargs)
    return built
"""
IN_A_CALLBACK = CALLBACK + """
from fibctl.reports import tables
tables.TABLES['table3'] = in_a_callback(tables.TABLES['table3'])
"""

# the Ctrl-C lands in matplotlib's PDF writer as it ends a stream, which its clean-up then
# ends again: AttributeError: 'Stream' object has no attribute 'pos'
IN_THE_PDF_WRITER = """
import matplotlib.backends.backend_pdf as pdf
header, calls = pdf.Stream._writeHeader, []
def interrupted(self):
    if sys._getframe(1).f_code.co_name == 'end' and not calls:
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)
    return header(self)
pdf.Stream._writeHeader = interrupted
"""

# the Ctrl-C comes while index.html is written, after the last table and figure
IN_THE_INDEX = """
from fibctl.reports import html
page = html.page
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return page(*args, **kwargs)
html.page = interrupted
"""


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 130, (done.returncode, done.stderr[-3000:])
    lines = [line for line in done.stderr.splitlines() if not line.startswith("skipped ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _no_part_files(out: Path) -> None:
    assert not [p.name for p in out.iterdir() if ".part" in p.name]
    for pdf in out.glob("*.pdf"):
        data = pdf.read_bytes()
        assert data.startswith(b"%PDF") and data.rstrip().endswith(b"%%EOF"), pdf.name


@pytest.mark.parametrize("patch, name", [(IN_A_CALLBACK, "callback"), (IN_THE_PDF_WRITER, "pdf")])
def test_report_all_stops_at_a_ctrl_c_wherever_it_lands(patch, name, tmp_path):
    """Lost in a weakref's callback, the Ctrl-C printed 'Exception ignored' and the report ran
    to its end (exit 0); in matplotlib's PDF writer it became an AttributeError (a traceback,
    exit 1). Either way: exit 130, one line, the files written before it complete."""
    out = tmp_path / "rep"
    done = _fibctl_with(patch, "report", "all", "--db", EXAMPLE, "--out", str(out))
    line = _one_line(done)
    assert line.startswith("interrupted; the ") and "files written before it" in line, line
    assert not (out / "index.html").exists()
    _no_part_files(out)


def test_a_ctrl_c_while_the_index_is_written_ends_the_complete_report_with_130(tmp_path):
    """It said 'nothing was written' and left the report without its index.html."""
    out = tmp_path / "rep"
    done = _fibctl_with(IN_THE_INDEX, "report", "all", "--db", EXAMPLE, "--out", str(out))
    assert _one_line(done) == f"interrupted; the report was complete: its 29 files are in {out}/"
    assert (out / "index.html").is_file() and (out / ".fibctl-report").is_file()
    _no_part_files(out)


def test_a_ctrl_c_lost_in_a_callback_still_ends_a_short_command_with_130():
    done = _fibctl_with(IN_A_CALLBACK, "report", "table3", "--db", EXAMPLE)
    assert _one_line(done) == "interrupted"


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_status_watch_ends_at_a_ctrl_c_lost_in_a_callback(terminal):
    """`status --watch` ran on, drawing its views, after a Ctrl-C lost in a weakref's callback
    (its KeyboardInterrupt ignored there): a watch has no end of its own, and nothing in it
    looked at the Ctrl-C noted. A test once waited 60 s for a watch sent SIGINT, under load."""
    patch = CALLBACK + "from fibctl import queue\nqueue.progress = in_a_callback(queue.progress)\n"
    args = ("status", "--db", EXAMPLE, "--watch", "--every", "0.2")
    if not terminal:
        assert _one_line(_fibctl_with(patch, *args)) == "interrupted"
        return
    with Terminal() as shown:
        done = _fibctl_with(patch, *args, stdout=shown.secondary)
    assert _one_line(done) == "interrupted" and b" done" in shown.shown, shown.shown


def test_report_all_sent_a_ctrl_c_at_any_point_exits_130_with_one_line(tmp_path):
    """Real SIGINTs, sent as the report has written more and more of its files (and one while
    the command line starts): each lands somewhere else, in a query, a figure's drawing or
    its PNG or PDF writer, between files."""
    for i, after in enumerate([None, 0, 3, 7, 12, 18, 22, 26]):
        out = tmp_path / f"rep{i}"
        proc = subprocess.Popen([sys.executable, "-m", "fibctl", "report", "all", "--db", EXAMPLE, "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        start = time.monotonic()
        while proc.poll() is None:
            written = len([p for p in out.iterdir() if not p.name.startswith(".")]) if out.is_dir() else -1
            if (written >= after) if after is not None else time.monotonic() - start > 0.4:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if (out / "index.html").exists() and proc.returncode == 0:  # it had ended before the signal
            assert "Traceback" not in stderr and stdout.startswith("wrote 29 files"), stderr
            continue
        line = _one_line(done)
        assert line.startswith("interrupted"), (after, line)
        if out.is_dir():
            _no_part_files(out)


def test_a_ctrl_c_just_after_the_temporary_file_is_made_leaves_none_behind(tmp_path, monkeypatch):
    """Made before the `try` that removes it, a report file's temporary was left in the folder
    by a Ctrl-C landing in between (seen once in the test above, under load)."""
    from fibctl.reports import output

    real_close = os.close

    def close_then_interrupted(fd):
        real_close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(output.os, "close", close_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        output.write_text(tmp_path / "table3.txt", "x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stopped", [KeyboardInterrupt(), SystemExit(143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_a_connection_closes_is_raised_on_without_the_pool_s_traceback(
        stopped, tmp_path, monkeypatch, caplog):
    """`worker --ddp` sent a Ctrl-C as it closed its check's connection printed SQLAlchemy's
    "Exception closing connection" and a traceback above its `interrupted` (seen under load)."""
    from fibctl.db.engine import connect

    engine = connect(str(tmp_path / "r.db"))
    engine.connect().close()  # one connection in the pool, which dispose closes

    def close(connection):
        raise stopped

    monkeypatch.setattr(engine.dialect, "do_close", close)
    with caplog.at_level("DEBUG", logger="sqlalchemy"), pytest.raises(type(stopped)):
        engine.dispose()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_an_error_while_a_connection_closes_is_still_logged(tmp_path, monkeypatch, caplog):
    from fibctl.db.engine import connect

    engine = connect(str(tmp_path / "r.db"))
    engine.connect().close()  # one connection in the pool, which dispose closes

    def close(connection):
        raise OSError("disk gone")

    monkeypatch.setattr(engine.dialect, "do_close", close)
    engine.dispose()  # SQLAlchemy logs a failed close and goes on
    assert any(r.exc_info and isinstance(r.exc_info[1], OSError) for r in caplog.records)


def test_psycopgs_warnings_on_cancelling_an_interrupted_query_are_not_printed(tmp_path, caplog):
    """A Ctrl-C in `status --watch` on PostgreSQL, landing in a query the server was ending,
    printed psycopg's "query cancellation interrupted (AdminShutdown): closing connection"
    above `interrupted` (seen in tests/test_queue.py's watch test); its other warnings stay."""
    import logging

    from fibctl.db.engine import connect

    connect(str(tmp_path / "r.db")).dispose()  # any database: psycopg is loaded for a server's
    psycopg = logging.getLogger("psycopg")
    with caplog.at_level("WARNING", logger="psycopg"):
        psycopg.warning("query cancellation interrupted (%s): closing connection", "AdminShutdown")
        psycopg.warning("query not terminated after cancellation: closing connection")
        psycopg.warning("query cancellation failed: %s", "timeout")
        psycopg.warning("error ignoring the notice: %s", "x")
    assert [r.getMessage() for r in caplog.records] == ["error ignoring the notice: x"]


def _quiet_143(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert [line for line in done.stderr.splitlines() if not line.startswith("skipped ")] == []


def test_a_sigterm_lost_in_a_callback_still_ends_a_short_command_with_143():
    """Its SystemExit, raised in a weakref's callback, printed 'Exception ignored' and the
    command ran on to exit 0 (`report all` under load)."""
    _quiet_143(_fibctl_with(IN_A_CALLBACK.replace("SIGINT", "SIGTERM"), "report", "table3", "--db", EXAMPLE))


@pytest.mark.parametrize("patch", [IN_A_CALLBACK, IN_THE_PDF_WRITER], ids=["callback", "pdf"])
def test_report_all_stops_at_a_sigterm_wherever_it_lands(patch, tmp_path):
    out = tmp_path / "rep"
    _quiet_143(_fibctl_with(patch.replace("SIGINT", "SIGTERM"), "report", "all", "--db", EXAMPLE, "--out", str(out)))
    assert not out.exists()  # a folder the report made holds no part of one (export.write_all)


# the Ctrl-C comes while pandas' JSON writer (C) asks an object of the table for its value
IN_THE_JSON_WRITER = """
from fibctl.reports import tables
class Pressed:
    def toDict(self):
        os.kill(os.getpid(), signal.SIGINT)
        return {}
def pressed(build):
    def built(*args, **kwargs):
        table = build(*args, **kwargs)
        table.frame = table.frame.assign(pressed=[Pressed() for _ in range(len(table.frame))])
        return table
    return built
tables.TABLES['table1'] = pressed(tables.TABLES['table1'])
"""


def test_a_ctrl_c_inside_pandas_json_writer_ends_the_command_after_it():
    """A KeyboardInterrupt raised inside pandas' JSON writer (ujson, C) was swallowed there (the
    table was printed whole before `interrupted`) or crashed `report all` with a segmentation
    fault (exit -11, nothing said; about one Ctrl-C in 75): the Ctrl-C now waits until the
    writer is done."""
    done = _fibctl_with(IN_THE_JSON_WRITER, "report", "table1", "--db", EXAMPLE, "--format", "json")
    assert _one_line(done) == "interrupted" and done.stdout == ""
