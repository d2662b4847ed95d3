"""The colocated encoder on the plain (ZeRO) engine: encoder work dispatched by cost over all ranks.

``dflop.model.encoder = "colocated"`` turns it on. Per micro-step every rank computes the same
:func:`~dflop_ds.schedule.dispatch.plan_dispatch` from the schedule; the data pipeline of rank
``r`` loads the tiles the plan gives ``r`` (its own samples' and, where the plan says so, other
ranks' samples'), and :class:`ColocatedMLLM` encodes them, sends the features to the samples'
ranks with a differentiable all-to-all (:func:`~dflop_ds.pipe.exchange.exchange_features`) and
runs the projector and the LLM on the rank's own samples. The ``(inputs, labels)`` of the LLM side
are those of the model's own collate; only the pixels change (the dispatched tiles) and three
integer routing tensors follow the inputs::

    inputs = (encode_pixels, *other_inputs, send_counts [world], recv_counts [world], recv_index [T_own])

With the encoder balanced by dispatch, the sampler balances each micro-step on the LLM alone
(:class:`~dflop_ds.cost.LLMOnlyCost`): a micro-step then costs the slowest rank's LLM plus the mean encoder work.

Under DeepSpeed AutoTP (``tensor_parallel.autotp_size = tp > 1``, HF models) the ranks of a
tensor-parallel group train the same microbatches with the LLM sharded and the vision tower
whole. The dispatch spans every rank (:class:`TensorParallelDispatch`): a group's first
rank owns its samples in the plan, every rank of the group receives their features
(``owner_of``, see :mod:`dflop_ds.pipe.exchange`), and the encoder's gradients are summed over the
group (each rank encoded other tiles) before DeepSpeed averages them over the data-parallel ranks
(:func:`~dflop_ds.train.autotp.autotp_partition_config` with ``sum_gradients``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dflop_ds.cost import CostModel, LayeredCostModel
from dflop_ds.pipe.exchange import StepExchange, exchange_features
from dflop_ds.pipe.module import FeatureReceiver
from dflop_ds.pipe.stage_bounds import split_by_cost
from dflop_ds.plan.stages import mean_layer_costs
from dflop_ds.schedule.dispatch import EncoderDispatch, plan_dispatch
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.shapes import SampleShape
from dflop_ds.train.device import move_to
from dflop_ds.train.sequential import SequentialMLLM


def tile_costs(cost_model: CostModel, shapes: Sequence[SampleShape]) -> tuple[np.ndarray, np.ndarray]:
    """``(tiles, cost per tile)`` of every sample: the encoder prediction spread over its tiles."""
    tiles = np.array([s.encoder_tiles for s in shapes], dtype=np.int64)
    encoder = np.asarray(cost_model.predict_samples(shapes), dtype=float).reshape(len(shapes), -1)[:, 0]
    return tiles, np.divide(encoder, tiles, out=np.zeros_like(encoder), where=tiles > 0)


def dispatch_microstep(
    microbatches: Sequence[Sequence[int]], tiles: np.ndarray, tile_cost: np.ndarray, owners: Sequence[int], ranks: int
) -> EncoderDispatch:
    """The dispatch of one micro-step whose data-parallel rank ``d`` trains ``microbatches[d]``,
    over ``ranks`` encoding ranks of which rank ``owners[d]`` owns replica ``d``'s samples."""
    by_rank: list[Sequence[int]] = [[] for _ in range(ranks)]
    for dp_rank, owner in enumerate(owners):
        by_rank[owner] = microbatches[dp_rank]
    return plan_dispatch(by_rank, tiles, tile_cost)


@dataclass(frozen=True)
class MicrostepRequest:
    """What rank ``rank`` loads for one micro-step: its own samples and the plan's tiles.
    ``owner``: the rank that owns its samples in the plan (its tensor-parallel group's first
    rank under AutoTP; None: ``rank`` itself)."""

    own: list[ScheduledIndex]
    plan: EncoderDispatch
    rank: int
    owner: int | None = None

    @property
    def receives_for(self) -> int:
        """The rank whose tiles this rank receives."""
        return self.rank if self.owner is None else self.owner


class DispatchingSampler:
    """Wraps a batch sampler: each micro-step yields ``[MicrostepRequest]`` (one element, so the
    DataLoader hands it to :class:`DispatchDataset` whole) instead of the rank's indices.

    The dispatch spans ``ranks`` ranks (default: the data-parallel ranks); data-parallel rank
    ``d``'s samples belong to rank ``owners[d]`` of them (default: ``d``) and this process is
    rank ``rank`` (default: its data-parallel rank), training the samples of rank ``owner``
    (default: its own). Under a pipeline every rank encodes, the first stage of each
    data-parallel replica owns its samples, and the other ranks own none; under AutoTP the
    first rank of each tensor-parallel group owns them and its peers train them too.

    Position, checkpoints and schedules stay the wrapped sampler's (``state_dict``,
    ``last_schedule``, ...); only what a micro-step loads changes.
    """

    def __init__(
        self,
        sampler: Any,
        tiles: np.ndarray,
        tile_cost: np.ndarray,
        *,
        owners: Sequence[int] | None = None,
        rank: int | None = None,
        ranks: int | None = None,
        owner: int | None = None,
    ) -> None:
        self.sampler = sampler
        self.tiles = np.asarray(tiles)
        self.tile_cost = np.asarray(tile_cost, dtype=float)
        self.owners = list(range(sampler.dp_size)) if owners is None else [int(r) for r in owners]
        self.rank = sampler.dp_rank if rank is None else int(rank)
        self.ranks = len(self.owners) if ranks is None else int(ranks)
        self.owner = None if owner is None else int(owner)
        if len(self.owners) != sampler.dp_size or not all(0 <= r < self.ranks for r in self.owners):
            raise ValueError(
                f"owners {self.owners} must give one rank in [0, {self.ranks}) per data-parallel rank "
                f"({sampler.dp_size})"
            )
        self.last_plan: EncoderDispatch | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def _request(self, schedule: Any, step: int, own: Sequence[ScheduledIndex]) -> list[MicrostepRequest]:
        microbatches = [rank[step] for rank in schedule.split.ranks]
        self.last_plan = dispatch_microstep(microbatches, self.tiles, self.tile_cost, self.owners, self.ranks)
        return [MicrostepRequest(list(own), self.last_plan, self.rank, self.owner)]

    def __iter__(self) -> Iterator[list[MicrostepRequest]]:
        """Each micro-step's request, the position moving as it is handed out (as the wrapped
        sampler's own ``__iter__``: exact without workers; with workers use ``make_loader``)."""
        for position, schedule, request in self.scheduled_microbatches():
            self.sampler.consumed(position, schedule)
            yield request

    def scheduled_microbatches(self) -> Iterator[tuple[Any, Any, list[MicrostepRequest]]]:
        """The wrapped sampler's ``scheduled_microbatches`` with each micro-step's request in place
        of its indices, so :func:`dflop_ds.make_loader` resumes a colocated run exactly too."""
        for position, schedule, own in self.sampler.scheduled_microbatches():
            # the position after micro-step j is j + 1 of the same batch, or 0 of the next one
            step = position.microbatch - 1 if position.microbatch > 0 else self.sampler.n_mb - 1
            yield position, schedule, self._request(schedule, step, own)

    def __getattr__(self, name: str) -> Any:  # last_schedule, dp_rank, state_dict, close, ...
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


@dataclass
class MicrostepItems:
    """The loaded items of a rank's own samples and the pixels of the tiles it encodes."""

    own: list[Any]
    encode_pixels: list[torch.Tensor]
    request: MicrostepRequest


class DispatchDataset(torch.utils.data.Dataset):
    """Loads a :class:`MicrostepRequest`: the rank's own items from ``dataset`` and, for each tile
    range the plan gives the rank, the pixels (``pixels_of(item)[start:stop]``), loading another
    rank's sample where the range belongs to one."""

    def __init__(self, dataset: Any, pixels_of: Callable[[Any], torch.Tensor] = lambda item: item.pixels) -> None:
        self.dataset = dataset
        self.pixels_of = pixels_of

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, request: MicrostepRequest) -> MicrostepItems:
        own = [self.dataset[index] for index in request.own]
        loaded = {int(index): item for index, item in zip(request.own, own)}
        pixels = []
        for piece in request.plan.work[request.rank]:
            item = loaded.get(piece.sample)
            if item is None:
                item = loaded[piece.sample] = self.dataset[piece.sample]
            tiles = self.pixels_of(item)
            if tiles.shape[0] < piece.stop:
                raise ValueError(
                    f"sample {piece.sample}: dispatch asks for tiles [{piece.start}, {piece.stop}) but "
                    f"the dataset gives {tiles.shape[0]}"
                )
            pixels.append(tiles[piece.start : piece.stop])
        return MicrostepItems(own, pixels, request)


class DispatchCollate:
    """The model's collate on the rank's own items, with the pixels replaced by the dispatched
    tiles and the routing tensors appended (see the module docstring)."""

    def __init__(self, collate: Callable, tiles: np.ndarray) -> None:
        self.collate = collate
        self.tiles = np.asarray(tiles)

    def __call__(self, batch: Sequence[MicrostepItems]) -> tuple[tuple[torch.Tensor, ...], Any]:
        if len(batch) != 1:
            raise ValueError(f"DispatchCollate expects one micro-step request per batch, got {len(batch)}")
        loaded = batch[0]
        inputs, labels = self.collate(loaded.own)
        plan, rank = loaded.request.plan, loaded.request.rank
        own_pixels = inputs[0]
        encode = (
            torch.cat(loaded.encode_pixels, dim=0)
            if loaded.encode_pixels
            else own_pixels.new_zeros((0, *own_pixels.shape[1:]))
        )
        receives_for = loaded.request.receives_for
        routing = (
            torch.tensor(plan.send_counts(rank), dtype=torch.long),
            torch.tensor(plan.recv_counts(receives_for), dtype=torch.long),
            torch.tensor(plan.recv_index(receives_for, self.tiles), dtype=torch.long),
        )
        return (encode, *inputs[1:], *routing), labels


def encoded_tiles(vis: torch.Tensor, tiles: int) -> torch.Tensor:
    """The encoder output's rows of the ``tiles`` dispatched tiles. An encoder given no tile may
    encode one placeholder (LLaVA's :class:`~dflop_ds.models.hf.llava.model.VisionEmbeddings`, so that
    every rank's backward runs the same layers); it is sliced away here, keeping the graph."""
    if tiles == 0 and vis.shape[0] == 1:
        return vis[:0]
    return vis


#: routing tensors :class:`DispatchCollate` appends to a microbatch's inputs
ROUTING_TENSORS = 3


class ColocatedMLLM(SequentialMLLM):
    """:class:`SequentialMLLM` whose encoder runs on the dispatched tiles: encoder layers, then the
    feature exchange, then projector and LLM on the rank's own samples.

    ``group`` is the process group the dispatch spans (None: the world, E_dp = all ranks).
    ``owner_of`` (set by :func:`~dflop_ds.train.engine.build_engine` under AutoTP) maps each rank
    of the group to the rank whose tiles it receives (None: its own, see
    :func:`~dflop_ds.pipe.exchange.exchange_features`). A frozen encoder runs without autograd:
    no graph, and no exchange in the backward.
    """

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.owner_of: list[int] | None = None
        self.encoder_frozen = not any(
            p.requires_grad for layer in list(self)[: self.n_encoder_layers] for p in layer.parameters()
        )

    @staticmethod
    def shared_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The inputs every rank training the same microbatch gets alike (all but the dispatched
        pixels and the routing tensors): what a tensor-parallel group must agree on."""
        return tuple(inputs[1:-ROUTING_TENSORS])

    def forward(self, *inputs: Any) -> Any:
        """Encode the dispatched tiles, exchange the features, run projector and LLM. ``inputs``:
        one tuple, or its tensors as separate arguments (as :class:`SequentialMLLM`)."""
        flat = inputs[0] if len(inputs) == 1 else inputs
        *model_inputs, send_counts, recv_counts, recv_index = flat
        layers = list(self)
        x: Any = tuple(model_inputs)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.encoder_frozen):
            for layer in layers[: self.n_encoder_layers]:
                x = layer(x)
        vis = encoded_tiles(x[0], int(model_inputs[0].shape[0]))
        features = exchange_features(
            vis, send_counts, recv_counts, recv_index, group=self.group, owner_of=self.owner_of
        )
        x = (features, *x[1:])
        for layer in layers[self.n_encoder_layers :]:
            x = layer(x)
        return x


def colocate(
    sampler: Any,
    dataset: Any,
    collate: Callable,
    shapes: Sequence[SampleShape],
    cost_model: CostModel,
    *,
    pixels_of: Callable[[Any], torch.Tensor] | None = None,
    **dispatch: Any,
) -> tuple[DispatchingSampler, DispatchDataset, DispatchCollate]:
    """The sampler, dataset and collate of a colocated-encoder run, wrapping the rank's plain ones.

    ``cost_model`` (with its encoder column) prices the tiles; ``sampler`` schedules on the LLM
    alone (build it with :class:`~dflop_ds.cost.LLMOnlyCost`; in lockstep on the plain engine). ``pixels_of``:
    a dataset item's tiles, one row each (default: ``item.pixels``, the tiny model's). ``dispatch``:
    ``owners``, ``rank``, ``ranks`` and ``owner`` of :class:`DispatchingSampler` (see
    :func:`pipeline_dispatch_ranks` for a pipeline, :meth:`TensorParallelDispatch.sampler_ranks` for AutoTP).
    """
    tiles, per_tile = tile_costs(cost_model, shapes)
    return (
        DispatchingSampler(sampler, tiles, per_tile, **dispatch),
        DispatchDataset(dataset) if pixels_of is None else DispatchDataset(dataset, pixels_of),
        DispatchCollate(collate, tiles),
    )


def pipeline_dispatch_ranks(engine: Any) -> dict[str, Any]:
    """``owners``, ``rank`` and ``ranks`` of the dispatch over every rank of a pipeline engine:
    data-parallel replica ``d``'s samples go to its first stage's rank."""
    grid = engine.grid
    owners = [grid.stage_to_global(stage_id=0, data=d) for d in range(grid.get_data_parallel_world_size())]
    return {"owners": owners, "rank": dist.get_rank(), "ranks": dist.get_world_size()}


@dataclass(frozen=True)
class TensorParallelDispatch:
    """Who owns and who receives the samples of each tensor-parallel group under AutoTP.

    Attributes:
        owners: ``owners[d]`` the rank owning data-parallel replica ``d``'s samples in the plan
            (the first rank of its tensor-parallel group).
        owner_of: ``owner_of[r]`` the owner whose samples rank ``r`` trains (and whose features
            it receives).
        rank: this process's global rank.
    """

    owners: list[int]
    owner_of: list[int]
    rank: int

    @classmethod
    def gather(cls, dp_rank: int, tp_group: Any) -> TensorParallelDispatch:
        """Every rank's replica and group, gathered (a collective over the world)."""
        owner = min(dist.get_process_group_ranks(tp_group))
        pairs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (int(dp_rank), owner))
        owners = dict(pairs)
        return cls([owners[d] for d in range(len(owners))], [first for _, first in pairs], dist.get_rank())

    def sampler_ranks(self) -> dict[str, Any]:
        """``owners``, ``rank``, ``ranks`` and ``owner`` of :class:`DispatchingSampler`."""
        owner = self.owner_of[self.rank]
        return {"owners": self.owners, "rank": self.rank, "ranks": len(self.owner_of), "owner": owner}


class EncoderTopology:
    """DeepSpeed's ``mpu`` interface for the encoder's own engine: data parallel over every rank
    of ``group`` (None: the world), no model parallelism. Passed explicitly, since a pipeline
    engine makes its own grid DeepSpeed's global topology. Every rank must construct it (it
    creates one single-rank model-parallel group per rank)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group if group is not None else dist.new_group(ranks=list(range(dist.get_world_size())))
        self.model_parallel_group, _ = dist.new_subgroups(group_size=1)

    def get_data_parallel_group(self) -> Any:
        """The ranks the encoder's gradients are averaged over."""
        return self.group

    def get_data_parallel_rank(self) -> int:
        """This process's rank among them."""
        return dist.get_rank(group=self.group)

    def get_data_parallel_world_size(self) -> int:
        """How many ranks hold an encoder replica."""
        return dist.get_world_size(group=self.group)

    def get_model_parallel_group(self) -> Any:
        """This rank alone: the encoder is not split."""
        return self.model_parallel_group

    def get_model_parallel_rank(self) -> int:
        """Always 0."""
        return 0

    def get_model_parallel_world_size(self) -> int:
        """Always 1."""
        return 1


@contextmanager
def global_topology(mpu: Any) -> Iterator[None]:
    """Make ``mpu`` DeepSpeed's global topology (``deepspeed.utils.groups.mpu``) for the block.

    DeepSpeed's plain engine reads that global at call time (its stage-0 gradient all-reduce
    takes ``groups._get_sequence_data_parallel_group()``), and a pipeline engine sets it to its
    own grid; the encoder's engine runs its initialisation, backward, step and checkpoints in
    this block so that they span the encoder's ranks, not the pipeline's data-parallel group.
    """
    from deepspeed.utils import groups

    saved = groups.mpu
    groups.mpu = mpu
    try:
        yield
    finally:
        groups.mpu = saved


def colocated_stage_bounds(bounds: Sequence[int], n_encoder: int) -> list[int]:
    """Stage bounds over the flat ``encoder layers + [projector] + llm layers`` list (what
    ``dflop.plan.stage_bounds`` and the cost-balanced split give) as bounds over the colocated
    pipeline's ``[FeatureReceiver, projector, *llm layers]``: the encoder layers leave the
    pipeline and the receiver takes the last one's index. The first stage must keep the projector."""
    bounds = [int(b) for b in bounds]
    if len(bounds) < 2 or bounds[1] <= n_encoder:
        raise ValueError(
            f"stage bounds {bounds}: with the colocated encoder the first stage must hold the projector "
            f"(layer {n_encoder}), so its bound must exceed {n_encoder}"
        )
    return [0, *(b - n_encoder + 1 for b in bounds[1:])]


def colocated_pipeline_bounds(
    bounds: Sequence[int] | None,
    n_encoder: int,
    cost_model: LayeredCostModel | None,
    shapes: Sequence[SampleShape],
    num_stages: int,
) -> Sequence[int] | None:
    """The colocated pipeline's stage bounds: ``bounds`` (over the flat list, see
    :func:`colocated_stage_bounds`) if given, else the split balancing the cost model's mean
    per-layer LLM-side cost (the encoder's cost is no stage's), else None (one per layer)."""
    if bounds is not None:
        return colocated_stage_bounds(bounds, n_encoder)
    if cost_model is None:
        return None
    return split_by_cost([0.0, *mean_layer_costs(cost_model, shapes)[n_encoder:]], num_stages)


#: DeepSpeed config keys the encoder's own engine copies from the pipeline engine's config
ENCODER_ENGINE_KEYS = (
    "fp16",
    "bf16",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "steps_per_print",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
)


def encoder_engine_config(ds_config: dict, world_size: int) -> dict:
    """The DeepSpeed config of the encoder's own engine: the pipeline's precision, loss scaling,
    clipping, optimizer and ZeRO stage, data parallel over all ``world_size`` ranks, one
    backward per step (the step's micro-steps are summed before it)."""
    config = {key: ds_config[key] for key in ENCODER_ENGINE_KEYS if key in ds_config}
    config.update(train_batch_size=world_size, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    return config


class ColocatedPipeline:
    """The encoder phase of a pipeline step whose encoder is data parallel over every rank.

    Per step every rank draws the step's ``gradient_accumulation_steps`` micro-steps (each as
    :class:`DispatchCollate` makes it), encodes the tiles the dispatch gives it, and sends the
    features to the first stage owning each sample; the first LLM stage gets them as its inputs
    (``(features, *other inputs)``) through ``train_batch``, and its :class:`FeatureReceiver`
    keeps their gradients. After ``train_batch`` the gradients go back to the ranks that encoded
    the tiles and one backward of the encoder runs; its engine all-reduces the gradients over all
    ranks and takes its own optimizer step (precision, loss scaling and clipping from the
    pipeline's config; clipping uses the encoder's own gradient norm).

    Args:
        encoder: the encoder layers as one module (tuple in, tuple out).
        receiver: the pipeline's first layer.
        encoder_engine: a DeepSpeed engine over ``encoder`` (None: a frozen encoder, run without
            autograd and never stepped).
        llm_dp_size: data-parallel ranks of the LLM pipeline; the engine averages the encoder's
            gradients over all its ranks, the pipeline over ``llm_dp_size``, so the encoder's
            backward is scaled by their ratio (the number of stages).
        group: the process group the dispatch spans (None: the world).
    """

    def __init__(
        self,
        encoder: nn.Sequential,
        receiver: FeatureReceiver,
        encoder_engine: Any,
        *,
        llm_dp_size: int,
        group: Any = None,
    ) -> None:
        self.encoder = encoder
        self.receiver = receiver
        self.encoder_engine = encoder_engine
        self.group = group
        self.gradient_scale = 1.0 if encoder_engine is None else encoder_engine.dp_world_size / llm_dp_size
        #: seconds of the last step's phases on this rank: "encode" (with the exchange), "pipeline"
        #: (``train_batch``), "encoder_backward" (gradients back, backward, all-reduce, step)
        self.phase_s: dict[str, float] = {}

    @property
    def trainable(self) -> bool:
        """Whether the encoder trains (else no graph is kept and no backward runs)."""
        return self.encoder_engine is not None

    def train_step(self, engine: Any, data_iter: Iterator[tuple[Any, Any]]) -> float:
        """One optimizer step of the pipeline ``engine`` and of the encoder; the step's loss.

        The tiles this rank encodes for all micro-steps go through the encoder in one forward
        (tiles are encoded independently; the encoder layers pass the other inputs through, as
        the layer contract says) and through one all-to-all (:class:`StepExchange`)."""
        start = time.perf_counter()
        self.receiver.start_step(keep_gradients=self.trainable)
        drawn = [move_to(next(data_iter), engine.device) for _ in range(engine.gradient_accumulation_steps())]
        send_counts, recv_counts, recv_index = zip(*(inputs[-3:] for inputs, _ in drawn))
        exchange = StepExchange(send_counts, recv_counts, recv_index, group=self.group)
        pixels = torch.cat([inputs[0] for inputs, _ in drawn])
        with torch.set_grad_enabled(self.trainable):
            vis = (self.encoder_engine if self.trainable else self.encoder)((pixels, *drawn[0][0][1:-3]))[0]
        features = exchange.features(vis)
        microbatches = [((own, *inputs[1:-3]), labels) for own, (inputs, labels) in zip(features, drawn)]
        encoded_at = time.perf_counter()
        loss = float(engine.train_batch(iter(microbatches)))
        trained_at = time.perf_counter()
        if self.trainable:
            self._encoder_backward_and_step(engine, features, exchange, vis)
        self.phase_s = {
            "encode": encoded_at - start,
            "pipeline": trained_at - encoded_at,
            "encoder_backward": time.perf_counter() - trained_at,
        }
        return loss

    def _encoder_backward_and_step(
        self, engine: Any, features: list[torch.Tensor], exchange: StepExchange, vis: torch.Tensor
    ) -> None:
        """Send the features' gradients back to their encoders, backward, all-reduce and step."""
        first = engine.is_first_stage()
        grads = self.receiver.take_gradients(features) if first else [torch.zeros_like(f) for f in features]
        # d(surrogate)/d(vis) = the tiles' gradient: one backward gives the vector-Jacobian product
        surrogate = (vis.float() * exchange.gradients(grads, vis).float()).sum()
        with global_topology(self.encoder_engine.mpu):
            self.encoder_engine.backward(surrogate * self.gradient_scale)
            self.encoder_engine.step()

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """The encoder engine's DeepSpeed checkpoint in ``directory`` (nothing when frozen)."""
        if self.trainable:
            with global_topology(self.encoder_engine.mpu):
                self.encoder_engine.save_checkpoint(directory, tag=tag)

    def load_checkpoint(self, directory: str) -> None:
        """Load the latest encoder checkpoint of ``directory`` (nothing when frozen); raises if none."""
        if not self.trainable:
            return
        with global_topology(self.encoder_engine.mpu):
            path, _ = self.encoder_engine.load_checkpoint(directory)
        if path is None:
            raise ValueError(f"no colocated encoder checkpoint in {directory}")

    def full_state(self, pipeline_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state under the flat names of the in-pipeline layout
        (``encoder layers + [projector] + llm layers``): the gathered ``pipeline_state`` (names over
        ``[FeatureReceiver, projector, ...]``) shifted past the encoder, plus this rank's replica
        of the encoder."""
        offset = len(self.encoder) - 1  # the receiver takes the last encoder layer's index
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.encoder.state_dict().items()}
        for name, tensor in pipeline_state.items():
            head, _, rest = name.partition(".")
            state[f"{int(head) + offset}.{rest}" if head.isdigit() else name] = tensor
        return state
