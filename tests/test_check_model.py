"""``dflop-ds check-model``: passes on a good model directory, fails loudly on a broken adapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dflop_ds.commands.main import main  # noqa: E402
from dflop_ds.models.hf.base import layers as common  # noqa: E402
from dflop_ds.models.hf.llava import model as llava  # noqa: E402
from dflop_ds.testing.hf_tiny import build_tiny_llava  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("clip_llama"), vision="clip", text="llama")


def summary(capsys: pytest.CaptureFixture) -> str:
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_console_script_passes_on_a_good_dir(tmp_path: Path) -> None:
    folder = build_tiny_llava(tmp_path / "m", vision="siglip", text="qwen2", tie_word_embeddings=True)
    out = subprocess.run(
        [sys.executable, "-m", "dflop_ds.commands.main", "check-model", str(folder), "--stages", "3"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "3 stage(s)" in line and "match HF" in line
    assert float(line.rsplit("max_rel_err=", 1)[1]) <= 1e-4


@pytest.mark.parametrize("stages", [1, 2])
def test_passes_in_process(model_dir: Path, stages: int, capsys) -> None:
    assert main(["check-model", str(model_dir), "--stages", str(stages), "--seed", "4"]) == 0
    line = summary(capsys)
    assert "match HF" in line and float(line.rsplit("max_rel_err=", 1)[1]) <= 1e-4
    assert "packed microbatches match padded" in line
    assert float(line.split("packed_rel_err=", 1)[1].split()[0]) <= 1e-4


def test_packed_attention_across_samples_is_named(model_dir: Path, capsys, monkeypatch) -> None:
    """Packed rows whose attention spans the whole row (one segment instead of one per sample):
    the padded microbatches still match HF, the packed ones differ from them on every batch of
    more than one sample, each named."""
    real = common.packed_kwargs
    monkeypatch.setattr(common, "packed_kwargs", lambda seq_lens: real(seq_lens.sum().reshape(1)))
    assert main(["check-model", str(model_dir), "--stages", "2"]) == 1
    line = summary(capsys)
    assert "loss and logits match HF" in line and float(line.rsplit("max_rel_err=", 1)[1]) <= 1e-4
    packed = line.split("packed microbatches DIFFER from padded: ", 1)[1]
    for batch in ("batch 0 (image inside", "batch 1 (text-only microbatch)", "batch 2 (two images"):
        assert batch in packed
    assert "batch 3" not in packed  # one sample: packed and padded are the same row
    assert "packed loss rel err" in packed and float(line.split("packed_rel_err=", 1)[1].split()[0]) > 1e-4


def test_wrong_feature_layer_is_named_with_its_stage(model_dir: Path, capsys, monkeypatch) -> None:
    """An adapter that stops the tower one layer early: stage 0 (embedding + tower layer 0) still
    agrees with HF, the first boundary after the wrong features is named."""
    monkeypatch.setattr(llava, "feature_depth", lambda config: 1)
    assert main(["check-model", str(model_dir), "--stages", "3"]) == 1
    line = summary(capsys)
    assert "DIFFER from HF" in line and "batch 0 (image inside the prompt + text-only row)" in line
    assert "bounds [0, 2, 4, 7]" in line and "stage 1 output (layer 3 DecoderLayer) already differs" in line
    assert "text-only microbatch" not in line  # no image: the tower does not matter
    assert float(line.rsplit("max_rel_err=", 1)[1]) > 1e-4


def test_wrong_positions_are_named(model_dir: Path, capsys, monkeypatch) -> None:
    """Rotary positions at twice the distance: the first decoder stage is named, on every batch.
    (A uniform shift would not show: rotary attention depends on relative positions only.)"""
    real = common.token_positions
    monkeypatch.setattr(common, "token_positions", lambda lens, rows, n: real(lens, rows, n) * 2)
    assert main(["check-model", str(model_dir), "--stages", "3"]) == 1
    line = summary(capsys)
    assert line.count("logits rel err") == 4
    assert "stage 1 output (layer 4 DecoderLayer) already differs" in line


def test_processor_that_disagrees_with_the_model(model_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    processor.patch_size = 16  # 4 tokens per image instead of 16
    folder = build_tiny_llava(tmp_path / "m", vision="clip", text="llama")
    processor.save_pretrained(folder)
    assert main(["check-model", str(folder)]) == 1
    err = capsys.readouterr().err
    assert str(folder) in err and "expands an image to 4 tokens but the model makes 16 features" in err


def test_unsupported_model_and_missing_dir(tmp_path: Path, capsys) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    ).save_pretrained(tmp_path / "llama")
    assert main(["check-model", str(tmp_path / "llama")]) == 1
    err = capsys.readouterr().err
    assert "model type 'llama' is not supported" in err and "supported: 'llava'" in err and "llama" in err
    assert main(["check-model", str(tmp_path / "nothing")]) == 1
    assert "no config.json" in capsys.readouterr().err
