"""The package's shape, for the README's architecture section and tests/test_structure.py: line count,
module import circles, imports that run from a lower layer back up (against ``LAYERS``), functions over 80
lines, and the length of ``Trainer.__init__``. ``python benchmarks/structure.py [PACKAGE_DIR]``.

Every import counts, also one inside a function. ``__main__`` modules are entry points: the top layer."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

# The package's layers, lowest first; a module may import from its own layer or any lower one.
LAYERS = [
    ["errors", "config"],
    ["ops", "models", "comm", "metrics", "hf", "checkpoint"],
    ["quant", "parallel", "data"],
    ["distill", "eval"],
    ["train"],
    ["generate", "export", "plan", "cli", "mup", "scaling"],
]


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


def report(root: Path) -> dict:
    package = root.name
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    long_functions, trainer_init, lines = [], 0, 0
    for name, path in modules.items():
        source = path.read_text()
        lines += len(source.splitlines())
        tree = ast.parse(source)
        graph[name] = _imports(tree, modules, package) - {name}
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
            "long_functions": long_functions, "trainer_init_lines": trainer_init}


if __name__ == "__main__":
    here = Path(__file__).resolve().parents[1] / "torchtitan_ext"
    print(json.dumps(report(Path(sys.argv[1]) if len(sys.argv) > 1 else here), indent=1))
