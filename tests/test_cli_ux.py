"""What a user sees of the command line: start-up without the heavy libraries, flags shown
as flags, option names that agree across commands, tables that fit 80 columns."""

from __future__ import annotations

import io
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ENV80 = {**os.environ, "COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}


def fibctl(*args, env=ENV80, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, env=env,
                          timeout=120, **kwargs)


def test_the_command_line_starts_without_torch_or_matplotlib():
    """`fibctl --help`, `queue ls`, `report`, `sql` import fibctl.cli only: torch and
    matplotlib load inside the commands that train, evaluate or draw."""
    probe = ("import sys, time; t = time.perf_counter(); import fibctl.cli; "
             "print(time.perf_counter() - t); print(' '.join(sorted(m for m in ('torch', 'matplotlib', "
             "'tensorboard', 'wandb', 'tokenizers', 'datasets') if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seconds, loaded = done.stdout.splitlines()
    assert loaded == "", f"fibctl.cli imported {loaded} ({float(seconds):.2f} s)"


def test_the_model_loads_without_torchs_compiler():
    """torch._dynamo (about 2 s of every command's start on a 2-core VM) loads only when a run
    compiles: the model keeps its learned layers out of the trace without importing it."""
    probe = ("import sys; import fibctl.model, fibctl.train.trainer, fibctl.flows.evaluation; "
             "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def help_text(*command: str) -> str:
    """`fibctl COMMAND --help` at 80 columns, from the app in this process (a new Python for
    each help text cost seconds)."""
    from typer.testing import CliRunner

    from fibctl.cli import app

    done = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"})
    assert done.exit_code == 0, done.output
    return done.output


def test_flags_show_as_flags_and_help_paragraphs_wrap():
    out = help_text("demo")
    assert "<bool>" not in out and "--quick" in out and "--plain" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    for command in (["worker"], ["sql"], ["eval"], ["data", "prepare"], ["queue", "rm"], ["probe"], ["figure"]):
        out = help_text(*command)
        assert "<bool>" not in out and "--help" in out, command
        # a repeatable option shows the type of one value, not Python's <list[int]>
        assert "list[" not in out, command
    assert re.search(r"--length +<int> ", help_text("eval"))


def test_piped_help_ends_no_line_with_a_space():
    """typer pads each help line to the width; through a pipe those spaces are noise that
    `cat -A`, diffs and `grep ' $'` show."""
    done = fibctl("import-study", "--help")
    assert done.returncode == 0 and "Example:" in done.stdout, done.stderr
    assert [line for line in done.stdout.splitlines() if line.endswith(" ")] == []


def test_the_top_help_lists_every_command_once_in_the_order_of_the_work():
    """Headings in the order of the work, each command's first sentence only (the whole of
    `train --help` made the list three screens long)."""
    import click
    from typer.main import get_command

    from fibctl.cli import PANELS, app

    out = help_text()
    names = re.findall(r"^│ ([a-z][a-z-]+) ", out, re.M)
    assert names == [name for names in PANELS.values() for name in names]
    assert sorted(names) == sorted(click.Group.list_commands(get_command(app), None))  # every command
    assert [h for h in PANELS if f"─ {h} ─" in out] == list(PANELS)
    assert out.index("─ Start here ─") < out.index("│ demo ") < out.index("─ Data and training ─")
    assert len(out.splitlines()) < 60 and all(len(line) <= 80 for line in out.splitlines())


def _leaf_commands():
    """Every command a user runs (`queue add`, `report table1`, ...), as its path of names."""
    import click
    from typer.main import get_command

    from fibctl.cli import app

    def walk(group, path):
        for name in group.list_commands(None):
            command = group.get_command(None, name)
            if isinstance(command, click.Group):
                yield from walk(command, [*path, name])
            else:
                yield [*path, name], command

    return list(walk(get_command(app), []))


def test_every_command_with_options_shows_an_example_that_parses():
    """`fibctl eval --help` (and most others) explained each option but never showed a command
    line using them, which a user coming from nanoGPT or W&B looks for first. Each example fits
    one line at 80 columns, for copying, and uses only options the command has (parsed with
    --help after it, so nothing runs)."""
    import shlex

    from typer.testing import CliRunner

    from fibctl.cli import app

    for path, command in _leaf_commands():
        if not [p for p in command.params if p.name != "help"]:  # `data recipes`: nothing to show
            continue
        line = next((line for line in help_text(*path).splitlines() if "Example: " in line), None)
        assert line is not None, f"fibctl {' '.join(path)} --help shows no example"
        example = line.split("Example: ", 1)[1].rstrip(" │")
        words = shlex.split(example)
        assert words[:1 + len(path)] == ["fibctl", *path], line  # whole on its line, this command
        done = CliRunner().invoke(app, [*words[1:], "--help"], env={"COLUMNS": "80"})
        assert done.exit_code == 0 and "Usage:" in done.output, (example, done.output)


# ----------------------------------------------------------------------------- 80 columns

REPO_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results.db.example")


def assert_fits(text: str, width: int = 80) -> None:
    assert "…" not in text, text
    assert all(len(line) <= width for line in text.splitlines()), text


def test_queue_ls_shows_an_errors_control_codes_instead_of_obeying_them(tmp_path):
    """A run's error is text from anywhere (a traceback quoting data): ESC [2J would clear the
    screen, a carriage return overwrite the line."""
    from fibctl import queue
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect

    engine = connect(str(tmp_path / "q.db"))
    queue.add_runs(engine, [RunConfig.resolve("r", "test", "micro", schedule="fixed")])
    queue.fail(engine, queue.claim_next(engine, "w").id, "ValueError: bad \x1b[2Jtoken\rX")
    engine.dispose()
    done = fibctl("queue", "ls", "--db", str(tmp_path / "q.db"))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\r" not in done.stdout
    assert "\\x1b[2Jtoken\\rX" in "".join(done.stdout.split())


def test_queue_ls_at_80_columns_cuts_no_cell(tmp_path):
    import shutil

    from fibctl import queue
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect

    done = fibctl("queue", "ls", "--db", REPO_EXAMPLE)
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout)
    assert all(n in done.stdout for n in ("fib_stagger_w8", "fib_fixed_w8", "dense", " done "))
    # a failed run's long error and a long worker name fold onto more lines instead of '…'
    db = str(tmp_path / "q.db")
    engine = connect(db)
    configs = [RunConfig.resolve(f"a_rather_long_run_name_{i}", "test", "micro", schedule="stagger") for i in range(2)]
    queue.add_runs(engine, configs)
    run = queue.claim_next(engine, "gpu-node-0042.cluster.example.org:123456:gpu7")
    queue.fail(engine, run.id, "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total)")
    engine.dispose()
    done = fibctl("queue", "ls", "--db", db)
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout)
    flat = "".join(done.stdout.split())  # folded cells read whole once the table's spacing is gone
    assert "failed" in done.stdout and "queued" in done.stdout and "a_rather_long_run_name_1" in done.stdout
    assert "Tried" in flat and "GiB" in flat
    queued_only = fibctl("queue", "ls", "--db", db, "--status", "queued")
    assert "no heartbeat" in queued_only.stdout  # a left-out column that is empty in every row
    wide = fibctl("queue", "ls", "--db", db, env={**ENV80, "COLUMNS": "200"})
    assert "heartbeat" in wide.stdout and "preset" in wide.stdout  # every column where there is room
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_matrix_show_paper_at_80_columns_cuts_no_cell():
    from fibctl.matrix import load_matrix

    done = fibctl("matrix", "show", "paper")
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout)
    for config in load_matrix("paper").resolve(None, None):
        split = f"{config.train.batch_size}x{config.train.grad_accum}"  # the micro-batch split, per run
        assert re.search(rf"│ {config.name} .*│ {split} +│", done.stdout), config.name
    # steps with a thousands separator, as queue show and the docs write them (it said 13000);
    # the length as fibctl writes T everywhere (it said T 1024)
    assert "preset paper; layers 16; T=1024; steps 13,000" in " ".join(done.stdout.split())
    assert "config hash" in fibctl("matrix", "show", "paper", env={**ENV80, "COLUMNS": "120"}).stdout


def test_a_run_s_window_and_batch_read_the_same_in_every_command():
    """The window was `W 8` in queue show and model, `W8` in Table 4's title and `W = 8` in a
    figure's legend, beside `W=8` in the coverage figure, Table 5 and the errors; the batch was
    `16x1` in matrix show and `16 x 128 tokens` in queue show. Now fibctl writes `W=8` and
    `T=128`, and a step's split `16x1` with its tokens; only Table 4's rows keep the paper's
    own labels (`fixed W8`)."""
    db = str(Path(__file__).resolve().parent.parent / "results.db.example")
    shown = fibctl("queue", "show", "fib_fixed_w8", "--db", db, "--events", "0")
    assert shown.returncode == 0, shown.stderr
    assert "model: fixed fib W=8; 4 layers, d 192, 6 heads (2 kv), vocab 4,096, T=128\n" in shown.stdout
    assert "recipe: 1,400 steps of 2,048 tokens (16x1 sequences of 128), lr 0.003, seed 42\n" in shown.stdout
    assert re.search(r"│ fib_fixed_w8 .*│ 16x1 +│", fibctl("matrix", "show", "demo").stdout)
    table4 = fibctl("report", "table4", "--db", db).stdout
    assert "Table 4: mean docs_val loss by position bin (fib, W=8, seed 42)" in table4
    assert "│ fixed W8   │" in table4 and "│ stagger W8 │" in table4


def test_sql_select_star_at_80_columns_shows_every_value():
    """`SELECT * FROM runs` (41 columns) drew a grid of empty cells at 80 columns: a result too
    wide to show side by side is printed a field a line, a rule between rows."""
    done = fibctl("sql", "--db", REPO_EXAMPLE, "SELECT * FROM runs ORDER BY id")
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout)
    for field, value in (("name", "fib_fixed_w8"), ("schedule", "stagger"), ("final_step", "1400")):
        assert re.search(rf"│ {field} +│ {value} +│", done.stdout), field
    narrow = fibctl("sql", "--db", REPO_EXAMPLE, "SELECT name, schedule FROM runs ORDER BY id")
    assert re.search(r"│ fib_fixed_w8 +│ fixed +│", narrow.stdout), narrow.stdout  # side by side where they fit


def test_sql_never_splits_a_value_mid_word_to_fit():
    """9 columns fit 3 characters each at 80 columns, so they were drawn side by side, folding
    `docs_val` into `docs_va` over `l`: a result whose words do not fit whole goes a field a line."""
    done = fibctl("sql", "--db", REPO_EXAMPLE, "SELECT * FROM evaluations ORDER BY id LIMIT 2")
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout)
    for field, value in (("dataset", "docs_val"), ("eval_length", "128"), ("ppl", r"\d+\.\d{10,}")):
        assert re.search(rf"│ {field} +│ {value} +│", done.stdout), done.stdout


def test_the_demo_headline_tables_at_80_columns_cut_no_cell():
    """The tables `fibctl demo` prints, from the database a full demo produced: columns that
    do not fit go to a second table, each value whole."""
    import io

    from rich.console import Console

    from fibctl.db.engine import connect_readonly
    from fibctl.reports import render, tables

    engine = connect_readonly(REPO_EXAMPLE)
    for table in (tables.table1(engine, matrix="demo", dense=True),
                  tables.table3(engine, matrix="demo", all_runs=True), tables.table4(engine, matrix="demo")):
        console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
        console.print(render.fitted(table, 80))
        text = console.export_text()
        assert_fits(text)
        for row in table.frame.itertuples(index=False):
            for column, value in zip(table.frame.columns, row):
                assert render.cell(table, column, value) in text, (column, value)


# ----------------------------------------------------------------------------- names and facts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_option_names_agree_across_commands():
    """A data folder is --data, an output format --format, plain output --plain, everywhere
    (the older spellings still work, as aliases)."""
    data_help = help_text("data", "prepare")
    assert "--data" in data_help and "--plain" in data_help
    for command in (["worker"], ["train"], ["eval"]):
        assert "--data" in help_text(*command), command
    assert "--plain" in help_text("worker") and "--plain" in help_text("demo")
    assert "--format" in help_text("sql") and "--format" in help_text("report", "table1")


def _tiny_recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "tiny.toml"
    # a sample of 20,000 characters for the tokenizer (the default, 50 million, took 20 s)
    recipe.write_text('name = "tiny"\nvocab_size = 300\ntrain_tokens = 3000\nheldout_tokens = 500\n'
                      'tokenizer_sample_chars = 20000\n\n'
                      '[[sources]]\nname = "gen"\nkind = "generated"\nseed = 1\nshare = 1.0\n'
                      'heldout = "gen_val"\nheldout_fraction = 0.1\n')
    return recipe


def test_data_prepare_writes_to_data_and_still_accepts_out(tmp_path):
    recipe = _tiny_recipe(tmp_path)
    done = fibctl("data", "prepare", str(recipe), "--data", str(tmp_path / "a"), "--plain")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a" / "manifest.json").is_file() and "prepared recipe 'tiny'" in " ".join(done.stdout.split())
    done = fibctl("data", "prepare", str(recipe), "--out", str(tmp_path / "b"), "-q")
    assert done.returncode == 0 and (tmp_path / "b" / "manifest.json").is_file(), done.stderr


def test_data_prepare_into_a_log_says_now_and_then_how_far_it_is(tmp_path, monkeypatch, capsys):
    """Not on a terminal (a log, a SLURM job's output), `data prepare` drew no bars and said
    nothing until it ended: hours, for the paper's recipe. It now writes a line for each task
    under way every LOG_EVERY_S (here at every update); --plain still writes none."""
    from cli_helpers import ran
    from fibctl.cli import data

    monkeypatch.setattr(data, "LOG_EVERY_S", 0.0)
    recipe = _tiny_recipe(tmp_path)
    code, _, err = ran(monkeypatch, capsys, "data", "prepare", str(recipe), "--data", str(tmp_path / "a"))
    assert code == 0, err
    said = err.splitlines()
    assert any(re.fullmatch(r"train tokens: [\d,]+ of 3,000 tokens \(\d+ %\)(, [\d.]+k? tokens/s)?, \d+s", line)
               for line in said), err
    assert max(map(len, said)) <= 80, err
    code, _, err = ran(monkeypatch, capsys, "data", "prepare", str(recipe), "--data", str(tmp_path / "b"), "--plain")
    assert (code, err) == (0, ""), err


def test_the_torch_floor_is_the_one_the_model_needs():
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    [torch_req] = [d for d in deps if re.match(r"torch\b", d)]
    assert ">=2.4" in torch_req  # nn.RMSNorm arrived in torch 2.4
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "torch 2.4 or later" in readme and "2.2+" not in readme
    assert "nn.RMSNorm" in open(os.path.join(ROOT, "fibctl", "model.py")).read()


def test_demo_quick_help_quotes_no_timing_of_a_machine():
    out = " ".join(fibctl("demo", "--help").stdout.replace("│", " ").split())
    assert "--quick" in out and "seconds rather than minutes" in out and "about 2 minutes" not in out


def test_report_tables_at_80_columns_cut_no_cell():
    """`fibctl report tableN` fits the terminal: columns that do not fit continue below."""
    root = Path(__file__).resolve().parent.parent
    for name in ("table1", "table3", "table4"):
        out = subprocess.run([sys.executable, "-m", "fibctl", "report", name, "--db", str(root / "results.db.example")],
                             capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"}, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "…" not in out.stdout and max(map(len, out.stdout.splitlines())) <= 80
        assert "fib_stagger_w8" in out.stdout  # a row of the demo's, whatever its numbers


def test_dash_h_is_help_and_version_names_fibctl_python_and_torch():
    import platform
    from importlib.metadata import version

    from typer.testing import CliRunner

    import fibctl
    from fibctl.cli import app

    assert help_text("queue", "ls") == CliRunner().invoke(
        app, ["queue", "ls", "-h"], env={"COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}).output
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0
    assert re.fullmatch(rf"fibctl {re.escape(fibctl.__version__)}, Python {re.escape(platform.python_version())}, "
                        rf"torch {re.escape(version('torch'))}\n(git [0-9a-f]{{40}}(\+dirty)?\n)?",
                        done.stdout), done.stdout
    assert all(len(line) <= 80 for line in done.stdout.splitlines())  # the commit beside them made 90


def test_shell_completion_completes_commands_and_options():
    """Tab completion was switched off (`fibctl --install-completion`: no such option), as the
    shell's hook found nothing; bash is asked the way its installed script asks."""
    assert "--install-completion" in help_text()
    for words, cword, expected in (("fibctl qu", "1", ["queue"]),
                                   ("fibctl queue ", "2", ["add", "ls", "cancel", "retry", "rm", "show"]),
                                   ("fibctl report table1 --com", "3", ["--compare"])):
        done = fibctl(env={**ENV80, "_FIBCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword})
        assert (done.returncode, done.stdout.split(), done.stderr) == (0, expected, ""), words
    script = subprocess.run([Path(sys.executable).parent / "fibctl", "--show-completion"], capture_output=True,
                            text=True, env={**ENV80, "SHELL": "/bin/bash"}, timeout=120)
    assert script.returncode == 0 and "_FIBCTL_COMPLETE=complete_bash" in script.stdout, script.stdout


def test_completion_started_from_no_shell_completes_for_the_shell_in_SHELL(monkeypatch):
    """typer looks for the shell among fibctl's ancestors: a suite started detached from its
    shell printed `Shell  not supported.` for --show-completion; $SHELL names it then."""
    import shellingham
    from typer.testing import CliRunner

    from fibctl.cli import app

    def no_shell():
        raise shellingham.ShellDetectionFailure()

    monkeypatch.setattr(shellingham, "detect_shell", no_shell)
    done = CliRunner().invoke(app, ["--show-completion"], env={"SHELL": "/usr/bin/zsh"})
    assert done.exit_code == 0 and "compdef _fibctl_completion fibctl" in done.output, done.output


@pytest.mark.parametrize("args,line", [
    (["eval", "x", "--length", "nan"], r"error: Invalid value for '--length': .* \(see `.*fibctl eval --help`\)"),
    (["queue", "ls", "--bogus"], r"error: No such option: --bogus \(see `.*fibctl queue ls --help`\)"),
    (["bogus"], r"error: No such command 'bogus'. \(see `.*fibctl --help`\)"),
    # two letters swapped: typer's close matches missed it
    (["queue", "sl"], r"error: No such command 'sl'. Did you mean 'ls'\? \(see `.*fibctl queue --help`\)"),
    (["eval", "x"], r"error: Missing option '--length'. \(see `.*fibctl eval --help`\)"),
    # click raises this one without the command's context: it had no hint
    (["queue", "ls", "--db"], r"error: Option '--db' requires an argument. \(see `.*fibctl queue ls --help`\)"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, line, monkeypatch, capsys):
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:  # fibctl's main in this process: no new Python to start
        main()
    out = capsys.readouterr()
    assert done.value.code == 2 and out.out == ""
    assert re.fullmatch(line, out.err.strip()), out.err


@pytest.mark.parametrize("command, patched, line", [
    (["data", "prepare", "quick", "--data", "{tmp}/d"], "fibctl.data.prepare.prepare",
     "interrupted; run the same command again to prepare {tmp}/d"),
    (["eval", "dense", "--length", "64", "--db", "{tmp}/r.db"], "fibctl.flows.evaluation.evaluate",
     "interrupted; the results measured before it are recorded: run the same command again to finish"),
    # these ended with exit 130 and nothing on stderr
    (["bench", "attention", "--length", "8"], "fibctl.flows.bench.bench_attention",
     "interrupted; a benchmark writes nothing: nothing is kept"),
    (["bench", "train", "--preset", "micro"], "fibctl.flows.bench.bench_train",
     "interrupted; a benchmark writes nothing: nothing is kept"),
    (["bench", "probe"], "fibctl.flows.bench.bench_probe", "interrupted; a benchmark writes nothing: nothing is kept"),
    (["report", "all", "--db", "{tmp}/r.db", "--out", "{tmp}/rep"], "fibctl.reports.export.write_all",
     "interrupted; nothing was written"),
])
def test_ctrl_c_in_a_long_command_is_one_line_and_exit_130(command, patched, line, tmp_path, monkeypatch, capsys):
    """typer ends a command a Ctrl-C stops with exit 130 and not a word (older typers: 'Aborted!'
    and exit 1): the long commands say what was kept, as `fibctl demo` and `fibctl sql` do."""
    import shutil

    from fibctl.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    shutil.copy(REPO_EXAMPLE, tmp_path / "r.db")
    monkeypatch.setattr(patched, interrupted)
    monkeypatch.setattr("fibctl.flows.evaluation.plan", lambda *a, **k: None)  # eval's checks: no data here
    monkeypatch.setattr(sys, "argv", ["fibctl", *(a.format(tmp=tmp_path) for a in command)])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 130 and out.out == ""
    assert out.err == line.format(tmp=tmp_path) + "\n"  # one line, also past 80 columns (a log file)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError])
def test_a_data_prepare_stopped_early_removes_the_folders_it_made_and_only_those(stop, tmp_path, monkeypatch, capsys):
    """`--data some/deeper/d` stopped before anything was in place left some/deeper/ behind."""
    from fibctl.cli import main

    def stopped(recipe, out, *args, **kwargs):
        out.parent.mkdir(parents=True, exist_ok=True)  # as prepare does first
        raise stop

    (tmp_path / "mine").mkdir()
    monkeypatch.setattr("fibctl.data.prepare.prepare", stopped)
    for data in ("some/deeper/d", "mine/a/b/d"):
        monkeypatch.setattr(sys, "argv", ["fibctl", "data", "prepare", "quick", "--data", str(tmp_path / data)])
        with pytest.raises((SystemExit, ValueError)):
            main()
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert list((tmp_path / "mine").iterdir()) == []


def test_report_all_interrupted_keeps_what_it_wrote_and_says_so(tmp_path, monkeypatch, capsys):
    import shutil

    from fibctl.cli import main
    from fibctl.reports import export

    write = export.write_text

    def interrupted(path, text):
        if path.name.startswith("table3"):
            raise KeyboardInterrupt
        return write(path, text)

    shutil.copy(REPO_EXAMPLE, tmp_path / "r.db")
    monkeypatch.setattr(export, "write_text", interrupted)
    rep = tmp_path / "rep"
    monkeypatch.setattr(sys, "argv", ["fibctl", "report", "all", "--db", str(tmp_path / "r.db"), "--out", str(rep)])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    kept = sorted(p.name for p in rep.glob("table1.*"))
    assert exit_.value.code == 130 and len(kept) == 6
    assert out.err.splitlines()[-1] == (f"interrupted; the 6 files written before it are in {rep}/ (no index.html): "
                                        "run the same command again for the whole report")
    assert not (rep / "index.html").exists()


def _damaged_copy(tmp_path) -> Path:
    """The example database with a page overwritten: some tables read, others fail midway."""
    import shutil

    db = tmp_path / "corrupt.db"
    shutil.copy(REPO_EXAMPLE, db)
    with open(db, "r+b") as f:
        f.seek(50000)
        f.write(b"\xde\xad" * 2000)
    return db


@pytest.mark.parametrize("command", [["report", "all", "--out", "{tmp}/rep/a"], ["report", "table2"]])
def test_a_damaged_database_is_named_in_one_line_and_no_report_is_left(command, tmp_path, monkeypatch, capsys):
    """It blamed the output folder ("cannot write the report into rep: Execution failed on sql
    ..." over 81 lines) and left rep/ with table1 in it; table2 was a traceback."""
    db = _damaged_copy(tmp_path)
    code, out, err = _in_process(capsys, monkeypatch, *(a.format(tmp=tmp_path) for a in command), "--db", str(db))
    assert code == 2 and err == f"error: {db} is not a usable database: database disk image is malformed\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.db"]


def test_a_run_list_that_fails_to_read_leaves_no_report_either(tmp_path, monkeypatch, capsys):
    """The page's run list is read after the tables and figures: a value there that SQLite
    cannot decode stopped the report with exit 2 but left rep/ with every file but index.html."""
    import shutil

    db = tmp_path / "r.db"
    shutil.copy(REPO_EXAMPLE, db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE runs SET host = CAST(x'ff41' AS TEXT)")  # not UTF-8: read by the run list only
    con.close()
    code, out, err = _in_process(capsys, monkeypatch, "report", "all", "--out", str(tmp_path / "rep"), "--db", str(db))
    assert code == 2 and len(err.splitlines()) == 1 and "decode" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.db"]


def test_ctrl_c_while_the_modules_import_exits_130_without_a_traceback():
    # the KeyboardInterrupt raised where a real one lands: inside the import of the command line
    stop_the_import = ("import sys\n"
                       "class Stop:\n"
                       "    def find_spec(self, name, path=None, target=None):\n"
                       "        if name == 'fibctl.cli':\n"
                       "            raise KeyboardInterrupt\n"
                       "sys.meta_path.insert(0, Stop())\n"
                       "from fibctl.__main__ import main\n"
                       "main()\n")
    done = subprocess.run([sys.executable, "-c", stop_the_import], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")
    import tomllib

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fibctl"] == "fibctl.__main__:program"  # the program starts there too, not in fibctl.cli


def _python(script: str) -> subprocess.CompletedProcess:
    """`script` in a new Python: a signal's handling there is the process's own, not pytest's."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_ctrl_c_while_torch_imports_is_held_until_the_import_is_over():
    """A Ctrl-C that lands inside torch's import (commands import it when they first need it)
    aborted `fibctl worker --ddp` once: exit 134 and a stack dump from torch's C++. fibctl's
    handler holds it until torch has loaded, then ends the command as a Ctrl-C a moment later
    would: torch here is whole, and the KeyboardInterrupt comes after the import."""
    script = ("import os, signal, sys, threading, time\n"
              "from fibctl.__main__ import _interrupt\n"
              "signal.signal(signal.SIGINT, _interrupt)  # as main() does\n"
              "def press():\n"
              "    while 'torch' not in sys.modules:\n"
              "        time.sleep(0.001)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "threading.Thread(target=press, daemon=True).start()\n"
              "try:\n"
              "    import torch\n"
              "    print('imported', flush=True)\n"
              "    time.sleep(60)\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted', tuple(torch.nn.Linear(2, 3)(torch.ones(2)).shape), flush=True)\n"
              "    sys.exit(130)\n")
    done = _python(script)
    assert (done.returncode, done.stdout) == (130, "imported\ninterrupted (3,)\n"), done.stderr[-2000:]


def test_a_ctrl_c_while_the_command_line_starts_is_held_until_it_has():
    """Typer evaluates each option's annotation as it builds the command line; a
    KeyboardInterrupt passing through one ends Python by SIGINT (exit -2 to Popen) whatever
    exit code its handler gives, so a Ctrl-C is held until the build is over."""
    script = ("import os, signal, sys, time\n"
              "import fibctl.__main__ as entry\n"
              "signal.signal(signal.SIGINT, entry._interrupt)\n"
              "entry._starting.set()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(0.5)\n"
              "print('held', flush=True)\n"
              "entry._starting.clear()\n"
              "try:\n"
              "    time.sleep(30)\n"
              "except KeyboardInterrupt:\n"
              "    print('raised', flush=True)\n")
    done = _python(script)
    assert (done.returncode, done.stdout, done.stderr) == (0, "held\nraised\n", "")


def test_a_held_ctrl_c_sent_again_before_the_command_s_handlers_are_set_exits_130_quietly():
    """Sent again as the build ended, a held Ctrl-C could land before fibctl.cli's own handling
    began (an import there, under a loaded machine): a traceback and Python's SIGINT exit."""
    script = ("import sys\n"
              "import fibctl.__main__ as entry\n"
              "import fibctl.cli\n"
              "def run(command):\n"
              "    raise KeyboardInterrupt  # where the Ctrl-C sent again lands\n"
              "fibctl.cli.main = run\n"
              "sys.argv = ['fibctl', 'matrix', 'list']\n"
              "entry.program()\n")
    done = _python(script)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")


def test_a_ctrl_c_caught_after_it_passed_through_code_run_from_a_string_still_exits_130(tmp_path):
    """A KeyboardInterrupt out of an `eval` or `exec` of a string (a dataclass's methods as a
    module imports, under `report all`) sets CPython's flag to end the process by SIGINT once
    it is done: the command caught it, said so and exited 130, and its caller saw -2. Run as
    a module, as `python -m fibctl` is (with -c, Python exits at the SystemExit itself)."""
    script = ("import os, signal, sys\n"
              "import fibctl.__main__ as entry\n"
              "import fibctl.cli\n"
              "def run(command):\n"
              "    try:\n"
              "        eval('[os.kill(os.getpid(), signal.SIGINT)] + [sum(range(10**6)) for _ in range(200)]')\n"
              "    except KeyboardInterrupt:\n"
              "        print('interrupted', file=sys.stderr)\n"
              "        sys.exit(130)\n"
              "fibctl.cli.main = run\n"
              "sys.argv = ['fibctl', 'matrix', 'list']\n"
              "entry.program()\n")
    (tmp_path / "through_a_string.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "through_a_string"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "interrupted\n")


def test_a_ctrl_c_held_in_the_import_machinery_is_sent_again_once_it_is_done():
    """Sent again at once, a Ctrl-C held in the import machinery landed there again (held again,
    dozens of times) or in its own handler, which then raised it inside the import."""
    script = ("import os, signal, sys, time\n"
              "import fibctl.__main__ as entry\n"
              "calls = []\n"
              "def counted(signum, frame):\n"
              "    calls.append(signum)\n"
              "    entry._interrupt(signum, frame)\n"
              "signal.signal(signal.SIGINT, counted)\n"
              "machinery = ('def find_spec():\\n'\n"
              "             '    os.kill(os.getpid(), signal.SIGINT)\\n'\n"
              "             '    end = time.monotonic() + 0.5\\n'\n"
              "             '    while time.monotonic() < end:\\n'\n"
              "             '        pass\\n')\n"
              "space = {'os': os, 'signal': signal, 'time': time}\n"
              "exec(compile(machinery, '<frozen importlib._bootstrap_external>', 'exec'), space)\n"
              "left = False\n"
              "try:\n"
              "    space['find_spec']()\n"
              "    left = True  # no signal is handled between the return and this line\n"
              "    time.sleep(30)\n"
              "except KeyboardInterrupt:\n"
              "    print('raised', 'after' if left else 'inside', len(calls), flush=True)\n")
    done = _python(script)
    assert (done.returncode, done.stdout, done.stderr) == (0, "raised after 2\n", "")


def test_a_ctrl_c_while_python_shuts_down_after_the_command_is_ignored():
    """Sent once the command had ended (its output written), a Ctrl-C ended Python by SIGINT
    (-2 to Popen) without a word, after a command that succeeded."""
    script = ("import atexit, os, signal, sys\n"
              "import fibctl.__main__ as entry\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), print('sent', flush=True)))\n"
              "sys.argv = ['fibctl', 'matrix', 'list']\n"
              "entry.program()\n")
    done = _python(script)
    assert (done.returncode, done.stdout.splitlines()[-1], done.stderr) == (0, "sent", ""), done


def test_the_program_leaves_sigint_s_handler_as_it_found_it(monkeypatch):
    """Run in the same process (the tests), it left its own handler behind for the caller."""
    import signal

    from fibctl.__main__ import main

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(sys, "argv", ["fibctl", "--help"])
    with pytest.raises(SystemExit):
        main()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_in_the_import_machinery_is_held_too():
    """Raised in importlib's own callbacks (a module lock's, after the module has run), a
    KeyboardInterrupt is printed as 'Exception ignored' and lost: `fibctl worker` trained on."""
    from types import SimpleNamespace

    from fibctl.__main__ import importing

    def landed_in(file):
        return SimpleNamespace(f_code=SimpleNamespace(co_filename=file))

    assert importing(landed_in("<frozen importlib._bootstrap>"))
    assert not importing(landed_in(__file__)) and not importing()  # this test imports nothing


def test_whether_torch_is_importing_is_told_while_another_thread_imports(monkeypatch):
    """A list of sys.modules' items, built while another thread imported, raised "dictionary
    changed size during iteration" in the thread that holds a Ctrl-C: the Ctrl-C was lost and
    the command ran on to exit 0. Read as one copy, the modules cannot change midway."""
    from fibctl.__main__ import importing

    class Importing(dict):  # its items change as they are read, as another thread's import would
        def items(self):
            raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(sys, "modules", Importing(sys.modules))
    assert importing() is False


def test_ctrl_c_while_typer_builds_the_command_exits_130_without_a_traceback(monkeypatch, capsys):
    """Between the imports and the command typer builds every command's options, outside the
    try that makes a Ctrl-C in a command exit 130: one there printed a traceback, exit -2.
    (`fibctl.__main__` holds a Ctrl-C then; `fibctl.cli.main` alone gets it.)"""
    import fibctl.cli as cli

    def building():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build", building)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 130 and capsys.readouterr() == ("", "")


# names, workers and errors as a hand-edited database may hold them: markup that rich would
# obey ([red]), and ESC [2J, which clears a terminal
MARKUP, ESC = "[red]a[/red]", "b\x1b[2J"


def _in_process(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def _shown_not_obeyed(text: str) -> None:
    assert "\x1b" not in text, text
    assert MARKUP in text and "b\\x1b[2J" in text, text


def _hostile_db(tmp_path) -> Path:
    """Two failed runs renamed by hand to MARKUP and ESC, their error text holding both."""
    import sqlite3

    from fibctl import queue
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect

    db = tmp_path / "r.db"
    engine = connect(str(db))
    queue.add_runs(engine, [RunConfig.resolve(n, "test", "micro", schedule="fixed") for n in ("a", "b")])
    for _ in range(2):
        queue.fail(engine, queue.claim_next(engine, "w").id, f"ValueError: {MARKUP} {ESC}")
    engine.dispose()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET name = ? WHERE name = 'a'", (MARKUP,))
        conn.execute("UPDATE runs SET name = ? WHERE name = 'b'", (ESC,))
    return db


def test_run_names_read_from_the_database_are_shown_not_obeyed(tmp_path, capsys, monkeypatch):
    db = str(_hostile_db(tmp_path))
    code, out, _ = _in_process(capsys, monkeypatch, "queue", "ls", "--db", db)  # its table: as written
    assert code == 0 and "\x1b" not in out and "b\\x1b[2J" in "".join(out.split()), out
    code, out, _ = _in_process(capsys, monkeypatch, "queue", "retry", "--all-failed", "--db", db)
    assert code == 0 and out.startswith("queued 2 failed run(s) again: ")
    _shown_not_obeyed(out)  # ESC went to the terminal as it was


def test_an_error_naming_a_worker_from_the_database_is_shown_not_obeyed(tmp_path, capsys, monkeypatch):
    """`fibctl train` of a run another worker holds names that worker, as the database has it."""
    import sqlite3

    from train_helpers import write_data

    db = _hostile_db(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET status = 'running', heartbeat_at = ?, worker = ?",
                     ("2999-01-01 00:00:00", f"{MARKUP} {ESC}"))
    code, _, err = _in_process(capsys, monkeypatch, "train", MARKUP, "--db", str(db), "--data",
                               str(write_data(tmp_path / "data")), "--runs-dir", str(tmp_path / "runs"))
    assert code == 2 and "is running on" in err, err
    _shown_not_obeyed(err)


def test_a_worker_shows_the_names_and_errors_of_the_runs_it_failed_as_written(tmp_path, capsys, monkeypatch):
    """Its closing lines name each run, and the error, in the database's words."""
    import sqlite3

    from train_helpers import write_data

    db = _hostile_db(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET status = 'queued', attempts = 0, error = NULL")
    code, out, err = _in_process(capsys, monkeypatch, "worker", "--db", str(db), "--data",
                                 str(write_data(tmp_path / "data")), "--runs-dir", str(tmp_path / "runs"))
    assert code == 1, out + err  # neither name is one a run folder may have
    assert out.count("failed while starting") == 2, out
    assert "Error:" not in out, out  # fibctl's own error as written, not `FibctlError: ...`
    _shown_not_obeyed(out)


def test_eval_shows_run_and_set_names_as_written(tmp_path, capsys, monkeypatch):
    """The results table and the per-result lines show names as the database and manifest
    have them (a hand-made run folder lets a run named so be evaluated)."""
    import pandas as pd

    import fibctl.flows.evaluation as evaluation

    def measured(engine, names, lengths, *, on_result=None, **_):
        rows = [{"run": MARKUP, "step": 10, "dataset": ESC, "eval_length": 64, "tokens": 64, "loss": 1.0,
                 "ppl": 2.718, "tokens_per_s": 100.0, "tokens_per_s_min": 90.0, "tokens_per_s_max": 110.0,
                 "speed_batch": 8}]
        for row in rows:
            on_result(row, len(rows))
        return pd.DataFrame(rows)

    monkeypatch.setattr(evaluation, "evaluate", measured)
    monkeypatch.setattr(evaluation, "plan", lambda *a, **k: None)  # its checks: no data here
    db = _hostile_db(tmp_path)
    code, out, err = _in_process(capsys, monkeypatch, "eval", MARKUP, "--length", "64", "--speed", "--db", str(db),
                                 "--data", str(tmp_path))
    assert code == 0, out + err
    _shown_not_obeyed(out)
    assert out.count(MARKUP) == 3, out  # the line logged, the table and the speed table


def _fake_evaluate(monkeypatch, items):
    """`evaluate` measuring `items` (run, length) on docs_val at once, telling on_start and
    on_result of each as the real one does; it returns their rows."""
    import pandas as pd

    import fibctl.flows.evaluation as evaluation

    def measured(engine, names, lengths, *, on_result=None, on_start=None, **_):
        rows = []
        for run, length in items:
            if on_start:
                on_start({"run": run, "dataset": "docs_val", "eval_length": length}, len(items))
            rows.append({"run": run, "step": 10, "dataset": "docs_val", "eval_length": length, "tokens": length,
                         "loss": 1.0, "ppl": 2.718, "tokens_per_s": float("nan"), "speed_batch": None})
            on_result(rows[-1], len(items))
        return pd.DataFrame(rows)

    monkeypatch.setattr(evaluation, "evaluate", measured)
    monkeypatch.setattr(evaluation, "plan", lambda *a, **k: None)  # its checks: no data here


def test_eval_in_a_log_file_counts_its_measurements_and_says_the_time_left(tmp_path, capsys, monkeypatch):
    """A line per result said nothing of how many were left: `eval --all` at three lengths
    is hundreds of measurements, an hour of a GPU, in a log read with tail -f."""
    from fibctl import queue
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect

    engine = connect(str(tmp_path / "r.db"))
    queue.add_runs(engine, [RunConfig.resolve(n, "test", "micro", schedule="fixed") for n in ("a", "b")])
    engine.dispose()
    _fake_evaluate(monkeypatch, [("a", 64), ("a", 128), ("b", 64)])
    code, out, err = _in_process(capsys, monkeypatch, "eval", "a", "b", "--length", "64", "--length", "128",
                                 "--db", str(tmp_path / "r.db"), "--data", str(tmp_path))
    assert code == 0, out + err
    lines = out.splitlines()
    # perplexity to 2 decimals, as the tables and the training line have it (it was 2.718)
    assert re.fullmatch(r"a length 64 docs_val: ppl 2\.72 \(1/3, ETA \d+s\)", lines[0]), lines
    assert re.fullmatch(r"a length 128 docs_val: ppl 2\.72 \(2/3, ETA \d+s\)", lines[1]), lines
    assert lines[2] == "b length 64 docs_val: ppl 2.72 (3/3)", lines  # the last: nothing left


def test_evals_bar_names_the_measurement_under_way_with_the_time_left(monkeypatch):
    """The bar named the measurement just finished (the first one's name came only when it
    was over, the total unknown until then) and said nothing of the time left."""
    import io

    from rich.console import Console

    from fibctl.cli import train as cli_train

    screen = io.StringIO()
    monkeypatch.setattr(cli_train, "console", Console(file=screen, width=80, force_terminal=True, color_system=None))
    frames = []

    def frame():
        progress.progress.refresh()
        frames.append(re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()))[-1])

    with cli_train.EvalProgress(plain=False) as progress:
        progress.start({"run": "dense", "dataset": "docs_val", "eval_length": 128}, 12)
        frame()
        progress.result({"run": "dense", "dataset": "docs_val", "eval_length": 128, "ppl": 27.5}, 12)
        progress.start({"run": "dense", "dataset": "docs_val", "eval_length": 256}, 12)
        frame()
        name = "f13__fib_stagger_w12_lr1e-3_s43"  # no room left for a bar
        progress.start({"run": name, "dataset": "fineweb_edu_val", "eval_length": 4096}, 12)
        frame()
    assert frames[0].startswith("dense @ 128 docs_val ") and frames[0].rstrip().endswith(" 0/12 0:00:00"), frames
    assert frames[1].startswith("dense @ 256 docs_val ") and re.search(r" 1/12 0:00:0\d ETA \d+s$", frames[1]), frames
    assert re.match(rf"{name} @ 4096 fineweb_edu_val +1/12 0:00:0\d ETA \d+s$", frames[2]), frames
    assert all(len(f) <= 80 for f in frames) and "…" not in screen.getvalue(), frames


def test_a_slurm_task_log_shows_names_and_errors_as_written(capsys):
    """A task's log is read in a terminal (tail -f): the database's text is shown, not obeyed."""
    from fibctl.flows.slurm import JobDisplay
    from fibctl.flows.worker import Outcome

    display = JobDisplay(None, "7", 0, 0)
    display.warn(f"run {ESC} {MARKUP}")
    display.finish(Outcome(ESC, "failed", 0, f"ValueError: {MARKUP} {ESC}"))
    out = capsys.readouterr().out
    assert out.count("b\\x1b[2J") == 3 and out.startswith("task 0: warning: run b\\x1b[2J"), out
    _shown_not_obeyed(out)


@pytest.mark.parametrize("bar", [True, False])
def test_a_run_s_progress_shows_its_name_and_sets_as_written(bar, monkeypatch):
    """The progress bar's description was markup ([bold]{name}): a run named [red]a[/red]
    showed as a red 'a'; the plain log lines let ESC through."""
    import io

    from rich.console import Console

    import fibctl.cli.train as cli_train
    from fibctl.flows.worker import Outcome
    from fibctl.train.trainer import Progress

    out = io.StringIO()
    monkeypatch.setattr(cli_train, "console", Console(file=out, force_terminal=bar, width=200))
    display = cli_train.RunDisplay(plain=not bar)
    for name in (MARKUP, ESC):
        step = display.start(name, 10)
        step(Progress(10, 10, 2.0, 1e3, 1.0, 1e-4, 0.1, None, {ESC: 2.0}))
        display.finish(Outcome(name, "done", 10))
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # rich's own colours, when a terminal
    assert MARKUP in text and "eval b\\x1b[2J loss" in text and "\x1b[2J" not in text, repr(text)


@pytest.mark.parametrize("columns,widest", [("0", 80), ("1", 20), ("99999999999", 1000)])
def test_a_columns_of_no_width_or_any_width_still_draws_the_help(columns, widest):
    # COLUMNS=0 printed one blank line, COLUMNS=1 borders alone, a huge one a MemoryError
    done = fibctl("--help", env={**ENV80, "COLUMNS": columns})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert "Usage:" in done.stdout and "queue" in done.stdout and max(len(line) for line in lines) <= widest


@pytest.mark.parametrize("terminal", [True, False])
def test_report_all_shows_which_table_or_figure_it_writes_at_a_terminal(terminal, tmp_path, monkeypatch, capsys):
    """Its bar pulsed for seconds without a count or a name: nothing said how far it was.
    Piped, stderr holds no bar."""
    from rich.console import Console

    import fibctl.cli.report as cli_report

    screen = io.StringIO()
    monkeypatch.setattr(cli_report, "err_console", Console(file=screen, width=80, force_terminal=terminal,
                                                           color_system=None))
    code, out, err = _in_process(capsys, monkeypatch, "report", "all", "--db", REPO_EXAMPLE, "--out",
                                 str(tmp_path / "rep"))
    frames = {line for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()))
              if line.startswith("writing")}
    assert code == 0 and "skipped table2" in screen.getvalue()
    if not terminal:
        assert not frames
        return
    assert any(re.fullmatch(r"writing curves +━+ +\d+/10 0:00:\d\d", f) for f in frames), frames
    assert any(re.fullmatch(r"writing coverage +━+ 10/10 0:00:\d\d", f) for f in frames), frames
    assert max(map(len, frames)) <= 80


def test_report_all_says_each_skipped_table_on_one_line(tmp_path, monkeypatch, capsys):
    """`skipped table2: ...` wrapped over 3 lines at 80 columns (and in a log file)."""
    code, out, err = _in_process(capsys, monkeypatch, "report", "all", "--db", REPO_EXAMPLE, "--out",
                                 str(tmp_path / "rep"))
    assert code == 0 and "skipped table2: no probe results" in err
    assert all(line.startswith("skipped ") for line in err.splitlines()), err


@pytest.mark.parametrize("args", [["queue", "ls", "--db", REPO_EXAMPLE], ["queue", "show", "dense", "--db", REPO_EXAMPLE],
                                  ["report", "table3", "--db", REPO_EXAMPLE], ["matrix", "list"], ["--help"],
                                  ["sql", "SELECT * FROM runs", "--db", REPO_EXAMPLE, "--csv"]])
def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly_with_0(args):
    """`fibctl queue ls | head -1`: rich and click exited 1 on the closed pipe, silently (a
    failure to `set -o pipefail`); only output that fit the pipe's buffer exited 0."""
    proc = subprocess.Popen([sys.executable, "-m", "fibctl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV80)
    proc.stdout.close()  # before it writes: it takes a second to start
    err = proc.stderr.read()
    assert (proc.wait(timeout=120), err) == (0, b"")


def test_data_show_of_a_file_says_it_is_a_file(tmp_path, monkeypatch, capsys):
    """It suggested `fibctl data prepare RECIPE --data r.toml`, which is then refused."""
    (tmp_path / "r.toml").write_text('vocab_size = 512\n')
    (tmp_path / "notes.txt").write_text("x\n")
    code, out, err = _in_process(capsys, monkeypatch, "data", "show", str(tmp_path / "r.toml"))
    assert code == 2 and err == (f"error: {tmp_path}/r.toml is a file, not a data folder (one `fibctl data prepare` "
                                 f"wrote); a recipe is prepared with `fibctl data prepare {tmp_path}/r.toml --data "
                                 "FOLDER`\n")
    code, out, err = _in_process(capsys, monkeypatch, "data", "show", str(tmp_path / "notes.txt"))
    assert code == 2 and err == f"error: {tmp_path}/notes.txt is a file, not a data folder (one `fibctl data " \
                                "prepare` wrote)\n"
    code, out, err = _in_process(capsys, monkeypatch, "data", "show", "/dev/null")  # not `--data /dev/null`
    assert code == 2 and err == ("error: /dev/null is a device or a pipe, not a data folder (one "
                                 "`fibctl data prepare` wrote)\n")


def test_data_show_suggests_a_command_that_pastes(tmp_path, monkeypatch, capsys):
    """`fibctl data show 'my data'` suggested `fibctl data prepare RECIPE --data my data`:
    pasted, that is two arguments."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my data").mkdir()
    (tmp_path / "my r.toml").write_text('vocab_size = 512\n')
    code, out, err = _in_process(capsys, monkeypatch, "data", "show", "my data")
    assert code == 2 and err == ("error: no data manifest in my data; run `fibctl data prepare RECIPE --data "
                                 "'my data'`\n")
    code, out, err = _in_process(capsys, monkeypatch, "data", "show", "my r.toml")
    assert code == 2 and err.endswith("a recipe is prepared with `fibctl data prepare 'my r.toml' --data FOLDER`\n")


def test_a_worker_whose_output_pipe_closes_mid_run_stops_it_as_a_first_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """`fibctl worker | head -1`: rich's closed pipe, past the worker's `except Exception`,
    ended the command with 0 and left the run `running` until its heartbeat went stale, no
    other worker able to take it meanwhile. It now stops as a first Ctrl-C does: the run
    checkpoints at the step it is at and is queued again at once; the command exits 141
    (128 + SIGPIPE), not 0, as the work is not done."""
    import sqlite3

    from cli_helpers import close_stdout
    from fibctl.cli.train import RunDisplay
    from train_helpers import micro_run, queued_db, write_data

    db = tmp_path / "r.db"
    queued_db(db, micro_run("run", steps=30)).dispose()
    shown, closed = RunDisplay.start, []

    def start(self, name, steps):
        progress = shown(self, name, steps)

        def closing(p):
            if p.step == 2:  # the next line printed (step 10's) finds the pipe closed
                close_stdout(monkeypatch, dup2=lambda fd, to: closed.append(to))
            return progress(p)
        return closing

    monkeypatch.setattr(RunDisplay, "start", start)
    code, out, err = _in_process(capsys, monkeypatch, "worker", "--db", str(db), "--data",
                                 str(write_data(tmp_path / "data")), "--runs-dir", str(tmp_path / "runs"), "--plain")
    assert code == 141 and closed == [1], (code, closed, err)
    assert err == ("warning: the output's reader has gone: stopping; the run checkpoints and is queued again\n"
                   "hint: queued again; run the same command to resume run from step 10\n")
    con = sqlite3.connect(db)
    assert con.execute("select status, checkpoint_path like '%step_00000010.pt' from runs").fetchone() == ("queued", 1)
    assert con.execute("select count(*) from events where kind = 'released' "
                       "and message like 'stopped at step 10%'").fetchone() == (1,)


def test_queue_ls_and_status_at_a_standstill_name_the_next_command(tmp_path, monkeypatch, capsys):
    """An empty database listed empty tables, and queued runs with no worker read as a queue at
    work: each now ends with the command that moves it on (none once a run is running)."""
    monkeypatch.setenv("COLUMNS", "80")
    db = str(tmp_path / "r.db")
    assert _in_process(capsys, monkeypatch, "db", "upgrade", "--db", db)[0] == 0
    for command in (["queue", "ls"], ["status"]):
        code, out, _ = _in_process(capsys, monkeypatch, *command, "--db", db)
        assert code == 0 and out.splitlines()[-1] == ("no runs yet: queue some with `fibctl queue add MATRIX` "
                                                      "(`fibctl matrix list`)"), out
    assert _in_process(capsys, monkeypatch, "queue", "add", "demo", "--preset", "micro", "--db", db)[0] == 0
    for command in (["queue", "ls"], ["status"]):
        code, out, _ = _in_process(capsys, monkeypatch, *command, "--db", db)
        assert code == 0 and out.splitlines()[-1] == "nothing is running: `fibctl worker` trains the queued runs"
    from fibctl import queue
    from fibctl.db.engine import connect

    queue.claim_next(connect(db), "w:1")
    code, out, _ = _in_process(capsys, monkeypatch, "status", "--db", db)
    assert code == 0 and "fibctl worker" not in out and "1 running" in out


def test_a_row_shown_a_field_a_line_leaves_out_its_empty_fields():
    """queue show's events at 80 columns ended each `finished` event with a bare `  message:`,
    which reads as a cut line."""
    from rich.console import Console

    from fibctl.cli.common import records

    console = Console(width=80, record=True, file=io.StringIO())
    console.print(records(["time (UTC)", "event", "message"],
                          [["2026-12-05 18:28:36", "checkpoint", "step 30: runs/dense/step_00000030.pt"],
                           ["2026-12-05 18:28:37", "finished", ""]]))
    assert console.export_text().splitlines() == [
        "2026-12-05 18:28:36", "  event: checkpoint", "  message: step 30: runs/dense/step_00000030.pt",
        "2026-12-05 18:28:37", "  event: finished"]


MATRIX = '[matrix]\npreset = "micro"\n\n[[runs]]\nname = "r1"\nschedule = "stagger"\nwindow = 8\n'
TILDE = {  # a command with every path in it quoted as `~/...`, and what it makes in the home folder
    "--db": (["db", "upgrade", "--db", "~/r.db"], "r.db"),
    "FIBCTL_DB": (["db", "upgrade"], "r.db"),
    "sqlite:///": (["db", "upgrade", "--db", "sqlite:///~/r.db"], "r.db"),
    "--from --to": (["db", "copy", "--from", "~/e.db", "--to", "~/c.db"], "c.db"),
    "--compare": (["report", "table1", "--db", "~/e.db", "--compare", "~/e.db", "--format", "csv"], "e.db"),
    "report all -o": (["report", "all", "--db", "~/e.db", "-o", "~/rep"], "rep/index.html"),
    "figure --out": (["figure", "coverage", "--preset", "micro", "--out", "~/c.png"], "c.png"),
    "matrix file": (["queue", "add", "~/m.toml", "--db", "~/q.db"], "q.db"),
    "import-study": (["import-study", "~/fib.db", "--lenextrap", "~/lenextrap.json", "--posloss", "~/posloss.json",
                      "--db", "~/s.db"], "s.db"),
    "demo --out": (["demo", "--out", "~/demo"], "demo"),
}


@pytest.mark.parametrize("case", TILDE)
def test_a_quoted_tilde_opening_any_path_is_the_home_folder(case, tmp_path, monkeypatch, capsys):
    """`--data '~/d'` meant the home folder, but `--db '~/r.db'`, FIBCTL_DB="~/r.db" (no shell
    expands it), `--out '~/rep'` and the rest made or looked for a file or folder named `~` in
    the current one: every path option reads `~` alike now (fibctl.paths.expanded)."""
    import shutil

    from cli_helpers import ran
    from test_import import make_study

    args, made = TILDE[case]
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "results.db.example", home / "e.db")
    (home / "m.toml").write_text(MATRIX)
    make_study(home)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    if case == "FIBCTL_DB":
        monkeypatch.setenv("FIBCTL_DB", "~/r.db")
    if case == "demo --out":  # where it would train (minutes), it makes the folder and stops
        monkeypatch.setattr("fibctl.flows.demo.run_demo", lambda out, *_: out.mkdir() or 0)
    code, out, err = ran(monkeypatch, capsys, *args)
    assert code == 0, out + err
    assert (home / made).exists() and not any(cwd.iterdir()), sorted(p.name for p in cwd.iterdir())
