"""dflop_ds.profile: model profiler, data profiler and engine profiler (cost models: :mod:`dflop_ds.cost`).

* :func:`profile_model` times forward+backward (attention separately) and memory of an encoder
  and an LLM given as flat lists of pipeline layers; :func:`tiny_target` is the bundled model.
* :class:`ModelProfile` is what :func:`profile_model` measured; :class:`dflop_ds.cost.FittedCostModel`
  fits on it.
* :func:`profile_data` / :class:`DataProfile`: the shape distribution of a dataset.
* :class:`EngineProfile`: the pipeline engine's own costs, fitted from a short run's telemetry
  (:func:`engine_profile_from_run`), which the simulator adds to the cost model.
"""

from dflop_ds.profile.data import DataProfile, profile_data
from dflop_ds.profile.engine import EngineProfile, engine_profile_from_run
from dflop_ds.profile.inputs import ContractEncoderInputs, ContractLLMInputs
from dflop_ds.profile.model import Measurement, ModelProfile, profile_model
from dflop_ds.profile.tiny import ProfileTarget, tiny_target

__all__ = [
    "ContractEncoderInputs",
    "ContractLLMInputs",
    "DataProfile",
    "EngineProfile",
    "Measurement",
    "ModelProfile",
    "ProfileTarget",
    "engine_profile_from_run",
    "profile_data",
    "profile_model",
    "tiny_target",
]
