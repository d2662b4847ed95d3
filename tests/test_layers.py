"""The package's layering: no module imports from a layer above its own, and no import loops.

Imports are read with ``ast`` (nothing is imported). The layer check covers every import, inside
functions too: a deferred import is still a dependency. The loop check covers the imports that run
when a module loads (its body, ``if``/``try`` blocks included, ``TYPE_CHECKING`` blocks excluded),
with the ``__init__`` of every package on the way, as Python runs them. docs/architecture.md draws
the same order.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflop_ds"

#: Bottom to top; a module may import from its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "shapes",
            "jsonio",
            "paths",
            "typecheck",
            "precision",
            "deepspeed_keys",
            "sync",
            "host",
            "zero_gather",
            "data",
        ),
    ),
    ("cost", ("cost",)),
    ("profile", ("profile",)),
    ("schedule", ("schedule", "loader", "testing")),
    ("pipe", ("pipe",)),
    ("models", ("models",)),
    ("plan", ("plan",)),
    ("telemetry", ("telemetry",)),
    ("train", ("train", "config", "setup_checks", "launch", "rank_lifecycle", "hf_trainer", "compose")),
    ("integrations", ("integrations",)),  # the frameworks' plugins: thin, over dflop_ds.compose
    ("commands", ("commands",)),  # and dflop_ds/__init__.py: every command-line module, no other layer above
]


@dataclass(frozen=True)
class Import:
    """One ``dflop_ds`` import: the importing module, the imported one, the line, whether it runs on load."""

    source: str
    target: str
    line: int
    on_load: bool


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``; an unplaced module fails with its name."""
    parts = module.split(".")
    if module == "dflop_ds":
        return len(LAYERS) - 1
    for index, (_, roots) in enumerate(LAYERS):
        if parts[1] in roots:
            return index
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS in {__file__}")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], on_load: bool):
    """``(statement, on_load)`` for every statement under ``body``; function bodies do not run on load."""
    for node in body:
        yield node, on_load
        if isinstance(node, ast.If):
            inner = on_load and not _is_type_checking(node)
            yield from _statements(node.body, inner)
            yield from _statements(node.orelse, on_load)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _statements(node.body, False)
        elif isinstance(node, ast.ClassDef):
            yield from _statements(node.body, on_load)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _statements(getattr(node, field, []), on_load)


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module (``from a import b`` may name an attribute)."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a ``dflop_ds`` module in ``path``."""
    found = []
    for node, on_load in _statements(ast.parse(path.read_text()).body, True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "dflop_ds":
                target = _resolve(name, modules)
                if target != module:
                    found.append(Import(module, target, node.lineno, on_load))
    return found


@lru_cache(maxsize=1)
def all_imports() -> tuple[Import, ...]:
    """Every ``dflop_ds`` import of the package (parsed once per session)."""
    modules = module_files()
    return tuple(found for module, path in modules.items() for found in imports_of(module, path, modules))


def load_graph(imports: Sequence[Import]) -> dict[str, set[str]]:
    """Module -> the modules that loading it runs: its on-load imports and their packages' ``__init__``
    (except its own packages, which are already loading)."""
    graph: dict[str, set[str]] = {}
    for found in imports:
        if not found.on_load:
            continue
        parts = found.target.split(".")
        for end in range(1, len(parts) + 1):
            package = ".".join(parts[:end])
            if package != found.source and not found.source.startswith(package + "."):
                graph.setdefault(found.source, set()).add(package)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_every_module_has_a_layer():
    for module in module_files():
        layer_of(module)


def test_no_module_imports_from_a_higher_layer():
    upward = sorted(
        {
            f"{found.source} ({LAYERS[layer_of(found.source)][0]}) line {found.line} imports "
            f"{found.target} ({LAYERS[layer_of(found.target)][0]})"
            for found in all_imports()
            if layer_of(found.target) > layer_of(found.source)
        }
    )
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_loops():
    cycle = find_cycle(load_graph(all_imports()))
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether loading ``start`` loads ``goal``."""
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_no_deferred_import_hides_a_loop():
    """An import inside a function must not be one that, moved to the top, would close a loop."""
    imports = all_imports()
    graph = load_graph(imports)
    hidden = sorted(
        {
            f"{found.source} line {found.line} -> {found.target}"
            for found in imports
            if not found.on_load and reaches(graph, found.target, found.source)
        }
    )
    assert not hidden, "deferred imports that hide a loop:\n" + "\n".join(hidden)


def test_the_checks_see_a_loop_and_an_upward_import(tmp_path):
    """The checker itself: a planted loop and a planted upward import are found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    probe = tmp_path / "probe.py"
    probe.write_text("from dflop_ds.plan import Plan\n\ndef f():\n    from dflop_ds.train.loop import train\n")
    found = imports_of("dflop_ds.shapes", probe, module_files())
    assert [(f.target, f.on_load) for f in found] == [("dflop_ds.plan", True), ("dflop_ds.train.loop", False)]
    assert all(layer_of(f.target) > layer_of("dflop_ds.shapes") for f in found)


def test_no_production_module_imports_the_test_helpers():
    """``dflop_ds.testing`` holds helpers for tests (tiny models, a stuck scheduler); nothing else in
    the package imports it, so production code never depends on test code."""
    helpers = "dflop_ds.testing"
    found = sorted(
        {
            f"{found.source} line {found.line} imports {found.target}"
            for found in all_imports()
            if (found.target == helpers or found.target.startswith(helpers + "."))
            and not (found.source == helpers or found.source.startswith(helpers + "."))
        }
    )
    assert not found, "production modules importing dflop_ds.testing:\n" + "\n".join(found)


TRAIN = "dflop_ds.train"
COMPOSE = "dflop_ds.compose"
#: the Trainer-shaped entry points, which reach the training machinery through dflop_ds.compose only
ENTRY_POINTS = ("dflop_ds.hf_trainer.trainer", "dflop_ds.integrations")
#: the DeepSpeed loop, whose settings, inputs and sampler come from dflop_ds.compose too
LOOP = "dflop_ds.train.loop"
#: what only the composition root calls: building a sampler, agreeing on a launch's inputs
ROOT_ONLY = {"make_sampler": "dflop_ds.schedule", "agree_on_inputs": "dflop_ds.train.launch_inputs"}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_trainer_entry_points_use_the_composition_root_and_nothing_from_train():
    """The Trainer mixin and the frameworks' plugins resolve a run through ``dflop_ds.compose``
    (one composition root), never through the DeepSpeed loop's modules in ``dflop_ds.train``."""
    imports = [f for f in all_imports() if any(_in(f.source, e) for e in ENTRY_POINTS)]
    from_train = sorted({f"{f.source} line {f.line} imports {f.target}" for f in imports if _in(f.target, TRAIN)})
    assert not from_train, "entry points importing dflop_ds.train:\n" + "\n".join(from_train)
    users = {f.source for f in imports if _in(f.target, COMPOSE)}
    assert "dflop_ds.hf_trainer.trainer" in users
    plugins = {m for m in module_files() if m.startswith("dflop_ds.integrations.") and m.rsplit(".", 1)[1] in PLUGINS}
    assert len(plugins) == len(PLUGINS) and plugins <= users, f"plugins not using dflop_ds.compose: {plugins - users}"


def imported_names(path: Path) -> set[str]:
    """The names ``path`` imports with ``from ... import`` (anywhere in it, functions included)."""
    return {
        alias.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_every_entry_point_builds_its_sampler_through_the_composition_root():
    """One way to build a run: the DeepSpeed loop imports ``dflop_ds.compose`` as the Trainer-shaped
    entry points do, and no module outside the composition root (and the names' own packages)
    builds a sampler or agrees on a launch's inputs itself (:data:`ROOT_ONLY`)."""
    assert any(f.source == LOOP and _in(f.target, COMPOSE) for f in all_imports()), f"{LOOP} does not use {COMPOSE}"
    elsewhere = sorted(
        f"{module} imports {name}"
        for module, path in module_files().items()
        if not _in(module, COMPOSE)
        for name in imported_names(path) & set(ROOT_ONLY)
        if not _in(module, ROOT_ONLY[name])
    )
    assert not elsewhere, "modules building a run outside dflop_ds.compose:\n" + "\n".join(elsewhere)


#: the modules of dflop_ds.integrations that are a framework's plugin
PLUGINS = ("swift", "llamafactory")


#: the most lines a module of dflop_ds may have: one over it holds more than one idea
MAX_MODULE_LINES = 600


def test_no_module_is_over_the_line_limit():
    """Small modules, one idea each: every module of the package has at most :data:`MAX_MODULE_LINES` lines."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_files().items()}
    assert lengths, "no modules found under " + str(PACKAGE)
    over = sorted(f"{name}: {n} lines" for name, n in lengths.items() if n > MAX_MODULE_LINES)
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)
