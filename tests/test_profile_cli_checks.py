"""``dflop-ds profile`` refuses what would profile nothing or fail late: non-positive sizes and
repeats (naming the option), an unwritable ``-o`` (before profiling), and a model folder without
weights or tokenizer (saying what is missing, not a transformers traceback)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from dflop_ds.commands.main import main as cli_main
from dflop_ds.cost import ProxyCost, save_cost_model

FAST = ["--vision-layers", "1", "--llm-layers", "1", "--tiles", "1", "--seq-lens", "16", "--batch-sizes", "1"]
FAST += ["--warmup", "0", "--repeats", "1", "--no-progress"]


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("--tiles", "0", "argument --tiles: expected positive integers, got '0'"),
        ("--tiles", "1,0,4", "argument --tiles: expected positive integers, got '1,0,4'"),
        ("--seq-lens", "0", "argument --seq-lens: expected positive integers"),
        ("--batch-sizes", "0", "argument --batch-sizes: expected positive integers"),
        ("--repeats", "0", "argument --repeats: expected an integer of at least 1, got 0"),
        ("--warmup", "-1", "argument --warmup: expected an integer of at least 0, got -1"),
        ("--threads", "0", "argument --threads: expected an integer of at least 1, got 0"),
    ],
)
def test_non_positive_sizes_and_repeats_are_refused_naming_the_option(option, value, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["profile", "model", option, value])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_output_is_refused_before_profiling(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    started = time.perf_counter()
    assert cli_main(["profile", "model", *FAST, "-o", str(tmp_path / "file" / "cm.json")]) == 1
    err = capsys.readouterr().err
    assert f"--output {tmp_path / 'file' / 'cm.json'}: cannot be written" in err
    assert time.perf_counter() - started < 5  # nothing was profiled
    out = tmp_path / "new" / "folder" / "cm.json"  # a missing folder is made up front
    assert cli_main(["profile", "model", *FAST, "-o", str(out)]) == 0 and out.is_file()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from dflop_ds.testing.hf_tiny import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.mark.parametrize(
    "removed,missing",
    [
        (["model.safetensors"], "no weights (none of *.safetensors"),
        (["tokenizer.json"], "no tokenizer (none of tokenizer.json, tokenizer.model"),
        (["config.json"], "no config.json"),
    ],
)
def test_a_model_folder_missing_a_part_is_named_before_transformers_reads_it(
    llava_dir: Path, tmp_path: Path, capsys, removed, missing
) -> None:
    folder = Path(shutil.copytree(llava_dir, tmp_path / "model"))
    for name in removed:
        (folder / name).unlink()
    code = cli_main(["profile", "model", "--model_name_or_path", str(folder), "-o", str(tmp_path / "cm.json")])
    err = capsys.readouterr().err
    assert code == 1 and f"model folder {folder}: {missing}" in err
    assert "sentencepiece" not in err and "Traceback" not in err


def test_preprocessors_and_loaders_name_the_missing_tokenizer_or_weights(llava_dir: Path, tmp_path: Path) -> None:
    from dflop_ds.models.hf.llava.data import LlavaPreprocessor
    from dflop_ds.models.hf.llava.model import load_llava
    from dflop_ds.models.hf.qwen2_vl.data import Qwen2VLPreprocessor

    folder = Path(shutil.copytree(llava_dir, tmp_path / "model"))
    (folder / "tokenizer.json").unlink()
    for load in (LlavaPreprocessor.from_pretrained, Qwen2VLPreprocessor.from_pretrained):
        with pytest.raises(FileNotFoundError, match="no tokenizer"):
            load(folder)
    assert load_llava(folder) is not None  # the model alone needs no tokenizer
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_llava(folder)


def test_profile_engine_refuses_a_cost_model_without_layer_depths(tmp_path: Path, capsys) -> None:
    """The engine profile reads the run's stage split as shares of the cost model's layers: a model
    that records none (the proxy) is refused naming its file, before the telemetry is read."""
    proxy = tmp_path / "proxy.json"
    save_cost_model(ProxyCost(), proxy)
    args = ["profile", "engine", str(tmp_path / "absent.jsonl"), "--cost-model", str(proxy)]
    assert cli_main([*args, "--data", str(tmp_path / "absent.jsonl"), "-o", str(tmp_path / "ep.json")]) == 1
    err = capsys.readouterr().err
    assert str(proxy) in err and "ProxyCost records no layer depths" in err
