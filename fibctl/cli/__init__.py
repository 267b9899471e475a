"""The `fibctl` command line. Each module here parses options, calls the library, prints.

Errors a user can fix (`FibctlError`) become one red line on stderr and exit code 2; so
does a database that refuses an operation (locked past its busy timeout, full, gone), which
the user fixes by waiting or freeing space, not by reading a traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from typing import Annotated

import typer
from typer.completion import completion_init, install_callback, show_callback
from rich.console import Console
from rich.markup import escape

from fibctl.cli.common import (PipeConsole, err_console, hold_interrupts, interrupted, noting_interrupts,
                               unencodable_shown_as_question_marks)
from fibctl.errors import FibctlError, printable, shown_path
from fibctl.flows.torchrun import launched  # here, not in main: an import there is a window for a Ctrl-C


def _help_fixes() -> None:
    """Fixes to typer's help, each applied where this typer has the part it fixes (they are
    internals, and fibctl allows any typer from 0.16 on): a boolean flag shows as
    a flag (typer 0.29 prints `<bool>` after every flag, `--help` included); a repeatable
    option or a list of arguments shows the type of one value (`<int>`, not `<list[int]>`:
    Python's annotation, which the help's "repeat" already says); help text is
    wrapped to the terminal, not at its source line breaks (half-empty lines at 80 columns);
    it is shown as written, not read as rich markup (which took `pip install -e
    '.[slurm]'` for a style tag and printed `'.'`); and piped, its lines end without the
    spaces they were padded to the width with (PipeConsole)."""
    from typer import rich_utils
    from typer.core import TyperArgument, TyperOption

    if getattr(rich_utils, "_fibctl_fixed", False):
        return
    rich_utils._fibctl_fixed = True
    for kind in (TyperOption, TyperArgument):
        shown_type = getattr(kind, "display_type_rich", None)
        if shown_type is not None:
            def display_type_rich(self, ctx, shown_type=shown_type):
                if getattr(self, "is_flag", False) and self.metavar is None:
                    return None
                shown = shown_type(self, ctx)
                return re.sub(r"<list\[(\w+)\]>", r"<\1>", shown) if isinstance(shown, str) else shown

            kind.display_type_rich = display_type_rich
    shown_text = getattr(rich_utils, "_make_rich_text", None)
    if shown_text is not None:
        def make_rich_text(*, text, style="", markup_mode):
            if markup_mode == "rich":
                if "\b" not in text:  # typer's mark for a block kept as laid out
                    text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)  # one line break: a space
                text = escape(text)
            return shown_text(text=text, style=style, markup_mode=markup_mode)

        rich_utils._make_rich_text = make_rich_text
    made_console = getattr(rich_utils, "_get_rich_console", None)
    if made_console is not None:
        def get_rich_console(*args, **kwargs):
            made = made_console(*args, **kwargs)
            made.__class__ = PipeConsole  # typer's console as made, its output trimmed in a pipe
            return made

        rich_utils._get_rich_console = get_rich_console


_help_fixes()


def _one_line_usage_errors() -> None:
    """A usage error (an unknown option, a value of the wrong type, a missing argument) as
    one line, like every other error, instead of typer's usage block and boxed message."""
    from typer import rich_utils

    def one_line(e) -> None:
        if e.__class__.__name__ == "NoArgsIsHelpError":  # `fibctl` alone: typer printed the help
            return
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        err_console.print(f"[bold red]error:[/] {escape(printable(e.format_message() + hint))}", highlight=False,
                          soft_wrap=True)

    rich_utils.rich_format_error = one_line

    # click raises a missing option value (`--db` last on the line) without the command's
    # context, so that error alone had no hint; give it the context it was parsed in
    for kind in (typer.core.TyperCommand, typer.core.TyperGroup):
        def parse_args_in_context(self, ctx, args, parse_args=kind.parse_args):
            try:
                return parse_args(self, ctx, args)
            except Exception as e:
                if getattr(e, "ctx", False) is None:
                    e.ctx = ctx
                raise

        kind.parse_args = parse_args_in_context


_one_line_usage_errors()

# `fibctl --help` lists the commands in the order of the work, under these headings.
PANELS = {
    "Start here": ["demo"],
    "Data and training": ["data", "matrix", "queue", "worker", "train", "status", "slurm", "probe"],
    "Results": ["eval", "sample", "report", "figure", "compare", "sql", "import-study"],
    "Inspect and measure": ["model", "coverage", "bench", "db"],
}
ORDER = [name for names in PANELS.values() for name in names]


class _InOrder(typer.core.TyperGroup):
    def list_commands(self, ctx) -> list[str]:
        return sorted(self.commands, key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))

    # the top command's own help is printed while its context is made; every other command's
    # output (subcommands' help too) while it is invoked
    def make_context(self, *args, **kwargs):
        with _closed_pipe_ends_quietly(), _ended_by_a_ctrl_c():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _closed_pipe_ends_quietly(), _ended_by_a_ctrl_c(last=True):
            return super().invoke(ctx)


@contextlib.contextmanager
def _ended_by_a_ctrl_c(last: bool = False):
    """A command a Ctrl-C was sent to ends with one line and exit 130, also where the command
    did not say it: a KeyboardInterrupt no command caught (typer exits 130 and says nothing),
    another error that the KeyboardInterrupt caused where it landed (a file writer that cannot
    clean up mid-write), or none, the KeyboardInterrupt having been lost in a callback of the
    garbage collector (the command ran on to its end). A command that said what it kept
    (and raised `typer.Exit(130)`) is left to say so. `last`: the command's work is over
    after this; a Ctrl-C from then on is noted, not raised where it lands in the exit (main
    ends the command as interrupted)."""
    try:
        yield
    except typer.Exit as e:  # what ctx.exit raises too (click's Exit in older typers)
        if e.exit_code == 0 and interrupted.is_set():
            raise _interrupted() from None
        raise
    except KeyboardInterrupt:
        raise _interrupted() from None
    except Exception:
        if interrupted.is_set():
            raise _interrupted() from None
        raise
    finally:
        if last:
            hold_interrupts()  # put back by main's noting_interrupts
    if interrupted.is_set():
        raise _interrupted()


def _interrupted() -> typer.Exit:
    """The line of a command that did not say what a Ctrl-C kept, and its exit; after a
    SIGTERM, its exit alone (143), as where its SystemExit was not lost."""
    if interrupted.signal == signal.SIGINT:
        err_console.print("interrupted", markup=False, highlight=False)
    return typer.Exit(128 + interrupted.signal)


@contextlib.contextmanager
def _closed_pipe_ends_quietly():
    """The reader closing our output (`fibctl queue ls | head -1`) has what it wanted: exit 0,
    silently, whatever the command (click and rich exited 1, which `set -o pipefail` took for
    a failure, and only output that fit the pipe's buffer exited 0)."""
    try:
        yield
    except OUTPUT_CLOSED:
        silence_closed_output(1, 2)
        raise typer.Exit(0) from None


class PipeClosed(BaseException):
    """rich's closed pipe, past every `except Exception`: a run must not be failed for its
    progress line (train and worker stop it gracefully instead, fibctl.cli.train)."""


OUTPUT_CLOSED = (BrokenPipeError, PipeClosed)


def silence_closed_output(*fds: int) -> None:
    """Point these of stdout (1) and stderr (2), whose reader has gone, at /dev/null: Python's
    last flush at exit would fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(devnull, fd)
    os.close(devnull)


def stopped_by_closed_output(line: str) -> typer.Exit:
    """The end of work that stopped because its output's reader went (`fibctl eval ... | head
    -1`): `line` on stderr if it is still read, and exit 141 (128 + SIGPIPE), not 0: the work
    is not done, and a script must not take it for done."""
    silence_closed_output(1)
    try:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    except OUTPUT_CLOSED:
        silence_closed_output(2)
    return typer.Exit(128 + signal.SIGPIPE)


def _raise_broken_pipe(self) -> None:
    self.quiet = True
    raise PipeClosed


# rich's consoles (fibctl's and typer's help) exit 1 on a closed pipe: raised instead, for the above
Console.on_broken_pipe = _raise_broken_pipe


_suggesting_resolve = typer.core.TyperGroup.resolve_command
# click's UsageError, whichever click typer uses (newer typers vendor their own)
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _resolve_command(self, ctx, args):
    """typer's, suggesting also a command whose letters the typo swapped (`queue sl`: 'ls'),
    which its close-match cutoff missed."""
    try:
        return _suggesting_resolve(self, ctx, args)
    except _UsageError as e:
        swapped = [name for name in self.commands if args and sorted(name) == sorted(args[0])]
        if swapped and "Did you mean" not in e.message:
            e.message = f"{e.message.rstrip('.')}. Did you mean {', '.join(map(repr, swapped))}?"
        raise


typer.core.TyperGroup.resolve_command = _resolve_command  # every group's: the top one and queue, report, ...


app = typer.Typer(
    cls=_InOrder,
    name="fibctl",
    help="Reproduce and extend the scaled-Fibonacci sparse-attention study: queue a matrix of "
    "runs, train them, evaluate them at any length, and report from one SQL database.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,  # _top's own options: typer's --show-completion made the top help a screen and a line
    context_settings={"help_option_names": ["-h", "--help"]},  # every command's, as click passes them down
)


def _print_version(asked: bool) -> None:
    if not asked:
        return
    import importlib.metadata
    import platform

    import fibctl
    from fibctl.provenance import git_commit

    commit = git_commit()
    try:  # its version without importing it (seconds)
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    # the commit on a line of its own: whole (it names the code exactly), and within 80 columns
    print(f"fibctl {fibctl.__version__}, Python {platform.python_version()}, torch {torch}"
          + (f"\ngit {commit}" if commit else ""))
    raise typer.Exit(0)


completion_init()  # the shells typer completes for: bash, zsh, fish, PowerShell


def _in_this_shell(callback):
    """typer's completion callback, told the shell where typer cannot find it: it looks among
    fibctl's ancestor processes, and one started from no shell (a detached job, an editor) found
    none and printed `Shell  not supported.`; $SHELL names the user's shell then."""
    def call(ctx: typer.Context, param, value):
        if value is True:
            import shellingham

            try:
                shellingham.detect_shell()
            except shellingham.ShellDetectionFailure:
                value = os.path.basename(os.environ.get("SHELL", "")) or value
        return callback(ctx, param, value)
    return call


@app.callback()
def _top(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print fibctl's version (and git commit), Python's "
                                                    "and torch's, and exit.")] = False,
         install_completion: Annotated[bool, typer.Option(
             "--install-completion", callback=_in_this_shell(install_callback), is_eager=True, expose_value=False,
             help="Install tab completion for this shell.")] = False,
         show_completion: Annotated[bool, typer.Option(  # docs/cli.md has it
             "--show-completion", callback=_in_this_shell(show_callback), is_eager=True, expose_value=False, hidden=True)] = False,
         ) -> None:
    pass  # the top command's own options (its help is app's)


def _register() -> None:
    # Imported for their side effect of adding commands to `app`.
    from fibctl.cli import model  # noqa: F401
    from fibctl.cli import db  # noqa: F401
    from fibctl.cli import data  # noqa: F401
    from fibctl.cli import train  # noqa: F401
    from fibctl.cli import report  # noqa: F401
    from fibctl.cli import demo  # noqa: F401
    from fibctl.cli import slurm  # noqa: F401
    from fibctl.cli import probe  # noqa: F401
    from fibctl.cli import sample  # noqa: F401


_register()


def _panels() -> None:
    panel = {name: heading for heading, names in PANELS.items() for name in names}
    for info in [*app.registered_commands, *app.registered_groups]:
        info.rich_help_panel = panel[info.name]  # a KeyError: a new command needs its heading


_panels()


def ends_through_python() -> None:
    """SIGTERM ends the command through Python, so that the `finally` in _run still runs (a
    read-only command killed outright left SQLite's -wal and -shm files); train and worker set
    their own. A torchrun rank keeps SIGTERM's default until its group's loop sets its own: it
    has recorded nothing before, torchrun reads a rank a signal ended as stopped, and a
    SystemExit raised while the rank imported torch aborted it from torch's C++ (exit 134)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not launched():
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum, frame) -> None:
    interrupted.note(signum)  # its SystemExit may be lost where it lands (noting_interrupts)
    sys.exit(128 + signum)


_terminated.holds = True  # noting first: `hold_interrupts(terminate=True)` may hold it


def build():
    """The command line as click runs it: typer builds every command's options, reading their
    annotations (`fibctl.__main__` holds a Ctrl-C until this is done)."""
    return typer.main.get_command(app)


def main(command=None) -> None:
    """Run the command line (`command`: `build()`'s, else built here)."""
    ends_through_python()
    with unencodable_shown_as_question_marks(), noting_interrupts():
        _run(command)


def _run(command) -> None:
    try:
        # what app() does, pretty exceptions being off; completion's variable is the installed
        # command's under `python -m fibctl` too (its name is not fibctl there)
        (command or build())(complete_var="_FIBCTL_COMPLETE")
    except KeyboardInterrupt:  # typer building the options: 130, as one in a command is
        if interrupted.is_set():  # a Ctrl-C (a test's KeyboardInterrupt is not noted)
            _interrupted()
        sys.exit(130)
    except SystemExit as e:
        if e.code in (0, None) and interrupted.is_set():  # one held while the command ended
            sys.exit(_interrupted().exit_code)
        raise
    except FibctlError as e:
        _fail(str(e))
    except Exception as e:
        from fibctl.db.engine import refusal

        if isinstance(e, OSError) and e.strerror:  # the system refused a path: a name too long, no space
            _fail(f"{shown_path(str(e.filename))[:120]}: {e.strerror}" if e.filename else e.strerror)
        # a database's refusal, or one that pandas wrapped (its DatabaseError) mid-query
        message = refusal(e) or (refusal(e.__cause__) if e.__cause__ is not None else None)
        if message is None:
            raise
        _fail(message)
    finally:  # a command that read a database leaves its folder as it found it
        engines = sys.modules.get("fibctl.db.engine")
        if engines is not None:
            engines.release()


def _fail(message: str) -> None:
    # a word of thousands of characters (a pasted name, a path) would bury the line: its start is enough
    message = re.sub(r"\S{200,}", lambda m: f"{m[0][:60]}... ({len(m[0]):,} characters)", message)
    # a name or error text read from a database is shown, never obeyed (markup, control codes);
    # a line break in one (a path, FIBCTL_DB) is shown too: an error is one line
    shown = escape(printable(message))
    err_console.print(f"[bold red]error:[/] {shown}", highlight=False, soft_wrap=True)
    sys.exit(2)
