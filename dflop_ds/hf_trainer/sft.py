"""``DFLOPSFTTrainer``: the mixin over TRL's ``SFTTrainer`` (``pip install 'dflop-ds[trl]'``).

TRL's vision fine-tuning keeps the dataset raw (``messages`` and ``images`` columns) and renders,
tokenizes and processes each microbatch in its collator; the mixin only decides which rows form
each microbatch. Shapes come from :func:`~dflop_ds.hf_trainer.hf_dataset_shapes`.
"""

from __future__ import annotations

try:
    from trl import SFTTrainer
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("DFLOPSFTTrainer needs TRL: pip install 'dflop-ds[trl]'") from error

from dflop_ds.hf_trainer.trainer import DFLOPTrainerMixin


class DFLOPSFTTrainer(DFLOPTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with DFLOP's balanced microbatches: every ``SFTTrainer`` argument, plus
    ``dflop=`` and ``sample_shapes=`` (see :class:`~dflop_ds.hf_trainer.DFLOPTrainerMixin`)."""


__all__ = ["DFLOPSFTTrainer"]
