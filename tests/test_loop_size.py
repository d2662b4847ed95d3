"""The training entry stays a short sequence of named builders: no function of
``dflop_ds/train/loop.py`` runs over 60 lines (read with ``ast``, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import dflop_ds

LOOP = Path(dflop_ds.__file__).parent / "train" / "loop.py"
MAX_LINES = 60


def test_no_function_of_the_training_loop_is_over_60_lines() -> None:
    tree = ast.parse(LOOP.read_text(), filename=str(LOOP))
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert any(node.name == "main" for node in functions)  # the module read is the training loop
    long = {
        node.name: node.end_lineno - node.lineno + 1 for node in functions if node.end_lineno - node.lineno >= MAX_LINES
    }
    assert not long, f"functions of {LOOP} over {MAX_LINES} lines: {long}"
