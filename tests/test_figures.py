"""`fibctl figure`: each figure is a non-empty PNG (or PDF) drawn from a small database."""

from __future__ import annotations


import pytest
from sqlalchemy import insert
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.db import schema
from fibctl.db.engine import connect, connect_readonly
from fibctl.errors import FibctlError
from fibctl.reports import figures
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


def test_other_extensions_and_missing_data_are_refused(db, tmp_path):
    with pytest.raises(FibctlError, match="PNG or PDF"):
        figures.coverage(tmp_path / "c.svg")
    with pytest.raises(FibctlError, match="alphas: no alphas recorded for run 'demo_fixed'"):
        figures.alphas(connect_readonly(db), tmp_path / "a.png", run="demo_fixed")
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
