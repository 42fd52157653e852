"""The project's modules (src/logitserve, server, client) import each other without a cycle, lazy imports included."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"logitserve": ROOT / "src" / "logitserve", "logitserve.server": ROOT / "server",
            "logitserve.client": ROOT / "client"}


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the three packages (generated stubs included)."""
    out = {}
    for package, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = f.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = f
    return out


def _imported(name: str, path: Path, node: ast.AST, known: set[str]) -> set[str]:
    """The project's modules an import statement reaches: `from pkg import x` reaches pkg.x when that is a
    module, else pkg itself."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:                     # relative: from the module's package, up level - 1 packages
            anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = set()
    for t in targets:
        while t and t not in known:        # `import logitserve.server.app as x` reaches that module
            t = t.rpartition(".")[0]
        if t:
            found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(name, path, node, known)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a list of modules (first == last), or [] when the graph has none."""
    state: dict[str, int] = {}            # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        path.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return []


def test_find_cycle_sees_a_cycle_and_its_absence():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "logitserve.vocab_parallel" in graph["logitserve.reductions"]       # `from .vocab_parallel import ...`
    assert "logitserve.head_export" in graph["logitserve.engine"]              # inside Engine.__init__
    assert "logitserve.engine" in graph["logitserve.server.app"]              # `from logitserve.engine import ...`


def test_no_import_cycle_among_the_projects_modules():
    cycle = find_cycle(import_graph())
    assert not cycle, " -> ".join(cycle)
