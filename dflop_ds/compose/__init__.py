"""The composition root below every entry point: a run's inputs resolved once, and the sampler
built for a topology (:mod:`~dflop_ds.compose.trainer`, :mod:`~dflop_ds.compose.launch`,
:mod:`~dflop_ds.compose.sampler`; every name is imported from here).

``DFLOPTrainer`` (:mod:`dflop_ds.hf_trainer.trainer`), the ms-swift plugin and the LLaMA-Factory
launcher (:mod:`dflop_ds.integrations`) all train through a ``transformers.Trainer`` that asks for
one rank's microbatches. Each of them only gathers what its framework knows (the DeepSpeed config,
the model, the dataset's shapes, the batch sizes and ranks) and comes here for the rest:

* :func:`run_settings`: the typed ``"dflop"`` block (of the DeepSpeed config or given) and where the
  data order's seed comes from;
* :func:`resolve_cost_model`: the cost model the block names (None: the unitless proxy), checked
  against the shapes' policy and the model's depth, wrapped for padding-free microbatches (whose
  attention spans the whole row unless :func:`attends_per_sample`);
* :func:`build_trainer_sampler`: after one cross-rank comparison of every input (a rank that would
  cut another split stops all of them, naming the input), this rank's
  :class:`~dflop_ds.hf_trainer.sampler.TrainerBatchSampler` for the :class:`TrainerTopology`.

The DeepSpeed loop (:mod:`dflop_ds.train.loop`) resolves its run here too:

* :func:`launch_settings`: the command line, the DeepSpeed config, its typed ``"dflop"`` block and
  the plan it follows, output paths checked before training;
* :func:`resolve_launch_inputs`: the model source, the shape table and cost model read on rank 0
  and agreed on by every rank (:func:`~dflop_ds.train.launch_inputs.agree_on_inputs`), the
  dataset, the cost model checked against the model;
* :func:`build_engine_sampler`: the memory cap and this rank's sampler for the engine's
  :class:`EngineTopology`.

Both kinds of entry point build their sampler through one function, :func:`schedule_sampler`.
"""

from __future__ import annotations

from dflop_ds.compose.launch import (
    EngineSampler,
    EngineTopology,
    LaunchRunInputs,
    LaunchSettings,
    build_engine_sampler,
    engine_sampler_cost,
    launch_settings,
    model_source,
    print_skip_report,
    resolve_launch_inputs,
    sampler_memory_cap,
)
from dflop_ds.compose.sampler import schedule_sampler
from dflop_ds.compose.trainer import (
    PROXY,
    RunInputs,
    RunSettings,
    TrainerTopology,
    attends_per_sample,
    block_sets_seed,
    build_trainer_sampler,
    dflop_block,
    dflop_settings,
    epochs_to_train,
    memory_cap,
    resolve_cost_model,
    run_settings,
    train_loader,
)

__all__ = [
    "PROXY",
    "EngineSampler",
    "EngineTopology",
    "LaunchRunInputs",
    "LaunchSettings",
    "RunInputs",
    "RunSettings",
    "TrainerTopology",
    "attends_per_sample",
    "block_sets_seed",
    "build_engine_sampler",
    "build_trainer_sampler",
    "dflop_block",
    "dflop_settings",
    "engine_sampler_cost",
    "epochs_to_train",
    "launch_settings",
    "memory_cap",
    "model_source",
    "print_skip_report",
    "resolve_cost_model",
    "resolve_launch_inputs",
    "run_settings",
    "sampler_memory_cap",
    "schedule_sampler",
    "train_loader",
]
