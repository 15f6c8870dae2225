"""The layering of onnxgrad's modules, read from their source: the import graph (imports inside functions
included) has no circles but the deliberate one between the rule registry and the rules it loads, and no module
imports another's private (underscored) name."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "onnxgrad"

# The one deliberate circle: `registry` loads the rule modules, and each rule module registers through it. The
# control-flow rules differentiate their bodies with the walker (`gradient`; `lowering`, whose reasons the RNN rules quote, reads the walker too), which looks
# the rules up in the registry, so the walker is on that circle too.
ALLOWED_CYCLE = {"onnxgrad.registry", "onnxgrad.rules", "onnxgrad.gradient", "onnxgrad.lowering"}

# (importer, private name) pairs allowed to stay: none. The set is exact (an entry whose import is gone fails
# the test below), so an exception made here is removed with the import.
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path]):
    """(importer, imported module, name or None) for every onnxgrad import in every module."""
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("onnxgrad"):
                        yield name, alias.name, None
            elif isinstance(node, ast.ImportFrom):
                target = resolve(name, path.name == "__init__.py", node)
                if not target.startswith("onnxgrad"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    # `from . import x` imports the module x; `from .m import y` imports the name y of m
                    yield name, (sub if sub in known else target), (None if sub in known else alias.name)


def owner(module: str, known: dict[str, Path]) -> str:
    """The module a dotted name belongs to: the longest known prefix."""
    while module not in known and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for importer, target, _ in imports(known):
        target = owner(target, known)
        if target != importer and target in known:
            graph[importer].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def allowed(component: set[str]) -> bool:
    return all(m in ALLOWED_CYCLE or m.startswith("onnxgrad.rules.") for m in component)


def test_no_import_cycles():
    cycles = [sorted(c) for c in strongly_connected(import_graph()) if not allowed(c)]
    assert cycles == []


def test_the_graph_is_read():
    graph = import_graph()
    # a few edges every version has: the check that the reader sees imports, inside functions too
    assert "onnxgrad.registry" in graph["onnxgrad.rules.elementwise"]
    assert "onnxgrad.pipeline" in graph["onnxgrad.passes.gradient"]
    assert "onnxgrad.passes" in graph["onnxgrad.api"]  # training_pipeline, imported inside _build


def test_pipeline_passes_and_memory_import_downward():
    graph = import_graph()
    above_pipeline = {m for m in graph if m.startswith(("onnxgrad.passes", "onnxgrad.api", "onnxgrad.cli"))}
    assert not graph["onnxgrad.pipeline"] & above_pipeline
    memory = {m for m in graph if m.startswith("onnxgrad.memory")}
    for m in memory:
        assert not {t for t in graph[m] if t.startswith(("onnxgrad.passes", "onnxgrad.pipeline", "onnxgrad.api"))}, m


def private_imports() -> set[tuple[str, str]]:
    known = modules()
    return {(importer, name) for importer, target, name in imports(known)
            if name is not None and name.startswith("_") and not name.startswith("__")
            and owner(target, known) != importer}


def test_no_private_imports():
    assert private_imports() - KNOWN == set()


def test_known_private_imports_are_still_there():
    # an entry whose import is gone must leave KNOWN, so the list stays exact
    assert KNOWN - private_imports() == set()
