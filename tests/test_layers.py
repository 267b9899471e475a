"""The package's three strata, read from the imports themselves (ast): compute (torch, no
SQL) < record (SQL, no torch) < flows (glue) < cli (parse, call one flow or library
function, print). A module may import its own stratum and those below, never above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fibctl"
MIGRATIONS = PACKAGE.parent / "migrations"
STRATA = ("compute", "record", "flows", "cli")


def stratum(module: str) -> str:
    """The stratum of a fibctl module, by its dotted name."""
    parts = module.split(".")[1:]  # without the leading "fibctl"
    top = parts[0] if parts else ""
    if top in ("cli", "__main__"):
        return "cli"
    if top == "flows":
        return "flows"
    if top in ("db", "reports", "queue", "matrix", "matrices", "migrations"):
        return "record"
    return "compute"  # config, schedules, attention, model, metrics, device, train, data, names, errors


def modules() -> dict[str, Path]:
    found = {}
    # migrations/ ships as fibctl.migrations (pyproject's package-dir): record, walked too
    for folder, package in ((PACKAGE, "fibctl"), (MIGRATIONS, "fibctl.migrations")):
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            found[".".join([package, *(p for p in rel.parts if p != "__init__")])] = path
    return found


def imports(path: Path, module: str) -> list[str]:
    """Every module `path` imports, at any depth (lazy imports inside functions count)."""
    tree = ast.parse(path.read_text())
    out = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return out


MODULES = modules()


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_go_down(module):
    mine = STRATA.index(stratum(module))
    for imported in imports(MODULES[module], module):
        if imported.split(".")[0] == "fibctl" and imported != "fibctl":
            assert STRATA.index(stratum(imported)) <= mine, f"{module} ({stratum(module)}) imports {imported}"


@pytest.mark.parametrize("module", MODULES)
def test_compute_knows_no_sql_record_no_torch_cli_no_sqlalchemy(module):
    found = {i.split(".")[0] for i in imports(MODULES[module], module)}
    named = set(imports(MODULES[module], module))
    if stratum(module) == "compute":
        assert "sqlalchemy" not in found and not any(i.startswith("fibctl.db") for i in named), module
    if stratum(module) == "record":
        assert "torch" not in found, module
    if stratum(module) == "cli":
        assert "sqlalchemy" not in found, module


def test_the_strata_are_all_populated():
    assert {stratum(m) for m in MODULES} == set(STRATA)
    assert stratum("fibctl.train.trainer") == "compute" and stratum("fibctl.db.importer") == "record"
    assert stratum("fibctl.flows.worker") == "flows" and stratum("fibctl.cli.report") == "cli"
    assert any(m.startswith("fibctl.migrations.versions.") for m in MODULES)
