"""The registry of HuggingFace model families: one lookup by ``model_type``, unknown types refused
naming the registered ones, and no module outside a family's own files naming its ``model_type``
(read with ``ast``: a string constant equal to the type), so that adding a family touches the
registry and the family's files only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dflop_ds.models.hf.preprocessor import hf_preprocessor  # noqa: E402
from dflop_ds.models.hf.registry import family_for, family_of, registered_families, registered_model_types  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "dflop_ds"

#: (module, string) pairs where the same word names something other than a model type.
OTHER_MEANINGS = {
    ("data/formats.py", "llava"): "the LLaVA JSON data format, read for every family",
    ("schedule/splitters/llava.py", "llava"): "the name of the LLaVA data-ordering splitter",
    ("cost/analytic.py", "llava"): "the prefix of the paper's analytic 'llava-ov-...' cost models",
    ("plan/projection.py", "llava"): "the LLaVA modality-grouping baseline method and its splitter",
}


def model_type_mentions(path: Path, types: set[str]) -> list[tuple[int, str]]:
    """``(line, string)`` of every string constant in ``path`` that equals one of ``types``."""
    tree = ast.parse(path.read_text())
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in types
    ]


def foreign_mentions(package: Path) -> list[str]:
    """Every place a module names a family's ``model_type`` outside that family's own files."""
    found = []
    for family in registered_families():
        own = set(family.files)
        for path in sorted(package.rglob("*.py")):
            relative = path.relative_to(package).as_posix()
            if relative in own:
                continue
            for line, value in model_type_mentions(path, set(family.model_types)):
                if (relative, value) not in OTHER_MEANINGS:
                    found.append(f"{relative}:{line} names {family.name}'s model type {value!r}")
    return found


def test_no_module_outside_a_family_names_its_model_type():
    assert foreign_mentions(PACKAGE) == []


def test_the_check_sees_a_foreign_model_type(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "dispatch.py").write_text('def pick(kind):\n    return kind == "llava"\n')
    assert foreign_mentions(tmp_path) == ["models/dispatch.py:2 names LLaVA's model type 'llava'"]


def test_every_family_lists_existing_files_and_distinct_types():
    types = registered_model_types()
    assert len(types) == len(set(types))
    assert {"llava", "qwen2_vl", "qwen2_5_vl", "llava_onevision", "internvl"} <= set(types)
    for family in registered_families():
        missing = [name for name in family.files if not (PACKAGE / name).is_file()]
        assert not missing, f"{family.name} lists files that do not exist: {missing}"
        assert family_for(family.model_types[0]) is family


def test_an_unknown_model_type_is_refused_naming_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match=r"somewhere: model type 'gemma3' is not supported \(supported: 'llava', "):
        family_for("gemma3", "somewhere")
    (tmp_path / "config.json").write_text('{"model_type": "idefics3"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="model type 'idefics3' is not supported.*'qwen2_vl'"):
        hf_preprocessor(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        family_of(tmp_path / "absent")
