"""Model-family settings, chat templates and conversations that cannot be trained as given are
refused (or warned about) naming the key, the file or the record."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from dflop_ds.commands.main import main
from dflop_ds.models.hf.llava_onevision.shapes import OnevisionTokenRule
from dflop_ds.models.hf.qwen2_vl.data import SmartResize
from dflop_ds.models.hf.registry import family_of


@pytest.mark.parametrize(
    ("pinpoints", "max_tiles", "message"),
    [
        (((0, 0),), 4, r"image_grid_pinpoints holds \[0, 0\]"),
        ((), 4, "image_grid_pinpoints is empty"),
        (((384, 500),), 4, r"image_grid_pinpoints holds \[384, 500\].*multiple of the tile size 384"),
        (((-384, 384),), 4, r"image_grid_pinpoints holds \[-384, 384\]"),
        (((384, 768),), -3, 'vision_aspect_ratio "anyres_max_-3": N must be at least 1'),
    ],
)
def test_onevision_settings_the_anyres_counting_cannot_use_are_refused_by_key(pinpoints, max_tiles, message):
    with pytest.raises(ValueError, match=message):
        OnevisionTokenRule(tile_size=384, patch_size=14, pinpoints=pinpoints, max_tiles=max_tiles)
    OnevisionTokenRule(tile_size=384, patch_size=16, pinpoints=((384, 768),), max_tiles=4)  # a good one


def test_a_qwen2_vl_size_of_zeros_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"size \{'shortest_edge': 0, 'longest_edge': 0\}"):
        SmartResize(patch_size=14, merge_size=2, min_pixels=0, max_pixels=0)


def test_a_corrupt_config_json_is_named(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "llava", ')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: not valid JSON at line 1"):
        family_of(tmp_path)


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory):
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset

    root = tmp_path_factory.mktemp("templates")
    data, images = write_llava_dataset(root / "data", 4, seed=1)
    return build_tiny_llava(root / "model"), data, images


def with_legacy_template(model: Path, folder: Path, content: str) -> Path:
    """A copy of ``model`` whose legacy ``chat_template.json`` holds ``content``."""
    shutil.copytree(model, folder)
    (folder / "chat_template.json").write_text(content)
    return folder


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ messages + 1 }}", r"id 'r0000'.*chat template fails on this conversation: TypeError"),
        ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", r"id 'r0000'.*: RecursionError"),
    ],
    ids=["type-error", "recursion"],
)
def test_a_template_that_raises_is_named_with_the_record(llava_checkpoint, tmp_path, template, message):
    from dflop_ds.data import DataError
    from dflop_ds.hf_trainer import llava_json_shapes

    model, data, images = llava_checkpoint
    folder = with_legacy_template(model, tmp_path / "m", json.dumps({"chat_template": template}))
    with pytest.raises(DataError, match=message):
        llava_json_shapes(data, str(folder), image_folder=images)


def test_a_corrupt_legacy_template_file_is_named_as_such(llava_checkpoint, tmp_path):
    from dflop_ds.hf_trainer import llava_json_shapes

    model, data, images = llava_checkpoint
    folder = with_legacy_template(model, tmp_path / "m", '{"chat_template": "{% for m in messages %}')
    with pytest.raises(ValueError, match=rf"{folder / 'chat_template.json'}: not valid JSON"):
        llava_json_shapes(data, str(folder), image_folder=images)


def test_a_template_without_a_generation_prompt_is_warned_about(llava_checkpoint, tmp_path, caplog):
    from dflop_ds.hf_trainer import llava_json_shapes

    model, data, images = llava_checkpoint
    template = (
        "{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
        "{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    )
    folder = with_legacy_template(model, tmp_path / "m", json.dumps({"chat_template": template}))
    with caplog.at_level(logging.WARNING):
        llava_json_shapes(data, str(folder), image_folder=images)
    assert "writes no generation prompt" in caplog.text


@pytest.mark.parametrize(
    ("turns", "message"),
    [
        (
            [("human", "hi"), ("gpt", "   "), ("human", "and?"), ("gpt", "yes")],
            r"conversations\[1\]\.value.*is an answer of whitespace only",
        ),
        ([("human", "hi"), ("gpt", "hello"), ("human", "and?")], r"conversations\[2\].*ends with a human turn"),
    ],
    ids=["whitespace-answer", "unanswered"],
)
def test_validate_flags_answers_that_only_train_the_end_of_turn_token(tmp_path, capsys, turns, message):
    record = {"id": "r1", "conversations": [{"from": role, "value": value} for role, value in turns]}
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record]))
    assert main(["validate", str(path), "--policy", "tiny"]) == 1
    out = capsys.readouterr()
    assert re.search(message, out.out + out.err), out


def test_an_internvl_tile_limit_beyond_any_checkpoint_is_refused_not_searched_for_minutes():
    from dflop_ds.models.hf.internvl.shapes import MAX_TILES, InternVLTileRule

    with pytest.raises(ValueError, match=rf"min_patches 1 and max_patches 100000: need .* <= {MAX_TILES}"):
        InternVLTileRule(tile_size=448, min_tiles=1, max_tiles=100000, tokens_per_tile=256)
    with pytest.raises(ValueError, match="min_patches 0"):
        InternVLTileRule(tile_size=448, min_tiles=0, max_tiles=12, tokens_per_tile=256)


def test_settings_that_are_not_whole_numbers_are_refused_by_key():
    """Strings in the pinpoints or a fractional max_patches gave a bare TypeError later."""
    from dflop_ds.models.hf.internvl.shapes import InternVLTileRule

    with pytest.raises(ValueError, match=r"image_grid_pinpoints holds \['384', '768'\]"):
        OnevisionTokenRule(tile_size=384, patch_size=14, pinpoints=(("384", "768"),), max_tiles=4)
    with pytest.raises(ValueError, match=r"max_patches must be a whole number, got 12\.5"):
        InternVLTileRule(tile_size=448, min_tiles=1, max_tiles=12.5, tokens_per_tile=256)  # type: ignore[arg-type]
