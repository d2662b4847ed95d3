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


def _all_to_all(
    features: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Any
) -> torch.Tensor:
    """Rows of ``features`` split by ``send_counts`` go to ranks 0..n-1; the result holds the rows
    received from each rank (``recv_counts``), source rank ascending."""
    received = features.new_empty((int(sum(recv_counts)), *features.shape[1:]))
    dist.all_to_all_single(
        received,
        features.contiguous(),
        output_split_sizes=[int(c) for c in recv_counts],
        input_split_sizes=[int(c) for c in send_counts],
        group=group,
    )
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


def exchange_features(
    features: torch.Tensor,
    send_counts: torch.Tensor | Sequence[int],
    recv_counts: torch.Tensor | Sequence[int],
    recv_index: torch.Tensor,
    group: Any | None = None,
) -> torch.Tensor:
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
        raise ValueError(
            f"exchange_features: send_counts sum to {sum(send)} but {features.shape[0]} tiles were encoded"
        )
    if features.requires_grad and torch.is_grad_enabled():
        received = _VariableAllToAll.apply(features, send, recv, group)
    else:
        received = _all_to_all(features.detach(), send, recv, group)
    return received.index_select(0, recv_index.to(device=received.device, dtype=torch.long))


def _block_starts(counts: torch.Tensor) -> torch.Tensor:
    """Start of every block when blocks of ``counts`` sizes are laid out in row-major order."""
    flat = counts.reshape(-1)
    return (torch.cumsum(flat, 0) - flat).reshape(counts.shape)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``arange(start, start + length)`` of every pair, concatenated."""
    pieces = [torch.arange(int(a), int(a) + int(n)) for a, n in zip(starts.tolist(), lengths.tolist())]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class StepExchange:
    """The feature exchange of a whole step's micro-steps in one all-to-all each way.

    Micro-step ``k`` has its own dispatch (``send_counts[k]``, ``recv_counts[k]``,
    ``recv_index[k]`` as for :func:`exchange_features`); the tiles this rank encodes for all of
    them are concatenated micro-step by micro-step (each grouped by owner rank). :meth:`features`
    sends them in one ``all_to_all_single`` (rows reordered owner by owner) and hands back each
    micro-step's own tiles in its own order; :meth:`gradients` sends the gradients of those
    back the same way and returns the gradient of every encoded row. Same results as one
    exchange per micro-step, with two collectives per step instead of two per micro-step.
    Every rank of ``group`` must call both methods (collectives).
    """

    def __init__(
        self,
        send_counts: Sequence[Sequence[int] | torch.Tensor],
        recv_counts: Sequence[Sequence[int] | torch.Tensor],
        recv_index: Sequence[torch.Tensor],
        group: Any | None = None,
    ) -> None:
        send = torch.tensor([_counts(c) for c in send_counts], dtype=torch.long)  # [steps, ranks]
        recv = torch.tensor([_counts(c) for c in recv_counts], dtype=torch.long)
        self.group = group
        self.send_total, self.recv_total = send.sum(0).tolist(), recv.sum(0).tolist()
        # encoded rows are laid out (micro-step, owner); the send buffer (owner, micro-step)
        encoded_start = _block_starts(send)
        self.send_order = _ranges(encoded_start.t().reshape(-1), send.t().reshape(-1))
        # the received buffer is laid out (source, micro-step); a micro-step's own buffer (source)
        received_start = _block_starts(recv.t()).t()
        self.own_index = []
        for k, index in enumerate(recv_index):
            local_to_received = _ranges(received_start[k], recv[k])
            self.own_index.append(local_to_received.to(index.device)[index.long()])

    def features(self, encoded: torch.Tensor) -> list[torch.Tensor]:
        """Each micro-step's own tiles' features (no autograd: the caller keeps ``encoded``'s graph)."""
        order = self.send_order.to(encoded.device)
        received = _all_to_all(encoded.detach().index_select(0, order), self.send_total, self.recv_total, self.group)
        return [received.index_select(0, index.to(received.device)) for index in self.own_index]

    def gradients(self, grads: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The gradient of every row of ``like`` (the encoded tiles) from ``grads[k]``, the
        gradient of micro-step ``k``'s own tiles in its own order."""
        index = torch.cat(self.own_index).to(like.device) if self.own_index else torch.zeros(0, dtype=torch.long)
        flat = torch.cat([g.reshape(-1, *like.shape[1:]) for g in grads]) if grads else like.new_zeros((0,))
        received = like.new_zeros((int(sum(self.recv_total)), *like.shape[1:])).index_add_(0, index, flat.to(like))
        back = _all_to_all(received, self.recv_total, self.send_total, self.group)
        return torch.zeros_like(like).index_copy_(0, self.send_order.to(like.device), back)
