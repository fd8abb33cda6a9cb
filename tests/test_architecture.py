"""The folders show the architecture: arrows point one way (cli -> exporters/reports -> core)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                pkg = path.parent.name
                found.add(f"{pkg}.{node.module}" if node.module else pkg)
            elif node.module:
                found.add(node.module)
    return found


def top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def test_core_never_imports_exporters_or_reports():
    for path in (ROOT / "llama_tools").glob("*.py"):
        if path.name == "cli.py":
            continue
        bad = top(imported_modules(path)) & {"exporters", "reports"}
        assert not bad, f"{path.name} imports {bad}: the core must not depend on them"


def test_exporters_and_reports_do_not_import_each_other_or_the_cli():
    for pkg, other in (("exporters", "reports"), ("reports", "exporters")):
        for path in (ROOT / pkg).rglob("*.py"):
            mods = imported_modules(path)
            assert other not in top(mods), f"{pkg}/{path.name} imports {other}"
            assert "llama_tools.cli" not in mods, f"{pkg}/{path.name} imports the CLI"


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "llama_tools" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("from exporters.onnx_export import export\nimport reports.shapes\n")
    assert top(imported_modules(bad)) >= {"exporters", "reports"}
