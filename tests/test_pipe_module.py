"""Tests of stage splits, boundary-output marking and MLLMPipelineModule in one process."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import socket

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.pipe import StageBounds, plan_stage_bounds, split_by_cost, stage_costs
from dflop_ds.pipe.module import int_seed, mark_boundary_outputs, unused_float_inputs

torch.set_num_threads(1)


def brute_force_best(costs: list[float], num_stages: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(stage_costs(costs, bounds)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=1, max_size=9), st.integers(1, 4))
def test_split_by_cost_is_optimal_and_contiguous(costs: list[float], num_stages: int) -> None:
    if num_stages > len(costs):
        with pytest.raises(ValueError, match="non-empty stages"):
            split_by_cost(costs, num_stages)
        return
    bounds = split_by_cost(costs, num_stages)
    assert isinstance(bounds, StageBounds) and bounds.n_layers == len(costs) and bounds.num_stages == num_stages
    assert all(type(b) is int for b in bounds)
    assert max(stage_costs(costs, bounds)) == pytest.approx(brute_force_best(costs, num_stages), abs=1e-9)


def test_split_by_cost_examples() -> None:
    assert split_by_cost([1, 1, 1, 1], 2) == [0, 2, 4]
    assert split_by_cost([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert split_by_cost(np.array([3.0, 1.0, 1.0, 1.0]), 2) == [0, 1, 4]


def test_split_by_cost_forces_the_encoder_onto_its_stages() -> None:
    # 4 cheap encoder layers + projector, 6 expensive LLM layers; free balancing would mix them
    costs = [1, 1, 1, 1, 0.5, 4, 4, 4, 4, 4, 4]
    free = split_by_cost(costs, 3)
    assert 5 not in free
    forced = split_by_cost(costs, 3, encoder_stages=1, n_encoder=5)
    assert forced == [0, 5, 8, 11]
    assert list(split_by_cost(costs, 4, encoder_stages=2, n_encoder=5)[:3]) == [0, 2, 5]
    with pytest.raises(ValueError, match="n_encoder"):
        split_by_cost(costs, 3, encoder_stages=1)
    with pytest.raises(ValueError, match="encoder_stages"):
        split_by_cost(costs, 3, encoder_stages=3, n_encoder=5)
    with pytest.raises(ValueError, match="cannot put"):
        split_by_cost(costs, 3, encoder_stages=1, n_encoder=10)
    with pytest.raises(ValueError, match=">= 0"):
        split_by_cost([1, -1], 2)


def test_stage_bounds_are_validated_once_when_built() -> None:
    bounds = StageBounds(np.array([0, 3, 7]), n_layers=7, num_stages=2)
    assert bounds == [0, 3, 7] and bounds == (0, 3, 7) and bounds != [0, 3, 6]
    assert all(type(b) is int for b in bounds) and bounds.to_list() == [0, 3, 7]
    assert (bounds.num_stages, bounds.n_layers, bounds.sizes(), bounds.ranges()) == (2, 7, [3, 4], [(0, 3), (3, 7)])
    assert repr(bounds) == "[0, 3, 7]" and json.dumps({"b": bounds}) == '{"b": [0, 3, 7]}'
    assert StageBounds.from_sizes([2, 1, 4]) == [0, 2, 3, 7]
    assert {bounds: 1}[StageBounds([0, 3, 7])] == 1
    with pytest.raises(ValueError, match=r"stage_bounds \[0, 7\] needs num_stages \+ 1 = 3 entries"):
        StageBounds([0, 7], num_stages=2)
    with pytest.raises(ValueError, match=r"\[0, 3, 6\] end at layer 6, but the model has 7 layers"):
        StageBounds([0, 3, 6], n_layers=7)
    with pytest.raises(ValueError, match=r"\[0, 3, 3, 7\] are not increasing: stage 1 gets no layers"):
        StageBounds([0, 3, 3, 7])
    with pytest.raises(ValueError, match=r"\[0, 5, 4\] are not increasing: stage 1"):
        StageBounds([0, 5, 4])
    with pytest.raises(ValueError, match="must start at layer 0"):
        StageBounds([1, 3, 7])
    with pytest.raises(ValueError, match="must be integers"):
        StageBounds([0, 2.5, 7])
    with pytest.raises(ValueError, match="must be integers"):
        StageBounds([0, True, 7])
    with pytest.raises(ValueError, match="at least 2 entries"):
        StageBounds([0])


def test_plan_stage_bounds() -> None:
    assert plan_stage_bounds(11, 6, 2, encoder_stages=1) == [0, 6, 11]
    assert plan_stage_bounds(11, 6, 2) == [0, 5, 11]  # tie: earlier stages shorter
    assert plan_stage_bounds(11, 6, 2, layer_costs=[0] * 6 + [1] * 5) == [0, 8, 11]
    assert plan_stage_bounds(11, 6, 2, stage_bounds=[0, 5, 11]) == [0, 5, 11]
    assert plan_stage_bounds(11, 6, 1) == [0, 11]
    with pytest.raises(ValueError, match="do not end the encoder"):
        plan_stage_bounds(11, 6, 2, encoder_stages=1, stage_bounds=[0, 5, 11])
    with pytest.raises(ValueError, match="layer_costs"):
        plan_stage_bounds(11, 6, 2, layer_costs=[1.0] * 3)
    with pytest.raises(ValueError, match="more than one stage"):
        plan_stage_bounds(11, 6, 1, encoder_stages=1)


def test_mark_boundary_outputs() -> None:
    frozen_out = torch.randn(2, 3)  # what a frozen layer yields: no grad history
    ints = torch.tensor([1, 2])
    weight = torch.randn(3, requires_grad=True)
    tracked = frozen_out * weight
    outputs = mark_boundary_outputs((frozen_out, tracked, ints))
    assert outputs[0] is frozen_out and frozen_out.requires_grad and frozen_out.is_leaf
    assert outputs[1] is tracked and tracked.grad_fn is not None
    assert not ints.requires_grad
    single = torch.randn(4)
    assert mark_boundary_outputs(single) is single and single.requires_grad
    with torch.no_grad():
        plain = torch.randn(2)
        mark_boundary_outputs((plain,))
    assert not plain.requires_grad
    # the engine's backward over a marked output now works instead of raising
    frozen_out.backward(torch.ones_like(frozen_out))


def test_unused_float_inputs_finds_ignored_received_tensors() -> None:
    hidden = torch.randn(2, 3, requires_grad=True)  # as the engine receives it
    extra = torch.randn(2, requires_grad=True)
    empty = torch.randn(0, 4, requires_grad=True)
    lens = torch.tensor([3, 2])
    layer = torch.nn.Linear(3, 3)
    out = layer(hidden) + empty.sum()
    assert unused_float_inputs((hidden, empty, extra, lens), (out, lens)) == [2]
    assert unused_float_inputs((hidden, empty, lens), (out, lens)) == []
    assert unused_float_inputs((hidden, extra), (hidden, extra * 2)) == []  # pass-through counts as used
    with torch.no_grad():
        detached = layer(hidden)
    assert unused_float_inputs((hidden,), detached) == [0]
    # the engine passes clones of the received buffers: non-leaf inputs
    cloned, cloned_extra = hidden.clone(), extra.clone()
    assert unused_float_inputs((cloned, cloned_extra, lens), (layer(cloned), lens)) == [1]


def test_int_seed_accepts_numpy_ints() -> None:
    int_seed(np.int64(1234) + np.int64(3))
    a = torch.rand(1)
    int_seed(1237)
    assert torch.equal(a, torch.rand(1))


# ------------------------------------------------------------------ in-process DeepSpeed (1 rank)


@pytest.fixture(scope="module")
def single_rank():
    """A one-process gloo group, as ``deepspeed`` would set it up for rank 0 of 1."""
    import deepspeed
    import torch.distributed as dist

    created = not dist.is_initialized()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # one rank needs no shared-memory all-reduce: skip JIT-building DeepSpeed's shm comm op
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    os.environ.setdefault("LOCAL_RANK", "0")
    yield
    if created:
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_single_stage_module_matches_the_reference(single_rank) -> None:
    from dflop_ds.models import TinyMLLMConfig, TinyMLLMDataset, build_reference, collate_microbatch, tiny_mllm_layers
    from dflop_ds.pipe import MLLMPipelineModule, token_normalized_loss
    from dflop_ds.shapes import TINY_POLICY

    config = TinyMLLMConfig(vision_layers=2, llm_layers=2, vision_dim=32, llm_dim=64, vocab_size=128)
    encoder, projector, llm = tiny_mllm_layers(config, seed=4)
    module = MLLMPipelineModule(encoder, projector, llm, num_stages=1, freeze_encoder=True, seed_layers=True)
    assert module.parts == [0, 7] and module.dynamic_shape is True
    assert module.loss_fn is token_normalized_loss
    frozen = {name.split(".")[0] for name, p in module.named_parameters() if not p.requires_grad}
    assert frozen == {"0", "1", "2"}  # encoder frozen, projector (3) and LLM trainable

    reference = build_reference(config, seed=4)
    state = module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    shapes = [TINY_POLICY.shape("a", image_sizes=[(336, 336)], text_tokens=7), TINY_POLICY.shape("b", text_tokens=4)]
    ds = TinyMLLMDataset(shapes, config)
    inputs, labels = collate_microbatch([ds[0], ds[1]])
    with torch.no_grad():
        torch.testing.assert_close(module(inputs), reference(inputs))
    loss = module.loss_fn(module(inputs), labels)
    loss.backward()
    assert all(p.grad is None for n, p in module.named_parameters() if n.startswith("0."))
    assert module.get_parameter("3.embed.weight").grad is not None

    trainable = module.optimizer_parameters()
    assert len(trainable) == sum(1 for p in module.parameters() if p.requires_grad) > 0
    n_params = len(list(module.parameters()))
    module.requires_grad_(False)  # a stage with nothing to train still gets an optimizer parameter
    anchor = module.optimizer_parameters()
    assert len(anchor) == 1 and anchor[0].requires_grad and torch.equal(anchor[0], torch.zeros(1))
    assert module.optimizer_parameters()[0] is anchor[0]
    assert len(list(module.parameters())) == n_params + 1 and "frozen_stage_anchor" not in module.state_dict()
    module.train()
    out = module(inputs)  # the anchor joins the graph without changing any output value
    with torch.no_grad():
        torch.testing.assert_close(out, reference(inputs), rtol=0, atol=0)
    module.loss_fn(out, labels).backward()
    assert torch.equal(anchor[0].grad, torch.zeros(1))  # what DeepSpeed's gradient clipping needs
    torch.optim.SGD(anchor, lr=0.1)

    with pytest.raises(ValueError, match="entries"):
        MLLMPipelineModule(encoder, projector, llm, num_stages=1, stage_bounds=[0, 4, 8])
    with pytest.raises(TypeError, match="dynamic_shape"):
        MLLMPipelineModule(encoder, projector, llm, num_stages=1, dynamic_shape=False)
    with pytest.raises(ValueError, match="layer_costs"):
        MLLMPipelineModule(encoder, projector, llm, num_stages=1, layer_costs=[1.0])
