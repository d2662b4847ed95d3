"""The token-normalized loss: variable-size microbatches give the gradient of the whole global batch.

The DeepSpeed pipeline engine's scaling is reproduced in plain torch: each microbatch loss is
multiplied by 1/GAS before backward, gradients are summed over a rank's microbatches and averaged
over the dp ranks.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dflop_ds.models import TinyMLLMConfig, TinyMLLMDataset, build_reference, collate_microbatch, label_tokens_in
from dflop_ds.pipe import token_loss_sum, token_normalized_loss
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.shapes import TINY_POLICY

torch.set_num_threads(1)

CONFIG = TinyMLLMConfig(vision_layers=1, llm_layers=2, vision_dim=32, llm_dim=64, vocab_size=128)
IMAGES = [(), ((336, 336),), ((672, 336),)]


def make_dataset(n: int = 10, seed: int = 0) -> TinyMLLMDataset:
    rng = random.Random(seed)
    shapes = []
    for i in range(n):
        text = rng.randint(3, 30)
        shapes.append(
            TINY_POLICY.shape(
                f"s{i}", image_sizes=rng.choice(IMAGES), text_tokens=text, label_tokens=rng.randint(1, text)
            )
        )
    return TinyMLLMDataset(shapes, CONFIG, seed=seed)


def as_double(batch):
    (pixels, ids, text_lens, tiles), (targets, denom) = batch
    return (pixels.double(), ids, text_lens, tiles), (targets, denom.double())


def grads_of(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def global_batch_grads(model: torch.nn.Module, ds: TinyMLLMDataset, indices: list[int]) -> tuple[torch.Tensor, float]:
    """Gradient of the global batch as one batch with a token-mean loss (plain int indices)."""
    model.zero_grad()
    inputs, labels = as_double(collate_microbatch([ds[i] for i in indices]))
    loss = token_normalized_loss(model(inputs), labels)
    loss.backward()
    return grads_of(model), float(loss.detach())


def pipeline_grads(
    model: torch.nn.Module, ds: TinyMLLMDataset, ranks: list[list[list[int]]], scheduled: bool
) -> tuple[torch.Tensor, float]:
    """Gradient DeepSpeed would apply: per rank, sum over microbatches of loss/GAS; mean over ranks.

    With ``scheduled`` the indices carry the global-batch denominator; otherwise every
    microbatch is normalized by its own label tokens (per-microbatch mean).
    """
    dp, gas = len(ranks), len(ranks[0])
    everything = [ds[i] for rank in ranks for mb in rank for i in mb]
    denominator = label_tokens_in(everything) / (gas * dp)
    total, reported = None, 0.0
    for rank in ranks:
        model.zero_grad()
        rank_loss = 0.0
        for mb in rank:
            items = [ds[ScheduledIndex(i, denominator) if scheduled else i] for i in mb]
            inputs, labels = as_double(collate_microbatch(items))
            loss = token_normalized_loss(model(inputs), labels)
            (loss / gas).backward()
            rank_loss += float(loss.detach()) / gas
        g = grads_of(model)
        total = g if total is None else total + g
        reported += rank_loss / dp
    return total / dp, reported


@pytest.fixture(scope="module")
def setup():
    ds = make_dataset()
    model = build_reference(CONFIG, seed=1).double()
    return ds, model


# dp=2 ranks x GAS=3 microbatches of 1..3 samples: every microbatch has another size and shape
SPLIT = [[[0], [1, 2, 3], [4]], [[5, 6], [7], [8, 9]]]


def test_variable_microbatches_give_the_global_batch_gradient(setup) -> None:
    ds, model = setup
    reference, ref_loss = global_batch_grads(model, ds, list(range(10)))
    split, reported = pipeline_grads(model, ds, SPLIT, scheduled=True)
    torch.testing.assert_close(split, reference, rtol=1e-9, atol=1e-12)
    assert reported == pytest.approx(ref_loss, rel=1e-12)  # the engine's reported loss is the token mean too


def test_other_splits_give_the_same_gradient(setup) -> None:
    ds, model = setup
    reference, _ = global_batch_grads(model, ds, list(range(10)))
    one_rank = [[[9, 0, 4, 1], [2], [3, 8], [5, 6, 7]]]
    # every rank needs GAS microbatches: the 4-rank split repeats sample 0 to fill the last one
    four_ranks = [[[0], [1, 2]], [[3, 4, 5], [6]], [[7], [8]], [[9], [0]]]
    grads, _ = pipeline_grads(model, ds, one_rank, scheduled=True)
    torch.testing.assert_close(grads, reference, rtol=1e-9, atol=1e-12)
    reference4, _ = global_batch_grads(model, ds, [*range(10), 0])
    grads4, _ = pipeline_grads(model, ds, four_ranks, scheduled=True)
    torch.testing.assert_close(grads4, reference4, rtol=1e-9, atol=1e-12)


def test_per_microbatch_mean_would_not_match(setup) -> None:
    ds, model = setup
    reference, _ = global_batch_grads(model, ds, list(range(10)))
    naive, _ = pipeline_grads(model, ds, SPLIT, scheduled=False)
    relative = float((naive - reference).norm() / reference.norm())
    assert relative > 0.05, f"per-microbatch mean unexpectedly matched (relative difference {relative:.2e})"


def test_token_normalized_loss_value() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.tensor([[1, -100, 3, 4, -100], [-100, -100, 6, 0, 2]])
    expected = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=-100, reduction="sum") / 2.5
    got = token_normalized_loss(logits, (targets, torch.tensor(2.5)))
    torch.testing.assert_close(got, expected)
    # with the token count as denominator it is the usual token mean
    mean = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(token_normalized_loss(logits, (targets, torch.tensor(6.0))), mean)
    assert float(token_loss_sum(logits, torch.full((2, 5), -100))) == 0.0


def test_token_normalized_loss_errors() -> None:
    logits = torch.randn(2, 5, 7)
    with pytest.raises(ValueError, match="do not align"):
        token_normalized_loss(logits, (torch.zeros(2, 4, dtype=torch.long), torch.tensor(1.0)))
    with pytest.raises(ValueError, match="> 0"):
        token_normalized_loss(logits, (torch.zeros(2, 5, dtype=torch.long), torch.tensor(0.0)))
    with pytest.raises(ValueError, match="targets, loss_denominator"):
        token_normalized_loss(logits, (torch.zeros(2, 5, dtype=torch.long),))
