"""The seams between modules (docs/architecture.md): stages are leaves, MLflow names live in one place,
each third-party library is imported by the module that wraps it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

STAGE_MODULES = {"quantize", "evaluate", "bench", "serve_bench", "size", "gate", "report"}
LIBRARY = [p for folder in ("pipelines", "eval", "quant") for p in sorted((REPO / folder).glob("*.py"))]
# what an MLflow metric, param or tag name looks like (a file name is not one)
NAME = re.compile(r"(eval|recovery|quant|size|engine|mem|server|gate|qeval)[/.][\w./{}-]+")
FILE = re.compile(r".*\.(json|jsonl|csv|png|md|log|yaml|py)")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _strings(path: Path) -> list[tuple[int, str]]:
    """String constants and f-string parts, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _is_module(text: str) -> bool:
    return (REPO / f"{text.replace('.', '/')}.py").is_file()


def test_no_stage_module_imports_another():
    for name in STAGE_MODULES:
        imported = _imports(REPO / "pipelines" / f"{name}.py")
        others = {f"pipelines.{m}" for m in STAGE_MODULES - {name}}
        assert not imported & others, f"pipelines/{name}.py imports {sorted(imported & others)}"


def test_mlflow_names_are_written_only_in_mlflow_names():
    found = [
        f"{p.relative_to(REPO)}:{line}: {text!r}"
        for p in LIBRARY
        if p.name not in ("mlflow_names.py", "tracking.py")  # tracking.py: the store's own keys (URIs, env)
        for line, text in _strings(p)
        if NAME.fullmatch(text) and not FILE.fullmatch(text) and not _is_module(text)
    ]
    assert found == []


def test_each_library_is_imported_by_the_module_that_wraps_it():
    wrappers = {
        "mlflow": {"pipelines/tracking.py"},
        "lm_eval": {"eval/accuracy.py"},
        "llmcompressor": {"quant/build.py", "quant/recipes.py", "quant/cpu_awq.py"},
    }
    for library, allowed in wrappers.items():
        users = {
            str(p.relative_to(REPO))
            for p in LIBRARY
            if any(m == library or m.startswith(f"{library}.") for m in _imports(p))
        }
        assert users <= allowed, (library, users - allowed)
