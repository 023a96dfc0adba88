"""The seams between modules (docs/architecture.md): the layers import downwards only, nothing imports in a
cycle, stages are leaves, MLflow names live in tracking/ and beside the result types, each third-party library is
imported by the module that wraps it, and no file grows past what a reader takes in at one sitting."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from helpers import REPO

from pipelines.core.framework.code import imported_modules, module_files, source_file
from pipelines.core.framework.registry import STAGES

# Top first; a module may import its own layer's modules and those of the layers below it.
LAYERS = [
    ("pipelines", "pipelines.__main__", "pipelines.cli", "pipelines.run", "pipelines.fanout"),
    ("pipelines.present",),  # results flow down to what presents them: no stage or decision draws or writes text
    ("pipelines.stages", "pipelines.decision"),
    ("pipelines.tracking",),
    ("pipelines.core.framework",),  # core/ in rooms (pipelines/core/__init__.py), each above the next
    ("pipelines.core.store",),
    ("pipelines.core.card",),
    ("pipelines.core.system", "pipelines.core"),
    ("eval.bench", "eval.load"),  # eval/ in rooms (eval/__init__.py), each above the next
    ("eval.quality",),
    ("eval.devices", "eval"),
    ("quant", "refmodel"),
]
INDEPENDENT = [("pipelines.stages", "pipelines.decision"), ("eval.bench", "eval.load"), ("quant", "refmodel")]
"""Packages of one layer that do not import each other."""
LIBRARY = [p for folder in ("pipelines", "eval", "quant") for p in sorted((REPO / folder).rglob("*.py"))]
# what an MLflow metric, param or tag name looks like (a file name is not one)
NAME = re.compile(r"(eval|recovery|quant|size|engine|mem|server|shape|gate|cost|qeval)[/.][\w./{}-]+")
FILE = re.compile(r".*\.(json|jsonl|csv|png|md|log|yaml|py)")
MAX_LINES = 420


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> set[str]:
    """Every module a file imports, first-party or not, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _layer(module: str) -> tuple[int, str]:
    """(layer index, the longest package or module of LAYERS the module falls under)."""
    best = max(
        ((i, p) for i, names in enumerate(LAYERS) for p in names if module == p or module.startswith(p + ".")),
        key=lambda t: len(t[1]),
    )
    return best


@cache
def _graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (pipelines/core/framework/code.py reads them, as for cache keys)."""
    files = [*LIBRARY, *sorted((REPO / "refmodel").glob("*.py"))]
    return {_module(p): imported_modules(p) - {_module(p)} for p in files}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports that reach a higher layer (the `pipelines` package's own __init__ aside: its docstring)."""
    wrong = []
    for module, imported in graph.items():
        here, _ = _layer(module)
        for other in imported:
            there, _ = _layer(other)
            if there < here and other != "pipelines":
                wrong.append(f"{module} (layer {here}) imports {other} (layer {there})")
    return wrong


def test_every_module_imports_only_its_own_layer_and_those_below():
    assert _upward(_graph()) == []


def test_packages_of_one_layer_that_are_independent_import_nothing_of_each_other():
    graph = _graph()
    for a, b in INDEPENDENT:
        for module, imported in graph.items():
            for mine, theirs in ((a, b), (b, a)):
                if module == mine or module.startswith(mine + "."):
                    assert not [m for m in imported if m == theirs or m.startswith(theirs + ".")], module


def test_no_import_cycle():
    graph = _graph()
    done: set[str] = set()
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for other in sorted(graph.get(module, ())):
            visit(other, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []


def test_the_layer_check_sees_an_upward_import():
    made_up = {
        "pipelines.core.card.cards": {"pipelines.stages.serve", "eval.quality.stats"},
        "eval.quality.stats": {"quant.recipes", "eval.load.serving"},
        "quant.recipes": {"eval.quality.stats"},
    }
    assert _upward(made_up) == [
        "pipelines.core.card.cards (layer 6) imports pipelines.stages.serve (layer 2)",
        "eval.quality.stats (layer 9) imports eval.load.serving (layer 8)",
        "quant.recipes (layer 11) imports eval.quality.stats (layer 9)",
    ]


def test_no_stage_module_imports_another_or_the_gate():
    stage_modules = {s.module for s in STAGES.values()}
    for module in stage_modules:
        imported = set(_graph()[module])
        assert not imported & (stage_modules - {module}), module
        assert not [m for m in imported if m.startswith("pipelines.decision")], module


def test_the_cache_key_of_each_stage_covers_the_code_it_runs():
    """The lists that drifted when they were kept by hand (issue: serve without eval/devices/speed.py and the child
    runner, bench without quant/verify.py) follow from the imports now."""
    files = {name: {str(p.relative_to(REPO)) for p in module_files(s.module)} for name, s in STAGES.items()}
    assert {
        "eval/devices/speed.py",
        "eval/load/serving.py",
        "eval/load/stream_stub.py",
        "pipelines/core/system/child.py",
        "pipelines/stages/engines.py",
        "eval/quality/paired.py",
    } <= files["serve"]
    assert {"quant/verify.py", "eval/bench/engine.py", "eval/devices/gpus.py", "eval/devices/sizing.py"} <= files[
        "bench"
    ]
    assert {"quant/build.py", "quant/verify.py", "quant/cpu_awq.py", "quant/recipes.py"} <= files["quantize"]
    assert "pipelines/stages/engines.py" not in files["quantize"]  # a stage's key is its own code's
    assert not [f for fs in files.values() for f in fs if f.startswith(("pipelines/decision", "pipelines/tracking"))]


def test_mlflow_names_are_written_only_in_tracking_and_beside_the_result_types():
    writers = {
        "pipelines/tracking/names.py",
        "pipelines/tracking/tables.py",
        "pipelines/tracking/mapping.py",
        "pipelines/tracking/mlflow_tracker.py",
    }  # the tracker: the store's own keys (URIs, env)
    results = REPO / "pipelines/core/store/results"  # each type's `LOGS`
    found = [
        f"{p.relative_to(REPO)}:{line}: {text!r}"
        for p in LIBRARY
        if str(p.relative_to(REPO)) not in writers and p.parent != results
        for line, text in _strings(p)
        if NAME.fullmatch(text) and not FILE.fullmatch(text) and source_file(text) is None
    ]
    assert found == []


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


def test_each_library_is_imported_by_the_module_that_wraps_it():
    wrappers = {
        "mlflow": {"pipelines/tracking/mlflow_tracker.py"},
        "lm_eval": {
            "eval/quality/accuracy.py",
            "eval/quality/lm_tasks.py",
            "eval/quality/rounds.py",
            "eval/quality/scored_rows.py",
        },
        "llmcompressor": {"quant/build.py", "quant/recipes.py", "quant/cpu_awq.py"},
    }
    for library, allowed in wrappers.items():
        users = {
            str(p.relative_to(REPO))
            for p in LIBRARY
            if any(m == library or m.startswith(f"{library}.") for m in _imported_names(p))
        }
        assert users <= allowed, (library, users - allowed)


def test_every_package_says_what_lives_there_and_no_file_is_long():
    for init in sorted([*(REPO / "pipelines").rglob("__init__.py"), *(REPO / "eval").rglob("__init__.py")]):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(REPO)} has no docstring"
    long = [f"{p.relative_to(REPO)}: {n}" for p in LIBRARY if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert long == []
    # and no folder is a drawer: about a dozen modules at most (eval/ was 22 before its rooms)
    modules = {f: len([p for p in f.glob("*.py") if p.name != "__init__.py"]) for f in {p.parent for p in LIBRARY}}
    crowded = {str(f.relative_to(REPO)): n for f, n in modules.items() if n > 14}
    assert crowded == {}


def test_every_stage_of_the_registry_has_its_command_and_make_target():
    from pipelines.cli import app

    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    makefile = (REPO / "Makefile").read_text()
    for spec in STAGES.values():
        assert spec.command.split()[0] in commands, spec.name
        assert re.search(rf"^{re.escape(spec.make_target)}:", makefile, re.M), spec.name
        assert spec.name == spec.result.STAGE and callable(spec.load())


def test_the_code_finds_the_repository_it_lives_in():
    """paths.py finds the repository by its own place in it: moving the file must move that count too."""
    from pipelines.core.system.paths import REPO_ROOT

    assert REPO_ROOT == REPO and (REPO_ROOT / "pipelines/models/ref-lm.yaml").is_file()
