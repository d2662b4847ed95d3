"""How an epoch is cut into global batches: a seeded permutation, every sample exactly once."""

from __future__ import annotations

import numpy as np


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of ``epoch``: a permutation of ``range(n_samples)``, a pure function of
    ``(seed, epoch)`` so that every rank computes the same one without communicating."""
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def global_batches(order: np.ndarray, global_batch_size: int, min_batch_size: int) -> list[np.ndarray]:
    """Cut ``order`` into global batches of at least ``global_batch_size`` samples.

    The epoch's remainder is spread over the batches (sizes differ by at most one), so no sample
    is dropped or repeated. Raises ``ValueError`` when the data cannot fill even one batch of
    ``min_batch_size`` samples (one per microbatch of every rank).
    """
    n = len(order)
    if global_batch_size < min_batch_size:
        raise ValueError(
            f"global batch size {global_batch_size} is smaller than the {min_batch_size} microbatches "
            "of a step (gradient_accumulation_steps x data-parallel size): some would be empty"
        )
    if n < min_batch_size:
        raise ValueError(f"dataset has {n} samples, fewer than the {min_batch_size} microbatches of one step")
    n_batches = max(1, n // global_batch_size)
    return [np.asarray(chunk) for chunk in np.array_split(order, n_batches)]
