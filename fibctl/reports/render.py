"""Rendering a `Table`: rich (terminal), Markdown, LaTeX (booktabs), CSV, JSON.

Text formats print each value with the table's formatter and bold the best value of the
columns the paper bolds; CSV and JSON carry the raw numbers.
"""

from __future__ import annotations

import contextlib
import io
import numbers
import re
import signal
import threading
from collections.abc import Iterator

from fibctl.lazy import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from fibctl.errors import FibctlError, printable, unknown
from fibctl.reports.tables import Table

FORMATS = ("rich", "md", "latex", "csv", "json")
EXTENSIONS = {"rich": "txt", "md": "md", "latex": "tex", "csv": "csv", "json": "json"}
MISSING = "-"
NAME_WIDTH = 32  # a run's name (up to 100 characters) folds onto lines this wide, not narrower


def title_line(title: str):
    """A table's title as every table fibctl prints shows it: a line of its own, left-aligned
    and wrapped at the terminal's width (rich's own table title is centred and wrapped at the
    table's width, a narrow table's over several lines)."""
    from rich.text import Text

    return Text(printable(title, lines=True), style="table.title")


def cell(table: Table, column: str, value) -> str:
    """A value as every text format shows it: the column's formatter's text, never a negative
    zero (Table 4's gap, fixed less stagger, read -0.000 where the two agreed to 3 places)."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return MISSING
    fmt = table.formats.get(column) or str
    text = fmt(value)
    if isinstance(value, numbers.Real) and _NEGATIVE_ZERO.fullmatch(text):
        return fmt(0.0)  # the formatter's own zero: 0.000, or +0.00 where it signs its values
    return text


# a number that rounded to zero from below, as a formatter writes it: -0, -0.000, -0.0 %
_NEGATIVE_ZERO = re.compile(r"-0(\.0*)?( ?%)?")


def best_rows(table: Table) -> dict[str, set[int]]:
    """Row positions holding the best value of each bolded column."""
    out = {}
    for column, how in table.best.items():
        values = pd.to_numeric(table.frame[column], errors="coerce").reset_index(drop=True)
        if values.notna().any():
            target = values.min() if how == "min" else values.max()
            out[column] = set(values.index[values == target])
    return out


def _numeric(table: Table, column: str) -> bool:
    return pd.api.types.is_numeric_dtype(table.frame[column])


def _cells(table: Table, bold: str, escape=lambda s: s) -> list[list[str]]:
    """Formatted, escaped rows; the best cells wrapped in `bold` (a format string with one {})."""
    best = best_rows(table)
    return [[bold.format(text) if i in best.get(col, ()) else text
             for col, text in ((c, escape(cell(table, c, v))) for c, v in zip(table.frame.columns, row))]
            for i, row in enumerate(table.frame.itertuples(index=False))]


def fitted(table: Table, width: int):
    """The terminal rendering no wider than `width`, with no cell cut: a header wraps at its
    spaces, a value keeps its full width, and columns that still do not fit go to further
    tables below, each repeating the columns that name a row (`table.key`: the run; Table 5's
    base, schedule and W, where base alone named none). A name (the first column's, or a
    header's: `compare` heads a column with each run) longer than NAME_WIDTH folds within its
    column where the table would not fit with it whole: a 60-character name took 62 of 80
    columns, leaving Table 3 in seven parts and cutting `compare`'s setting names. A value
    too wide for the room beside the names even alone folds too, it and the names sharing
    that room. The title and notes wrap at `width`."""
    from rich.cells import cell_len
    from rich.console import Group
    from rich.text import Text

    texts = [[printable(cell(table, c, v), lines=True) for c, v in zip(table.frame.columns, row)]
             for row in table.frame.itertuples(index=False)]
    headers = [printable(str(c), lines=True) for c in table.frame.columns]
    words = [max([min(cell_len(w), NAME_WIDTH) for w in h.split()] + [1]) for h in headers]  # a header's longest
    least = [max([words[i]] + [cell_len(row[i]) if i else min(cell_len(row[i]), NAME_WIDTH) for row in texts])
             for i in range(len(headers))]
    key = range(min(table.key, len(headers)))

    def lead(i: int) -> list[int]:  # the key columns before column i that fit beside it, in a continued part
        k = [j for j in key if j < i]
        while len(k) > 1 and sum(least[j] + 3 for j in k) + least[i] + 3 + 1 > width:
            k.pop()
        return k

    chunks: list[list[int]] = [[0]]
    repeated = 1  # of the last chunk's columns, those repeated from the key
    for i in range(1, len(headers)):
        if sum(least[j] + 3 for j in chunks[-1]) + least[i] + 3 + 1 > width and len(chunks[-1]) > repeated:
            chunks.append(lead(i))
            repeated = len(chunks[-1])
        chunks[-1].append(i)
    bolded = _cells(table, "[bold]{}[/bold]", lambda s: escape(printable(s, lines=True)))
    natural = [max([cell_len(h), least[i]] + [cell_len(row[i]) for row in texts]) for i, h in enumerate(headers)]
    parts = []
    for n, chunk in enumerate(chunks):
        # rich narrows the widest columns first and, past their minimum, cuts the table at the
        # edge: so the widths are set here, wrapping the headers with the most room to spare
        widths = {i: natural[i] for i in chunk}
        excess = sum(widths[i] + 3 for i in chunk) + 1 - width
        for i in sorted(chunk, key=lambda i: (i == 0, least[i] - natural[i])):  # the runs' names fold last
            cut = min(max(excess, 0), natural[i] - least[i])
            widths[i] -= cut
            excess -= cut
        # a value too wide to sit whole beside the runs' names (a 24-character one at 30 columns
        # left them 0 or 1 wide): it folds, as do the names, the widest first, none narrower
        # than its header's longest word
        while excess > 0:
            i = max(chunk, key=lambda i: (widths[i] > words[i], widths[i], i != 0))
            if widths[i] <= words[i]:
                break
            widths[i] -= 1
            excess -= 1
        if excess > 0:  # a long run name and one column: the names fold (rich cut 'Schedul'/'e')
            widths[0] = max(1, widths[0] - excess)
        # the notes as lines of their own too: a table's own wrapped under a narrow continued
        # part at 19 columns
        parts.append(title_line(table.title if n == 0 else f"{table.title} (continued)"))
        out = RichTable()
        for i in chunk:
            c = table.frame.columns[i]
            out.add_column(escape(headers[i]), justify="right" if _numeric(table, c) else "left",
                           width=widths[i], overflow="fold")
        for row in bolded:
            out.add_row(*(row[i] for i in chunk))
        parts.append(out)
    if table.notes:
        parts.append(Text(printable("\n".join(table.notes), lines=True), style="table.caption"))
    return Group(*parts)


def to_text(table: Table, width: int = 200) -> str:
    """The terminal rendering as plain text (what `report all` saves as .txt)."""
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(fitted(table, width))
    return console.export_text()


def to_markdown(table: Table) -> str:
    cols = [str(c) for c in table.frame.columns]
    align = ["---:" if _numeric(table, c) else ":---" for c in table.frame.columns]
    lines = [f"**{_md_text(table.title)}**", "", _md_row(cols), _md_row(align)]
    lines += [_md_row(row) for row in _cells(table, "**{}**")]
    if table.notes:
        lines += [""] + [f"_{_md_text(note)}_" for note in table.notes]
    return "\n".join(lines) + "\n"


def _md_text(text: str) -> str:
    """Text for one line of Markdown, read in a terminal too: names from a database are data,
    their control characters shown (\\x1b), never obeyed; a line break would end the row. '<'
    and '&' as entities: a run named '<script>...' was raw HTML, run by a renderer that passes
    it through (a backslash before '<' would not do: a name's own backslash undoes it)."""
    return printable(text, lines=True).replace("\n", " ").replace("&", "&amp;").replace("<", "&lt;")


def _md_row(values: list[str]) -> str:
    return "| " + " | ".join(_md_text(v).replace("|", "\\|") for v in values) + " |"


# '[' and ']' braced: a row's first cell starting with '[' was read as the optional argument of
# the row end before it (\\[bold] 'Illegal unit of measure'); a line break is a space (two
# made a paragraph, which ends a caption or a cell with an error)
_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
          "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
          "[": "{[}", "]": "{]}", "\n": " ", "Δ": r"$\Delta$", "α": r"$\alpha$"}


def latex_escape(s: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in printable(s, lines=True))  # a control character as its escape


def _latex_cell(s: str) -> str:
    """A cell escaped, a negative number's sign a minus ($-$): text mode set it as a hyphen,
    half as long as the plus beside it (Table 3's -0.7 % under +82.3 %)."""
    return re.sub(r"^-(?=[\d.])", "$-$", latex_escape(s))


def to_latex(table: Table) -> str:
    """A booktabs tabular with a caption; best values in \\textbf."""
    spec = "".join("r" if _numeric(table, c) else "l" for c in table.frame.columns)
    header = " & ".join(latex_escape(str(c)) for c in table.frame.columns)
    rows = [" & ".join(row) for row in _cells(table, "\\textbf{{{}}}", _latex_cell)]
    body = "\n".join(f"{r} \\\\" for r in rows)
    # LaTeX numbers the table itself: "Table 3: ..." would print as "Table 1: Table 3: ..."
    caption = " ".join([re.sub(r"^Table \d+: ", "", table.title), *table.notes])
    return (f"\\begin{{table}}[t]\n\\centering\n\\caption{{{latex_escape(caption)}}}\n"
            f"\\begin{{tabular}}{{{spec}}}\n\\toprule\n{header} \\\\\n\\midrule\n{body}\n"
            f"\\bottomrule\n\\end{{tabular}}\n\\end{{table}}\n")


def to_csv(table: Table) -> str:
    return table.frame.to_csv(index=False)


def to_json(table: Table) -> str:
    with _ctrl_c_after():
        return table.frame.to_json(orient="records", indent=2, force_ascii=False) + "\n"


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """A Ctrl-C waits until pandas' JSON writer (ujson, C) is done, then acts: its
    KeyboardInterrupt raised inside the writer was swallowed there, or crashed the process with a
    segmentation fault (`report all` sent a Ctrl-C, about one in 75)."""
    if threading.current_thread() is not threading.main_thread():  # only its handler runs
        yield
        return
    pressed = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if pressed:
            signal.raise_signal(signal.SIGINT)  # to the handler that was there


def render(table: Table, fmt: str) -> str:
    """`table` as text in `fmt` (rich: the terminal rendering without colour)."""
    renderers = {"rich": to_text, "md": to_markdown, "latex": to_latex, "csv": to_csv, "json": to_json}
    if fmt not in renderers:
        raise FibctlError(unknown("format", fmt, FORMATS))
    return renderers[fmt](table)
