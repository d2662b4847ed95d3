"""Encoder dispatch: which data-parallel rank encodes which tiles (or frames) of a micro-step.

The vision encoder is replicated on every rank, and every tile (an image tile or a video frame)
is encoded on its own, so the tiles of one micro-step may be encoded anywhere: the features are
then sent to the rank that trains the sample (:mod:`dflop_ds.pipe.exchange`). The plan is a pure
function of the micro-step's microbatches on all ranks and the per-tile costs, which every rank
knows (the schedule is a pure function of ``(seed, epoch, batch)``), so every rank computes the
same plan without talking.

The plan keeps each rank's own tiles at home up to the balanced load (total / ranks), so only
the excess travels; the excess is dealt largest piece first to the least-loaded rank (LPT),
split at tile boundaries where a whole piece would overfill that rank. No rank ends more than
one tile above the mean unless a single tile is larger than the gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TileRange", "EncoderDispatch", "plan_dispatch"]


@dataclass(frozen=True)
class TileRange:
    """Tiles ``[start, stop)`` of dataset sample ``sample``, trained on rank ``owner``."""

    sample: int
    owner: int
    start: int
    stop: int

    @property
    def tiles(self) -> int:
        """Number of tiles in the range."""
        return self.stop - self.start


@dataclass(frozen=True)
class EncoderDispatch:
    """The encoder work of one micro-step on every rank.

    Attributes:
        microbatches: ``microbatches[r]`` the samples rank ``r`` trains, in its microbatch order.
        work: ``work[r]`` the tile ranges rank ``r`` encodes, in the order its features are sent:
            grouped by owner rank (ascending), then in the owner's tile order.
        loads: predicted encoder cost of each rank under the plan.
    """

    microbatches: tuple[tuple[int, ...], ...]
    work: tuple[tuple[TileRange, ...], ...]
    loads: tuple[float, ...]

    @property
    def ranks(self) -> int:
        """Ranks the plan spans."""
        return len(self.work)

    def send_counts(self, rank: int) -> list[int]:
        """Tiles ``rank`` encodes for each owner rank (the all-to-all's input splits)."""
        counts = [0] * self.ranks
        for piece in self.work[rank]:
            counts[piece.owner] += piece.tiles
        return counts

    def recv_counts(self, rank: int) -> list[int]:
        """Tiles of ``rank``'s samples that each rank encodes (the all-to-all's output splits)."""
        return [self.send_counts(source)[rank] for source in range(self.ranks)]

    def recv_index(self, rank: int, tiles: Sequence[int] | np.ndarray) -> list[int]:
        """For each tile of ``rank``'s microbatch in its own order (samples in microbatch order,
        tiles in sample order), its position in the buffer the all-to-all delivers
        (the sources' pieces concatenated, source rank ascending). ``tiles[i]`` is sample
        ``i``'s tile count (indexed by dataset index)."""
        position: dict[tuple[int, int], int] = {}
        cursor = 0
        for source in range(self.ranks):
            for piece in self.work[source]:
                if piece.owner != rank:
                    continue
                for tile in range(piece.start, piece.stop):
                    position[(piece.sample, tile)] = cursor
                    cursor += 1
        try:
            return [
                position[(sample, tile)] for sample in self.microbatches[rank] for tile in range(int(tiles[sample]))
            ]
        except KeyError as missing:
            raise ValueError(f"encoder dispatch encodes no rank's copy of (sample, tile) {missing.args[0]}") from None


def _tiles_within(room: float, cost: float, available: int) -> int:
    """How many tiles of ``cost`` each fit in ``room`` (at most ``available``; all if free)."""
    if cost <= 0 or room >= available * cost:
        return available
    fits = room / cost  # may overflow to inf for a vanishing (subnormal) cost
    return available if not np.isfinite(fits) else max(0, min(available, int(np.floor(fits + 1e-9))))


def _keep_at_home(
    samples: Sequence[int], owner: int, tiles: np.ndarray, tile_cost: np.ndarray, budget: float
) -> tuple[list[TileRange], list[TileRange]]:
    """Split one rank's samples into tiles it keeps (up to ``budget`` of cost) and tiles it gives
    away; samples with the most tiles are kept first, so few samples are cut."""
    kept: list[TileRange] = []
    spilled: list[TileRange] = []
    room = budget
    for sample in sorted(samples, key=lambda i: (-int(tiles[i]), i)):
        n, cost = int(tiles[sample]), float(tile_cost[sample])
        if n == 0:
            continue
        keep = _tiles_within(room, cost, n)
        if keep:
            kept.append(TileRange(sample, owner, 0, keep))
            room -= keep * cost
        if keep < n:
            spilled.append(TileRange(sample, owner, keep, n))
    return kept, spilled


def _send_order(pieces: list[TileRange], position: dict[int, int]) -> tuple[TileRange, ...]:
    """Pieces grouped by owner, then in the owner's tile order, adjacent ranges merged."""
    ordered = sorted(pieces, key=lambda p: (p.owner, position[p.sample], p.start))
    merged: list[TileRange] = []
    for piece in ordered:
        last = merged[-1] if merged else None
        if last is not None and last.sample == piece.sample and last.stop == piece.start:
            merged[-1] = TileRange(piece.sample, piece.owner, last.start, piece.stop)
        else:
            merged.append(piece)
    return tuple(merged)


def plan_dispatch(
    microbatches: Sequence[Sequence[int]], tiles: Sequence[int] | np.ndarray, tile_cost: Sequence[float] | np.ndarray
) -> EncoderDispatch:
    """Balance the encoder work of one micro-step over the ranks.

    Args:
        microbatches: ``microbatches[r]`` the dataset indices rank ``r`` trains in this micro-step.
        tiles: encoder tiles (or frames) of every dataset sample, indexed by dataset index.
        tile_cost: predicted encoder cost of one tile of every sample (e.g. the cost model's
            encoder prediction / tiles), indexed by dataset index.

    Returns the :class:`EncoderDispatch` every rank computes identically.
    """
    tiles = np.asarray(tiles)
    tile_cost = np.asarray(tile_cost, dtype=float)
    if (tile_cost < 0).any() or not np.isfinite(tile_cost).all():
        raise ValueError("tile_cost must be finite and >= 0")
    ranks = len(microbatches)
    if ranks < 1:
        raise ValueError("plan_dispatch needs the microbatches of at least one rank")
    position: dict[int, int] = {}
    for samples in microbatches:
        for j, sample in enumerate(samples):
            if sample in position:
                raise ValueError(f"sample {sample} appears twice in the micro-step's microbatches")
            position[int(sample)] = j
    total = sum(float(tiles[i]) * float(tile_cost[i]) for samples in microbatches for i in samples)
    target = total / ranks
    work: list[list[TileRange]] = []
    loads = np.zeros(ranks)
    spill: list[TileRange] = []
    for rank, samples in enumerate(microbatches):
        kept, given = _keep_at_home([int(i) for i in samples], rank, tiles, tile_cost, target)
        work.append(kept)
        loads[rank] = sum(p.tiles * tile_cost[p.sample] for p in kept)
        spill.extend(given)
    spill.sort(key=lambda p: (-p.tiles * tile_cost[p.sample], p.owner, position[p.sample]))
    for piece in spill:
        cost, start = float(tile_cost[piece.sample]), piece.start
        while start < piece.stop:
            rank = int(np.argmin(loads))  # the first of equally loaded ranks: deterministic
            take = max(_tiles_within(target - loads[rank], cost, piece.stop - start), 1)
            work[rank].append(TileRange(piece.sample, piece.owner, start, start + take))
            loads[rank] += take * cost
            start += take
    frozen = tuple(tuple(int(i) for i in samples) for samples in microbatches)
    return EncoderDispatch(frozen, tuple(_send_order(w, position) for w in work), tuple(float(x) for x in loads))
