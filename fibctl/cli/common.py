"""Options and output helpers shared by the command modules."""

from __future__ import annotations

import codecs
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.cells import cell_len
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from fibctl.errors import FibctlError, printable
from fibctl.paths import expanded
from fibctl.reports.render import NAME_WIDTH, title_line
from fibctl.reports.tables import length_label

MIN_COLUMNS, MAX_COLUMNS = 20, 1000  # the widths output is drawn at, whatever COLUMNS says


def _sane_columns() -> None:
    """Bring COLUMNS, which rich and typer's help read, within what can be drawn: 0 means no
    width (dropped: the terminal's, or 80), a narrower one is raised to MIN_COLUMNS (at 0 or 1
    every table drew blank), a huge one lowered to MAX_COLUMNS (rich ran out of memory)."""
    value = os.environ.get("COLUMNS", "").strip()
    if not value.isdigit():
        return  # rich ignores what is not a number
    n = int(value)
    if n == 0:
        del os.environ["COLUMNS"]
    elif not MIN_COLUMNS <= n <= MAX_COLUMNS:
        os.environ["COLUMNS"] = str(min(MAX_COLUMNS, max(MIN_COLUMNS, n)))


# a line's trailing spaces, before any style codes that close it (FORCE_COLOR in a pipe)
_TRAILING_SPACES = re.compile(r" +((?:\x1b\[[0-9;]*m)*)\n")


class PipeConsole(Console):
    """A rich console that, writing to a pipe or file, ends no line with spaces: rich keeps the
    space a line was wrapped at, and pads help lines to the width, which `cat -A`, diffs and
    `grep ' $'` all see. A terminal gets rich's output as it is (a live display redraws
    over its own lines); a prompt's last space, before no line break, stays."""

    def _render_buffer(self, buffer) -> str:
        rendered = super()._render_buffer(buffer)
        return rendered if self.is_terminal else _TRAILING_SPACES.sub(r"\1\n", rendered)


_sane_columns()  # before the consoles read it
console = PipeConsole()
err_console = PipeConsole(stderr=True)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="FIBCTL_DB",
        help="Results database: a SQLAlchemy URL, or a bare path meaning SQLite.",
        show_default=True,
    ),
]
DEFAULT_DB = "results.db"


def say_queued(line: str, db: str) -> None:
    """What `queue add` and `probe` print of the runs they queued: the count, then the command
    that trains them, on a line of its own and never folded (folded at 80 columns it split
    from its path), with the database it names: the worker's default one may be another."""
    from fibctl.db import engine as db_engine
    from fibctl.errors import shell_word

    console.print(f"{line}. Train them with:", highlight=False, markup=False)
    console.print(f"  fibctl worker --db {shell_word(db_engine.shown(db))}", highlight=False, markup=False,
                  soft_wrap=True)


def plain(value, style: str = "") -> Text:
    """A table cell or line shown as written: names, paths and errors from data are never rich
    markup, nor control codes a terminal would obey (an error text holding ESC [2J clears the
    screen). Anything that prints text read from a database or a file goes through this."""
    return Text("" if value is None else printable(str(value), lines=True), style=style)


def typed(ctx: typer.Context, param: str) -> bool:
    """Whether the option `param` (its parameter name) was given on the command line, not left
    at its default or taken from the environment (FIBCTL_RUNS_DIR serves many commands)."""
    source = ctx.get_parameter_source(param)  # typer's own click or click's: compared by name
    return getattr(source, "name", None) == "COMMANDLINE"


def goes_with(ctx: typer.Context, param: str, option: str, needs: str, given: bool) -> None:
    """Refuse `option` typed without `needs` (`given`: whether it was): it would do nothing,
    and a user who typed it expects it to."""
    if not given and typed(ctx, param):
        raise FibctlError(f"{option} goes with {needs}; without it, {option} does nothing")


@contextmanager
def on_interrupt(kept: str) -> Iterator[None]:
    """Ctrl-C inside: exit 130 with one line, `interrupted; KEPT` (typer's own 130 said nothing)."""
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"interrupted; {kept}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None


class _Signalled(threading.Event):
    """Set by a signal that ends the command, whose number it keeps: 130 after a Ctrl-C,
    143 after a SIGTERM (128 + it)."""

    signal: int = signal.SIGINT

    def note(self, signum: int) -> None:
        if not self.is_set():
            self.signal = signum
        self.set()

    def clear(self) -> None:
        self.signal = signal.SIGINT
        super().clear()


# Every Ctrl-C this command was sent (`noting_interrupts`), and SIGTERM (fibctl.cli's
# handler), also one whose KeyboardInterrupt or SystemExit was lost: raised in a garbage
# collector's or weakref's callback, Python prints "Exception ignored" and runs on; or turned
# into another error by the code it landed in (matplotlib's PDF writer, stopped mid-write,
# fails its clean-up with AttributeError). Such a command still ends as interrupted
# (fibctl.cli), and `report all` stops at its next file.
interrupted = _Signalled()


def stop_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C, or the SystemExit of a SIGTERM, that was sent
    but lost on its way."""
    if interrupted.is_set():
        raise KeyboardInterrupt if interrupted.signal == signal.SIGINT else SystemExit(128 + interrupted.signal)


@contextmanager
def raised_as_the_signal() -> Iterator[None]:
    """An error inside that a noted signal caused where it landed (matplotlib's PDF writer,
    stopped mid-write, fails its clean-up with AttributeError) is raised as the signal's own
    KeyboardInterrupt or SystemExit."""
    try:
        yield
    except Exception:
        stop_if_interrupted()
        raise


@contextmanager
def noting_interrupts() -> Iterator[None]:
    """Inside, SIGINT's handler (fibctl.__main__'s, or Python's) sets `interrupted` first, and
    a KeyboardInterrupt (or a noted SIGTERM's SystemExit) raised where Python cannot raise it
    (a callback of the garbage collector) is not printed as "Exception ignored": the command
    stops at its next check."""
    interrupted.clear()
    handler, terminated = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    noting = None
    if callable(handler) and threading.current_thread() is threading.main_thread():  # not where it is ignored
        def noting(signum, frame):
            interrupted.note(signum)
            return handler(signum, frame)

        noting.holds = True  # for hold_interrupts
        signal.signal(signal.SIGINT, noting)
    hook = sys.unraisablehook

    def unraisable(what) -> None:
        if not (isinstance(what.exc_value, (KeyboardInterrupt, SystemExit)) and interrupted.is_set()):
            hook(what)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = hook
        if noting is not None and signal.getsignal(signal.SIGINT) in (noting, _note):
            signal.signal(signal.SIGINT, handler)
        if signal.getsignal(signal.SIGTERM) is _note:  # held (`hold_interrupts(terminate=True)`)
            signal.signal(signal.SIGTERM, terminated)


def _note(signum, frame) -> None:
    interrupted.note(signum)


def hold_interrupts(*, terminate: bool = False) -> Callable[[], None]:
    """From here a Ctrl-C is only noted in `interrupted`, not raised (the work is over, or
    nearly: what is left is to say how it ended); with `terminate`, a SIGTERM too. Returns what
    puts the handlers back (`noting_interrupts` does at its end). Only inside
    `noting_interrupts`, whose handler is SIGINT's (SIGTERM's: fibctl.cli's): not where a
    signal is ignored, nor where a command set its own handler."""
    restores = []
    for signum in (signal.SIGINT, signal.SIGTERM) if terminate else (signal.SIGINT,):
        handler = signal.getsignal(signum)
        if not getattr(handler, "holds", False) or threading.current_thread() is not threading.main_thread():
            continue
        signal.signal(signum, _note)
        restores.append(lambda signum=signum, handler=handler:
                        signal.signal(signum, handler) if signal.getsignal(signum) is _note else None)
    return lambda: [restore() for restore in restores] and None


@contextmanager
def unencodable_shown_as_question_marks() -> Iterator[None]:
    """stdout and stderr in an encoding other than UTF-8 (PYTHONIOENCODING=ascii, LANG=C):
    a character it lacks (Δ, ×) is printed as '?' instead of failing the command with
    UnicodeEncodeError. rich still draws its tables with ASCII boxes there (it reads the
    encoding, which stays); files are written as UTF-8 whatever the terminal's."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        encoding, errors = getattr(stream, "encoding", None), getattr(stream, "errors", None)
        # strict, or surrogateescape (Python's in the C locale), which raises for a Δ too
        if not (encoding and errors in ("strict", "surrogateescape") and hasattr(stream, "reconfigure")):
            continue
        try:
            if codecs.lookup(encoding).name.startswith("utf"):
                continue
            stream.reconfigure(errors="replace")
        except (LookupError, ValueError, OSError):  # an unknown codec, a closed stream: left as it is
            continue
        changed.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in changed:
            try:
                stream.reconfigure(errors=errors)  # as it was, for a caller in the same process (the tests)
            except (ValueError, OSError):
                pass


def step_of(step: int, steps: int | None) -> str:
    """A running run's `step/steps` (`?` for the steps of one whose stored config is damaged)."""
    return f"{step:,}/" + (f"{steps:,}" if steps is not None else "?")


def attention_label(schedule: str, base: str | None, window: int | None) -> str:
    """A model's attention in words (`stagger fib W=12`: the method's symbols W and T are
    written `W=12`, `T=1024` wherever fibctl speaks; `W12` only in the paper's own table
    rows); dense has no base or window to show."""
    return "dense" if schedule == "dense" else f"{schedule} {base} W={window}"


def split_label(batch_size: int, grad_accum: int) -> str:
    """A step's micro-batch split, `8x4` (8 sequences a micro-batch, 4 accumulated), the same
    in `matrix show`, `queue show` and `bench train`."""
    return f"{batch_size}x{grad_accum}"


def model_line(m) -> str:
    """A ModelConfig in one line, the same in `queue show` and `model`: `stagger fib W=12; 16
    layers, d 512, 8 heads (2 kv), vocab 32,768, T=1024` (query heads, and the key/value heads
    they share where fewer: `heads 8/2` was a ratio to decode), within 80 columns."""
    kv = f" ({m.n_kv_heads} kv)" if m.n_kv_heads != m.n_heads else ""
    return (f"{attention_label(m.schedule, m.base, m.window)}; {m.n_layers} layers, d {m.d_model}, "
            f"{m.n_heads} heads{kv}, vocab {m.vocab_size:,}, T={length_label(m.seq_len)}")


def sqlite_int(param: typer.CallbackParam, value: int | None) -> int | None:
    """Option callback: an integer that goes into SQL must fit a 64-bit column."""
    if value is not None and not -2**63 <= value < 2**63:
        raise FibctlError(f"--{param.name.replace('_', '-')} {value} does not fit a 64-bit integer")
    return value


def seed_value(param: typer.CallbackParam, value: int | None) -> int | None:
    """Option callback: a seed as runs record them, 0 to 2**32 - 1 (no run has seed -1)."""
    from fibctl.config import check_seed

    return None if value is None else check_seed(value, f"--{param.name.replace('_', '-')}")


FOLD_WIDTH = 12  # optional columns go before a `fold` column (free text) narrows below this,
# or a `names` column below NAME_WIDTH (render's: a name may be 100 characters)
FOLD_LEAST = 8  # narrower, a folded name or text is hard to read: a table is shown as `records`


def fitted_table(headers: Sequence[str], rows: Sequence[Sequence], *, width: int, optional: Sequence[str] = (),
                 fold: Sequence[str] = (), names: Sequence[str] = (), whole: Sequence[str] = (),
                 right: Sequence[str] = ()) -> tuple[Table, list[str]]:
    """A rich table no wider than `width` whose cells are never cut with '…': columns in
    `optional` are left out, in that order, until the rest fits; a header wraps at its spaces;
    a cell of a `fold` column (free text: errors, descriptions) folds onto more lines, as does a
    long one of a `names` column (run and matrix names: whole, so they can be read and copied);
    a cell of a `whole` column (text holding paths) wraps at its spaces only, never inside a
    word; any other cell keeps its full width. The widest columns give way first. Returns the
    table and the headers left out."""
    texts = [[c if isinstance(c, Text) else plain(c) for c in row] for row in rows]

    def widest(i: int) -> int:  # a column's width with no cell or header wrapped
        return max([cell_len(headers[i]), *(line.cell_len for row in texts for line in row[i].split())])

    def least(i: int) -> int:  # the narrowest a column may become without cutting a cell
        header = max((cell_len(w) for w in headers[i].split()), default=1)
        if headers[i] in whole:  # its longest word
            return max([header, *(cell_len(w) for row in texts for w in row[i].plain.split())])
        cells = [line.cell_len for row in texts for line in row[i].split()]
        floor = FOLD_WIDTH if headers[i] in fold else NAME_WIDTH if headers[i] in names else None
        return max([header, *(c if floor is None else min(c, floor) for c in cells)])

    shown = list(range(len(headers)))
    dropped: list[str] = []
    for name in optional:
        if sum(least(i) + 3 for i in shown) + 1 <= width:
            break
        shown.remove(headers.index(name))
        dropped.append(name)
    room = width - 3 * len(shown) - 1  # less each column's padding and border
    most = [widest(i) for i in shown]
    # where the least widths do not fit (a very narrow terminal), names and free text fold
    # further, then every column
    for tier, floors in enumerate(([least(i) for i in shown],
                                   [1 if headers[i] in (*fold, *names) else least(i) for i in shown],
                                   [1] * len(shown))):
        widths = _narrowed(floors, most, room)
        if sum(widths) <= room:
            break
    table = Table()
    # else numbers fold too, or names a few letters a line (a very narrow terminal): see `records`
    folded = [w for i, w in zip(shown, widths) if headers[i] in (*fold, *names)]
    table.cells_whole = tier == 0 or (tier == 1 and min(folded, default=FOLD_LEAST) >= FOLD_LEAST)
    for i, w in zip(shown, widths):
        table.add_column(headers[i], width=w, overflow="fold", justify="right" if headers[i] in right else "left")
    for row in texts:
        table.add_row(*(row[i] for i in shown))
    return table, dropped


def fitted_view(headers: Sequence[str], rows: Sequence[Sequence], *, width: int | None = None,
                title: str | None = None, **fit) -> Group:
    """What to print for `rows` at `width` (the terminal's): `title` (a `title_line`, as the
    report tables have theirs), the `fitted_table` and a line naming the columns it left out,
    or, where even that would fold numbers (or split a word of a `whole` column), the rows as
    `records`. With `whole` columns, print it with crop=False: a word longer than the terminal
    (a path) is shown whole, past the width, not cut."""
    width = width or console.width
    table, dropped = fitted_table(headers, rows, width=width, **fit)
    above = [title_line(title)] if title is not None else []
    if not table.cells_whole:  # a very narrow terminal: a field a line
        return Group(*above, *([records(headers, rows, whole=fit.get("whole", ()), width=width)] if rows else []))
    note = left_out(headers, dropped, rows) if rows else None
    return Group(*above, table, *([plain(note)] if note else []))


def records(headers: Sequence[str], rows: Sequence[Sequence], *, whole: Sequence[str] = (),
            width: int | None = None) -> Group:
    """The rows of a table too wide to show whole, a field a line: each row's first cell (its
    name), then `  header: value` for the others, so no number is folded across lines; a field
    of a `whole` column is wrapped as `unbroken` (at `width`), so a path in it stays whole. An
    empty field (a `finished` event's message) is left out: a bare `  message:` reads as cut."""
    lines = []
    for row in rows:
        lines.append(plain(str(row[0])))
        for h, v in zip(headers[1:], row[1:]):
            if not str(v).strip():
                continue
            lines.append(unbroken(f"  {h}: {v}", width) if h in whole else plain(f"  {h}: {v}"))
    return Group(*lines)


def unbroken(text, width: int | None = None) -> Text:
    """`text` (shown as `plain` shows it) wrapped at its spaces to `width` (the terminal's), a
    word longer than a line, a path say, whole on a line of its own: rich would fold it there,
    and a path folded across lines cannot be copied. Such a line is wider than the terminal,
    which wraps it on screen: print with soft_wrap=True (or, in a Group, crop=False), or rich
    cuts it."""
    width = width or console.width
    lines = []
    for line in plain(text).plain.split("\n"):
        words = line.split(" ")
        current = words[0]
        for word in words[1:]:
            if cell_len(current) + 1 + cell_len(word) > width and current.strip():
                lines.append(current)
                current = word
            else:
                current += " " + word
        lines.append(current.rstrip())
    return Text("\n".join(lines), overflow="ignore", no_wrap=True)


def _narrowed(least: Sequence[int], most: Sequence[int], room: int) -> list[int]:
    """Column widths, each from its least to its most, that fit `room` if any can: the widest
    columns are narrowed first, together, so the narrow ones stay whole."""
    cap = max(most, default=0)
    while cap > 1 and sum(max(lo, min(hi, cap)) for lo, hi in zip(least, most)) > room:
        cap -= 1
    return [max(lo, min(hi, cap)) for lo, hi in zip(least, most)]


def left_out(headers: Sequence[str], dropped: Sequence[str], rows: Sequence[Sequence]) -> str | None:
    """A line for the columns `fitted_table` left out: a value they all share, or their names.
    A one-letter header is the method's symbol, said as fibctl says it everywhere (`T=1024`;
    `matrix show` said `T 1024`)."""
    if not dropped:
        return None
    same, varied = [], []
    for name in dropped:
        values = {str(row[headers.index(name)]) for row in rows}
        (same if len(values) == 1 else varied).append((name, values))
    parts = [_shared(name, value) for name, values in same for value in values]
    if varied:
        parts.append("not shown at this width: " + ", ".join(name for name, _ in varied)
                     + f" (a wider terminal shows {'them' if len(varied) > 1 else 'it'})")
    return "; ".join(parts)


def _shared(name: str, value: str) -> str:
    if not value:
        return f"no {name}"
    symbol = len(name) == 1 and name.isupper() and value != "-"  # a dense run's W is '-', not a value
    return f"{name}={value}" if symbol else f"{name} {value}"


def interactive() -> bool:
    """Whether a person answers at stdin (a terminal), not a script, a pipe or a scheduler."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # stdin closed (`<&-`): no one to answer
        return False


def confirmed(question: str) -> bool:
    """Ask `question [y/N]` on stderr and read the answer at stdin: yes only for y or yes (an
    empty line, or stdin closed, is no)."""
    err_console.print(plain(f"{question} [y/N] "), end="", soft_wrap=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def folder_value(option: str, what: str) -> Callable[[object], Path]:
    """Option parser of a folder (or a file: --prompt-file): a typed `OPTION ''` is refused,
    as `--db ''` is (Path('') is the current folder: a worker trained into it, a SLURM job
    kept its logs in it); `what` names the folder in the message. An empty environment variable is unset, as FIBCTL_DB.
    A `~` opening it is the home folder, as in a recipe's globs and `fibctl slurm`'s folders:
    quoted (`--data '~/data'`, FIBCTL_DATA="~/data") it made a folder named `~` here."""
    def parse(value) -> Path:
        if isinstance(value, str) and not value.strip():
            raise FibctlError(f"{option} is empty; name {what}")
        return Path(expanded(value))
    return parse


runs_dir_value = folder_value("--runs-dir", "the folder of the checkpoints (default: runs)")
data_dir_value = folder_value("--data", "the prepared data folder (fibctl data prepare)")
