"""Every command explains itself and is in the README's command list; every registered
table and figure is in docs/cli.md. The lists come from the CLI and the registries, so a new
command, table or figure without docs fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from fibctl.cli import app
from fibctl.reports import figures, tables

ROOT = Path(__file__).resolve().parent.parent


def leaf_commands(command=None, path=()):
    command = command or typer.main.get_command(app)
    subs = getattr(command, "commands", None)
    if not subs:
        yield " ".join(path), command
        return
    for name, sub in subs.items():
        yield from leaf_commands(sub, (*path, name))


COMMANDS = dict(leaf_commands())


@pytest.mark.parametrize("path", COMMANDS)
def test_every_command_has_help_and_is_in_the_readme(path):
    command = COMMANDS[path]
    assert (command.help or "").strip(), f"fibctl {path} has no help text"
    assert (command.help or "").strip().splitlines()[-1].strip().startswith("Example: fibctl "), \
        f"fibctl {path}'s help does not end with an Example: line"
    for param in command.params:
        if param.name != "help" and getattr(param, "param_type_name", "") == "option":
            assert (param.help or "").strip(), f"fibctl {path} {param.opts[0]} has no help text"
    readme = (ROOT / "README.md").read_text()
    assert f"`fibctl {path}`" in readme, f"fibctl {path} is missing from the README's command list"


@pytest.mark.parametrize("name", [*tables.TABLES, *figures.FIGURES])
def test_every_table_and_figure_is_documented(name):
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert name in cli, f"{name} is not described in docs/cli.md"


def test_the_report_commands_are_the_table_registry():
    assert {p.split()[1] for p in COMMANDS if p.startswith("report ")} == {*tables.TABLES, "all"}


def test_help_shows_bracketed_text_as_written():
    """rich markup would read `pip install -e '.[slurm]'` as a style tag and print `'.'`."""
    import re

    from typer.testing import CliRunner

    runner = CliRunner()
    checked = 0
    for path, command in COMMANDS.items():
        texts = [command.help or ""] + [p.help or "" for p in command.params if getattr(p, "help", None)]
        wanted = {m for t in texts for m in re.findall(r"\[[a-z_]+\]", t)}
        if not wanted:
            continue
        out = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"}).output
        for token in wanted:
            assert token in out, f"fibctl {path} --help lost {token}"
        checked += 1
    assert checked >= 2  # worker's --log-to and slurm submit name their extras


def test_every_study_run_name_in_the_docs_is_a_run_of_the_paper_matrix():
    """The docs name the study's runs (f06__fib_fixed_w8); a name no run has (fixed W8 is f06,
    f05 is W6) sends a reader's `fibctl eval` to an error or to the wrong run."""
    from fibctl.matrix import load_matrix

    runs = {e.name for e in load_matrix("paper").entries}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(p.name, n) for p in pages for n in re.findall(r"\b[fgh]\d\d__\w+", p.read_text())}
    assert len(named) > 10
    assert not {(page, n) for page, n in named if n not in runs}


def test_every_table_and_column_of_the_schema_is_in_schema_md():
    """docs/schema.md is the SQL API's reference: a column the schema gained (revision 0006's
    provenance, say) must be described there, under its table."""
    from fibctl.db.schema import Base

    doc = (ROOT / "docs" / "schema.md").read_text()
    sections = dict(re.findall(r"\*\*`(\w+)`\*\*(.*?)(?=\n\*\*`|\n## |\Z)", doc, re.S))
    for table in Base.metadata.sorted_tables:
        assert table.name in sections, f"docs/schema.md has no section for {table.name}"
        text = sections[table.name]
        key = re.match(r"\s*\[([\w, ]+)\]", text)  # a metric table's natural key: [run_id, step]
        said = set(re.findall(r"`(\w+)`", text)) | set(key.group(1).replace(" ", "").split(",") if key else ())
        missing = [c.name for c in table.columns if c.name != "id" and c.name not in said]
        assert not missing, f"docs/schema.md does not describe {table.name}: {missing}"


def test_every_preset_and_manifest_key_is_in_the_docs():
    """docs/cli.md lists the presets `--preset` takes; docs/data.md every key a data folder's
    manifest.json holds."""
    import dataclasses

    from fibctl.config import PRESETS
    from fibctl.data.streams import DataManifest

    presets = re.search(r"\nPresets: (.*?)\n\n", (ROOT / "docs" / "cli.md").read_text(), re.S).group(1)
    assert not [p for p in PRESETS if f"`{p}` (" not in presets]
    fields = {f.name: None for f in dataclasses.fields(DataManifest)}
    manifest = (ROOT / "docs" / "data.md").read_text().split("`manifest.json`: ", 1)[1].split("\n\n", 1)[0]
    assert not [k for k in DataManifest(**fields).to_dict() if f"`{k}`" not in manifest]


def test_the_readme_s_demo_table_is_results_db_example_s_table3():
    """The README shows what the demo printed: Table 3 of results.db.example as the demo
    reports it (its title, every column, each cell as printed)."""
    from fibctl.db.engine import connect_readonly
    from fibctl.reports import render

    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"\n```\n(Table 3: .*?)```", readme, re.S)
    assert shown, "the README shows no Table 3 under its title"
    lines = shown.group(1).splitlines()
    table = tables.table3(connect_readonly(str(ROOT / "results.db.example")), matrix="demo", all_runs=True)
    assert lines[0] == table.title
    assert re.split(r"\s{2,}", lines[1]) == list(table.frame.columns)
    cells = [[render.cell(table, c, v) for c, v in row.items()] for row in table.frame.to_dict("records")]
    assert [re.split(r"\s{2,}", line.strip()) for line in lines[2:]] == cells


def test_the_readme_s_map_of_the_package_names_every_module():
    """The README's Development section maps fibctl's modules to their strata; a module or
    package added since (flops.py, provenance.py) must find its place there."""
    readme = (ROOT / "README.md").read_text()
    tree = readme.split("## Development", 1)[1].split("```", 2)[1]
    package = ROOT / "fibctl"
    names = [p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").is_file()]
    assert not [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", tree)]


def test_every_test_the_docs_cite_exists():
    """The docs cite tests as evidence (`tests/test_study_loop.py`,
    `test_clipping_sums_the_gradient_norms_in_the_study_order`): a test renamed or removed
    must take its citation with it."""
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    files = set(re.findall(r"tests/[\w/]+\.py", docs))
    assert files and not [f for f in files if not (ROOT / f).is_file()]
    defined = "".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    names = set(re.findall(r"`(test_\w+)`", docs))
    assert names and not [n for n in names if f"def {n}(" not in defined]


def test_the_docs_run_fibctl_sql_on_postgresql_as_the_reader_role_it_names():
    """fibctl sql refuses a PostgreSQL login that may reach the server's files, naming the
    role to make instead; the docs make that role (cli.md, and cluster.md's shared server)
    and every `fibctl sql` they show against a server connects as it (cluster.md's
    FIBCTL_DB is the owner the workers write as, so its queries name --db)."""
    from types import SimpleNamespace

    from fibctl.errors import FibctlError
    from fibctl.reports import sql
    from test_docs_commands import fenced

    class Superuser:
        def exec_driver_sql(self, statement):
            row = SimpleNamespace(rolname="postgres", rolsuper=True)
            return SimpleNamespace(first=lambda: row, scalar=lambda: "postgres")

    with pytest.raises(FibctlError) as refused:
        sql._refuse_privileged_login(Superuser())
    remedy = re.search(r"\((CREATE ROLE .*)\)$", str(refused.value)).group(1)
    statements = remedy.split("; ")
    cli, cluster = " ".join((ROOT / "docs" / "cli.md").read_text().split()), ROOT / "docs" / "cluster.md"
    assert f"`{remedy};" in cli
    setup = " ".join(fenced(cluster, "sh"))
    assert all(f'"{s}"' in setup for s in statements)
    reader = statements[0].split()[2]
    shown = [c for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for lang in ("sh", "bash") for c in fenced(p, lang) if c.startswith("fibctl sql")]
    on_a_server = [c for c in shown if "postgresql" in c] + [c for c in fenced(cluster, "sh")
                                                             if c.startswith("fibctl sql")]
    assert on_a_server and not [c for c in on_a_server if f"--db postgresql+psycopg://{reader}@" not in c]


def test_the_characters_cli_md_says_are_escaped_are_those_printable_escapes():
    """docs/cli.md names the one set fibctl.errors.printable escapes: C0, DEL, C1, the code
    points it lists, and lone surrogates (a file name's undecodable bytes)."""
    from fibctl.errors import printable

    cli = " ".join((ROOT / "docs" / "cli.md").read_text().split())
    said = cli.split("is shown, never obeyed: ", 1)[1].split("(`\\n`)", 1)[0]
    assert "C0, DEL, C1" in said and "undecodable bytes" in said
    listed = set()
    for first, last in re.findall(r"U\+([0-9A-F]{4})(?:-U\+([0-9A-F]{4}))?", said):
        listed |= set(range(int(first, 16), int(last or first, 16) + 1))
    expected = {*range(0x20), *range(0x7F, 0xA0), *range(0xD800, 0xE000), *listed}
    escaped = {c for c in range(0x110000) if printable(chr(c)) != chr(c)}
    assert escaped == expected


def test_every_link_between_the_docs_reaches_its_page_and_heading():
    """A relative link resolves from the page it is on (docs/cli.md's `docs/method.md` went
    nowhere), and an anchor names a heading there, as GitHub makes them."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M) if linked.is_file() else []
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            if not linked.is_file() or (anchor and anchor not in slugs):
                broken.append(f"{page.name}: {target}")
    assert not broken


DOCS_WIDTH = 95


def test_no_prose_line_of_the_docs_is_wider_than_95_columns():
    """Prose lines ran to 211 columns beside the 90-odd of their paragraphs, past an editor's
    or a diff's width. Fenced code, table rows and headings keep their own lines."""
    wide = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and not line.lstrip().startswith(("|", "#")) and len(line) > DOCS_WIDTH:
                wide.append(f"{page.name}:{number}: {len(line)} columns")
    assert not wide


def test_every_command_and_option_is_in_cli_md_s_command_table():
    """docs/cli.md ends with every command, its options and where it is described: a command
    or option added since (worker --max-attempts, probe --vocab) must find its row there."""
    cli = (ROOT / "docs" / "cli.md").read_text()
    table = cli.split("\n## Every command\n", 1)[1]
    rows = {m.group(1): line for line in table.splitlines()
            if (m := re.match(r"\| `fibctl ([a-z][a-z0-9 -]*?)(?: [A-Z_\[\].]+)*` \|", line))}
    missing = []
    for path, command in COMMANDS.items():
        row = rows.get(path)
        if row is None:
            missing.append(f"fibctl {path}")
            continue
        for param in command.params:
            if param.name != "help" and getattr(param, "param_type_name", "") == "option":
                missing += [f"fibctl {path} {o}" for o in param.opts + param.secondary_opts
                            if o.startswith("--") and f"`{o}`" not in row]
    assert not missing
    assert not set(rows) - set(COMMANDS), "cli.md's command table names a command fibctl lacks"


CODE_WIDTH = 120  # the code's own lines, which its docstrings' prose keeps within


def test_no_docstring_line_is_wider_than_the_code():
    """A sentence added to a docstring without rewrapping it ran on to 145 columns
    (`token_progress`'s) beside the 90-odd of its paragraph."""
    import ast

    wide = []
    for path in sorted((ROOT / "fibctl").rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                for number in range(body[0].lineno, body[0].end_lineno + 1):
                    if len(lines[number - 1]) > CODE_WIDTH:
                        wide.append(f"{path.relative_to(ROOT)}:{number}: {len(lines[number - 1])} columns")
    assert not wide
