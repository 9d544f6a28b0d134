"""The package's shape, for the README's architecture section and tests/test_structure.py: line count,
module import circles, imports that run from a lower layer back up (against ``LAYERS``), functions over 80
lines, the length of ``Trainer.__init__``, and the same drawn by package: circles between packages, arrows from
a library package up to a higher one, library packages that import the tool layer, and command lines that live
outside it. ``python tests/structure.py [PACKAGE_DIR]``.

Every import counts, also one inside a function. A ``__main__`` module is the top layer in the module graph; in
the package graph it belongs to its package, unless it is a shim (it defines nothing and imports only the tool
layer), whose one arrow into ``tools`` is the documented ``python -m torchtitan_ext.<tool>``, not a dependency."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

# The package's layers, lowest first; a module may import from its own layer or any lower one.
LAYERS = [
    ["errors", "config", "outputs"],
    ["ops", "models", "comm", "metrics", "checkpoint"],
    ["hf", "quant", "parallel", "data"],
    ["distill", "eval"],
    ["train"],
    ["generate", "export", "plan", "mup", "scaling"],
    ["tools", "cli"],  # the tool layer: the command lines and what they share
]
TOOL_LAYER = LAYERS[-1]


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(root.rglob("*.py")):
        name = ".".join(f.relative_to(root.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imports(tree: ast.AST, modules: dict[str, Path], package: str) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return {m for m in found if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _layer(module: str, package: str) -> int:
    if module.endswith("__main__"):
        return len(LAYERS)
    top = module.removeprefix(package + ".").split(".")[0]
    return next((i for i, names in enumerate(LAYERS) if top in names), len(LAYERS))


def _top(module: str, package: str) -> str:
    return module.removeprefix(package + ".").split(".")[0]


def _is_shim(module: str, tree: ast.Module, imports: set[str], package: str) -> bool:
    """A ``__main__`` that defines nothing and imports only the tool layer."""
    return module.endswith("__main__") and all(_top(m, package) in TOOL_LAYER for m in imports) and \
        not any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) for node in tree.body)


def _package_report(graph: dict[str, set[str]], shims: set[str], package: str) -> dict:
    """The import graph drawn by package (``__main__`` modules in their own package, shims left out)."""
    edges: dict[str, set[str]] = {}
    for a, targets in graph.items():
        if a in shims:
            continue
        edges.setdefault(_top(a, package), set()).update(_top(b, package) for b in targets)
    for a in edges:
        edges[a].discard(a)
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    library = [a for a in sorted(edges) if a not in TOOL_LAYER]
    return {
        "package_cycles": _cycles(edges),
        "package_upward": [f"{a} -> {b}" for a in library for b in sorted(edges[a])
                           if b not in TOOL_LAYER and layer.get(b, len(LAYERS)) > layer.get(a, len(LAYERS))],
        "tool_layer_importers": [f"{a} -> {b}" for a in library for b in sorted(edges[a]) if b in TOOL_LAYER],
        "entry_points_outside_tools": sorted(m for m in graph if m.endswith("__main__") and m not in shims
                                             and _top(m, package) != "tools"),
    }


def report(root: Path) -> dict:
    package = root.name
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    shims: set[str] = set()
    long_functions, trainer_init, lines = [], 0, 0
    for name, path in modules.items():
        source = path.read_text()
        lines += len(source.splitlines())
        tree = ast.parse(source)
        graph[name] = _imports(tree, modules, package) - {name}
        if _is_shim(name, tree, graph[name], package):
            shims.add(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Trainer":
                init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
                if init is not None:
                    trainer_init = init.end_lineno - init.lineno + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long_functions.append(f"{name}.{node.name} ({length} lines)")
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if _layer(b, package) > _layer(a, package))
    return {"lines": lines, "modules": len(modules), "import_cycles": _cycles(graph), "upward_imports": upward,
            "long_functions": long_functions, "trainer_init_lines": trainer_init,
            **_package_report(graph, shims, package)}


if __name__ == "__main__":
    here = Path(__file__).resolve().parents[1] / "torchtitan_ext"
    print(json.dumps(report(Path(sys.argv[1]) if len(sys.argv) > 1 else here), indent=1))
