"""dflop_ds.train: the one training loop, over DeepSpeed's pipeline engine or its plain (ZeRO) engine.

:func:`main` is what ``examples/train.py`` runs; :class:`TrainingEngine` and :func:`build_engine`
are the pieces a script of one's own can use (one step on either engine kind:
:meth:`TrainingEngine.train_step`).
"""

from dflop_ds.models.source import ModelSource, tiny_source
from dflop_ds.train.engine import TrainingEngine, build_engine, data_parallel_coords
from dflop_ds.train.loop import main
from dflop_ds.train.sequential import SequentialMLLM

__all__ = [
    "ModelSource",
    "SequentialMLLM",
    "TrainingEngine",
    "build_engine",
    "data_parallel_coords",
    "main",
    "tiny_source",
]
