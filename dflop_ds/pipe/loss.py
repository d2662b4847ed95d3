"""The token-normalized loss: a step's gradient is that of the whole global batch's token mean.

Why not a per-microbatch mean? Balanced scheduling makes microbatches of very different sizes;
averaging each one's token losses would give a token of a short microbatch more weight than a
token of a long one, so the gradient would depend on how the batch was cut.

Why divide by ``loss_denominator = label tokens of the global batch / (GAS * dp)``? DeepSpeed's
pipeline engine multiplies every microbatch loss by ``1 / gradient_accumulation_steps`` before
backward and averages gradients over the ``dp`` data-parallel ranks. With this denominator the
two scalings cancel: the summed gradient equals that of ``sum of token losses / global tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies of ``logits [B, S, V]`` against ``targets [B, S]`` (-100 ignored)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not align")
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def token_normalized_loss(logits: torch.Tensor, labels: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum of token cross-entropies / loss_denominator`` for ``labels = (targets, loss_denominator)``.

    Use it as the pipeline's ``loss_fn``; the collate sets ``loss_denominator``
    (see :mod:`dflop_ds.models.tiny_data` and ``docs/architecture.md``).
    """
    if len(labels) != 2:
        raise ValueError(f"token_normalized_loss expects labels=(targets, loss_denominator), got {len(labels)} items")
    targets, denominator = labels
    if float(denominator) <= 0:
        raise ValueError(f"loss_denominator must be > 0, got {float(denominator)}")
    total = token_loss_sum(logits, targets.to(logits.device))
    return total / torch.as_tensor(denominator, dtype=total.dtype, device=total.device)
