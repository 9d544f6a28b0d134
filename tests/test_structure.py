"""The package's shape (tests/structure.py): the layering the README's architecture section describes."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "torchtitan_ext"


def _report() -> dict:
    spec = importlib.util.spec_from_file_location("structure", REPO / "tests" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.report(PACKAGE)


def test_layers_circles_and_function_sizes():
    report = _report()
    assert report["import_cycles"] == [["torchtitan_ext.comm.squinch", "torchtitan_ext.comm.squinch_triton"]]
    assert report["upward_imports"] == []
    assert report["long_functions"] == []
    assert 0 < report["trainer_init_lines"] < 60


def test_packages_form_layers_with_the_tools_on_top():
    """Drawn by package (a ``__main__`` in its own package, a thin shim left out): no two packages import each
    other, no library package imports one of a higher layer, none imports the tool layer (``tools``, ``cli``),
    and every command line lives in ``tools/`` (a ``__main__`` elsewhere is a shim). At 2d6a835 this found
    three circles (data <-> eval, distill <-> train, checkpoint <-> hf), four arrows up (those three and
    quant -> eval), ten library packages importing ``cli`` and eleven command lines outside ``tools/``."""
    report = _report()
    assert report["package_cycles"] == []
    assert report["package_upward"] == []
    assert report["tool_layer_importers"] == []
    assert report["entry_points_outside_tools"] == []


def test_every_tool_has_its_documented_shim():
    """``python -m torchtitan_ext.tools <tool>`` and ``python -m torchtitan_ext.<tool>`` name the same tools."""
    from torchtitan_ext.tools.__main__ import TOOLS

    shims = {".".join(path.parent.relative_to(PACKAGE).parts) for path in PACKAGE.rglob("__main__.py")}
    assert shims - {"tools"} == set(TOOLS)
    assert all((PACKAGE / "tools" / f"{module}.py").is_file() for module, _ in TOOLS.values())


def test_library_modules_neither_print_nor_define_main():
    """Only the tool layer (``tools/``, its ``__main__`` shims and the shared ``cli.py``) prints, parses
    arguments or exits."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py" or path == PACKAGE / "cli.py" or path.parent == PACKAGE / "tools":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} print")
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} def main")
            if isinstance(node, ast.Attribute) and node.attr in ("exit", "_exit") and \
                    isinstance(node.value, ast.Name) and node.value.id in ("sys", "os"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
    assert offenders == []


def test_no_module_configured_through_class_attributes():
    """Settings reach modules through constructors or explicit per-step calls: no class attribute of the
    package is assigned from outside its class body."""
    classes = set()
    trees = {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    for tree in trees.values():
        classes.update(node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
    offenders = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                        target.value.id in classes:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {target.value.id}.{target.attr}")
    assert offenders == []


GPU_MODEL = re.compile(r"\b(?:A100|A800|A10G|H100|H200|H800|H20|B100|B200|GB200|GB300|L40S?|V100|MI\d{3}X?|"
                       r"RTX ?\d{4})s?\b")
THROUGHPUT = re.compile(r"\d[\d,.]*\s?(?:[kM]\s?)?(?:tokens|tok)/s|\d[\d,.]*\s?[TGP]FLOP/?s|\d[\d,.]*\s?[MGT]B/s"
                        r"|\d[\d,.]*\s?(?:ms|us|µs)\b|\b\d+\.\d+(?:-\d+\.\d+)?x\b|\d+(?:\.\d+)?x (?:faster|slower)"
                        r"|\d+(?:\.\d+)?% (?:MFU|slower|faster)")
RESULTS_POINTER = re.compile(r"RESULTS\.md|\bbenchmarks/|\b20\d\d-\d\d-\d\d\b")  # where, and when, it was measured
HELP_KEYWORDS = ("help", "description", "epilog")


def _strings(node: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _explanations(path: Path) -> list[tuple[int, str]]:
    """A library file's comments, docstrings and help texts (argparse help / description / epilog, config
    ``opt`` help, the tools table and module-level ``*DESCRIPTION`` / ``*EPILOG`` texts), with their lines."""
    source = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and \
                node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            found.append((node.body[0].lineno, node.body[0].value.value))
        elif isinstance(node, ast.Call):
            found += [s for kw in node.keywords if kw.arg in HELP_KEYWORDS for s in _strings(kw.value)]
            if isinstance(node.func, ast.Name) and node.func.id == "opt" and len(node.args) > 1:
                found += _strings(node.args[1])
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and (t.id == "TOOLS" or t.id.endswith(("DESCRIPTION", "EPILOG")))
                   for t in targets):
                found += _strings(node.value)
    return found


def test_library_explanations_name_no_gpu_model_and_no_throughput_figure():
    """Comments, docstrings and help texts say what the code does and why; measurements (the GPU they ran on,
    tokens/s, TFLOP/s, bandwidths, milliseconds, speed-up ratios, MFU, the date) belong in benchmarks/RESULTS.md,
    and the library does not point there or at a benchmark script."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _explanations(path):
            for pattern in (GPU_MODEL, THROUGHPUT, RESULTS_POINTER):
                offenders += [f"{path.relative_to(REPO)}:{line}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert offenders == []
