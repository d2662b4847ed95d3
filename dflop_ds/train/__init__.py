"""dflop_ds.train: the one training loop, over DeepSpeed's pipeline engine or its plain (ZeRO) engine.

:func:`main` is what ``examples/train.py`` runs (:func:`run_training`, then the rank's end);
:class:`TrainingEngine` and :func:`build_engine` are the pieces a script of one's own can use (one
step on either engine kind: :meth:`TrainingEngine.train_step`). The names are imported lazily,
so that the light modules of this package (its options, the launch inputs) load without DeepSpeed.
"""

from importlib import import_module
from typing import Any

#: public name -> the module that defines it
_HOMES = {
    "ModelSource": "dflop_ds.models.source",
    "tiny_source": "dflop_ds.models.source",
    "TrainingEngine": "dflop_ds.train.engine",
    "build_engine": "dflop_ds.train.engine",
    "data_parallel_coords": "dflop_ds.train.engine",
    "main": "dflop_ds.train.loop",
    "run_training": "dflop_ds.train.loop",
    "SequentialMLLM": "dflop_ds.train.sequential",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'dflop_ds.train' has no attribute {name!r}")
