"""Former name of :mod:`dflop_ds.models.hf.llava_synthetic` (LLaVA's synthetic contract
microbatches), kept so that code written against it keeps importing; new code imports ``llava_synthetic``."""

from dflop_ds.models.hf.llava_synthetic import *  # noqa: F403
from dflop_ds.models.hf.llava_synthetic import __all__  # noqa: F401
