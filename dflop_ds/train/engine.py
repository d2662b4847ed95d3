"""One training step on either DeepSpeed engine: the pipeline engine or the plain (ZeRO) engine.

``dflop.plan.pipeline_stages > 1`` builds an :class:`~dflop_ds.pipe.MLLMPipelineModule` and
DeepSpeed's ``PipelineEngine``; ``pipeline_stages == 1`` builds the same layers as one
``nn.Sequential`` under DeepSpeed's plain engine, where the config's ZeRO stage (0-3) applies.
:class:`TrainingEngine` hides the difference from the loop: the data-parallel coordinates the
sampler needs, which ranks read the data iterator, and :meth:`TrainingEngine.train_step`.

Both paths give a step the same mathematics: each microbatch's loss is the token-normalized
loss (sum of token losses / ``loss_denominator``); DeepSpeed scales it by ``1 / GAS`` and
averages gradients over the data-parallel ranks, so a step's gradient is that of the global
batch's token mean, and the reported loss is that token mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.pipe import MLLMPipelineModule, StageBounds, token_normalized_loss
from dflop_ds.precision import check_precisions
from dflop_ds.train.autotp import with_autotp_layout
from dflop_ds.train.colocated import (
    ColocatedMLLM,
    ColocatedPipeline,
    EncoderTopology,
    TensorParallelDispatch,
    encoder_engine_config,
    global_topology,
    pipeline_dispatch_ranks,
)
from dflop_ds.train.device import move_to
from dflop_ds.train.sequential import SequentialMLLM, built_layers

Microbatch = tuple[Any, Any]


def data_parallel_coords(engine: Any) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this process under ``engine`` (pipeline or plain DeepSpeed engine).

    The pipeline engine's grid knows its data-parallel group; the plain engine keeps the group
    DeepSpeed built (which excludes tensor-parallel peers under AutoTP).
    """
    grid = getattr(engine, "grid", None)
    if grid is not None:
        return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
    group = getattr(engine, "data_parallel_group", None)
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def tensor_parallel_coords(engine: Any) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of this process under ``engine``: ``(0, 1)`` without AutoTP."""
    autotp = getattr(engine, "autotp_size", None)
    if autotp is None or autotp() <= 1:
        return 0, 1
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_rank(), groups.get_tensor_model_parallel_world_size()


@dataclass
class TrainingEngine:
    """A DeepSpeed engine with what the training loop needs to know about it.

    Attributes:
        engine: the DeepSpeed engine (``PipelineEngine`` or ``DeepSpeedEngine``).
        module: the model it trains (:class:`MLLMPipelineModule` or :class:`SequentialMLLM`).
        loss_fn: the loss of the plain engine (the pipeline module holds its own).
        colocated_pipeline: the encoder phase of a pipeline whose encoder runs data parallel
            over all ranks (:class:`~dflop_ds.train.colocated.ColocatedPipeline`), else None.
        tensor_parallel_dispatch: who owns and receives each tensor-parallel group's samples
            with a colocated encoder under AutoTP, else None.
    """

    engine: Any
    module: MLLMPipelineModule | SequentialMLLM
    loss_fn: Callable = token_normalized_loss
    colocated_pipeline: Any = None
    tensor_parallel_dispatch: TensorParallelDispatch | None = None

    @property
    def is_pipeline(self) -> bool:
        """True under DeepSpeed's pipeline engine."""
        return isinstance(self.module, MLLMPipelineModule)

    @property
    def dp_coords(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``."""
        return data_parallel_coords(self.engine)

    @property
    def tp_coords(self) -> tuple[int, int]:
        """``(tp_rank, tp_size)``: the ranks of a tensor-parallel group train the same microbatches."""
        return tensor_parallel_coords(self.engine)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks. DeepSpeed's
        ``train_batch_size`` counts every rank (``micro * GAS * world``); under AutoTP the ranks
        of a tensor-parallel group train the same samples, so it is ``tp`` times this."""
        return self.engine.train_batch_size() // self.tp_coords[1]

    @property
    def num_stages(self) -> int:
        """Pipeline stages (1 for the plain engine)."""
        return self.engine.num_stages if self.is_pipeline else 1

    @property
    def reads_data(self) -> bool:
        """Whether this rank draws microbatches (pipeline: first and last stage, every stage with
        the colocated encoder; plain: all)."""
        return (
            not self.is_pipeline
            or self.colocated_pipeline is not None
            or self.engine.is_first_stage()
            or self.engine.is_last_stage()
        )

    def dispatch_ranks(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~dflop_ds.train.colocated.colocate` placing this rank in
        the colocated encoder's dispatch: over every rank of a pipeline (its first stages own
        the samples) or of an AutoTP run (each tensor-parallel group's first rank owns them);
        over the data-parallel ranks otherwise (empty)."""
        if self.is_pipeline:
            return pipeline_dispatch_ranks(self.engine)
        if self.tensor_parallel_dispatch is not None:
            return self.tensor_parallel_dispatch.sampler_ranks()
        return {}

    @property
    def stage_bounds(self) -> StageBounds:
        """Layer boundaries of the stages over the flat layer list."""
        if isinstance(self.module, MLLMPipelineModule):  # is_pipeline, spelled so that the type narrows
            return StageBounds(self.module.parts)
        return StageBounds([0, len(self.module)])

    def save_checkpoint(self, directory: str, tag: str, client_state: dict) -> None:
        """DeepSpeed checkpoint of the engine (and of the colocated encoder's engine, in
        ``directory/encoder``, same tag)."""
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state)
        if self.colocated_pipeline is not None:
            self.colocated_pipeline.save_checkpoint(str(Path(directory) / "encoder"), tag)

    def load_checkpoint(self, directory: str) -> tuple[Any, dict]:
        """Load the latest checkpoint of :meth:`save_checkpoint`; ``(path or None, client_state)``."""
        path, client_state = self.engine.load_checkpoint(directory)
        if path is not None and self.colocated_pipeline is not None:
            self.colocated_pipeline.load_checkpoint(str(Path(directory) / "encoder"))
        return path, client_state

    def train_step(self, data_iter: Iterator[Microbatch]) -> float:
        """Run one optimizer step (``gradient_accumulation_steps`` microbatches); the global
        batch's token-mean loss (the same figure on every rank)."""
        if self.colocated_pipeline is not None:
            return self.colocated_pipeline.train_step(self.engine, data_iter)
        if self.is_pipeline:
            return float(self.engine.train_batch(data_iter))
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        spread = self.tp_coords[1] > 1  # AutoTP: see SequentialMLLM.forward
        for _ in range(gas):
            inputs, labels = next(data_iter)
            inputs = move_to(inputs, engine.device)
            outputs = engine(*inputs) if spread else engine(inputs)
            loss = self.loss_fn(outputs, move_to(labels, engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().to(torch.float64)
        total /= gas
        _, dp_size = self.dp_coords
        if dp_size > 1:
            dist.all_reduce(total, group=engine.data_parallel_group)
            total /= dp_size
        return float(total)


def build_engine(
    encoder_layers: Sequence[Any],
    projector: Any,
    llm_layers: Sequence[Any],
    ds_config: dict,
    *,
    pipeline_stages: int,
    stage_bounds: Sequence[int] | None = None,
    layer_costs: Sequence[float] | None = None,
    freeze_encoder: bool = False,
    lr: float = 1e-3,
    loss_fn: Callable = token_normalized_loss,
    activation_checkpoint_interval: int = 0,
    make_optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    colocated: bool = False,
    hf_model: nn.Module | None = None,
) -> TrainingEngine:
    """Build the DeepSpeed engine the config asks for over the model's layer lists.

    ``pipeline_stages > 1``: an :class:`MLLMPipelineModule` split at ``stage_bounds`` (or on
    ``layer_costs``) under the pipeline engine. ``pipeline_stages == 1``: a
    :class:`SequentialMLLM` under the plain engine, with the config's ZeRO stage. The optimizer:
    ``make_optimizer(trainable_parameters)`` if given, else the config's ``"optimizer"``, else
    AdamW at ``lr`` (a torch optimizer starts faster than DeepSpeed's CPU FusedAdam build). A
    pipeline stage holding only frozen layers gets a zero anchor parameter (see
    :meth:`MLLMPipelineModule.optimizer_parameters`). ``colocated``: the encoder runs on
    dispatched tiles and exchanges features; on the plain engine inside the model's forward
    (:class:`~dflop_ds.train.colocated.ColocatedMLLM`), under a pipeline before ``train_batch``,
    the pipeline's stages then holding ``[FeatureReceiver, projector, *llm_layers]`` (``stage_bounds``
    and ``layer_costs`` over that list) and the encoder its own engine
    (:class:`~dflop_ds.train.colocated.ColocatedPipeline`).
    ``"tensor_parallel": {"autotp_size": N > 1}`` (plain engine only) shards the LLM's linears of
    ``hf_model`` (whose modules the layers share) as its HF tp_plan says, through DeepSpeed AutoTP
    (:func:`~dflop_ds.train.autotp.with_autotp_layout`); the vision tower stays whole.
    A 16-bit precision the device cannot train in is refused before DeepSpeed sees the config
    (:func:`~dflop_ds.precision.check_precisions`).
    """
    keys = deepspeed_keys(ds_config)
    check_precisions(keys.precisions, "the DeepSpeed config")
    if pipeline_stages > 1 and keys.autotp_size > 1:
        raise ValueError(
            "tensor_parallel.autotp_size > 1 needs pipeline_stages == 1: AutoTP shards the plain "
            "engine's model; a PipelineModule gives it nothing to shard"
        )
    if colocated and activation_checkpoint_interval:
        raise ValueError("activation checkpointing is not supported with a colocated encoder yet (either engine)")
    if pipeline_stages > 1:
        pipe_kwargs = dict(
            num_stages=pipeline_stages,
            stage_bounds=stage_bounds,
            layer_costs=layer_costs,
            loss_fn=loss_fn,
            activation_checkpoint_interval=activation_checkpoint_interval,
        )
        if colocated:
            return _colocated_pipeline(
                encoder_layers,
                projector,
                llm_layers,
                ds_config,
                pipe_kwargs,
                freeze_encoder=freeze_encoder,
                lr=lr,
                make_optimizer=make_optimizer,
            )
        pipeline = MLLMPipelineModule(
            encoder_layers, projector, llm_layers, freeze_encoder=freeze_encoder, **pipe_kwargs
        )
        trainable = pipeline.optimizer_parameters()
        module: MLLMPipelineModule | SequentialMLLM = pipeline
    else:
        sequential = ColocatedMLLM if colocated else SequentialMLLM
        module = sequential(
            encoder_layers,
            projector,
            llm_layers,
            freeze_encoder=freeze_encoder,
            checkpoint_layers=activation_checkpoint_interval > 0,
        )
        trainable = [p for p in module.parameters() if p.requires_grad]
        summed = encoder_parameter_names(module) if colocated else []
        ds_config = with_autotp_layout(ds_config, hf_model, module, sum_gradients=summed)
    trainer = TrainingEngine(_initialize(module, trainable, ds_config, make_optimizer, lr), module, loss_fn)
    if colocated and trainer.tp_coords[1] > 1 and isinstance(module, ColocatedMLLM):
        _colocate_under_autotp(trainer, module)
    return trainer


def encoder_parameter_names(module: SequentialMLLM) -> list[str]:
    """Names of ``module``'s trainable encoder-layer parameters (flat layer index < encoder layers)."""
    return [
        name
        for name, param in module.named_parameters()
        if param.requires_grad and int(name.split(".", 1)[0]) < module.n_encoder_layers
    ]


def _colocate_under_autotp(trainer: TrainingEngine, module: ColocatedMLLM) -> None:
    """Place the colocated encoder's dispatch over every rank of an AutoTP engine: each
    tensor-parallel group's first rank owns its samples and all its ranks receive their
    features; DeepSpeed's first-forward check that a group got the same data is narrowed to
    the inputs the group shares (the dispatched pixels and routing differ by design)."""
    from deepspeed.utils import groups

    dispatch = TensorParallelDispatch.gather(trainer.dp_coords[0], groups.get_tensor_model_parallel_group())
    trainer.tensor_parallel_dispatch = dispatch
    module.owner_of = dispatch.owner_of
    narrow_tensor_parallel_input_check(trainer.engine, module.shared_inputs)


def narrow_tensor_parallel_input_check(engine: Any, shared: Callable[[tuple], tuple]) -> None:
    """Make DeepSpeed AutoTP's first-forward check (the ranks of a tensor-parallel group got equal
    inputs) compare ``shared(args)`` instead of all the forward's arguments."""
    handle = getattr(engine, "first_dataloader_check", None)
    hooks = engine.module._forward_pre_hooks
    if handle is None or handle.id not in hooks:  # already ran
        return
    check = hooks[handle.id]
    handle.remove()

    def check_shared(module: nn.Module, args: tuple, kwargs: dict) -> None:
        check(module, shared(args), kwargs)
        narrowed.remove()

    narrowed = engine.module.register_forward_pre_hook(check_shared, prepend=True, with_kwargs=True)


def _initialize(
    module: nn.Module,
    trainable: list,
    ds_config: dict,
    make_optimizer: Callable[[list], torch.optim.Optimizer] | None,
    lr: float,
    mpu: Any = None,
) -> Any:
    """``deepspeed.initialize`` with the optimizer :func:`build_engine` describes; the engine.
    An explicit ``mpu`` does not stay DeepSpeed's global topology (``groups.mpu`` is restored)."""
    import deepspeed

    optimizer: torch.optim.Optimizer | None
    if make_optimizer is not None:
        optimizer = make_optimizer(trainable)
    else:
        optimizer = None if "optimizer" in ds_config else torch.optim.AdamW(trainable, lr=lr)
    with global_topology(mpu) if mpu is not None else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=ds_config, model_parameters=trainable, mpu=mpu
        )
    return engine


def _colocated_pipeline(
    encoder_layers: Sequence[Any],
    projector: Any,
    llm_layers: Sequence[Any],
    ds_config: dict,
    pipe_kwargs: dict,
    *,
    freeze_encoder: bool,
    lr: float,
    make_optimizer: Callable[[list], torch.optim.Optimizer] | None,
) -> TrainingEngine:
    """The pipeline engine over ``[FeatureReceiver, projector, *llm_layers]`` and the encoder
    beside it, data parallel over all ranks with its own engine (none when frozen)."""
    from dflop_ds.pipe.module import FeatureReceiver  # deepspeed is imported with the pipeline module

    encoder = nn.Sequential(*built_layers(encoder_layers))
    encoder_engine = None
    if freeze_encoder:
        encoder.requires_grad_(False)
    else:
        encoder_engine = _initialize(
            encoder,
            list(encoder.parameters()),
            encoder_engine_config(ds_config, dist.get_world_size()),
            make_optimizer,
            lr,
            mpu=EncoderTopology(),
        )
    receiver = FeatureReceiver()
    module = MLLMPipelineModule([receiver], projector, llm_layers, **pipe_kwargs)
    engine = _initialize(module, module.optimizer_parameters(), ds_config, make_optimizer, lr)
    encoder.to(engine.device)
    colocated = ColocatedPipeline(encoder, receiver, encoder_engine, llm_dp_size=data_parallel_coords(engine)[1])
    return TrainingEngine(engine, module, pipe_kwargs["loss_fn"], colocated_pipeline=colocated)
