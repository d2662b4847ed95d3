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
import sys
from collections.abc import Callable, Sequence

from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult, register_splitter
from dflop_ds.schedule.splitters.packs import Pack, check_fits, default_capacity, packed_result


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Positions by decreasing length, equal lengths in position order."""
    return sorted(range(len(lengths)), key=lambda p: -int(lengths[p]))


#: picks, from the rows' ``(load, row)`` ascending and the room an item needs, the entry it goes
#: into (-1: none fits)
RowPick = Callable[[list[tuple[int, int]], int], int]


def emptiest(loads: list[tuple[int, int]], room: int) -> int:
    """``binpacking`` 2.0: the emptiest row (the first among equals) when it fits; if it does not, none does."""
    return 0 if loads and loads[0][0] <= room else -1


def fullest(loads: list[tuple[int, int]], room: int) -> int:
    """``binpacking`` 1.x (best fit): the fullest row that fits, the first among equals."""
    fit = bisect.bisect_right(loads, (room, sys.maxsize))
    return bisect.bisect_left(loads, (loads[fit - 1][0], -1)) if fit else -1


def decreasing_fit(lengths: Sequence[int], capacity: int, pick: RowPick) -> list[Pack]:
    """``to_constant_volume``: positions per row, in the order they went in; every length, longest
    first, into the row ``pick`` chooses, else into a new row."""
    rows: list[Pack] = []
    loads: list[tuple[int, int]] = []  # (load, row) of every row, ascending
    for position in longest_first(lengths):
        length = int(lengths[position])
        slot = pick(loads, capacity - length)
        if slot >= 0:
            load, target = loads.pop(slot)
        else:
            load, target = 0, len(rows)
            rows.append([])
        rows[target].append(position)
        bisect.insort(loads, (load + length, target))
    return rows


#: ``to_constant_volume``'s rule by ``binpacking`` release
FIT_RULES: dict[str, RowPick] = {"least_loaded": emptiest, "fullest": fullest}


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
        self.pick = FIT_RULES[fit]

    def split(self, request: SplitRequest) -> SplitResult:
        """Pack the batch, deal the rows (:func:`~.packs.packed_result`), cost them packed."""
        shapes = request.row_shapes(self.name)
        lengths = [s.llm_tokens for s in shapes]
        capacity = self.max_length or default_capacity(lengths)
        check_fits(shapes, lengths, capacity, "ms-swift")
        rows = decreasing_fit(lengths, capacity, self.pick)
        return packed_result(request, rows, lengths, padded_to=None, solver=self.name)
