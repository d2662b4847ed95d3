"""Former name of :mod:`dflop_ds.models.hf.llava_data` (the LLaVA family's data pipeline), kept so
that code written against it keeps importing; new code imports ``llava_data``."""

from dflop_ds.models.hf.llava_data import *  # noqa: F403
from dflop_ds.models.hf.llava_data import __all__  # noqa: F401
