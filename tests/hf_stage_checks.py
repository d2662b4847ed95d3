"""Shared assertion of the HF adapter tests: layer lists split into 1-3 stages give HF's logits and loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
