"""Encoder feature exchange: a differentiable variable-size all-to-all.

Each rank encodes the tiles an :class:`~dflop_ds.schedule.dispatch.EncoderDispatch` gives it;
:func:`exchange_features` sends every encoded tile to the rank that trains its sample and puts
the received tiles in that rank's own tile order. Its backward sends the gradients of the
features back the same way, so the encoder that produced a tile receives that tile's gradient.

The collective is ``torch.distributed.all_to_all_single`` with per-rank split sizes, which both
NCCL and gloo implement (measured here with gloo on CPU, torch 2.13: variable splits and
zero-size splits work; the list form ``all_to_all`` refuses unequal sizes under gloo). Tensors
stay on the device they come on.

Under tensor parallelism (AutoTP) several ranks train the same samples: every rank of a
tensor-parallel group needs the features of the group's samples. The dispatch then names one
rank of the group as the samples' owner, and ``owner_of`` tells the exchange whose tiles each
rank receives: a tile is sent to every rank whose owner is its owner (a fan-out), and its
gradient is the mean of the copies' gradients, since every receiver computes the same function
of it (the replicated projector and the same loss), not their sum.
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


class _FanOut(torch.autograd.Function):
    """Rows of ``features`` picked by ``index`` (a row may be picked several times); the backward
    gives each row the mean of its copies' gradients."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, index: torch.Tensor):
        ctx.save_for_backward(index)
        ctx.rows = features.shape[0]
        return features.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        total = grad.new_zeros((ctx.rows, *grad.shape[1:])).index_add_(0, index, grad)
        copies = torch.bincount(index, minlength=ctx.rows).clamp(min=1).to(grad.dtype)
        return total / copies.reshape(-1, *([1] * (grad.dim() - 1))), None


def fan_out(features: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``features[rows]`` (a row may be picked several times); with autograd each row's gradient
    is the mean of its copies' gradients. Without grad no graph is kept."""
    if features.requires_grad and torch.is_grad_enabled():
        return _FanOut.apply(features, rows)
    return features.detach().index_select(0, rows)


def fan_out_routing(send_counts: Sequence[int], owner_of: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(rows, split sizes)`` of the all-to-all's input when rank ``j`` receives the tiles encoded
    for rank ``owner_of[j]``: the encoded rows are grouped by owner (``send_counts[o]`` rows for
    owner ``o``, owners ascending), and each owner's block is repeated for each of its receivers."""
    starts = [sum(send_counts[:o]) for o in range(len(send_counts))]
    rows = [row for owner in owner_of for row in range(starts[owner], starts[owner] + int(send_counts[owner]))]
    return rows, [int(send_counts[owner]) for owner in owner_of]


def exchange_features(
    features: torch.Tensor,
    send_counts: torch.Tensor | Sequence[int],
    recv_counts: torch.Tensor | Sequence[int],
    recv_index: torch.Tensor,
    group: Any | None = None,
    owner_of: Sequence[int] | None = None,
) -> torch.Tensor:
    """Send encoded tiles to their owners; this rank's own tiles in its own order.

    Args:
        features: ``[T_encoded, ...]`` the tiles this rank encoded, grouped by owner rank.
        send_counts: tiles for each owner rank (sums to ``T_encoded``).
        recv_counts: tiles each rank encoded for this rank's owner.
        recv_index: ``[T_own]`` position in the received buffer of each of this rank's tiles.
        group: the process group the dispatch spans (default: the world).
        owner_of: ``owner_of[j]`` the rank whose tiles rank ``j`` receives (its tensor-parallel
            group's owner, see the module docstring); None: every rank its own.

    Every rank of ``group`` must call it (a collective), in forward and, when ``features``
    requires grad, in backward. Without grad (a frozen encoder) no graph is kept.
    """
    send, recv = _counts(send_counts), _counts(recv_counts)
    if sum(send) != features.shape[0]:
        raise ValueError(
            f"exchange_features: send_counts sum to {sum(send)} but {features.shape[0]} tiles were encoded"
        )
    if owner_of is not None and list(owner_of) != list(range(len(send))):
        rows, send = fan_out_routing(send, owner_of)
        index = torch.tensor(rows, dtype=torch.long, device=features.device)
        features = fan_out(features, index)
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
