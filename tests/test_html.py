"""`report all` writes index.html: one self-contained page with the five tables, every figure
and the run list, checked in a real headless Chromium (skipped, with the reason, without one)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html import escape
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from fibctl.db.engine import connect_readonly
from fibctl.reports import export, figures, render, tables
from test_reports import study  # noqa: F401  (the small imported study: every table has data)


@pytest.fixture(scope="module")
def module_backend() -> str:
    """SQLite only: the page and the browser are this module's subject; test_reports.py runs
    every table's query on both backends."""
    return "sqlite"


BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.fixture(scope="module")
def report(study, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("report")
    written, skipped = export.write_all(connect_readonly(study), out, source=export.made_from(study))
    assert not skipped, skipped
    return out


def test_index_is_self_contained_with_every_table_figure_and_run(report):
    page = (report / "index.html").read_text()
    for name in tables.TABLES:  # every registered table, in every format, with its SQL
        assert f'<section id="{name}">' in page
        for ext in (*render.EXTENSIONS.values(), "sql"):
            assert (report / f"{name}.{ext}").stat().st_size > 0
    for name in figures.FIGURES:
        assert f'<section id="figure-{name}">' in page
        assert (report / f"{name}.png").is_file() and (report / f"{name}.pdf").is_file()
    assert page.count("data:image/png;base64,") == len(figures.FIGURES)
    assert page.count("<summary>SQL</summary>") == len(tables.TABLES)
    assert '<section id="runs">' in page and "f13__fib_stagger_w12" in page
    assert not re.search(r'(src|href)="(https?:|//)', page)  # nothing fetched from a network
    # what it was made from, under the title (the page alone did not say)
    import fibctl
    assert re.search(rf'<p class="note">from [^<]+ by fibctl {re.escape(fibctl.__version__)}( \(git [0-9a-f]{{40}}'
                     r'(\+dirty)?\))?</p>', page), page[:600]


def test_figures_are_captioned_linked_and_shown_at_one_scale(report):
    """Each figure says what it shows, links its PNG and PDF beside the page (relative), and
    shows at 140 px to the printed inch: the column-wide posloss at half the page-wide width."""
    page = (report / "index.html").read_text()
    for name, draw in figures.FIGURES.items():
        section = page[page.index(f'<section id="figure-{name}">'):]
        section = section[:section.index("</section>")]
        summary = " ".join(draw.__doc__.split("\n\n")[0].split())
        assert f"<figcaption>{escape(summary)}" in section
        assert f'<a href="{name}.pdf">PDF</a>' in section and f'<a href="{name}.png">PNG</a>' in section
    widths = dict(re.findall(r'<section id="figure-(\w+)">.*?<img [^>]*width="(\d+)"', page))
    assert int(widths["posloss"]) == round(figures.COLUMN_WIDTH * 140)
    assert int(widths["extrapolation"]) == round(figures.TEXT_WIDTH * 140)


def test_pdf_figures_embed_truetype_fonts(report):
    pdf = (report / "coverage.pdf").read_bytes()
    assert b"/FontFile2" in pdf and b"/Type3" not in pdf


def test_latex_caption_does_not_repeat_the_table_number(report):
    tex = (report / "table3.tex").read_text()
    assert "\\caption{" in tex and "Table 3:" not in tex


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine (Debian: apt-get install chromium)")
def test_the_page_renders_in_headless_chromium(report, tmp_path):
    url = (report / "index.html").as_uri()
    common = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--enable-logging=stderr", "--v=0"]
    shot = tmp_path / "shot.png"
    run = subprocess.run([*common, "--window-size=1280,2400", f"--screenshot={shot}", url],
                         capture_output=True, text=True, timeout=120)
    assert shot.is_file(), run.stderr[-2000:]
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    assert float(np.std(pixels)) > 0.05 and float(np.mean(pixels < 0.5)) > 0.005  # not blank: text, lines
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    for name in tables.TABLES:
        assert f'id="{name}"' in dom.stdout
    assert dom.stdout.count("<img") == len(figures.FIGURES)
    console = [line for line in (run.stderr + dom.stderr).splitlines() if ":CONSOLE" in line]
    assert not console, console
