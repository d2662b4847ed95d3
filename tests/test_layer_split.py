"""Per-layer costs measured on real microbatches (dflop_ds.profile.layer_split), for stage bounds."""

from __future__ import annotations

import pytest
import torch

from dflop_ds.models import TinyMLLMDataset, collate_microbatch, tiny_mllm_layers
from dflop_ds.pipe import split_by_cost
from dflop_ds.pipe.loss import token_normalized_loss
from dflop_ds.profile.layer_split import measure_layer_costs, measure_layer_times
from tests.test_packing import SHAPES, SMALL

torch.set_num_threads(1)


def flat_layers() -> list[torch.nn.Module]:
    encoder, projector, llm = tiny_mllm_layers(SMALL, seed=3, as_specs=False)
    return [*encoder, projector, *llm]


def test_layer_split_backward_gives_the_whole_models_gradients() -> None:
    batch = collate_microbatch([TinyMLLMDataset(SHAPES, SMALL, seed=2)[i] for i in range(4)], packed=True)
    layers = flat_layers()
    seconds = measure_layer_costs(layers, [batch], token_normalized_loss, warmup=0)
    measured = [p.grad.clone() for layer in layers for p in layer.parameters()]

    reference = flat_layers()
    inputs, labels = batch
    token_normalized_loss(torch.nn.Sequential(*reference)(inputs), labels).backward()
    expected = [p.grad for layer in reference for p in layer.parameters()]
    assert len(measured) == len(expected)
    for got, want in zip(measured, expected):
        torch.testing.assert_close(got, want)
    assert seconds.shape == (len(layers),) and (seconds > 0).all()
    assert split_by_cost(seconds, 2).n_layers == len(layers)


def test_layer_split_charges_a_heavier_layer_more() -> None:
    light = torch.nn.Linear(32, 32)
    heavy = torch.nn.Sequential(torch.nn.Linear(32, 2048), torch.nn.Linear(2048, 32))
    batch = (torch.randn(256, 32), None)
    seconds = measure_layer_costs([light, heavy], [batch] * 3, lambda out, _labels: out.sum(), repeats=3)
    assert seconds[1] > 4 * seconds[0]


def test_layer_split_times_each_microbatch_forward_and_backward() -> None:
    layer = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.Linear(1024, 32))
    small, large = (torch.randn(16, 32), None), (torch.randn(1024, 32), None)
    times = measure_layer_times([layer], [small, large], lambda out, _labels: out.sum(), repeats=3)
    assert times.shape == (2, 2, 1) and (times > 0).all()
    assert times[0, 1, 0] > 4 * times[0, 0, 0] and times[1, 1, 0] > 4 * times[1, 0, 0]  # 64x the rows


def test_layer_split_refuses_empty_inputs() -> None:
    with pytest.raises(ValueError, match="needs layers and microbatches"):
        measure_layer_costs([], [(torch.ones(1, 2), None)], lambda out, _labels: out.sum())
    with pytest.raises(ValueError, match="needs layers and microbatches"):
        measure_layer_costs([torch.nn.Linear(2, 2)], [], lambda out, _labels: out.sum())
    with pytest.raises(ValueError, match="repeats"):
        measure_layer_costs([torch.nn.Linear(2, 2)], [(torch.ones(1, 2), None)], lambda o, _l: o.sum(), repeats=0)
