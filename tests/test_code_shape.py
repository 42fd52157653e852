"""The code's shape, read from its source: no import cycle among logitserve's modules, no function over 60 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"logitserve": ROOT / "src" / "logitserve", "logitserve.server": ROOT / "server",
            "logitserve.client": ROOT / "client"}
MAX_LINES = 60


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the three packages (generated *_pb2 stubs left out)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if path.stem.endswith(("_pb2", "_pb2_grpc")):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under `if TYPE_CHECKING:` (no import at run time)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (function-level imports too)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:       # `import a.b.c` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def long_functions(limit: int = MAX_LINES) -> list[str]:
    """`file:function (n lines)` for each function or method of src/ and server/ over `limit` lines, argument
    parsers (five or more add_argument calls) excepted."""
    out = []
    for folder in (ROOT / "src" / "logitserve", ROOT / "server"):
        for path in sorted(folder.rglob("*.py")):
            if path.stem.endswith(("_pb2", "_pb2_grpc")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                n = node.end_lineno - node.lineno + 1
                parser = sum(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                             and c.func.attr == "add_argument" for c in ast.walk(node)) >= 5
                if n > limit and not parser:
                    out.append(f"{path.relative_to(ROOT)}:{node.name} ({n} lines)")
    return out


def test_the_import_graph_is_read():
    """The graph holds the edges it must (so that no cycle is not a blind reader's)."""
    graph = import_graph()
    assert "logitserve.loading" in graph["logitserve.server.app"] or "logitserve.loading" in graph["logitserve.server.cli"]
    assert "logitserve.events" in graph["logitserve.pipeline"] and "logitserve.pipeline" in graph["logitserve.engine"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_logitserves_modules():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_function_over_sixty_lines_in_src_and_server():
    found = long_functions()
    assert not found, f"functions over {MAX_LINES} lines: " + ", ".join(found)


def test_tests_import_helpers_not_each_other():
    """Shared test code lives in tests/helpers/: no test module imports another test module or conftest."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[-1].startswith("test_") or n.split(".")[-1] == "conftest"]
    assert not offenders, offenders
