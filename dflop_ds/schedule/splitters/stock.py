"""Stock DeepSpeed's split: contiguous slices of the (shuffled) batch, equal sample counts."""

from __future__ import annotations

from dflop_ds.schedule.splitters.base import RankSplit, SplitRequest, SplitResult, register_splitter
from dflop_ds.shapes import split_evenly


def stock_positions(n_items: int, n_mb: int, dp: int) -> RankSplit:
    """Each rank takes a contiguous slice of the batch's positions and cuts it into ``n_mb``
    consecutive microbatches of equal sample count (sizes differ by at most one when the count
    does not divide; the larger ones first)."""
    split: RankSplit = []
    start = 0
    for rank_size in split_evenly(n_items, dp):
        rank = []
        for size in split_evenly(rank_size, n_mb):
            rank.append(list(range(start, start + size)))
            start += size
        split.append(rank)
    return split


@register_splitter("stock")
class StockSplitter:
    """What stock DeepSpeed and the HF Trainer do: fixed sample counts in the loader's order."""

    name = "stock"

    def split(self, request: SplitRequest) -> SplitResult:
        """See :func:`stock_positions`."""
        return request.result(stock_positions(len(request.batch), request.n_mb, request.dp), self.name)
