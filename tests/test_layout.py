"""The layout keeps the data flow: capture -> format -> analysis -> compare -> report, read from
the source (ast), so that it stays true. docs/architecture.md explains the rules."""

from __future__ import annotations

import ast
import os

import pytest

from capture_utils import ROOT

PACKAGE = os.path.join(ROOT, "srdd_dump")
# package -> the project packages its modules may import (besides their own)
ALLOWED = {
    "format": {"errors", "vocabulary"},
    "analysis": {"errors", "vocabulary"},
    "runtime": {"errors"},
    "capture": {"errors", "version", "vocabulary", "format", "runtime"},
    "compare": {"errors", "vocabulary", "format", "analysis", "runtime"},
    "report": {"errors", "vocabulary", "analysis", "compare"},
}
TOP_LEVEL = {"__init__", "errors", "version", "vocabulary"}  # the modules outside the packages


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of srdd_dump (cli/ maps to srdd_dump.cli)."""
    out = {}
    for base, prefix in ((PACKAGE, "srdd_dump"), (os.path.join(ROOT, "cli"), "srdd_dump.cli")):
        for folder, _, names in os.walk(base):
            for name in names:
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([prefix, *rel])] = os.path.join(folder, name)
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """Project modules imported anywhere in the file (function bodies included)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("srdd_dump") and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_graph_sees_the_imports():
    assert "srdd_dump.analysis.sums" in GRAPH["srdd_dump.analysis.metrics"]
    assert "srdd_dump.compare.results" in GRAPH["srdd_dump.report.terminal"]
    assert "srdd_dump.format.schema" in GRAPH["srdd_dump.compare.sources"]


def test_only_the_packages_and_three_modules_at_the_top():
    loose = {m.split(".")[1] for m in MODULES if m.count(".") == 1} - set(ALLOWED) - {"cli"}
    assert loose <= TOP_LEVEL


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_from_a_higher_layer(package):
    wrong = []
    for module, imported in GRAPH.items():
        if _package(module) != package:
            continue
        for name in imported:
            target = _package(name)
            if target != package and target not in ALLOWED[package]:
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle_between_files():
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if seen.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for module in sorted(GRAPH):
        if module not in seen:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_only_capture_and_the_dump_cli_import_torch():
    for module, path in MODULES.items():
        text = open(path, encoding="utf-8").read()
        imports_torch = any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            and any((a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
                    == "torch" for a in n.names)
            for n in ast.walk(ast.parse(text)))
        if imports_torch:
            assert _package(module) == "capture", module


def test_the_dump_and_analysis_agree_on_the_block_site():
    from srdd_dump.analysis.signals import BLOCK_SITE
    from srdd_dump.format.schema import BLOCK_SITE as SCHEMA_BLOCK_SITE

    assert BLOCK_SITE == SCHEMA_BLOCK_SITE  # analysis may not import the format: a copy


def _private_members() -> dict[str, set[str]]:
    """Module -> the private names it defines: module-level functions, classes and globals,
    and the methods and ``self._x`` attributes of its classes."""
    defined: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        names = defined.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self" and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        defined[module] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    return defined


def test_no_private_member_of_the_project_is_used_from_another_module():
    """``obj._name`` where ``obj`` is not ``self`` or ``cls`` and ``_name`` is private to
    another module of the project: a dependency the import graph cannot show."""
    defined = _private_members()
    wrong = []
    for module, path in MODULES.items():
        others = set().union(*(names for m, names in defined.items() if m != module))
        mine = defined[module]
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in others and node.attr not in mine:
                wrong.append(f"{module}:{node.lineno} uses {ast.unparse(node)}")
    assert not wrong, "\n".join(sorted(wrong))
