"""The transformers versions the Trainer integration supports, and the adapters by version range.

The mixin overrides ``Trainer._get_train_sampler`` and ``get_train_dataloader`` and calls the
Trainer's column-removal helpers; those are internals that change between releases, so a version
outside :data:`SUPPORTED` is refused before training rather than risking a silent change of the
data order. Each range is the one a training framework installs: 5.6 (LLaMA-Factory 0.9.5),
5.19 (ms-swift 4.6) and 5.24. Read in their sources, the hooks the mixin uses
(``_remove_unused_columns``, ``_get_collator_with_removed_columns``, ``get_tp_size``,
``get_batch_samples``, ``compute_loss``, ``log``) are the same in all three; one detail differs:

* **resumed epoch** (below 5.19): on resume the Trainer rebuilds the loader through accelerate's
  ``skip_first_batches`` (a plain ``DataLoader`` over a ``SkipBatchSampler``) and then calls
  ``set_epoch`` only on a loader that has it, so the rebuilt loader's batch sampler keeps epoch 0
  and a run resumed in epoch ``e > 0`` would replay epoch 0's order (samples twice or never).
  5.19 also passes ``set_epoch`` to the wrapped batch sampler. :class:`ResumedEpochCallback` sets
  the epoch from the Trainer's state at every epoch's start, which the loop runs before the skip.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version
from transformers import TrainerCallback

#: the supported ranges ``[low, high)``: each tested minor release up to the next one
SUPPORTED = ((Version("5.6"), Version("5.7")), (Version("5.19"), Version("5.20")), (Version("5.24"), Version("5.25")))
#: from this release on the Trainer passes ``set_epoch`` to the batch sampler of a resumed epoch's loader
EPOCH_REACHES_WRAPPED_SAMPLER = Version("5.19")


def supported_ranges() -> str:
    """The supported ranges as pip writes them, for messages."""
    return " or ".join(f"'transformers>={low},<{high}'" for low, high in SUPPORTED)


def check_transformers_version(installed: str | None = None) -> str:
    """The installed transformers version; ``RuntimeError`` naming it and the supported ranges when
    it is missing or outside :data:`SUPPORTED`."""
    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError:
            raise RuntimeError(f"DFLOPTrainer needs transformers: pip install {supported_ranges()}") from None
    if not any(low <= Version(installed) < high for low, high in SUPPORTED):
        raise RuntimeError(
            f"DFLOPTrainer supports transformers {supported_ranges()} (its sampler and data loader hooks were"
            f" tested there); transformers {installed} is installed: install one of those"
        )
    return installed


class ResumedEpochCallback(TrainerCallback):
    """Sets the DFLOP batch sampler's epoch at the start of every Trainer epoch, from the Trainer's
    progress (``state.epoch``: whole epochs done plus the fraction of the current one), for
    transformers releases whose resumed epoch never reaches the sampler's ``set_epoch``."""

    def __init__(self, batch_sampler: Callable[[], Any]) -> None:
        self.batch_sampler = batch_sampler

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Point the sampler at the epoch the Trainer starts (or resumes)."""
        sampler = self.batch_sampler()
        if sampler is not None:
            sampler.set_epoch(math.floor(state.epoch or 0))


def epoch_adapters(batch_sampler: Callable[[], Any], installed: str | None = None) -> list[TrainerCallback]:
    """The callbacks the installed transformers release needs so that the sampler returned by
    ``batch_sampler()`` (None before the loader exists) follows the Trainer's epochs."""
    release = Version(installed or version("transformers"))
    return [] if release >= EPOCH_REACHES_WRAPPED_SAMPLER else [ResumedEpochCallback(batch_sampler)]


__all__ = [
    "EPOCH_REACHES_WRAPPED_SAMPLER",
    "SUPPORTED",
    "ResumedEpochCallback",
    "check_transformers_version",
    "epoch_adapters",
    "supported_ranges",
]
