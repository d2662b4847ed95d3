"""Exchange samples between the global batches of an epoch until every batch fits the memory cap.

With a fixed number of microbatches per step, a global batch whose samples need more memory
than its microbatches can hold under the cap cannot be split, even when every sample fits alone.
Instead of failing when training reaches it, the epoch is fixed before training: a batch that
does not fit gives its largest samples (by predicted bytes) to the next batches that still fit
after taking them, in return for their smallest. Batch sizes stay exact and the epoch holds the
same samples, each once, so nothing is lost or trained twice; the result is a pure function of
the epoch's batches, so every rank and every resume computes the same one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflop_ds.schedule.lpt import InfeasibleError

#: Exchanges tried (each checking that the partner still fits) before a batch is given up on.
TRIALS = 32


class MemoryCapError(InfeasibleError):
    """A global batch cannot be split under the memory cap, even after exchanging samples."""


def fit_batches(
    batches: list[np.ndarray], memory: np.ndarray, fits: Callable[[np.ndarray], bool], pinned: int = 0
) -> tuple[list[np.ndarray], list[int]]:
    """``batches`` with samples exchanged until ``fits`` holds for each, and the batches that
    still do not fit (empty when all do).

    Args:
        batches: the epoch's global batches (dataset indices); not modified.
        memory: predicted bytes per dataset index: a batch gives away its largest first.
        fits: whether a batch can be split under the cap.
        pinned: the first ``pinned`` samples of batch 0 stay where they are (samples carried
            from the previous epoch, so each epoch's own samples stay within it).
    """
    batches = [np.array(batch, copy=True) for batch in batches]
    fitting = [bool(fits(batch)) for batch in batches]
    for b in range(len(batches)):
        for _ in range(len(batches[b])):  # each exchange lowers the batch's bytes
            if fitting[b] or not _give_away_one(batches, fitting, b, memory, fits, pinned):
                break
            fitting[b] = bool(fits(batches[b]))
    return batches, [b for b, ok in enumerate(fitting) if not ok]


def _give_away_one(
    batches: list[np.ndarray],
    fitting: list[bool],
    b: int,
    memory: np.ndarray,
    fits: Callable[[np.ndarray], bool],
    pinned: int,
) -> bool:
    """Exchange one of batch ``b``'s largest samples for the smallest sample of a batch that still
    fits afterwards (the batches holding the fewest bytes are asked first); False when none of
    :data:`TRIALS` exchanges tried is accepted."""
    batch = batches[b]
    first = pinned if b == 0 else 0
    partners = sorted(
        (c for c in range(len(batches)) if c != b and fitting[c]), key=lambda c: (memory[batches[c]].sum(), c)
    )
    trials = 0
    for p in first + np.argsort(-memory[batch[first:]], kind="stable"):
        given = batch[p]
        for c in partners:
            other = batches[c]
            if np.any(other == given):
                continue  # a sample carried into batch 0 may appear again later in the epoch
            allowed = (memory[other] < memory[given]) & ~np.isin(other, batch)
            allowed[: pinned if c == 0 else 0] = False
            if not allowed.any():
                continue
            q = int(np.argmin(np.where(allowed, memory[other], np.inf)))
            batch[p], other[q] = other[q], given
            if fits(other):
                return True
            batch[p], other[q] = given, batch[p]
            trials += 1
            if trials == TRIALS:
                return False
    return False
