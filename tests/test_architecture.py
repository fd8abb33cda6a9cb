"""The folders show the architecture: arrows point one way (CLI -> exporters/reports -> core), one package."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The repository's folders and the packages they install as.
PACKAGES = {"llama_tools": ROOT / "llama_tools", "llama_tools.exporters": ROOT / "exporters",
            "llama_tools.reports": ROOT / "reports"}
CLI = "llama_tools.cli"


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file imports, relative imports resolved against `package`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
                found.update(f"{base}.{a.name}" for a in node.names if not node.module)
            elif node.module:
                found.add(node.module)
    return found


def modules() -> dict[str, set[str]]:
    """Module name -> what it imports, for every module of the installed package."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.parent.relative_to(folder).parts
            if any(other != folder and other.is_relative_to(folder) and path.is_relative_to(other)
                   for other in PACKAGES.values()):
                continue  # a folder that installs as a package of its own
            pkg = ".".join((package, *rel))
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            out[name] = imported_modules(path, pkg)
    return out


def layer(name: str) -> str:
    if name == CLI or name.startswith(CLI + "."):
        return "cli"
    if name.startswith(("llama_tools.exporters", "llama_tools.reports")):
        return name.split(".")[1]
    return "core"


# The core's subpackages, lowest first: each imports only those below it (and itself); one rank, no arrows between.
CORE_RANKS = {"outputs": 0, "modeling": 1, "checkpoints": 2, "counting": 3, "inference": 3}


def core_package(name: str) -> str | None:
    """The core subpackage a module belongs to (llama_tools.modeling.model -> modeling), or None."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "llama_tools" and parts[1] in CORE_RANKS else None


def violations(mods: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, imports in mods.items():
        for imp in imports:
            mine, theirs = core_package(name), core_package(imp)
            if mine and theirs and mine != theirs and CORE_RANKS[theirs] >= CORE_RANKS[mine]:
                bad.append(f"{name} ({mine}) imports {imp} ({theirs}): an arrow up or sideways between the core's "
                           "subpackages")
            if imp.split(".")[0] in ("exporters", "reports"):
                bad.append(f"{name} imports {imp}: installed as llama_tools.{imp}")
            if imp == "click" and layer(name) != "cli":
                bad.append(f"{name} imports click: only the CLI layer may")
            if imp.startswith("llama_tools") and imp != "llama_tools":
                me, them = layer(name), layer(imp)
                if them == "cli" and me != "cli":
                    bad.append(f"{name} imports the CLI")
                if me == "core" and them != "core":
                    bad.append(f"{name} (core) imports {imp}")
                if {me, them} == {"exporters", "reports"}:
                    bad.append(f"{name} imports {imp}: exporters and reports are siblings")
    return bad


def test_arrows_point_one_way():
    mods = modules()
    assert CLI in mods and "llama_tools.exporters.verification.parity" in mods and "llama_tools.reports.shapes" in mods
    assert violations(mods) == []


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import click\nfrom .exporters.onnx_export import export_onnx\nimport reports.shapes\n")
    found = violations({"llama_tools.bad": imported_modules(bad, "llama_tools")})
    assert len(found) == 3, found
    up = tmp_path / "up.py"  # the model reaching up into checkpoint files and into inference
    up.write_text("from ..checkpoints.load import load_checkpoint\nfrom ..inference import reference\n")
    found = violations({"llama_tools.modeling.up": imported_modules(up, "llama_tools.modeling"),
                        "llama_tools.counting.up": imported_modules(up, "llama_tools.counting")})
    assert len(found) == 3, found  # modeling -> checkpoints, modeling -> inference, counting -> inference (sideways)


def test_every_core_module_is_in_a_subpackage():
    """Folders show the architecture: the core's modules live in its subpackages; the top holds only __init__."""
    assert [p.name for p in (ROOT / "llama_tools").glob("*.py") if p.name != "__init__.py"] == []
    subpackages = {p.name for p in (ROOT / "llama_tools").iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(CORE_RANKS) | {"cli"}


def test_the_layout_page_names_every_module():
    """docs/layout.md is the map a newcomer reads: every subpackage and module of the wheel is on it."""
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", page))
    names = {n: n.split(".")[-1] for n in modules()}
    missing = sorted(n for n, last in names.items() if last not in words and last != "llama_tools" and
                     not last.startswith("__"))
    assert missing == []


def test_one_installed_package_built_from_the_folders():
    """The wheel's only top-level package is llama_tools; exporters/ and reports/ map under it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.split(".")[0] for p in cfg["packages"]} == {"llama_tools"}
    assert {k: ROOT / v for k, v in cfg["package-dir"].items()} == PACKAGES
    import llama_tools.exporters
    import llama_tools.reports

    assert Path(llama_tools.exporters.__file__).parent == ROOT / "exporters"
    assert Path(llama_tools.reports.__file__).parent == ROOT / "reports"


def test_every_third_party_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]  # onnxruntime comes from one of cpu / gpu / genai / genai-cuda
    declared = project["dependencies"] + [d for name, deps in extras.items() if name != "test" for d in deps]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in declared}
    dists = importlib.metadata.packages_distributions()
    undeclared = []
    for name, imports in modules().items():
        for imp in imports:
            root = imp.split(".")[0]
            if root in sys.stdlib_module_names or root in ("llama_tools", "__future__"):
                continue
            owners = {d.lower().replace("_", "-") for d in dists.get(root, [root])}
            if not owners & names:
                undeclared.append(f"{name}: {root} (from {sorted(owners)})")
    assert undeclared == []


def circles(mods: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (every import counts: the ones inside
    functions and under TYPE_CHECKING too, since each says which module needs which)."""
    # `from . import x` names the parent package too; Python has it loaded first, so that is no arrow back up
    edges = {m: {i for i in imps if i in mods and i != m and not m.startswith(i + ".")} for m, imps in mods.items()}
    reach = {}
    for m in mods:
        seen, todo = set(), [m]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[m] = seen
    groups = {frozenset([m, *(o for o in reach[m] if m in reach[o])]) for m in mods if m in reach[m]}
    return sorted(sorted(g) for g in groups)


def test_no_import_circles():
    assert circles(modules()) == []


def test_the_check_sees_a_circle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import y\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import z\n")
    (tmp_path / "d.py").write_text("from .a import x\n")
    mods = {f"pkg.{p.stem}": imported_modules(p, "pkg") for p in tmp_path.glob("*.py")}
    assert circles(mods) == [["pkg.a", "pkg.b", "pkg.c"]]
