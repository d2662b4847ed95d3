"""How ``make test``'s pytest-xdist workers share the test files, read from the sources alone (the
xdist controller, which schedules, collects no tests).

A worker takes whole groups: a test file, or the files whose tests take the same session-scoped
fixture of tests/conftest.py (a launch several files assert on), so that every module- and
session-scoped launch runs once. Groups with more ``slow`` tests go first, so that a long group
does not start last while the other worker has nothing left. pytest-xdist's own ``loadgroup``
cannot do this here: it tags node ids, which pytest 9 no longer lets a plugin change.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def session_fixtures(conftest: Path) -> set[str]:
    """The names of the fixtures ``conftest`` defines with ``scope="session"``."""
    names = set()
    for node in ast.walk(ast.parse(conftest.read_text())):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                if (
                    isinstance(decorator, ast.Call)
                    and ast.unparse(decorator.func) == "pytest.fixture"
                    and any(k.arg == "scope" and ast.literal_eval(k.value) == "session" for k in decorator.keywords)
                ):
                    names.add(node.name)
    return names


def _parameters_and_slow_marks(path: Path) -> tuple[set[str], int]:
    """The parameter names of every function in ``path`` (the fixtures its tests and fixtures
    take) and how many ``pytest.mark.slow`` it holds."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    parameters = {a.arg for f in functions for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)}
    slow = sum(isinstance(n, ast.Attribute) and ast.unparse(n) == "pytest.mark.slow" for n in ast.walk(tree))
    return parameters, slow


@cache
def file_groups(tests: Path = TESTS) -> dict[str, tuple[str, int]]:
    """For every ``test_*.py`` in ``tests``: its group's name (the file's own, or the first of the
    files sharing a session-scoped fixture of ``tests/conftest.py``, by name) and the group's
    count of slow tests."""
    shared = session_fixtures(tests / "conftest.py")
    facts = {path.name: _parameters_and_slow_marks(path) for path in sorted(tests.glob("test_*.py"))}
    group = {name: name for name in facts}
    for fixture in sorted(shared):
        users = [name for name, (parameters, _) in facts.items() if fixture in parameters]
        old = {group[name] for name in users}
        new = min(old, default=None)
        for name in group:
            if group[name] in old:
                group[name] = new
    slow = {g: sum(facts[n][1] for n in facts if group[n] == g) for g in set(group.values())}
    return {name: (group[name], slow[group[name]]) for name in facts}


def _group_of(nodeid: str) -> tuple[str, int]:
    """A test's group (its file's name outside ``tests/``) and the group's count of slow tests."""
    file = nodeid.split("::", 1)[0]
    return file_groups().get(Path(file).name, (file, 0))


def scope_of(nodeid: str) -> str:
    """The group a test's node id falls in."""
    return _group_of(nodeid)[0]


def schedule_key(nodeid: str) -> tuple[int, str]:
    """Where a test's group goes in the workers' queue: more slow tests first, then by name."""
    name, slow = _group_of(nodeid)
    return -slow, name
