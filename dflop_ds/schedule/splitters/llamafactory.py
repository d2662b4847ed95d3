"""LLaMA-Factory's sequence packing (``packing`` / ``neat_packing``) as a splitter.

Written from LLaMA-Factory's ``data/processor/supervised.py`` (``PackedSupervisedDatasetProcessor``)
and ``processor_utils.py`` (``greedy_knapsack``, ``search_for_fit``) (hiyouga/LLaMA-Factory, 2026):
the processor tokenizes each sample (its multimodal plugin expands every image and video into its
tokens, so the length is :attr:`SampleShape.llm_tokens`), and packs the lengths by a greedy
knapsack: the lengths sorted ascending, each knapsack repeatedly takes the largest remaining length
that still fits (a binary search) until none does, then the next knapsack opens. Packing lowers
the user's ``cutoff_len`` by one for the knapsack and pads every pack to ``cutoff_len`` tokens
(``neat_packing`` masks the padding and keeps attention inside each sample; plain ``packing``
attends across the pack). Samples sharing a length fill the knapsack's slots last-read first.

The packs become microbatches as the HF Trainer deals rows (:mod:`.packs`). A pack's cost is the
sum of its samples' (``neat_packing``: attention per sample), the LLM column grown to the padded
``cutoff_len`` tokens of each row. LLaMA-Factory drops a sample longer than the knapsack; here
every sample must train, so a ``cutoff_len`` too short for one is refused naming it; by default
the cutoff is the smallest power of two that holds the batch's longest sample with LLaMA-Factory's
extra token.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult, register_splitter
from dflop_ds.schedule.splitters.packs import Pack, check_fits, default_capacity, packed_result


def greedy_knapsack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """LLaMA-Factory's knapsacks of ``lengths`` (each at most ``capacity``): lists of lengths,
    each filled by taking the largest remaining length that fits until none does."""
    remaining = sorted(int(x) for x in lengths)
    if remaining and remaining[-1] > capacity:
        raise ValueError(f"a length of {remaining[-1]} exceeds the knapsack capacity {capacity}")
    knapsacks = []
    while remaining:
        room, knapsack = capacity, []
        while (fit := bisect.bisect_right(remaining, room)) > 0:
            length = remaining.pop(fit - 1)
            knapsack.append(length)
            room -= length
        knapsacks.append(knapsack)
    return knapsacks


def knapsack_packs(lengths: Sequence[int], capacity: int) -> list[Pack]:
    """The positions of each pack: every knapsack's lengths taken back to samples, the most
    recently read sample of a length first (LLaMA-Factory's ``length2indexes[length].pop()``)."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for position, length in enumerate(lengths):
        by_length[int(length)].append(position)
    return [[by_length[length].pop() for length in knapsack] for knapsack in greedy_knapsack(lengths, capacity)]


@register_splitter("llamafactory_packing")
class LlamaFactoryPackingSplitter:
    """LLaMA-Factory ``packing``/``neat_packing``: greedy-knapsack packs up to ``cutoff_len - 1``
    tokens, each padded to ``cutoff_len``, dealt to ranks in the sampler's random order
    (``cutoff_len`` None: see the module docstring)."""

    name = "llamafactory_packing"

    def __init__(self, cutoff_len: int | None = None) -> None:
        if cutoff_len is not None and cutoff_len < 2:
            raise ValueError(f"{self.name}: cutoff_len must be >= 2, got {cutoff_len}")
        self.cutoff_len = cutoff_len

    def split(self, request: SplitRequest) -> SplitResult:
        """Pack the batch, deal the packs (:func:`~.packs.packed_result`), cost them padded to the cutoff."""
        shapes = request.row_shapes(self.name)
        lengths = [s.llm_tokens for s in shapes]
        cutoff = self.cutoff_len or default_capacity([max(lengths) + 1])
        check_fits(shapes, lengths, cutoff - 1, "LLaMA-Factory")
        packs = knapsack_packs(lengths, cutoff - 1)
        return packed_result(request, packs, lengths, padded_to=cutoff, solver=self.name)
