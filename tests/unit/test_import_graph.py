"""The house's import rules, read from the code: no import cycle among ``services/``, ``shared/``
and ``loadtest/`` (imports inside functions and under ``TYPE_CHECKING`` count too), and no arrow
from the shared library up into ``services/`` or ``loadtest/``. Design: docs/design/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "loadtest")


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the project modules it imports (a name imported from a package counts as the
    submodule when there is one, else as the package)."""
    mods = modules(root)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for target in targets:
                found = known(target)
                if found and found != mod:
                    graph[mod].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if a.split(".")[0] == "shared" and b.split(".")[0] in ("services", "loadtest"))


def test_the_code_has_no_import_cycle():
    assert cycles(import_graph(REPO)) == []


def test_the_shared_library_never_imports_the_services_or_the_harness():
    assert upward(import_graph(REPO)) == []


def test_the_checks_see_a_cycle_through_a_function_level_import_and_an_upward_arrow(tmp_path):
    for top in PACKAGES:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "shared" / "a.py").write_text("from shared import b\n")
    (tmp_path / "shared" / "b.py").write_text("def f():\n    from shared.a import X\n")
    (tmp_path / "services" / "d.py").write_text("")
    (tmp_path / "shared" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from services import d\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["shared.a", "shared.b"]]
    assert upward(graph) == ["shared.c -> services.d"]
