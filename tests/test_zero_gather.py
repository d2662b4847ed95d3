"""dflop_ds.zero_gather: which DeepSpeed releases get ZeRO-3's waited gather, and that gather on ranks.

The gather read too early (DeepSpeed before 0.19.8 on CPU ranks) shows only in such an
environment: `make test-frameworks`' ``llamafactory_zero3_weights`` check loads a checkpoint
under LLaMA-Factory's DeepSpeed 0.18.4 (tests/frameworks/zero3_weights.py)."""

from __future__ import annotations

from ds_runs import REPO, run_on_ranks

from dflop_ds.zero_gather import FIXED_IN, gathers_read_early


def test_releases_before_the_fix_on_an_unsynchronised_accelerator_are_the_ones_patched():
    assert gathers_read_early("0.18.4", synchronize_skipped=True)
    assert gathers_read_early("0.19.6", synchronize_skipped=True)
    assert gathers_read_early("0.19.7+cpu", synchronize_skipped=True)
    assert not gathers_read_early("0.18.4", synchronize_skipped=False)  # CUDA: its synchronize waits for all
    assert not gathers_read_early(str(FIXED_IN), synchronize_skipped=True)
    assert not gathers_read_early("0.19.8+cu130", synchronize_skipped=True)
    assert not gathers_read_early("0.20.1", synchronize_skipped=True)


def test_the_waited_gather_returns_what_rank_0_wrote_on_two_ranks():
    result = run_on_ranks(REPO / "tests" / "ds_scripts" / "zero_gather_check.py", [], timeout=300)
    assert result.stdout.count("8 layers gathered as written") == 2, result.stdout
