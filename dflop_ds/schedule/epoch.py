"""How the sample stream is cut into global batches of exactly ``global_batch_size`` samples.

The samples of epoch ``e`` are a seeded permutation, a pure function of ``(seed, e)``. Every
global batch holds exactly ``global_batch_size`` samples, DeepSpeed's ``train_batch_size``:

- carry (the default): the epochs' permutations form one stream, cut into consecutive
  batches. The samples that do not fill the last batch of an epoch are carried into the next
  epoch's first batch, which tops them up from the next permutation. Over the run every epoch's
  samples are trained exactly once; the first ``k * n`` samples trained are every sample ``k``
  times. The next permutation is reordered so that its top-up never repeats a carried sample
  (no sample twice in one global batch).
- drop_last: each epoch keeps its first ``n // global_batch_size`` full batches and drops the
  ``n % global_batch_size`` samples left over (counted by :func:`dropped_per_epoch`).

Epoch ``e`` owns the global batches ``[first_batch(e), first_batch(e + 1))`` (with carry, the
batch that straddles two permutations belongs to the later epoch, as the carried samples do).
Everything is computed from ``(seed, epoch, batch)`` alone, so every rank agrees without talking.
"""

from __future__ import annotations

import numpy as np


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The raw sample order of ``epoch``: a permutation of ``range(n_samples)``, a pure function
    of ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def check_batch_sizes(n_samples: int, global_batch_size: int, min_batch_size: int) -> None:
    """Raise ``ValueError`` unless a global batch fills every microbatch (``min_batch_size``:
    gradient_accumulation_steps x data-parallel size) and the data fills one global batch."""
    if global_batch_size < min_batch_size:
        raise ValueError(
            f"global batch size {global_batch_size} is smaller than the {min_batch_size} microbatches "
            "of a step (gradient_accumulation_steps x data-parallel size): some would be empty"
        )
    if n_samples < global_batch_size:
        raise ValueError(f"dataset has {n_samples} samples, fewer than one global batch ({global_batch_size})")


def carried_into(epoch: int, n_samples: int, global_batch_size: int) -> int:
    """Samples of epoch ``epoch - 1`` carried into ``epoch``'s first batch (0 for epoch 0)."""
    return (epoch * n_samples) % global_batch_size if epoch > 0 else 0


def dropped_per_epoch(n_samples: int, global_batch_size: int, drop_last: bool) -> int:
    """Samples each epoch leaves untrained: ``n % global_batch_size`` with ``drop_last``, else 0."""
    return n_samples % global_batch_size if drop_last else 0


def first_batch(epoch: int, n_samples: int, global_batch_size: int, drop_last: bool = False) -> int:
    """Index, counted over the whole run, of the first global batch of ``epoch``."""
    if drop_last:
        return epoch * (n_samples // global_batch_size)
    return (epoch * n_samples) // global_batch_size


def _avoiding(order: np.ndarray, carried: np.ndarray, head: int) -> np.ndarray:
    """``order`` with its first ``head`` entries drawn from samples not in ``carried`` (stable:
    the carried ones move just behind the head). Touches only the first ``head + len(carried)``
    positions."""
    taken = ~np.isin(order, carried)
    head_positions = np.flatnonzero(taken)[:head]
    rest = np.ones(len(order), dtype=bool)
    rest[head_positions] = False
    return np.concatenate([order[head_positions], order[rest]])


def epoch_order(n_samples: int, seed: int, epoch: int, global_batch_size: int) -> np.ndarray:
    """The sample order of ``epoch`` under carry: its permutation, with the top-up of the
    carried batch free of carried samples. Reordering touches only the first
    ``global_batch_size`` positions, so an epoch needs its predecessor's full order only when
    its carried tail lies there (datasets under two global batches)."""
    start = epoch
    while start > 0 and n_samples - carried_into(start, n_samples, global_batch_size) < global_batch_size:
        start -= 1
    previous = epoch_permutation(n_samples, seed, start - 1) if start > 0 else None
    for e in range(start, epoch + 1):
        order = epoch_permutation(n_samples, seed, e)
        carried = carried_into(e, n_samples, global_batch_size)
        if carried and previous is not None:
            order = _avoiding(order, previous[n_samples - carried :], global_batch_size - carried)
        previous = order
    return order


def epoch_batches(
    n_samples: int, seed: int, epoch: int, global_batch_size: int, drop_last: bool = False
) -> list[np.ndarray]:
    """The global batches (arrays of sample indices, each exactly ``global_batch_size`` long)
    of ``epoch``; see the module docstring for what happens to the remainder."""
    size = global_batch_size
    if drop_last:
        order = epoch_permutation(n_samples, seed, epoch)
        return [order[b * size : (b + 1) * size] for b in range(n_samples // size)]
    begin, end = (first_batch(e, n_samples, size) for e in (epoch, epoch + 1))
    offset = begin * size - epoch * n_samples  # -carried: the batch starts in the previous epoch's tail
    pieces = [epoch_order(n_samples, seed, epoch, size)]
    if offset < 0:
        pieces.insert(0, epoch_order(n_samples, seed, epoch - 1, size))
        offset += n_samples
    stream = np.concatenate(pieces)
    return [stream[offset + b * size : offset + (b + 1) * size] for b in range(end - begin)]


def global_batches(order: np.ndarray, global_batch_size: int, min_batch_size: int) -> list[np.ndarray]:
    """Cut one ``order`` into its full global batches of exactly ``global_batch_size``
    samples; the ``len(order) % global_batch_size`` left over are not returned (a single-epoch
    view, e.g. for benchmarks; training uses :func:`epoch_batches`, which carries them)."""
    check_batch_sizes(len(order), global_batch_size, min_batch_size)
    return [
        np.asarray(order[b * global_batch_size : (b + 1) * global_batch_size])
        for b in range(len(order) // global_batch_size)
    ]
