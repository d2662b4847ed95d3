"""ms-swift's sequence packing (``--packing true``, its default ``binpack`` strategy) as a splitter.

Written from ms-swift's ``swift/dataset/packing.py`` (modelscope/ms-swift, 2026) and the
``binpacking`` package's ``to_constant_volume`` it calls (unpinned, so a fresh install takes the
latest release): every encoded sample's length (its template expands images and videos into their
tokens: :attr:`SampleShape.llm_tokens`) is packed into rows of at most ``max_length``
(``packing_length``) tokens, the lengths taken longest first, each into a row chosen by the
release's rule, else into a new row:

- ``binpacking`` 2.0 (``fit="least_loaded"``, the default): the emptiest row it fits (the
  first among equals);
- ``binpacking`` 1.x (``fit="fullest"``, best fit): the fullest row it still fits (the first
  among equals).

Equal lengths go in position order (2.0's stable sort; 1.x sorts with numpy's unstable
``argsort``, whose order of equal lengths depends on the numpy build and the CPU).

Packed rows are padding-free (``padding_free``: the rows are concatenated with each sample's own
positions, attention kept inside each sample), so a row costs the sum of its samples. The rows
become microbatches as the HF Trainer deals them (:mod:`.packs`). ms-swift drops or refuses a
sample longer than ``max_length``; here every sample must train, so a ``max_length`` too short
for one is refused naming it; by default it is the smallest power of two that holds the batch's
longest sample.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult, register_splitter
from dflop_ds.schedule.splitters.packs import (
    Pack,
    check_fits,
    deal_packs,
    default_capacity,
    flatten,
    packed_costs,
)


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Positions by decreasing length, equal lengths in position order."""
    return sorted(range(len(lengths)), key=lambda p: -int(lengths[p]))


def least_loaded_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[Pack]:
    """``to_constant_volume`` of ``binpacking`` 2.0: positions per row, in the order they went in.
    The emptiest row is the only candidate (if it is too full, every row is)."""
    rows: list[Pack] = []
    loads: list[tuple[int, int]] = []  # heap of (load, row)
    for position in longest_first(lengths):
        length = int(lengths[position])
        if loads and loads[0][0] + length <= capacity:
            load, target = heapq.heappop(loads)
        else:
            load, target = 0, len(rows)
            rows.append([])
        rows[target].append(position)
        heapq.heappush(loads, (load + length, target))
    return rows


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[Pack]:
    """``to_constant_volume`` of ``binpacking`` 1.x: positions per row, in the order they went in."""
    rows: list[Pack] = []
    loads: list[tuple[int, int]] = []  # (load, row) of every row, ascending
    for position in longest_first(lengths):
        length = int(lengths[position])
        fit = bisect.bisect_right(loads, (capacity - length, len(rows)))
        if fit > 0:
            load = loads[fit - 1][0]
            _, target = loads.pop(bisect.bisect_left(loads, (load, -1)))  # the first row of that load
        else:
            load, target = 0, len(rows)
            rows.append([])
        rows[target].append(position)
        bisect.insort(loads, (load + length, target))
    return rows


#: ``to_constant_volume``'s rule by ``binpacking`` release
FIT_RULES = {"least_loaded": least_loaded_fit_decreasing, "fullest": best_fit_decreasing}


@register_splitter("swift_packing")
class SwiftPackingSplitter:
    """ms-swift ``packing``: rows of at most ``max_length`` tokens by ``to_constant_volume``
    (``fit``: its release's rule), padding-free, dealt to ranks in the sampler's random order
    (``max_length`` None: see the module docstring)."""

    name = "swift_packing"

    def __init__(self, max_length: int | None = None, fit: str = "least_loaded") -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"{self.name}: max_length must be >= 1, got {max_length}")
        if fit not in FIT_RULES:
            raise ValueError(f"{self.name}: fit must be one of {sorted(FIT_RULES)}, got {fit!r}")
        self.max_length = max_length
        self.pack = FIT_RULES[fit]

    def split(self, request: SplitRequest) -> SplitResult:
        """Pack the batch, deal the rows (:func:`~.packs.deal_packs`), cost them packed."""
        shapes = request.row_shapes(self.name)
        lengths = [s.llm_tokens for s in shapes]
        capacity = self.max_length or default_capacity(lengths)
        check_fits(shapes, lengths, capacity, "ms-swift")
        dealt = deal_packs(self.pack(lengths, capacity), request.dp, request.n_mb, request.seed)
        predicted = packed_costs(request.costs, dealt, lengths, padded_to=None)
        return request.result(flatten(dealt), self.name, predicted=predicted)
