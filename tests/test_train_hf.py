"""examples/train.py on a HuggingFace LLaVA directory and LLaVA JSON with image files, 2 CPU ranks:
the pipeline engine (hf_pp2.json) and ZeRO-2 (hf_zero2.json), both samplers, LoRA, save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflop_ds.launch import run_deepspeed

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llava_run_inputs(tmp_path_factory):
    """A tiny LLaVA directory and a 40-record LLaVA dataset with real PNG/JPEG files."""
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset

    root = tmp_path_factory.mktemp("hf_train")
    model = build_tiny_llava(root / "model", vision="siglip", text="qwen2")
    data, images = write_llava_dataset(root / "data", 40, seed=3)
    return model, data, images


def train(tmp_path: Path, config: str, model: Path, data: Path, images: Path, *args: str,
          dflop: dict | None = None) -> dict:
    """Launch examples/train.py on 2 ranks with a bundled config (``dflop`` keys overridden)."""
    settings = json.loads((ROOT / "ds_configs" / config).read_text())
    settings["dflop"].update(dflop or {})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(settings))
    summary = tmp_path / "summary.json"
    result = run_deepspeed(
        ROOT / "examples" / "train.py",
        ["--deepspeed_config", str(path), "--model_name_or_path", str(model), "--data_path", str(data),
         "--image_folder", str(images), "--summary", str(summary), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=500,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(summary.read_text())


def changed_tensors(before: Path, after: Path) -> tuple[int, int]:
    """``(changed, total)`` tensors between two save_pretrained directories (loaded by transformers)."""
    from transformers import AutoModelForImageTextToText

    old = AutoModelForImageTextToText.from_pretrained(str(before)).state_dict()
    new = AutoModelForImageTextToText.from_pretrained(str(after)).state_dict()
    assert old.keys() == new.keys()
    return sum(not torch.equal(old[k], new[k]) for k in old), len(old)


@pytest.mark.slow
@pytest.mark.parametrize("config,sampler", [("hf_pp2.json", "dflop"), ("hf_pp2.json", "stock"),
                                            ("hf_zero2.json", "dflop"), ("hf_zero2.json", "stock")])
def test_hf_llava_trains_on_two_ranks_with_both_engines_and_samplers(tmp_path, llava_run_inputs, config, sampler):
    model, data, images = llava_run_inputs
    out = tmp_path / "trained"
    run = train(tmp_path, config, model, data, images, "--output_dir", str(out),
                dflop={"sampler": sampler, "steps": 6})
    summary = run["summary"]
    assert summary["engine"] == ("pipeline" if "pp2" in config else "plain") and summary["model"].startswith("llava")
    losses = [s["loss"] for s in run["steps"]]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    # the trained weights come back as a directory transformers loads
    changed, total = changed_tensors(model, out)
    assert changed > total // 2, (changed, total)


@pytest.mark.slow
def test_hf_llava_lora_on_zero2_trains_adapters_and_saves_a_merged_model(tmp_path, llava_run_inputs):
    from transformers import AutoModelForImageTextToText

    model, data, images = llava_run_inputs
    out = tmp_path / "trained"
    run = train(tmp_path, "hf_zero2.json", model, data, images, "--output_dir", str(out),
                dflop={"lora": {"r": 4, "alpha": 8}, "lr": 0.01, "steps": 6})
    losses = [s["loss"] for s in run["steps"]]
    assert losses[-1] < losses[0], losses
    old = AutoModelForImageTextToText.from_pretrained(str(model)).state_dict()
    new = AutoModelForImageTextToText.from_pretrained(str(out)).state_dict()
    assert not any("lora" in k for k in new), "adapters must be merged into the base weights"
    moved = {k for k in old if not torch.equal(old[k], new[k])}
    assert any("language_model" in k and "q_proj" in k for k in moved)  # merged adapters
    assert any("multi_modal_projector" in k for k in moved)  # trained in full, as LLaVA's LoRA recipe does
    assert not any("vision_tower" in k or "embed_tokens" in k for k in moved)  # frozen
