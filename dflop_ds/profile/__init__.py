"""dflop_ds.profile: model profiler, data profiler and engine profiler (cost models: :mod:`dflop_ds.cost`).

* :func:`profile_model` times forward+backward (attention separately) and memory of an encoder
  and an LLM given as flat lists of pipeline layers described by a :class:`ProfileTarget`
  (the bundled model's: :func:`dflop_ds.models.tiny_profile.tiny_target`).
* :class:`ModelProfile` is what :func:`profile_model` measured; :class:`dflop_ds.cost.FittedCostModel`
  fits on it.
* :func:`profile_data` / :class:`DataProfile`: the shape distribution of a dataset.

The engine's own costs (:class:`dflop_ds.plan.EngineProfile`) calibrate the simulator, so they
live in :mod:`dflop_ds.plan`, above this package.
"""

from dflop_ds.profile.data import DataProfile, profile_data
from dflop_ds.profile.inputs import ContractEncoderInputs, ContractLLMInputs
from dflop_ds.profile.model import Measurement, ModelProfile, profile_model
from dflop_ds.profile.target import ProfileTarget

__all__ = [
    "ContractEncoderInputs",
    "ContractLLMInputs",
    "DataProfile",
    "Measurement",
    "ModelProfile",
    "ProfileTarget",
    "profile_data",
    "profile_model",
]
