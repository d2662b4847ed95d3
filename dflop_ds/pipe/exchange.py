"""Encoder feature exchange: a differentiable variable-size all-to-all.

Each rank encodes the tiles an :class:`~dflop_ds.schedule.dispatch.EncoderDispatch` gives it;
:func:`exchange_features` sends every encoded tile to the rank that trains its sample and puts
the received tiles in that rank's own tile order. Its backward sends the gradients of the
features back the same way, so the encoder that produced a tile receives that tile's gradient.

The collective is ``torch.distributed.all_to_all_single`` with per-rank split sizes, which both
NCCL and gloo implement (measured here with gloo on CPU, torch 2.13: variable splits and
zero-size splits work; the list form ``all_to_all`` refuses unequal sizes under gloo). Tensors
stay on the device they come on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def _all_to_all(features: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                group: Any) -> torch.Tensor:
    """Rows of ``features`` split by ``send_counts`` go to ranks 0..n-1; the result holds the rows
    received from each rank (``recv_counts``), source rank ascending."""
    received = features.new_empty((int(sum(recv_counts)), *features.shape[1:]))
    dist.all_to_all_single(received, features.contiguous(), output_split_sizes=[int(c) for c in recv_counts],
                           input_split_sizes=[int(c) for c in send_counts], group=group)
    return received


class _VariableAllToAll(torch.autograd.Function):
    """All-to-all of rows whose backward is the reverse all-to-all of the gradients."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Any):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _all_to_all(features, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_counts, recv_counts = ctx.counts
        return _all_to_all(grad, recv_counts, send_counts, ctx.group), None, None, None


def _counts(counts: torch.Tensor | Sequence[int]) -> list[int]:
    """Split sizes as python ints (from a tensor or a sequence)."""
    return [int(c) for c in (counts.tolist() if torch.is_tensor(counts) else counts)]


def exchange_features(features: torch.Tensor, send_counts: torch.Tensor | Sequence[int],
                      recv_counts: torch.Tensor | Sequence[int], recv_index: torch.Tensor,
                      group: Any | None = None) -> torch.Tensor:
    """Send encoded tiles to their owners; this rank's own tiles in its own order.

    Args:
        features: ``[T_encoded, ...]`` the tiles this rank encoded, grouped by owner rank.
        send_counts: tiles for each rank (sums to ``T_encoded``).
        recv_counts: tiles each rank encoded for this one.
        recv_index: ``[T_own]`` position in the received buffer of each of this rank's tiles.
        group: the process group the dispatch spans (default: the world).

    Every rank of ``group`` must call it (a collective), in forward and, when ``features``
    requires grad, in backward. Without grad (a frozen encoder) no graph is kept.
    """
    send, recv = _counts(send_counts), _counts(recv_counts)
    if sum(send) != features.shape[0]:
        raise ValueError(f"exchange_features: send_counts sum to {sum(send)} but {features.shape[0]} tiles "
                         "were encoded")
    if features.requires_grad and torch.is_grad_enabled():
        received = _VariableAllToAll.apply(features, send, recv, group)
    else:
        received = _all_to_all(features.detach(), send, recv, group)
    return received.index_select(0, recv_index.to(device=received.device, dtype=torch.long))


def return_feature_gradients(grad: torch.Tensor, send_counts: torch.Tensor | Sequence[int],
                             recv_counts: torch.Tensor | Sequence[int], recv_index: torch.Tensor,
                             group: Any | None = None) -> torch.Tensor:
    """The backward of :func:`exchange_features` run by hand: ``grad [T_own, ...]`` (the
    gradient of this rank's own tiles, in its own order) goes back to the ranks that encoded
    them; the result is the gradient of the tiles this rank encoded (``[T_encoded, ...]``, in
    their send order). For a pipeline, whose engine computes the features' gradients outside
    any autograd graph this process holds. A collective: every rank of ``group`` calls it."""
    send, recv = _counts(send_counts), _counts(recv_counts)
    index = recv_index.to(device=grad.device, dtype=torch.long)
    received = grad.new_zeros((int(sum(recv)), *grad.shape[1:])).index_add_(0, index, grad)
    return _all_to_all(received, recv, send, group)
