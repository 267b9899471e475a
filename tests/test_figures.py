"""`fibctl figure`: each figure is a non-empty PNG (or PDF) drawn from a small database."""

from __future__ import annotations

import contextlib
import re

import pytest
from sqlalchemy import insert, text
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.db import schema
from fibctl.db.engine import connect, connect_readonly
from fibctl.errors import FibctlError
from fibctl.reports import figures
from fibctl.schedules import layer_alphas
from test_reports import add_eval, add_run

PNG, PDF = b"\x89PNG\r\n\x1a\n", b"%PDF"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """Two W8 runs and a dense one, evaluated during training and at 1x..4x, with positions and alphas."""
    path = str(tmp_path_factory.mktemp("fig") / "results.db")
    engine = connect(path)
    with engine.begin() as conn:
        for schedule, base_ppl in (("dense", 20.0), ("fixed", 24.0), ("stagger", 23.0), ("learned", 23.5)):
            rid = add_run(conn, f"demo_{schedule}", schedule)
            for step in (200, 400):
                add_eval(conn, rid, 128, base_ppl + 600 / step, step=step)
            for length, factor in ((128, 1.0), (256, 1.5 if schedule == "dense" else 0.99), (512, 3.0 if schedule == "dense" else 0.98)):
                add_eval(conn, rid, length, base_ppl * factor)
            conn.execute(insert(schema.PositionLoss), [
                dict(run_id=rid, step=600, dataset="docs_val", eval_length=128, position=p,
                     mean_loss=3 + 1 / (p + 1), windows=8) for p in range(127)])
            if schedule == "learned":
                conn.execute(insert(schema.Alpha), [dict(run_id=rid, step=s, layer=l, alpha=1 + (l - 1.5) * s / 2000)
                                                     for s in (0, 300, 600) for l in range(4)])
    engine.dispose()
    return path


@pytest.mark.parametrize("name", [n for n in figures.FIGURES if n != "coverage"])  # coverage: below
def test_each_figure_from_the_database_is_a_png(db, tmp_path, name):
    out = figures.FIGURES[name](connect_readonly(db), tmp_path / f"{name}.png")
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000


def test_coverage_png_and_pdf_by_extension(tmp_path):
    png = figures.coverage(tmp_path / "c.png", schedules=("fixed", "stagger", "coprime"), n_layers=4, seq_len=128)
    pdf = figures.coverage(tmp_path / "c.pdf", base="pow2", n_layers=4, seq_len=128)
    assert png.read_bytes().startswith(PNG) and pdf.read_bytes().startswith(PDF)
    svg = [figures.coverage(tmp_path / f"c{i}.svg", n_layers=4, seq_len=128).read_bytes() for i in (1, 2)]
    assert b"<svg" in svg[0] and svg[0] == svg[1]  # no date in it: the same data, the same bytes


def test_other_extensions_and_missing_data_are_refused(db, tmp_path):
    with pytest.raises(FibctlError, match="PNG, PDF or SVG"):
        figures.coverage(tmp_path / "c.eps")
    with pytest.raises(FibctlError, match="alphas: no alphas recorded for run 'demo_fixed'"):
        figures.alphas(connect_readonly(db), tmp_path / "a.png", run="demo_fixed")
    with pytest.raises(FibctlError, match="alphas: run 'demo_dense' is dense: it has no alpha"):
        figures.alphas(connect_readonly(db), tmp_path / "a.png", run="demo_dense")
    # a figure drawn from a table's data says its own name, not the table's ("table4: ...")
    with pytest.raises(FibctlError, match=r"^posloss: no per-position"):
        figures.posloss(connect_readonly(db), tmp_path / "a.png", window=12)
    with pytest.raises(FibctlError, match=r"^extrapolation: --only 'no-such-run\*' matches no run"):
        figures.extrapolation(connect_readonly(db), tmp_path / "a.png", only="no-such-run*")
    assert not (tmp_path / "a.png").exists()


def test_cli_figure(db, tmp_path):
    runner = CliRunner()
    out = tmp_path / "coverage.pdf"
    r = runner.invoke(app, ["figure", "coverage", "--out", str(out), "--preset", "tiny", "--schedule", "stagger"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(PDF)
    r = runner.invoke(app, ["figure", "extrapolation", "--db", db, "--out", str(tmp_path / "e.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "e.png").read_bytes().startswith(PNG)
    r = runner.invoke(app, ["figure", "nope", "--db", db])
    assert isinstance(r.exception, FibctlError) and "unknown figure 'nope'" in str(r.exception)
    r = runner.invoke(app, ["figure", "extrapolaton", "--db", db])  # a typo names the figure meant
    assert str(r.exception) == ("unknown figure 'extrapolaton' (did you mean 'extrapolation'?); "
                                "allowed: extrapolation, posloss, curves, alphas, coverage")


# --- what a paper needs of them, checked on the matplotlib objects -----------------------

OKABE_ITO = {"black", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7"}


@pytest.fixture
def drawn(monkeypatch):
    """The Figure objects the figure functions save, in order (each still drawn to a file)."""
    figs = []
    save = figures._save

    def keep(fig, path):
        figs.append(fig)
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    return figs


@pytest.fixture(scope="module")
def many_runs_db(tmp_path_factory) -> str:
    """A dense run and 12 sparse ones (fixed, stagger and pow2 stagger at W 6..12): too many
    to name each in a legend. The dense one, named as the study names it, blows up at 4x."""
    path = str(tmp_path_factory.mktemp("many") / "results.db")
    engine = connect(path)
    with engine.begin() as conn:
        rid = add_run(conn, "ref_e0000", "dense")
        for length, ppl in ((128, 20.0), (256, 30.0), (512, 100.0)):
            add_eval(conn, rid, length, ppl)
        for schedule, base in (("fixed", "fib"), ("stagger", "fib"), ("stagger", "pow2")):
            for w in (6, 8, 10, 12):
                rid = add_run(conn, f"{base}_{schedule}_w{w}", schedule, base=base, window=w)
                for length, factor in ((128, 1.0), (256, 0.99), (512, 0.98)):
                    add_eval(conn, rid, length, (24 - w / 10) * factor)
    engine.dispose()
    return path


def _renderer(fig):
    """The figure drawn (laid out) on an Agg canvas, and its renderer to measure with: under
    the figures' style, as they are saved (outside it, ticks made while drawing took 10 pt
    labels, and the style's 8 pt ones took more ticks, unmeasured)."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with rc_context(figures.STYLE):
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
    return renderer


def _texts(fig):
    """Every text the figure shows, with its extent: matplotlib keeps labels for ticks outside
    the view (not drawn), which are left out."""
    from matplotlib.text import Text

    renderer = _renderer(fig)
    hidden = set()
    for ax in fig.axes + [inset for ax in fig.axes for inset in ax.child_axes]:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            hidden |= {id(label) for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks())
                       if not lo <= tick.get_loc() <= hi for label in (tick.label1, tick.label2)}
    return [(t, t.get_window_extent(renderer)) for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip() and id(t) not in hidden
            and (t.axes is None or t.axes.get_visible())]


def _draw_every_figure(db, tmp_path):
    engine = connect_readonly(db)
    for name in ("extrapolation", "posloss", "curves", "alphas"):
        figures.FIGURES[name](engine, tmp_path / f"{name}.png")
    # the study's four fib schedules side by side: their x labels once ran into each other
    figures.coverage(tmp_path / "coverage.png", schedules=("fixed", "learned", "stagger", "coprime"), n_layers=4,
                     seq_len=128)


def test_figures_are_drawn_at_print_size_with_no_text_cut_or_overlapping(db, drawn, tmp_path):
    """A column or the text width of a two-column paper, so that 8-9 pt stays 8-9 pt in print;
    every text inside the figure and clear of every other (three coverage titles once ran
    into each other; the posloss title ran off both sides)."""
    from matplotlib.image import imread

    _draw_every_figure(db, tmp_path)
    for fig, name in zip(drawn, ("extrapolation", "posloss", "curves", "alphas", "coverage")):
        width = imread(tmp_path / f"{name}.png").shape[1] / figures.STYLE["savefig.dpi"]
        assert width <= figures.TEXT_WIDTH + 0.01, name
        assert fig._suptitle is not None and fig._suptitle.get_text(), f"{name}: no title says what is shown"
        _assert_text_inside_and_apart(fig, name)
    assert drawn[1].get_figwidth() == figures.COLUMN_WIDTH  # posloss: one column


def _assert_text_inside_and_apart(fig, name: str) -> None:
    """Every text at 8 pt or more, inside the figure and clear of every other."""
    texts = _texts(fig)
    for text, box in texts:
        assert text.get_fontsize() >= 8, (name, text.get_text())
        assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1, (name, text.get_text())
        assert fig.bbox.y0 - 1 <= box.y0 and box.y1 <= fig.bbox.y1 + 1, (name, text.get_text())
    upright = [(t, box) for t, box in texts if t.get_rotation() % 90 == 0]  # a slanted text's box is loose
    for i, (a, abox) in enumerate(upright):
        for b, bbox in upright[i + 1:]:
            assert not abox.overlaps(bbox), (name, a.get_text(), b.get_text())


@pytest.mark.parametrize("length", [1024, 2**20])
def test_coverage_of_the_four_schedules_at_the_paper_shape_keeps_its_text_apart(drawn, tmp_path, length):
    """Four panels at the paper's 16 layers and T=1024: 'fib stagger / 133 distinct distances'
    ran into the next panel's title, and the distance labels 100 and 1000 into each other
    ('1001000'). Titles break to fit their panels; decades are labelled while they stand
    apart, else every other one down from the largest, and 0 always."""
    figures.coverage(tmp_path / "c.png", schedules=("fixed", "learned", "stagger", "coprime"), seq_len=length,
                     n_rungs=19 if length > 1024 else 15)
    (fig,) = drawn
    _assert_text_inside_and_apart(fig, f"coverage T={length}")
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.get_xscale() == "symlog"]
    assert len(panels) == 4
    for ax in panels:
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels[0] == "0" and labels[-1] == f"{10 ** (len(str(length - 1)) - 1):,}", labels
        assert len(ax.get_xticks()) + len(ax.get_xticks(minor=True)) == len(str(length - 1)) + 1


def test_the_change_axis_labels_each_tick_with_its_own_value(tmp_path, drawn):
    """A sweep's changes of 0 to -2 % on the linear change axis are ticked in quarters: -1.25
    and -1.75 read -1.2 and -1.8, two labels a step apart differing by 0.2 and 0.3."""
    figures.extrapolation(connect_readonly(_sweep_db(str(tmp_path / "sweep.db"), 4)), tmp_path / "e.png")
    right = drawn[0].axes[1]
    _renderer(drawn[0])  # its ticks labelled as saved
    lo, hi = sorted(right.get_ylim())
    shown = [(tick.get_loc(), tick.label1.get_text()) for tick in right.yaxis.get_major_ticks()
             if lo <= tick.get_loc() <= hi]
    assert right.get_yscale() == "linear" and len(shown) >= 4
    assert any(loc != round(loc) for loc, _ in shown)  # steps finer than 1
    for loc, label in shown:
        assert float(label.replace(",", "")) == pytest.approx(loc, abs=1e-9), (loc, label)


def test_extrapolation_limits_fit_the_runs_not_the_dense_blow_up(db, drawn, tmp_path):
    """The fixture's dense run triples at 4x (60 vs ~23): the sparse runs fill the panel and
    the dense value is written at its top edge instead of crushing them into a band."""
    figures.extrapolation(connect_readonly(db), tmp_path / "e.png")
    left = drawn[0].axes[0]
    low, high = left.get_ylim()
    assert low <= 20 and 24 <= high < 40  # every sparse value and dense up to 2x (30) in view
    assert [t.get_text() for t in left.texts] == ["\u2191 60"]


def test_names_holding_dollar_signs_are_drawn_as_written(tmp_path, drawn):
    """A run or held-out set named with '$' (a database from elsewhere) was parsed as
    mathtext: '$\\foo{$' was a traceback, '$x^2$' drawn as a formula."""
    names = {"fixed": "a$\\foo{$b", "stagger": "c$x^2$", "learned": "d$"}
    path = str(tmp_path / "r.db")
    engine = connect(path)
    with engine.begin() as conn:
        for schedule, name in names.items():
            rid = add_run(conn, name, schedule)
            for step, length in ((300, 128), (600, 128), (600, 256)):
                add_eval(conn, rid, length, 20.0 + length / 128 + step / 600, dataset="v$\\$", step=step)
            conn.execute(insert(schema.PositionLoss), [
                dict(run_id=rid, step=600, dataset="v$\\$", eval_length=128, position=p, mean_loss=3.0, windows=8)
                for p in range(127)])
        conn.execute(insert(schema.Alpha), [dict(run_id=rid, step=s, layer=layer, alpha=1.0)
                                             for s in (0, 600) for layer in range(4)])
    engine.dispose()
    for name in ("extrapolation", "posloss", "curves", "alphas"):
        figures.FIGURES[name](connect_readonly(path), tmp_path / f"{name}.png")
    shown = {t.get_text() for fig in drawn for t, _ in _texts(fig)}
    assert set(names.values()) <= shown, shown  # the legend's names, the alphas panel's title
    # fibctl's own text is no formula either: every '$' shown is one of the database's
    assert all(any(n in s for n in (*names.values(), "v$\\$")) for s in shown if "$" in s), shown


@pytest.mark.parametrize("value", [0.0, -1.0, "nan"])
def test_a_perplexity_that_is_not_positive_is_left_out_not_a_traceback(tmp_path, drawn, value, recwarn):
    """Only a row edited by hand holds one: extrapolation divided by 0 (or drew nothing for a
    run whose every value was nan) and curves warned that it could not log-scale."""
    path = str(tmp_path / "r.db")
    engine = connect(path)
    with engine.begin() as conn:
        for schedule in ("dense", "fixed"):
            rid = add_run(conn, f"r_{schedule}", schedule)
            for length in (128, 256, 512):
                add_eval(conn, rid, length, 20.0 + length / 128)
            add_eval(conn, rid, 128, 30.0, step=300)
        rid = add_run(conn, "r_stagger", "stagger")
        for length in (128, 256):
            add_eval(conn, rid, length, 22.0)
        # in SQL: the text 'nan' as a hand edit leaves it (the schema's float type would bind NULL)
        conn.execute(text("UPDATE evaluations SET ppl = :v WHERE run_id = :rid"), dict(v=value, rid=rid))
        conn.execute(text("UPDATE evaluations SET ppl = :v WHERE eval_length = 128 AND step = 600 "
                          "AND run_id <> :rid"), dict(v=value, rid=rid))  # the others' at the training length
    engine.dispose()
    figures.extrapolation(connect_readonly(path), tmp_path / "e.png")
    figures.curves(connect_readonly(path), tmp_path / "c.png")
    assert not [w for w in recwarn if "log" in str(w.message)]
    left = drawn[0].axes[0]
    assert sorted(tuple(line.get_xdata()) for line in left.lines if len(line.get_xdata())) == [(256, 512)] * 2
    assert all(low > 0 for low, _ in [drawn[1].axes[0].get_ylim()])


def test_many_runs_get_a_legend_of_the_encoding_below_the_panels(many_runs_db, drawn, tmp_path):
    """13 runs: a legend entry each would crowd; the legend keys colour (schedule), line
    (base) and marker (W), sits outside every panel, and names the imported dense run."""
    figures.extrapolation(connect_readonly(many_runs_db), tmp_path / "e.png")
    fig = drawn[0]
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts() if t.get_text()]
    assert sorted(labels) == sorted(["dense", "fixed schedule", "stagger schedule", "fib base", "pow2 base",
                                     "W=6", "W=8", "W=10", "W=12"])
    renderer = _renderer(fig)
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    assert figures.run_label("ref_e0000", "dense") == "ref_e0000 (dense)"


def test_few_runs_are_named_in_a_legend_outside_the_panels(db, drawn, tmp_path):
    figures.extrapolation(connect_readonly(db), tmp_path / "e.png")
    fig = drawn[0]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["demo_dense", "demo_fixed", "demo_learned", "demo_stagger"]
    renderer = _renderer(fig)
    assert not any(legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_curves_without_training_steps_draw_no_empty_panel(db, drawn, tmp_path):
    """The fixture (like an imported study) records evaluations but no training steps."""
    figures.curves(connect_readonly(db), tmp_path / "c.png")
    assert len(drawn[0].axes) == 1
    assert "no training steps recorded" in drawn[0]._suptitle.get_text()


def test_the_training_curve_is_smoothed_without_lag_whatever_the_runs_length():
    """An exponential average of 0.1 per logged point lagged above every raw point of a short
    run's falling loss; the centred mean follows a straight fall exactly, and on a long noisy
    run averages the noise over a tenth of it."""
    import numpy as np
    import pandas as pd

    short = pd.Series(np.linspace(6.0, 4.8, 16))
    assert figures.smoothed(short).tolist() == pytest.approx(short.tolist())
    fall = pd.Series(np.linspace(6.0, 3.0, 1300))
    assert (figures.smoothed(fall) - fall).abs().max() < 1e-9  # narrowed at the ends, still centred
    noise = pd.Series(np.random.default_rng(0).normal(0, 1, 1300))
    assert figures.smoothed(noise)[65:-65].std() < 0.2 * noise.std()
    gap = pd.Series(np.linspace(6.0, 3.0, 30)).mask(lambda s: s.index == 15)  # a step not logged
    assert figures.smoothed(gap)[15] == pytest.approx((gap[14] + gap[16]) / 2)


def test_colours_are_colour_blind_safe_and_tell_schedules_apart():
    colors = [figures.SCHEDULE_COLORS[s] for s in figures.SCHEDULES]
    assert set(colors) <= OKABE_ITO and len(set(colors)) == len(colors)


def test_the_same_data_give_the_same_bytes(db, tmp_path):
    """No creation date in a PDF: a figure redrawn from unchanged data is the same file."""
    engine = connect_readonly(db)
    for suffix in (".pdf", ".png"):
        first = figures.extrapolation(engine, tmp_path / f"a{suffix}").read_bytes()
        assert first == figures.extrapolation(engine, tmp_path / f"b{suffix}").read_bytes()
    assert b"/CreationDate" not in (tmp_path / "a.pdf").read_bytes()


def test_the_change_axis_reads_short_numbers():
    """A tick at a small range's end read +0.654804."""
    assert [figures.percent_tick(v) for v in (0.654804, -0.570405, 0.0, 2.0, -5.25, 150.0, 1234.5)] == \
        ["+0.65", "-0.57", "0", "+2", "-5.25", "+150", "+1,234"]


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_figure_no_title_leaves_the_title_to_a_papers_caption(db, tmp_path, monkeypatch, name):
    titles, save = [], figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, path: titles.append(fig.get_suptitle()) or save(fig, path))
    args = ["figure", name, "--out", str(tmp_path / f"{name}.svg")] + ([] if name == "coverage" else ["--db", db])
    for extra in ([], ["--no-title"]):
        r = CliRunner().invoke(app, args + extra)
        assert r.exit_code == 0, r.output
    assert titles[0] and titles[1] == ""
    assert figures._TITLED.get()  # the next figure drawn in this process has its title again


def test_a_static_runs_alphas_are_labelled_as_the_schedules_a_learned_runs_by_step(tmp_path, monkeypatch):
    path = str(tmp_path / "a.db")
    engine = connect(path)
    with engine.begin() as conn:
        for name, schedule in (("s", "stagger"), ("l", "learned")):
            rid = add_run(conn, name, schedule)
            conn.execute(insert(schema.Alpha), [dict(run_id=rid, step=0 if name == "s" else 250, layer=layer,
                                                     alpha=0.5 + layer / 4) for layer in range(4)])
    engine.dispose()
    labels, titles = {}, []
    save = figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, out: labels.update(
        {ax.get_title(): ax.get_xlabel() for ax in fig.axes if ax.get_title()})
        or titles.append(" ".join(fig.get_suptitle().split())) or save(fig, out))
    figures.alphas(connect_readonly(path), tmp_path / "a.png")
    assert labels == {"s": "layer (at every step)", "l": "layer (step 250)"}
    # the title says how each kind is drawn: "of each sparse run" said nothing of a static
    # schedule's panel standing for all its runs; a learned run recorded at one step (the
    # study's imported probe) is drawn by layer, which the title called "over training"
    for only in ("s", "l"):
        figures.alphas(connect_readonly(path), tmp_path / f"{only}.png", only=only)
    assert titles == [f"Per-layer \u03b1{what} (rung distance = \u03b1 \u00d7 base sequence)" for what in (
        ": each static schedule once, each learned run by layer", " of each static schedule", " by layer")]


def test_one_learned_runs_alphas_have_a_title_of_two_lines_at_column_width(tmp_path, drawn):
    """One learned run is drawn a column wide: its title, 'Per-layer alpha of each learned run
    over training (rung distance = ...)', took three lines over a panel that names the run."""
    figures.alphas(connect_readonly(_alphas_db(str(tmp_path / "a.db"), 1)), tmp_path / "a.png")
    fig = drawn[0]
    assert fig.get_figwidth() == figures.COLUMN_WIDTH and _panel_titles(fig) == ["r00__logsparse_learned_w12_s43"]
    assert fig.get_suptitle() == "Per-layer \u03b1 over training\n(rung distance = \u03b1 \u00d7 base sequence)"
    _assert_text_inside_and_apart(fig, "alphas")


# --- a reader of the printed page: greyscale, one colour per schedule, readable ticks -----

def _lightness(color) -> float:
    """CIE L* (0 black, 100 white): what is left of a colour printed in greyscale."""
    from matplotlib.colors import to_rgb

    r, g, b = [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in to_rgb(color)]
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return 116 * y ** (1 / 3) - 16 if y > 0.008856 else 903.3 * y


def _apart_in_greyscale(a, b) -> bool:
    """Two drawn lines a reader of a greyscale print can tell apart: by marker, line style,
    hollow or filled marker, or a grey at least 15 L* lighter or darker."""
    from matplotlib.colors import to_hex

    def look(line):
        return line.get_marker(), line.get_linestyle(), to_hex(line.get_markerfacecolor()) == "#ffffff"
    return look(a) != look(b) or abs(_lightness(a.get_color()) - _lightness(b.get_color())) >= 15


def test_the_schedules_lines_stay_apart_in_greyscale(db, drawn, tmp_path):
    """fixed's blue and stagger's green print as one grey (L* 46 and 58), and at the same base
    and W they share marker and line: posloss, the study's fixed-vs-stagger figure, drew two
    identical grey lines. Every pair of schedules now differs in grey or in marker fill."""
    from itertools import combinations

    from matplotlib.lines import Line2D

    for a, b in combinations(figures.SCHEDULES, 2):
        assert _apart_in_greyscale(Line2D([], [], **figures.run_style(a, "fib", 8)),
                                   Line2D([], [], **figures.run_style(b, "fib", 8))), (a, b)
    _draw_every_figure(db, tmp_path)
    for fig in drawn:
        for ax in fig.axes:
            named = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
            for a, b in combinations(named, 2):
                assert _apart_in_greyscale(a, b), (a.get_label(), b.get_label())


@pytest.fixture(scope="module")
def repeated_db(tmp_path_factory) -> str:
    """Dense and fixed and stagger at W 6 and W 8, each trained (30 evaluations, 60 logged
    steps) and evaluated at 1x..4x."""
    path = str(tmp_path_factory.mktemp("repeated") / "results.db")
    engine = connect(path)
    with engine.begin() as conn:
        for name, schedule, w in (("dense", "dense", 8), ("fixed_w6", "fixed", 6), ("fixed_w8", "fixed", 8),
                                  ("stagger_w6", "stagger", 6), ("stagger_w8", "stagger", 8)):
            rid = add_run(conn, name, schedule, window=w)
            for step in range(20, 620, 20):
                add_eval(conn, rid, 128, 30 - step / 100 - w / 10, step=step)
            for length, factor in ((256, 0.99), (512, 0.98)):
                add_eval(conn, rid, length, (24 - w / 10) * factor)
            conn.execute(insert(schema.TrainStep), [
                dict(run_id=rid, step=step, loss=4 - step / 1000 - w / 100, lr=1e-3, grad_norm=1.0, tokens_per_s=1e3,
                     elapsed_s=step) for step in range(10, 610, 10)])
    engine.dispose()
    return path


def test_a_run_has_its_schedules_colour_in_every_figure(repeated_db, drawn, tmp_path):
    """curves gave each of up to 8 runs a colour of its own when schedules repeated: fixed_w8
    was orange there (learned's colour in every other figure) and blue in extrapolation. Colour
    is the schedule in every figure; runs of one schedule differ by marker (W), in the training
    panel too."""
    from matplotlib.colors import to_hex

    engine = connect_readonly(repeated_db)
    figures.extrapolation(engine, tmp_path / "e.png")
    figures.curves(engine, tmp_path / "c.png")
    colors = [{line.get_label(): to_hex(line.get_color()) for line in fig.axes[0].get_lines()
               if not line.get_label().startswith("_")} for fig in drawn]
    assert colors[0] == colors[1] and len(colors[0]) == 5
    for run, color in colors[0].items():
        assert color == to_hex(figures.SCHEDULE_COLORS[run.split("_")[0]]), run
    smoothed = [line for line in drawn[1].axes[1].get_lines() if line.get_alpha() is None]
    looks = {(to_hex(line.get_color()), line.get_marker()) for line in smoothed}
    assert len(looks) == len(smoothed) == 5


def _markers_shown(line) -> int:
    every = line.get_markevery()
    start, step = (0, 1) if every is None else every if isinstance(every, tuple) else (0, every)
    return len(range(start, len(line.get_xdata()), step))


def test_a_long_curve_draws_a_few_markers_not_one_per_point(repeated_db, drawn, tmp_path):
    """The study's runs are evaluated 26 times each: a marker at every evaluation of 31 runs
    buried the curves under a band of markers. A line shows at most 10, enough to tell W."""
    figures.curves(connect_readonly(repeated_db), tmp_path / "c.png")
    for ax in drawn[0].axes:
        for line in ax.get_lines():
            if line.get_marker() not in ("", "None", None):
                assert 3 <= _markers_shown(line) <= 10, line.get_label()


def test_small_changes_with_length_are_read_on_a_linear_axis(tmp_path, drawn):
    """Changes of -2 % to +1 % on the symmetric-log axis got two ticks (0 and -1) or only the
    ends' (+0.044, -0.92, next to 0); within +-10 % the axis is linear, with several ticks."""
    path = str(tmp_path / "small.db")
    engine = connect(path)
    with engine.begin() as conn:
        rid = add_run(conn, "fib_stagger_w8", "stagger")
        for length, ppl in ((128, 23.2), (256, 22.97), (512, 22.74), (1024, 23.43)):
            add_eval(conn, rid, length, ppl)
    engine.dispose()
    figures.extrapolation(connect_readonly(path), tmp_path / "e.png")
    right = drawn[0].axes[1]
    lo, hi = right.get_ylim()
    shown = [t for t in right.get_yticks() if lo <= t <= hi]
    assert right.get_yscale() == "linear" and len(shown) >= 4
    assert lo <= -2 and hi >= 1


def test_no_axis_label_is_longer_than_its_axis(db, drawn, tmp_path):
    """posloss's gap panel is a third of the figure: its two-line label 'fixed - stagger (nats)'
    stood 1 in tall beside a 0.6 in panel and touched the loss panel's label. A label runs
    along its own axis, no further."""
    _draw_every_figure(db, tmp_path)
    for fig in drawn:
        renderer = _renderer(fig)
        for ax in fig.axes:
            box = ax.get_window_extent(renderer)
            for label, length in ((ax.yaxis.label, box.height), (ax.xaxis.label, box.width)):
                if label.get_visible() and label.get_text():
                    extent = label.get_window_extent(renderer)
                    along = extent.height if label is ax.yaxis.label else extent.width
                    assert along <= length + 1, label.get_text()


def _sweep_db(path: str, lrs: int) -> str:
    """A dense run and `lrs` runs of fib fixed W8 (a learning-rate sweep: alike in schedule,
    base and W), each trained and evaluated at 1x..4x."""
    engine = connect(path)
    with engine.begin() as conn:
        for i, name in enumerate(["dense"] + [f"fixed_w8_lr{k}" for k in range(lrs)]):
            rid = add_run(conn, name, "dense" if i == 0 else "fixed")
            for step in range(20, 620, 20):
                add_eval(conn, rid, 128, 30 - step / 100 - i / 10, step=step)
            for length, factor in ((256, 0.99), (512, 0.98)):
                add_eval(conn, rid, length, (24 - i / 10) * factor)
            conn.execute(insert(schema.TrainStep), [
                dict(run_id=rid, step=step, loss=4 - step / 1000 - i / 100, lr=1e-3, grad_norm=1.0,
                     tokens_per_s=1e3, elapsed_s=step) for step in range(10, 610, 10)])
    engine.dispose()
    return path


def test_a_sweeps_runs_alike_in_schedule_base_and_w_are_told_apart(tmp_path, drawn):
    """A learning-rate sweep's runs share schedule, base and W: every one was drawn in fixed's
    blue with the same marker and line, its legend names on identical lines. The first keeps
    fixed's colour, the others the palette's other colours, the same in every figure."""
    from matplotlib.colors import to_hex

    engine = connect_readonly(_sweep_db(str(tmp_path / "sweep.db"), 4))
    figures.extrapolation(engine, tmp_path / "e.png")
    figures.curves(engine, tmp_path / "c.png")
    looks = []
    for fig in drawn:
        named = [line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
        looks.append({line.get_label(): (to_hex(line.get_color()), to_hex(line.get_markerfacecolor()))
                      for line in named})
        assert len(set(looks[-1].values())) == len(named) == 5, looks[-1]
    assert looks[0] == looks[1]
    assert looks[0]["fixed_w8_lr0"][0] == to_hex(figures.SCHEDULE_COLORS["fixed"])
    assert looks[0]["dense"][0] == to_hex("black")
    assert not {c for c, _ in looks[0].values()} & {to_hex(c) for s, c in figures.SCHEDULE_COLORS.items()
                                                      if s not in ("fixed", "dense")}
    smoothed = [line for line in drawn[1].axes[1].get_lines() if line.get_alpha() is None]
    assert len({(to_hex(line.get_color()), to_hex(line.get_markerfacecolor())) for line in smoothed}) == 5


def test_a_title_too_wide_for_its_figure_breaks_before_its_parenthesis(db, drawn, tmp_path):
    """posloss is a column wide: its title broke as 'mean docs_val loss by position bin (fib' over
    'W8, seed 42)', the parenthesis split between the lines."""
    figures.posloss(connect_readonly(db), tmp_path / "p.png")
    assert drawn[0].get_suptitle() == "mean docs_val loss by position bin\n(fib, W=8, seed 42)"


def test_the_position_legend_names_schedule_and_run_in_the_figures_notation(db, drawn, tmp_path):
    """Its legend said 'fixed W8 (demo_fixed)' under a title saying 'W=8': the paper's table
    row name, in the figure's other notation; the title gives W once."""
    figures.posloss(connect_readonly(db), tmp_path / "p.png")
    (legend,) = drawn[0].legends
    assert [t.get_text() for t in legend.get_texts()] == ["fixed (demo_fixed)", "stagger (demo_stagger)"]
    assert "W=8" in drawn[0].get_suptitle()


def test_a_sweep_of_every_schedule_draws_each_run_apart_under_its_own_name(tmp_path, drawn):
    """`fibctl queue add demo --set train.lr=1e-3 --suffix _lr1e-3` (queue add's own example):
    the look-alike colours were counted per schedule, so fixed's and stagger's second runs
    were drawn alike (green, hollow, solid, circles), and every dense run was named 'dense'."""
    from matplotlib.colors import to_hex

    path = str(tmp_path / "sweep.db")
    engine = connect(path)
    with engine.begin() as conn:
        for i, (name, schedule) in enumerate([("dense", "dense"), ("fib_fixed_w8", "fixed"),
                                              ("fib_stagger_w8", "stagger"), ("dense_lr1e-3", "dense"),
                                              ("fib_fixed_w8_lr1e-3", "fixed"),
                                              ("fib_stagger_w8_lr1e-3", "stagger")]):
            rid = add_run(conn, name, schedule)
            for length, ppl in ((128, 30.0), (256, 31.0), (512, 32.0)):
                add_eval(conn, rid, length, ppl - i)
    engine.dispose()
    figures.extrapolation(connect_readonly(path), tmp_path / "e.png")
    lines = [line for line in drawn[0].axes[0].get_lines() if not line.get_label().startswith("_")]
    assert sorted(line.get_label() for line in lines) == sorted(
        ["dense", "dense_lr1e-3", "fib_fixed_w8", "fib_fixed_w8_lr1e-3", "fib_stagger_w8", "fib_stagger_w8_lr1e-3"])
    looks = {(to_hex(line.get_color()), to_hex(line.get_markerfacecolor()), line.get_marker(), line.get_linestyle())
             for line in lines}
    assert len(looks) == len(lines)


def test_past_8_runs_a_sweep_drawn_alike_is_said_and_the_layout_holds(tmp_path, drawn):
    """Ten runs alike in schedule, base and W once got a legend naming each, which took the
    panels' room ('axes sizes collapsed'): the legend keys the encoding and says how many runs
    are drawn alike; every text stays inside the figure, the legend off the panels."""
    engine = connect_readonly(_sweep_db(str(tmp_path / "sweep.db"), 10))
    for name in ("extrapolation", "curves"):
        figures.FIGURES[name](engine, tmp_path / f"{name}.png")
    for fig in drawn:
        (legend,) = fig.legends
        assert legend.get_title().get_text() == "11 runs; 9 drawn as another of their schedule, base and W"
        assert sorted(t.get_text() for t in legend.get_texts() if t.get_text()) == ["W=8", "dense", "fib base",
                                                                                   "fixed schedule"]
        renderer = _renderer(fig)
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
        for text, extent in _texts(fig):
            assert fig.bbox.x0 - 1 <= extent.x0 and extent.x1 <= fig.bbox.x1 + 1, text.get_text()
            assert fig.bbox.y0 - 1 <= extent.y0 and extent.y1 <= fig.bbox.y1 + 1, text.get_text()


PAPER_MIX = ("learned", "fixed", "stagger", "coprime")


def _alphas_db(path: str, runs: int, schedules=PAPER_MIX, depths=(16,)) -> str:
    """`runs` runs with alphas, as a fibctl-trained paper matrix records them: learned ones over
    training (27 steps), static ones once, `schedules` and `depths` (layers) in turn; names as
    long as the probe's."""
    engine = connect(path)
    with engine.begin() as conn:
        for i in range(runs):
            schedule, layers = schedules[i % len(schedules)], depths[i % len(depths)]
            rid = add_run(conn, f"r{i:02d}__logsparse_{schedule}_w12_s43", schedule, window=12)
            steps = range(0, 13500, 500) if schedule == "learned" else (0,)
            static = layer_alphas(schedule, layers)
            conn.execute(insert(schema.Alpha), [
                dict(run_id=rid, step=s, layer=l, alpha=1 + (l / (layers - 1) - 0.5) * s / 13000
                     if schedule == "learned" else static[l]) for s in steps for l in range(layers)])
    engine.dispose()
    return path


def _panel_titles(fig) -> list[str]:
    """The alphas panels' titles in the figure's order, a title broken over lines joined (after
    an underscore as it was, else by a space), its no-break spaces plain."""
    return [re.sub(r"(?<!_)\n", " ", ax.get_title()).replace("\n", "").replace("\u00a0", " ")
            for ax in fig.axes if ax.get_visible() and ax.get_title()]


def test_probe_run_names_stay_whole_in_alphas_panel_titles(tmp_path, drawn):
    """The imported study's probe runs, three panels to a row: a name a little wider than its
    panel broke after its last underscore ('probe_marked_d2_uniform_' over 's0'), beside
    whole ones. The titles take one smaller size at which every name fits whole."""
    engine = connect(str(tmp_path / "a.db"))
    names = [f"probe_marked_d{d}_{kind}_s{s}" for d in (2, 4) for kind in ("stagger", "uniform") for s in (0, 1)]
    with engine.begin() as conn:
        for name in names:
            rid = add_run(conn, name, "learned", window=8)
            conn.execute(insert(schema.Alpha), [dict(run_id=rid, step=2500, layer=l, alpha=0.6 + 0.8 * l)
                                                for l in range(2)])
    engine.dispose()
    figures.alphas(connect_readonly(str(tmp_path / "a.db")), tmp_path / "a.png")
    panels = [ax for ax in drawn[0].axes if ax.get_visible() and ax.get_title()]
    assert sorted(ax.get_title() for ax in panels) == sorted(names)  # not one broken over lines
    assert len({ax.title.get_fontsize() for ax in panels}) == 1
    assert panels[0].title.get_fontsize() >= figures.TITLE_LEAST_PT
    _renderer(drawn[0])
    assert all(ax.title.get_window_extent().width <= ax.get_window_extent().width for ax in panels)


@pytest.mark.parametrize("runs, schedules, depths", [
    (1, PAPER_MIX, (16,)), (3, PAPER_MIX, (16,)), (9, PAPER_MIX, (16,)), (31, PAPER_MIX, (16,)),
    (13, ("learned",), (16,)), (50, ("learned",) * 4 + ("stagger",), (16,)),
    (40, ("learned", "stagger"), (16, 16, 4, 4)),  # 'stagger, 16 layers (10 runs)' in a 1 in panel
])
def test_the_alphas_of_many_runs_fit_a_page(tmp_path, drawn, runs, schedules, depths):
    """A panel of 1.9 in a row of three: 31 runs (a paper matrix recorded by fibctl) drew a
    figure 21 in tall. Past a page's rows the panels get smaller and more to a row; every run
    is drawn, or stands in its static schedule's panel (past 36 panels the first learned runs
    by name, said under them); every text stays inside the figure and clear of the others, at
    8 pt or more."""
    figures.alphas(connect_readonly(_alphas_db(str(tmp_path / "a.db"), runs, schedules, depths)), tmp_path / "a.png")
    fig = drawn[0]
    assert fig.get_figheight() <= figures.PAGE_HEIGHT and fig.get_figwidth() <= figures.TEXT_WIDTH
    titles = _panel_titles(fig)
    stands_for = [int(m[1]) if (m := re.search(r"\((\d+) runs\)$", t)) else 1 for t in titles]
    if runs == 50:  # 40 learned and 10 stagger: the stagger panel and 35 learned ones
        assert titles[0] == "stagger (10 runs)" and len(titles) == 36 and sum(stands_for) == 45
        assert fig.get_supxlabel().endswith("the first 35 of 40 learned runs by name; --run, --matrix or "
                                            "--only draws others")
    else:
        assert sum(stands_for) == runs
    texts = _texts(fig)
    for i, (a, abox) in enumerate(texts):
        assert a.get_fontsize() >= 8, a.get_text()
        assert fig.bbox.x0 - 1 <= abox.x0 and abox.x1 <= fig.bbox.x1 + 1, a.get_text()
        assert fig.bbox.y0 - 1 <= abox.y0 and abox.y1 <= fig.bbox.y1 + 1, a.get_text()
        for b, bbox in texts[i + 1:]:
            if a.get_rotation() % 90 == 0 and b.get_rotation() % 90 == 0:
                assert not abox.overlaps(bbox), (a.get_text(), b.get_text())


def _colour_bars(fig) -> list:
    """The figure's colour bars: laid out beside panels, or inside an empty cell's axes."""
    return [a for ax in fig.axes for a in (ax, *ax.child_axes) if a.get_label() == "<colorbar>"]


def test_the_layer_colour_bar_leaves_the_columns_evenly_spaced(tmp_path, drawn):
    """Three static panels over one learned one (the demo with a learned run added): the bar of
    the learned panel's layer colours, laid out beside it, widened the first column alone, the
    gap after it several times the other. The bar now sits in the empty cell after it."""
    figures.alphas(connect_readonly(_alphas_db(str(tmp_path / "a.db"), 4)), tmp_path / "a.png")
    fig = drawn[0]
    _renderer(fig)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    top = sorted((ax.get_position() for ax in panels[:3]), key=lambda box: box.x0)
    gaps = [right.x0 - left.x1 for left, right in zip(top, top[1:])]
    assert gaps[0] == pytest.approx(gaps[1], abs=0.01), gaps
    (bar,) = _colour_bars(fig)
    at = bar.get_window_extent()
    assert panels[3].get_window_extent().x1 < at.x0 and at.x1 < panels[1].get_window_extent().x1  # in the next cell


def test_identical_static_curves_are_drawn_once_and_each_learned_run_has_a_panel(tmp_path, drawn):
    """A matrix like the paper's, 31 runs: 23 fixed, stagger or coprime, whose alphas are
    their schedule's (the same at every step, for every base and W), drew three curves 23 times
    over, and the 8 learned runs, alpha over training, were lost among them. A static curve is
    drawn once, first, titled by its schedule and how many runs it stands for; each learned run
    has a panel of its own. A schedule at two depths draws a curve for each, its layers said; a
    curve of one run is titled by its name; --only picks the runs as before."""
    path = _alphas_db(str(tmp_path / "a.db"), 31)
    engine = connect_readonly(path)
    figures.alphas(engine, tmp_path / "a.png")
    learned = [f"r{i:02d}__logsparse_learned_w12_s43" for i in range(0, 31, 4)]
    assert _panel_titles(drawn[0]) == ["fixed (8 runs)", "stagger (8 runs)", "coprime (7 runs)"] + learned
    panels = [ax for ax in drawn[0].axes if ax.get_title()]
    assert [len(ax.get_lines()) for ax in panels] == [1, 1, 1] + [16] * 8  # learned: a line a layer
    for ax, schedule in zip(panels, ("fixed", "stagger", "coprime")):
        assert list(ax.get_lines()[0].get_ydata()) == pytest.approx(layer_alphas(schedule, 16))
    renderer = _renderer(drawn[0])  # the layers' colour bar beside the learned panels, not the static ones
    (bar,) = _colour_bars(drawn[0])
    assert bar.get_window_extent(renderer).y1 < min(ax.get_window_extent(renderer).y0 for ax in panels[:3])
    figures.alphas(engine, tmp_path / "b.png", only="r0[0-4]*")
    assert _panel_titles(drawn[1]) == [f"r0{i}__logsparse_{s}_w12_s43" for i, s in
                                       ((1, "fixed"), (2, "stagger"), (3, "coprime"), (0, "learned"), (4, "learned"))]
    with connect(path).begin() as conn:  # two stagger runs of 4 layers
        for name in ("d4_a", "d4_b"):
            rid = add_run(conn, name, "stagger")
            conn.execute(insert(schema.Alpha), [dict(run_id=rid, step=0, layer=l, alpha=a)
                                                for l, a in enumerate(layer_alphas("stagger", 4))])
    figures.alphas(engine, tmp_path / "c.png")
    assert _panel_titles(drawn[2])[:4] == ["fixed (8 runs)", "stagger, 4 layers (2 runs)",
                                           "stagger, 16 layers (8 runs)", "coprime (7 runs)"]


def _unticked_ends(fig) -> list[str]:
    """The panels of a drawn figure whose lowest point has no labelled tick at or below it, or
    whose highest point none at or above it."""
    _renderer(fig)
    bare = []
    for ax in [a for a in fig.axes if a.get_label() != "<colorbar>"] + [c for a in fig.axes for c in a.child_axes]:
        span = figures._drawn_span(ax)
        bottom, top = ax.get_ylim()
        if span is None or not ax.get_visible() or bottom > top:  # an inverted axis: layer 0 on top
            continue
        slack = (top - bottom) * 1e-9
        ticks = [t for t in ax.get_yticks() if bottom - slack <= t <= top + slack]
        for end, ticked in ((f"lowest {span[0]:.4g}", any(t <= span[0] + slack for t in ticks)),
                            (f"highest {span[1]:.4g}", any(t >= span[1] - slack for t in ticks))):
            if not ticked:
                bare.append(f"{ax.get_title() or ax.get_ylabel()}: {end}, ticks {list(ax.get_yticks())}")
    return bare


@pytest.mark.parametrize("fixture", ["db", "repeated_db", "study_like_db"])
def test_every_line_has_a_tick_at_or_beyond_its_lowest_and_highest_points(fixture, request, drawn, tmp_path):
    """posloss's loss panel ticked from 3.75 with its lowest point at 3.71; curves' perplexity
    from 40 with the dense run at 34: a line's lowest part could be read only against ticks
    above it. Likewise at the top: the study's pow2 fixed run at 49.5 over extrapolation's
    highest tick, 48. Every panel of every figure has a labelled tick at or below its lowest
    point and one at or above its highest."""
    engine = connect_readonly(request.getfixturevalue(fixture))
    for name in ("extrapolation", "posloss", "curves", "alphas"):
        with contextlib.suppress(FibctlError):  # repeated_db records no positions, no alphas
            figures.FIGURES[name](engine, tmp_path / f"{name}.png")
    assert len(drawn) >= 2
    assert not [bare for fig in drawn for bare in _unticked_ends(fig)]


@pytest.fixture(scope="module")
def study_like_db(tmp_path_factory) -> str:
    """The imported study's shape: sparse runs evaluated 24 times (perplexity 210 down to about
    42), the dense baseline at its final step only (34), positions with a small spread."""
    path = str(tmp_path_factory.mktemp("study") / "results.db")
    engine = connect(path)
    with engine.begin() as conn:
        rid = add_run(conn, "ref_e0000", "dense", T=1024)
        for length, ppl in ((1024, 33.9), (2048, 49.0), (4096, 100.0)):
            add_eval(conn, rid, length, ppl)
        for i, (schedule, w) in enumerate((("fixed", 8), ("stagger", 8), ("fixed", 12), ("stagger", 12))):
            rid = add_run(conn, f"f{i:02d}__fib_{schedule}_w{w}", schedule, window=w, T=1024)
            for step in range(25, 625, 25):  # final_step 600
                add_eval(conn, rid, 1024, 41.5 + i + 4300 / step - 4300 / 600, step=step)
            for length, factor in ((2048, 0.99), (4096, 0.98 + i / 50)):
                add_eval(conn, rid, length, (41.5 + i) * factor)
            conn.execute(insert(schema.PositionLoss), [
                dict(run_id=rid, step=600, dataset="docs_val", eval_length=1024, position=p,
                     mean_loss=3.71 + 0.04 * (schedule == "fixed") + 0.17 / (1 + p / 40), windows=8)
                for p in range(1023)])
    engine.dispose()
    return path


def _labelled_yticks(ax) -> list[float]:
    lo, hi = sorted(ax.get_ylim())
    return [float(t) for t in ax.get_yticks() if lo <= t <= hi]


def test_the_change_axis_is_ticked_1_2_5_where_decades_leave_it_empty(study_like_db, drawn, tmp_path):
    """The dense run changes +195 % at 4x: ticked by decades, its axis was widened to the
    next, +1,000, a decade of empty panel over it (and its margins, set on a linear scale,
    reached -11 under the sparse runs' -2 %). The ends take the next whole multiple of a
    decade (+200, -2), the decades between keep theirs: few labels, none over another."""
    figures.extrapolation(connect_readonly(study_like_db), tmp_path / "e.png")
    fig = drawn[0]
    right = fig.axes[1]
    assert right.get_yscale() == "symlog"
    assert _labelled_yticks(right) == [-2, -1, 0, 1, 10, 100, 200]
    scale = right.yaxis.get_transform()
    bottom, top = scale.transform(right.get_ylim())
    # a margin past +200 and -2, not a decade
    assert scale.transform([200])[0] > top - (top - bottom) * 0.1
    assert scale.transform([-2])[0] < bottom + (top - bottom) * 0.1
    labels = [(t, box) for t, box in _texts(fig) if t in right.get_yticklabels()]
    assert len(labels) == 7
    for i, (a, abox) in enumerate(labels):
        for b, bbox in labels[i + 1:]:
            assert not abox.overlaps(bbox), (a.get_text(), b.get_text())


def test_the_change_axis_ends_at_the_next_multiple_of_a_decade_past_each_end():
    """The study's dense run changes +200.76 %: +300 tops its axis (1, 2 and 5 of a decade
    put it at +500). A tick within a factor of 2 of an end gives way (+20 under +30), and
    past CHANGE_TICKS_MAX ticks the decades alone are labelled."""
    assert figures.symlog_ticks(-1.35, 200.76) == [-2, -1, 0, 1, 10, 100, 300]
    assert figures.symlog_ticks(0, 200 * (1 + 1e-15)) == [0, 1, 10, 100, 200]  # a float's error over 200
    assert figures.symlog_ticks(-0.05, 25) == [-1, 0, 1, 2, 5, 10, 30]
    assert figures.symlog_ticks(0, 95) == [0, 1, 2, 5, 10, 20, 50, 100]
    assert figures.symlog_ticks(-99, 12000) == [-100, -1, 0, 1, 100, 10000, 20000]  # every other decade


def test_a_narrow_log_axis_is_ticked_at_round_numbers(tmp_path, drawn):
    """The demo's perplexities, 231.7 to 237.2, span too little for 1-2-5 ticks on a log axis:
    the evenly spaced ones that replace them were 231, 232.5, ..., 238.5 (steps of 1.5)."""
    path = str(tmp_path / "narrow.db")
    engine = connect(path)
    with engine.begin() as conn:
        for schedule, ppls in (("dense", (233.8, 232.9, 232.1, 231.7)), ("fixed", (236.2, 235.9, 235.8, 235.7)),
                               ("stagger", (237.2, 237.0, 236.7, 236.6))):
            rid = add_run(conn, f"n_{schedule}", schedule, T=64)
            for length, ppl in zip((64, 128, 256, 512), ppls):
                add_eval(conn, rid, length, ppl)
    engine.dispose()
    figures.extrapolation(connect_readonly(path), tmp_path / "e.png")
    left = drawn[0].axes[0]
    assert left.get_yscale() == "log"
    assert _labelled_yticks(left) == [230, 232, 234, 236, 238]
    assert not _unticked_ends(drawn[0])


def test_the_end_of_training_is_magnified_where_the_curves_flatten(study_like_db, repeated_db, drawn, tmp_path):
    """The study's perplexity falls from 210 to 42 in 13,000 steps: on its log axis the last
    4,000, where the schedules part, were a band 0.15 in tall. The step axis stays linear (a log
    one would squash the end further); an inset draws the last third on a linear axis, which its
    lines fill, over no point of the panel and clear of every other text. A curve still falling
    fast at the end (repeated_db's: it fills its panel there) gets none."""
    import numpy as np

    figures.curves(connect_readonly(study_like_db), tmp_path / "c.png")
    figures.curves(connect_readonly(repeated_db), tmp_path / "r.png")
    panel = drawn[0].axes[0]
    (inset,) = panel.child_axes
    assert panel.get_xscale() == inset.get_xscale() == inset.get_yscale() == "linear"
    lo, hi = inset.get_xlim()
    assert lo <= 400 and 600 <= hi < 650  # the last third of 600 steps
    points = np.concatenate([line.get_xydata() for line in panel.get_lines()])
    late = np.concatenate([xy[xy[:, 0] >= 400, 1] for xy in (line.get_xydata() for line in panel.get_lines())
                           if len(xy) > 1])  # not the dense run's one evaluation
    bottom, top = inset.get_ylim()
    assert bottom <= late.min() and late.max() <= top and np.ptp(late) / (top - bottom) >= 0.5
    in_panel = panel.transAxes.inverted().transform(panel.transData.transform([[600, late.min()], [600, late.max()]]))
    assert np.ptp(in_panel[:, 1]) < 0.25  # what the inset magnifies took under a quarter of the panel
    renderer = _renderer(drawn[0])
    covered = inset.get_tightbbox(renderer)  # with its tick labels
    assert not any(covered.contains(x, y) for x, y in panel.transData.transform(points))
    texts = [(t, box) for t, box in _texts(drawn[0]) if t.get_rotation() % 90 == 0]
    for i, (a, abox) in enumerate(texts):
        for b, bbox in texts[i + 1:]:
            assert not abox.overlaps(bbox), (a.get_text(), b.get_text())
    assert not drawn[1].axes[0].child_axes


def _round_steps(ticks) -> bool:
    """Whether evenly spaced ticks step by 1, 2, 2.5 or 5 times a power of ten."""
    import math

    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    return len(steps) == 1 and round(steps.pop() / 10 ** math.floor(math.log10(ticks[1] - ticks[0])), 9) in \
        (1, 2, 2.5, 5)


def test_the_curves_legend_lists_the_runs_in_the_extrapolation_figure_s_order(study_like_db, drawn, tmp_path):
    """curves listed its runs by name: the study's dense `ref_e0000` last and fixed W=12 between
    the stagger runs, where extrapolation (and the tables) list the paper's order."""
    engine = connect_readonly(study_like_db)
    figures.extrapolation(engine, tmp_path / "e.png")
    figures.curves(engine, tmp_path / "c.png")
    extrapolation, curves = ([t.get_text() for t in fig.legends[0].get_texts() if t.get_text()] for fig in drawn)
    assert sorted(curves) == sorted(extrapolation) and len(curves) == 5
    assert _in_reading_order(drawn[1]) == _in_reading_order(drawn[0])


def test_the_curves_legend_says_what_a_thin_validation_line_is(study_like_db, drawn, tmp_path):
    """A run's light evaluations (fewer tokens) are drawn thin and faint; the panel's title
    said "(thin: light budget)", which the legend did not explain. One budget: nothing to say."""
    from pathlib import Path

    example = str(Path(__file__).parents[1] / "results.db.example")  # light and full evaluations
    figures.curves(connect_readonly(example), tmp_path / "c.png")
    figures.curves(connect_readonly(study_like_db), tmp_path / "one.png")
    legend, one = (fig.legends[0] for fig in drawn)
    assert legend.get_title().get_text() == figures.LIGHT_NOTE
    assert "thin" in figures.LIGHT_NOTE and "fewer tokens" in figures.LIGHT_NOTE
    assert [ax.get_title() for ax in drawn[0].axes[:1]] == ["validation"]
    assert one.get_title().get_text() == ""


def _in_reading_order(fig) -> list[str]:
    """A legend's labels as drawn, left to right along each row (matplotlib fills by columns)."""
    legend = fig.legends[0]
    _renderer(fig)
    texts = [t for t in legend.get_texts() if t.get_text()]
    at = {t.get_text(): t.get_window_extent() for t in texts}
    return sorted(at, key=lambda label: (-round(at[label].y0), at[label].x0))


def test_the_inset_and_the_alphas_step_axes_are_ticked_at_round_steps(study_like_db, drawn, tmp_path):
    """MaxNLocator's own steps include 1.5, 3, 4, 6 and 8: the inset of 600 steps was ticked
    400, 480, 560 (and a flatter one 16.5, 18, 19.5), an alphas panel of 200 steps 0, 80, 160."""
    figures.curves(connect_readonly(study_like_db), tmp_path / "c.png")
    (inset,) = drawn[0].axes[0].child_axes
    for axis, (lo, hi) in ((inset.xaxis, inset.get_xlim()), (inset.yaxis, inset.get_ylim())):
        ticks = [t for t in axis.get_majorticklocs() if lo <= t <= hi]
        assert _round_steps(ticks), ticks
    assert [t for t in inset.get_xticks() if 390 <= t <= 610] == [400, 500, 600]
    path = tmp_path / "a.db"
    _alphas_db(str(path), 20, schedules=("learned",))  # 20 panels: small ones, 3 ticks each
    with connect(str(path)).begin() as conn:  # 200 steps of training
        conn.execute(text("UPDATE alphas SET step = step * 200 / (SELECT MAX(step) FROM alphas)"))
    figures.alphas(connect_readonly(str(path)), tmp_path / "a.png")
    panels = [ax for ax in drawn[1].axes if ax.get_xlim()[0] <= 0 and ax.get_xlim()[1] >= 200]
    assert len(panels) == 20
    for ax in panels:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert _round_steps(ticks), ticks


def test_the_alpha_colour_bar_is_ticked_at_its_ends(drawn, tmp_path):
    """The coverage figure's bar of alpha (0.5 to 1.5) was ticked 0.6 to 1.4: stagger's first
    and last layers' colours had no tick at or beyond them."""
    figures.coverage(tmp_path / "c.png")  # the paper's 16 layers: a bar 3 in tall
    (bar,) = _colour_bars(drawn[0])
    assert bar.get_yticks()[0] == 0.5 and bar.get_yticks()[-1] == 1.5


def test_a_matplotlib_backend_it_does_not_know_leaves_the_figure_drawn(tmp_path):
    """MPLBACKEND=bogus (a typo) failed matplotlib's import with a ValueError traceback; fibctl
    draws on a Figure and saves by suffix, with no backend."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fibctl", "figure", "coverage", "--preset", "micro", "--out",
                           str(tmp_path / "cov.png")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MPLBACKEND": "bogus"})
    assert done.returncode == 0 and (tmp_path / "cov.png").stat().st_size > 0, done.stderr
