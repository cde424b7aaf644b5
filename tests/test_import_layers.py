"""Data flows one way: cluster -> engine -> executor -> workers -> kernels, with the step types
and config as leaves at the bottom (see DESIGN.md, "Data flows one way"). Every `import` in
pagedserve/ is read from the AST, at module level and inside functions alike (a function-level
import is a dependency too, only a later one), and checked against the layer it may reach.

The rules:
- a module may import its own layer and any layer below it, never one above;
- kernels import nothing of the project outside kernels;
- the step types (what crosses the engine <-> worker boundary) and config.py import only leaves:
  bottom modules that import nothing of the project themselves (config describes; it neither
  resolves models nor starts Ray; the step types are plain data both sides read);
- the bottom layer imports only the bottom layer;
- no module reaches itself through its imports (no circle), wherever the imports sit.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "pagedserve"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Layers, top first. A module's layer is its first name under pagedserve (pagedserve.engine.*:
# "engine"); a top-level module's is given in TOP_LEVEL_MODULES. A top-level module named in
# neither is in no layer, which the test reports: a new module must be placed on purpose.
ENTRY = "entry"  # what people run or import first: it may import anything, nothing imports it
LAYERS = [ENTRY, "cluster", "engine", "executor", "workers", "kernels", "step_types", "bottom"]
# Layers whose modules may import only leaves (see is_leaf), beside their own layer.
LEAF_IMPORTERS = {"step_types"}

# Every top-level module's layer, each for a reason.
TOP_LEVEL_MODULES = {
    "pagedserve": ENTRY,  # the package: LLM, AsyncLLM, SamplingParams, loaded lazily
    "pagedserve.cli": ENTRY,  # `pagedserve serve | generate`
    "pagedserve.cli_args": ENTRY,  # the CLI's flags, made from the config's fields
    "pagedserve.config": "bottom",  # pydantic models for the engine's knobs: describes, resolves nothing
    "pagedserve.sampling_params": "bottom",  # a request's parameters
    "pagedserve.inputs": "bottom",  # prompts: the typed dicts the engine and the server take
    "pagedserve.lora_request": "bottom",  # a request's adapter: the API, the engine and the server carry it
    "pagedserve.request_ids": "bottom",  # the shapes of request ids: the engine's child ids, the cluster's others
    # Starting or joining Ray: the cluster (replica placement) and the Ray executor
    # both need it, so it sits below both; it imports nothing of the project.
    "pagedserve.ray_env": "bottom",
    "pagedserve.cpu_list": "bottom",  # '0-3,8': the config validates one, the workers bind threads to one
    "pagedserve.onednn_caches": "bottom",  # the bound on oneDNN's primitive caches, set at the package's import
    # Model name -> checkpoint folder -> ModelConfig. The engine resolves the model once, before
    # any worker starts (it asks the executor for the device and the workers' model registry for
    # the architectures); the workers only receive the finished ModelConfig, so they may not
    # import it, and config may not either (it describes).
    "pagedserve.model_resolver": "engine",
    # What model resolution builds or converts on disk: the 'demo' and 'tiny' checkpoints and GGUF
    # files. Only model_resolver (and `python -m pagedserve.demo`) uses them: the same layer.
    "pagedserve.demo": "engine",
    "pagedserve.tiny_model": "engine",
    "pagedserve.gguf_checkpoint": "engine",
}


@dataclass(frozen=True)
class Import:
    target: str  # the imported module, e.g. "pagedserve.step_types.scheduler_output"
    line: int
    in_function: str | None  # the enclosing function's name for a function-level import


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(name: str) -> bool:
    return (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()


def is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def project_imports(source: str, name: str, is_pkg: bool = False) -> list[Import]:
    """Every import of a pagedserve module in `source` (the module `name`), wherever it sits.
    `from pkg import sub` counts as importing `pkg.sub` when `sub` is a module."""
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, child.lineno, function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(child, name, is_pkg)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(Import(sub if is_module(sub) else base, child.lineno, function))
            visit(child, inner)

    visit(ast.parse(source), None)
    return [i for i in found if i.target == PACKAGE or i.target.startswith(PACKAGE + ".")]


def _absolute(node: ast.ImportFrom, name: str, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def layer_of(name: str) -> str | None:
    if name in TOP_LEVEL_MODULES:
        return TOP_LEVEL_MODULES[name]
    parts = name.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    return None


def is_leaf(name: str) -> bool:
    """A module that imports nothing of the project (one that does not exist yet counts: the
    check then falls to its own file once it is written)."""
    path = _path_of(name)
    return path is None or not project_imports(path.read_text(), name, path.name == "__init__.py")


def _path_of(name: str) -> Path | None:
    path = ROOT.parent / name.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def violation(importer: str, imported: Import) -> str | None:
    """Why `importer` may not import `imported.target`, or None when it may."""
    target = imported.target
    mine, theirs = layer_of(importer), layer_of(target)
    if mine is None:
        return f"{importer} is in no layer: place it in tests/test_import_layers.py"
    if theirs is None:
        return f"{target} is in no layer: place it in tests/test_import_layers.py"
    if mine == ENTRY:
        return None
    if LAYERS.index(theirs) < LAYERS.index(mine):
        return f"imports upward: {mine} may not import {theirs} ({target})"
    if mine == "kernels" and theirs != "kernels":
        return f"kernels import nothing of the project, not {target}"
    if importer == "pagedserve.config" and not is_leaf(target):
        return f"config may import only leaves (modules that import nothing of the project), not {target}"
    if mine in LEAF_IMPORTERS and theirs != mine and not is_leaf(target):
        return f"{mine} may import only leaves (modules that import nothing of the project), not {target}"
    return None


def violations(path: Path) -> list[str]:
    name = module_name(path)
    found = []
    for imported in project_imports(path.read_text(), name, path.name == "__init__.py"):
        reason = violation(name, imported)
        if reason is not None:
            where = f" (inside {imported.in_function}())" if imported.in_function else ""
            found.append(f"{path.relative_to(ROOT.parent)}:{imported.line}{where}: {reason}")
    return found


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT.parent)) for p in FILES])
def test_imports_respect_the_layers(path):
    found = violations(path)
    assert not found, "\n" + "\n".join(found)


def import_graph() -> dict[str, set[str]]:
    """Every module -> the project modules it imports (a package's __init__ is the package)."""
    graph: dict[str, set[str]] = {}
    for path in FILES:
        name = module_name(path)
        targets = {i.target for i in project_imports(path.read_text(), name, path.name == "__init__.py")}
        graph[name] = {t for t in targets if t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once all it reaches is checked
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# ---- the checker itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "importer, source, fragment",
    [
        ("pagedserve.workers.worker", "def f():\n    from pagedserve.engine.core.scheduler import Scheduler\n", "imports upward"),
        ("pagedserve.workers.worker", "from pagedserve.executor.executor import Executor\n", "imports upward"),
        ("pagedserve.executor.executor", "from pagedserve.engine.core.request import Request\n", "imports upward"),
        ("pagedserve.step_types.scheduler_output", "from pagedserve.workers import worker\n", "imports upward"),
        ("pagedserve.workers.worker", "from pagedserve.cluster import app\n", "imports upward"),
        ("pagedserve.kernels.reference", "import pagedserve.config\n", "kernels import nothing"),
        ("pagedserve.config", "def f():\n    from pagedserve.model_resolver import resolve_checkpoint\n", "imports upward"),
        ("pagedserve.config", "def f():\n    from pagedserve.demo import ensure_demo_model\n", "imports upward"),
        ("pagedserve.workers.model_loader", "from pagedserve.model_resolver import resolve_model_path\n", "imports upward"),
        ("pagedserve.ray_env", "from pagedserve.executor import ray_executor\n", "imports upward"),
        ("pagedserve.engine.core.scheduler", "from ...cluster import app\n", "imports upward"),
        ("pagedserve.sampling_params", "from pagedserve.step_types import scheduler_output\n", "imports upward"),
        ("pagedserve.workers.worker", "from pagedserve.engine.engine_core_output import FinishReason\n", "imports upward"),
    ],
)
def test_the_checker_catches(importer, source, fragment):
    reasons = [violation(importer, i) for i in project_imports(source, importer)]
    assert any(r is not None and fragment in r for r in reasons), reasons


@pytest.mark.parametrize("importer", ["pagedserve.config", "pagedserve.step_types.scheduler_output"])
def test_the_checker_lets_config_and_step_types_import_only_leaves(monkeypatch, importer):
    """Every bottom module is a leaf today; pretend sampling_params imported something."""
    imported = project_imports("from pagedserve.sampling_params import SamplingParams\n", importer)
    assert [violation(importer, i) for i in imported] == [None]
    monkeypatch.setitem(globals(), "is_leaf", lambda name: False)
    reasons = [violation(importer, i) for i in imported]
    assert reasons and "only leaves" in reasons[0], reasons


@pytest.mark.parametrize(
    "importer, source",
    [
        ("pagedserve.workers.worker", "from pagedserve.step_types.scheduler_output import SchedulerOutput\n"),
        ("pagedserve.workers.worker", "from pagedserve.step_types import model_runner_output\n"),
        ("pagedserve.cluster.app", "from pagedserve.executor.executor import Executor\n"),
        ("pagedserve.engine.llm_engine", "from pagedserve.executor.factory import create_executor\n"),
        ("pagedserve.executor.ray_executor", "from pagedserve.workers.worker import Worker\n"),
        ("pagedserve.step_types.scheduler_output", "from pagedserve.sampling_params import SamplingParams\n"),
        ("pagedserve.config", "from pagedserve.sampling_params import SamplingParams\n"),
        ("pagedserve.engine.core.scheduler", "from .request import Request\n"),
        ("pagedserve.cli", "from pagedserve.cluster.launcher import serve_forever\n"),
    ],
)
def test_the_checker_allows(importer, source):
    imports = project_imports(source, importer)
    assert imports and [violation(importer, i) for i in imports] == [None] * len(imports)
