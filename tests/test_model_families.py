"""The registry of HuggingFace model families: one lookup by ``model_type``, unknown types refused
naming the registered ones, no module outside a family's own files naming its ``model_type``
(read with ``ast``: a string constant equal to the type), and no module in one family's folder
importing another family's, so that adding a family touches the registry and the family's files only."""

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


def owned(relative: str, files: tuple[str, ...]) -> bool:
    """Whether the module ``relative`` (to the package root) is one of ``files`` or in one of its folders."""
    return any(relative == name or (name.endswith("/") and relative.startswith(name)) for name in files)


def foreign_mentions(package: Path) -> list[str]:
    """Every place a module names a family's ``model_type`` outside that family's own files."""
    found = []
    for family in registered_families():
        for path in sorted(package.rglob("*.py")):
            relative = path.relative_to(package).as_posix()
            if owned(relative, family.files):
                continue
            for line, value in model_type_mentions(path, set(family.model_types)):
                if (relative, value) not in OTHER_MEANINGS:
                    found.append(f"{relative}:{line} names {family.name}'s model type {value!r}")
    return found


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``import``/``from ... import`` in ``path`` (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def family_folders() -> dict[str, str]:
    """Each family's folder (relative to the package root, ending in ``/``) by family name."""
    return {f.name: name for f in registered_families() for name in f.files if name.endswith("/")}


def cross_family_imports(package: Path, folders: dict[str, str]) -> list[str]:
    """Every import in one family's folder (``folders``: family name -> folder) of another family's module."""
    dotted = {name: "dflop_ds." + folder.rstrip("/").replace("/", ".") for name, folder in folders.items()}
    found = []
    for name, folder in folders.items():
        for path in sorted((package / folder).rglob("*.py")):
            for line, module in imported_modules(path):
                for other, prefix in dotted.items():
                    if other != name and (module == prefix or module.startswith(prefix + ".")):
                        found.append(f"{path.relative_to(package).as_posix()}:{line} imports {other}'s {module}")
    return sorted(set(found))


def test_no_module_outside_a_family_names_its_model_type():
    assert foreign_mentions(PACKAGE) == []


def test_every_family_has_a_folder_and_none_imports_another():
    folders = family_folders()
    assert sorted(folders) == sorted(f.name for f in registered_families())
    assert cross_family_imports(PACKAGE, folders) == []


def test_the_family_neutral_base_imports_no_family():
    """``models/hf/base/`` is what families build on: it imports none of them (checked as if it
    were one more family)."""
    found = cross_family_imports(PACKAGE, {**family_folders(), "base": "models/hf/base/"})
    assert [line for line in found if line.startswith("models/hf/base/")] == []


def test_the_check_sees_a_cross_family_import(tmp_path):
    for name in ("a", "b"):
        (tmp_path / "models" / name).mkdir(parents=True)
    (tmp_path / "models" / "a" / "data.py").write_text("def f():\n    from dflop_ds.models.b import model\n")
    (tmp_path / "models" / "b" / "model.py").write_text("import dflop_ds.models.a\n")
    assert cross_family_imports(tmp_path, {"A": "models/a/", "B": "models/b/"}) == [
        "models/a/data.py:2 imports B's dflop_ds.models.b",
        "models/a/data.py:2 imports B's dflop_ds.models.b.model",
        "models/b/model.py:1 imports A's dflop_ds.models.a",
    ]


def test_the_check_sees_a_foreign_model_type(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "dispatch.py").write_text('def pick(kind):\n    return kind == "llava"\n')
    assert foreign_mentions(tmp_path) == ["models/dispatch.py:2 names LLaVA's model type 'llava'"]


def test_every_family_lists_existing_files_and_distinct_types():
    types = registered_model_types()
    assert len(types) == len(set(types))
    assert {"llava", "qwen2_vl", "qwen2_5_vl", "llava_onevision", "internvl"} <= set(types)
    for family in registered_families():
        missing = [name for name in family.files if not (PACKAGE / name).exists()]
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


def test_a_processor_finds_its_family_by_its_transformers_model_folder():
    """``hf_dataset_shapes`` dispatches a loaded processor through the registry: its class's model
    folder is the family's ``model_type``; a family without a processor policy, or a class from no
    transformers model, is refused by name before any row is read."""
    from transformers import Idefics3Processor, LlavaProcessor, Qwen2VLProcessor

    from dflop_ds.hf_trainer.shapes import hf_dataset_shapes
    from dflop_ds.models.hf.registry import processor_family

    assert processor_family(LlavaProcessor.__new__(LlavaProcessor)).name == "LLaVA"
    qwen = Qwen2VLProcessor.__new__(Qwen2VLProcessor)  # the class is what is read: no files needed
    assert processor_family(qwen).name == "Qwen2-VL"
    with pytest.raises(ValueError, match="the Qwen2-VL family gives no shape policy from a processor yet"):
        hf_dataset_shapes([], qwen)
    with pytest.raises(ValueError, match="processor Idefics3Processor: model type 'idefics3' is not supported"):
        processor_family(Idefics3Processor.__new__(Idefics3Processor))
    with pytest.raises(ValueError, match="processor dict .* is not a transformers model's processor"):
        processor_family({})
