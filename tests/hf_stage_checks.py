"""Shared assertion of the HF adapter tests: layer lists split into 1-3 stages give HF's logits and loss."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from ds_runs import hf_data_args

from dflop_ds.models.hf.check import run_stages
from dflop_ds.pipe import plan_stage_bounds, token_normalized_loss


def assert_stages_match_hf(layers: Sequence[Any], n_encoder: int, inputs: Any, labels: Any, reference: Any) -> None:
    """Run ``layers`` (``n_encoder`` = encoder layers + projector) stage by stage for 1, 2 and 3
    stages on ``inputs``; logits and token-normalized loss must equal the HF ``reference`` output."""
    for stages in (1, 2, 3):
        bounds = plan_stage_bounds(len(layers), n_encoder, stages)
        logits, _ = run_stages(layers, bounds, inputs)
        torch.testing.assert_close(logits, reference.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(token_normalized_loss(logits, labels), reference.loss, rtol=1e-5, atol=1e-6)


def assert_packed_matches_padded(layers: Sequence[Any], n_encoder: int, padded: Any, packed: Any) -> None:
    """The ``packed`` microbatch (one row) gives the ``padded`` one's logits at every real token and
    its loss, split into 1 and 2 stages, and the same parameter gradients."""
    (inputs, labels), (packed_inputs, packed_labels) = padded, packed
    seq_lens = inputs[2]
    real = torch.arange(inputs[1].shape[1])[None, :] < seq_lens[:, None]
    assert packed_inputs[1].shape == (1, int(seq_lens.sum())) and torch.equal(packed_inputs[2], seq_lens)
    for stages in (1, 2):
        bounds = plan_stage_bounds(len(layers), n_encoder, stages)
        logits, _ = run_stages(layers, bounds, inputs)
        packed_logits, _ = run_stages(layers, bounds, packed_inputs)
        torch.testing.assert_close(packed_logits[0], logits[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            token_normalized_loss(packed_logits, packed_labels),
            token_normalized_loss(logits, labels),
            rtol=1e-5,
            atol=1e-6,
        )
    model = torch.nn.Sequential(*layers)
    grads = []
    for microbatch_inputs, microbatch_labels in (padded, packed):
        model.zero_grad()
        token_normalized_loss(model(microbatch_inputs), microbatch_labels).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def assert_qwen2_vl_packs(model: Any, inputs_of: Any, samples: Sequence[Any]) -> None:
    """``samples`` packed through the Qwen2-VL layer lists: every sample's M-RoPE positions are
    HF's ``get_rope_index`` of that sample (restarting at 0), and the packed microbatch gives the
    padded one's logits, loss and gradients (:func:`assert_packed_matches_padded`)."""
    from dflop_ds.models.hf.base.layers import run_layers
    from dflop_ds.models.hf.qwen2_vl.model import qwen2_vl_layers
    from dflop_ds.models.hf.qwen2_vl.synthetic import qwen2_vl_hf_positions

    encoder, projector, llm = qwen2_vl_layers(model)
    padded, packed = inputs_of.microbatch(samples), inputs_of.microbatch(samples, packed=True)
    _, positions, _ = run_layers([*encoder, projector], packed[0])
    hf = qwen2_vl_hf_positions(model, padded[0])
    per_sample = [hf[:, b, :n] for b, n in enumerate(padded[0][2].tolist())]
    assert torch.equal(positions, torch.cat(per_sample, dim=1)[:, None])
    assert_packed_matches_padded([*encoder, projector, *llm], len(encoder) + 1, padded, packed)


def media_run_args(media: Sequence[Any], config: Path, out: Path) -> list[str]:
    """examples/train.py's command line for an HF model with images and videos (``media``: model,
    data, image folder, video folder), the DeepSpeed ``config`` and the trained model saved to ``out``."""
    model, data, images, videos = media
    return [
        "--deepspeed_config",
        str(config),
        *hf_data_args(model, data, images, "--video_folder", videos, "--output_dir", out),
    ]


def assert_trained_with_media(run: dict, model: Path, out: Path, family: str, **summary: Any) -> None:
    """A six-step run of :func:`media_run_args` (its ``--summary``: ``run``) is ``family``'s with
    the ``summary`` fields given, its loss falls, and the model saved to ``out`` loads back with most
    of its tensors changed from ``model``'s."""
    assert run["summary"]["model"].startswith(family), run["summary"]
    assert {key: run["summary"].get(key) for key in summary} == summary, run["summary"]
    losses = [s["loss"] for s in run["steps"]]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    changed, total = changed_tensors(model, out)
    assert changed > total // 2, (changed, total)


def changed_tensors(before: Path, after: Path) -> tuple[int, int]:
    """``(changed, total)`` tensors between two save_pretrained directories (loaded by transformers)."""
    from transformers import AutoModelForImageTextToText

    old = AutoModelForImageTextToText.from_pretrained(str(before)).state_dict()
    new = AutoModelForImageTextToText.from_pretrained(str(after)).state_dict()
    assert old.keys() == new.keys()
    return sum(not torch.equal(old[k], new[k]) for k in old), len(old)
