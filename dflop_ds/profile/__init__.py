"""dflop_ds.profile: model profiler, data profiler and the fitted CostModel.

* :func:`profile_model` times forward+backward (attention separately) and memory of an encoder
  and an LLM given as flat lists of pipeline layers described by a :class:`ProfileTarget`
  (the bundled model's: :func:`dflop_ds.models.tiny_profile.tiny_target`).
* :class:`CostModel` fits monotone, non-negative regressors on a :class:`ModelProfile`.
* :func:`profile_data` / :class:`DataProfile`: the shape distribution of a dataset.
* :class:`ProxyCost`: the no-profiling fallback with the same prediction interface.
* :class:`PackedCost`: any of them for packed microbatches (additive plus one overhead).

The engine's own costs (:class:`dflop_ds.plan.EngineProfile`) calibrate the simulator, so they
live in :mod:`dflop_ds.plan`, above this package.
"""

from dflop_ds.profile.costmodel import CostModel
from dflop_ds.profile.data import DataProfile, profile_data
from dflop_ds.profile.inputs import ContractEncoderInputs, ContractLLMInputs
from dflop_ds.profile.model import Measurement, ModelProfile, profile_model
from dflop_ds.profile.packed import PackedCost
from dflop_ds.profile.proxy import ProxyCost
from dflop_ds.profile.target import ProfileTarget

__all__ = [
    "ContractEncoderInputs",
    "ContractLLMInputs",
    "CostModel",
    "DataProfile",
    "Measurement",
    "ModelProfile",
    "PackedCost",
    "ProfileTarget",
    "ProxyCost",
    "profile_data",
    "profile_model",
]
