"""A DataLoader over a dflop-ds batch sampler whose state is what the caller consumed.

A ``DataLoader`` with workers draws index lists from its batch sampler ahead of training
(``prefetch_factor x num_workers`` microbatches). A checkpoint of the sampler taken then would
skip the fetched but untrained microbatches on resume. :func:`make_loader` records, for every
index list handed to the workers, the sampler position that follows it, and moves the sampler
there only when the caller receives the collated microbatch; ``state_dict()`` is therefore
exact after any number of microbatches, also in the middle of a global batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from dflop_ds.schedule.sampler import BatchSchedule, GlobalBatchSampler
from dflop_ds.schedule.state import Position

#: DataLoader arguments that would override or reorder the batch sampler's microbatches.
_REFUSED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")

_Log = collections.deque[tuple[Position, BatchSchedule]]


class _Tap:
    """The batch sampler as the DataLoader sees it: each index list it hands out is logged with
    the position after it, without moving the sampler."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler
        self.log: _Log = collections.deque()

    def __iter__(self):
        return self._run(self.log)

    def _run(self, log: _Log):
        for position, schedule, indices in self.sampler.scheduled_microbatches():
            log.append((position, schedule))
            yield indices

    def __len__(self) -> int:
        return len(self.sampler)


class ResumableLoader:
    """Iterates collated microbatches of the sampler's current epoch, like a ``DataLoader``.

    Attributes:
        dataset: the dataset.
        batch_sampler: the dflop-ds sampler, or a wrapper that delegates to one (the colocated
            encoder's); anything with ``scheduled_microbatches`` (checked). Its position
            (``state_dict``) and ``last_schedule`` follow what the caller has received.
    """

    def __init__(
        self,
        dataset: Any,
        batch_sampler: Any,
        *,
        collate_fn: Callable | None,
        num_workers: int = 0,
        **dataloader_kwargs: Any,
    ) -> None:
        import torch.utils.data

        refused = sorted(set(dataloader_kwargs) & set(_REFUSED))
        if refused:
            raise ValueError(f"make_loader: {refused} would override the batch sampler's microbatches; leave them out")
        if dataloader_kwargs.get("in_order", True) is not True:
            raise ValueError("make_loader: in_order=False would hand out microbatches out of schedule order")
        if not hasattr(batch_sampler, "scheduled_microbatches"):
            raise TypeError(
                f"make_loader needs a dflop-ds batch sampler (DFLOPBatchSampler, StockBatchSampler),"
                f" got {type(batch_sampler).__name__}"
            )
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self._tap = _Tap(batch_sampler)
        self._loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self._tap, collate_fn=collate_fn, num_workers=num_workers, **dataloader_kwargs
        )

    def __iter__(self) -> Iterator[Any]:
        """The rest of the sampler's current epoch, from the last microbatch the caller received."""
        log: _Log = collections.deque()
        self._tap.log = log
        for batch in self._loader:
            position, schedule = log.popleft()
            self.batch_sampler.consumed(position, schedule)
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def state_dict(self) -> dict:
        """The sampler's state after the last microbatch the caller received."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue after the microbatches ``state`` says were consumed (the next ``iter()``)."""
        self.batch_sampler.load_state_dict(state)


def make_loader(
    dataset: Any, batch_sampler: Any, *, collate_fn: Callable | None, num_workers: int = 0, **dataloader_kwargs: Any
) -> ResumableLoader:
    """A ``DataLoader`` over ``batch_sampler`` whose ``state_dict()`` / ``load_state_dict()``
    resume exactly after the microbatches already yielded to the caller, with any number of
    workers. Save ``loader.state_dict()`` with the checkpoint; on resume build the same sampler
    and loader and call ``load_state_dict``. Other keyword arguments go to ``DataLoader``
    (``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ...)."""
    return ResumableLoader(dataset, batch_sampler, collate_fn=collate_fn, num_workers=num_workers, **dataloader_kwargs)
