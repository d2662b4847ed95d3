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
(:class:`LLMOnlyCost`): a micro-step then costs the slowest rank's LLM plus the mean encoder work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from dflop_ds.pipe.exchange import exchange_features
from dflop_ds.schedule.dispatch import EncoderDispatch, plan_dispatch
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.shapes import SampleShape
from dflop_ds.train.sequential import SequentialMLLM


class LLMOnlyCost:
    """A cost model's predictions with the encoder column zeroed: what the sampler balances when
    the encoder's work is dispatched separately (the encoder costs the mean over ranks anyway)."""

    def __init__(self, cost_model: Any) -> None:
        self.cost_model = cost_model

    @staticmethod
    def _drop_encoder(costs: Any) -> np.ndarray:
        costs = np.array(costs, dtype=float)
        costs[..., 0] = 0.0
        return costs

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Per-sample ``[0, llm]``."""
        return self._drop_encoder(self.cost_model.predict_samples(shapes))

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """A collated (padded) microbatch's ``[0, llm]``."""
        return self._drop_encoder(self.cost_model.predict_microbatch(shapes))


def tile_costs(cost_model: Any, shapes: Sequence[SampleShape]) -> tuple[np.ndarray, np.ndarray]:
    """``(tiles, cost per tile)`` of every sample: the encoder prediction spread over its tiles."""
    tiles = np.array([s.encoder_tiles for s in shapes], dtype=np.int64)
    encoder = np.asarray(cost_model.predict_samples(shapes), dtype=float).reshape(len(shapes), -1)[:, 0]
    return tiles, np.divide(encoder, tiles, out=np.zeros_like(encoder), where=tiles > 0)


@dataclass(frozen=True)
class MicrostepRequest:
    """What rank ``rank`` loads for one micro-step: its own samples and the plan's tiles."""

    own: list[ScheduledIndex]
    plan: EncoderDispatch
    rank: int


class DispatchingSampler:
    """Wraps a lockstep batch sampler: each micro-step yields ``[MicrostepRequest]`` (one element,
    so the DataLoader hands it to :class:`DispatchDataset` whole) instead of the rank's indices.

    Position, checkpoints and schedules stay the wrapped sampler's (``state_dict``,
    ``last_schedule``, ...); only what a micro-step loads changes.
    """

    def __init__(self, sampler: Any, tiles: np.ndarray, tile_cost: np.ndarray) -> None:
        self.sampler = sampler
        self.tiles = np.asarray(tiles)
        self.tile_cost = np.asarray(tile_cost, dtype=float)
        self.last_plan: Optional[EncoderDispatch] = None

    def __len__(self) -> int:
        return len(self.sampler)

    def _request(self, schedule: Any, step: int, own: Sequence[ScheduledIndex]) -> list[MicrostepRequest]:
        microbatches = [rank[step] for rank in schedule.split.ranks]
        self.last_plan = plan_dispatch(microbatches, self.tiles, self.tile_cost)
        return [MicrostepRequest(list(own), self.last_plan, self.sampler.dp_rank)]

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
                raise ValueError(f"sample {piece.sample}: dispatch asks for tiles [{piece.start}, {piece.stop}) but "
                                 f"the dataset gives {tiles.shape[0]}")
            pixels.append(tiles[piece.start:piece.stop])
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
        encode = (torch.cat(loaded.encode_pixels, dim=0) if loaded.encode_pixels
                  else own_pixels.new_zeros((0, *own_pixels.shape[1:])))
        routing = (torch.tensor(plan.send_counts(rank), dtype=torch.long),
                   torch.tensor(plan.recv_counts(rank), dtype=torch.long),
                   torch.tensor(plan.recv_index(rank, self.tiles), dtype=torch.long))
        return (encode, *inputs[1:], *routing), labels


class ColocatedMLLM(SequentialMLLM):
    """:class:`SequentialMLLM` whose encoder runs on the dispatched tiles: encoder layers, then the
    feature exchange, then projector and LLM on the rank's own samples.

    ``group`` is the process group the dispatch spans (None: the world, E_dp = all ranks).
    A frozen encoder runs without autograd: no graph, and no exchange in the backward.
    """

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.encoder_frozen = not any(p.requires_grad for layer in list(self)[: self.n_encoder_layers]
                                      for p in layer.parameters())

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        """Encode the dispatched tiles, exchange the features, run projector and LLM."""
        *model_inputs, send_counts, recv_counts, recv_index = inputs
        layers = list(self)
        x: Any = tuple(model_inputs)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.encoder_frozen):
            for layer in layers[: self.n_encoder_layers]:
                x = layer(x)
        features = exchange_features(x[0], send_counts, recv_counts, recv_index, group=self.group)
        x = (features, *x[1:])
        for layer in layers[self.n_encoder_layers:]:
            x = layer(x)
        return x


def colocate(sampler: Any, dataset: Any, collate: Callable, shapes: Sequence[SampleShape],
             cost_model: Any) -> tuple[DispatchingSampler, DispatchDataset, DispatchCollate]:
    """The sampler, dataset and collate of a colocated-encoder run, wrapping the rank's plain ones.

    ``cost_model`` (with its encoder column) prices the tiles; ``sampler`` must schedule in
    lockstep on the LLM alone (build it with :class:`LLMOnlyCost`).
    """
    tiles, per_tile = tile_costs(cost_model, shapes)
    return DispatchingSampler(sampler, tiles, per_tile), DispatchDataset(dataset), DispatchCollate(collate, tiles)
