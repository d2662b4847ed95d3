"""A failing exact solver never stops training: the heuristic split answers and the failure is logged."""

from __future__ import annotations

import logging

import numpy as np
import pulp
import pytest

from dflop_ds.schedule import ilp, partition
from dflop_ds.schedule.splitters import FALLBACK_SUFFIX, SplitRequest, SplitResult, make_splitter
from dflop_ds.schedule.splitters import dflop as split

N_MB, DP = 2, 2


def split_balanced(costs: np.ndarray, **limits: float) -> SplitResult:
    """The dflop splitter's split of a batch of ``len(costs)`` samples with the solver's ``limits``."""
    return make_splitter("dflop", **limits).split(SplitRequest(list(range(len(costs))), costs, N_MB, DP))


def off_bound_costs() -> np.ndarray:
    """A batch whose heuristic split is not provably optimal, so the exact solver is tried."""
    for seed in range(50):
        costs = np.random.default_rng(seed).integers(1, 100, size=(12, 2)).astype(float)
        heuristic = partition.partition_batch(costs, N_MB * DP, time_limit_s=0)
        if heuristic.makespan > heuristic.lower_bound * (1 + 1e-3):
            return costs
    pytest.skip("the heuristic reached the lower bound on every candidate batch")


def check_split(result, n_items: int) -> None:
    seen = sorted(i for rank in result.ranks for mb in rank for i in mb)
    assert seen == list(range(n_items))
    assert all(len(rank) == N_MB and all(rank) for rank in result.ranks)
    assert len(result.ranks) == DP


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(split, "_warned_fallback", set())


def test_solver_exception_falls_back_to_heuristic_and_warns_once(monkeypatch, caplog):
    costs = off_bound_costs()
    calls = []

    def broken_solver(*args, **kwargs):
        calls.append(1)
        raise pulp.PulpSolverError("solver crashed")

    monkeypatch.setattr(ilp, "solve_ilp", broken_solver)
    with caplog.at_level(logging.WARNING, logger=split.__name__):
        first = split_balanced(costs, time_limit_s=1.0)
        second = split_balanced(costs, time_limit_s=1.0)
    assert len(calls) == 2, "the exact solver was never tried: the test would prove nothing"
    for result in (first, second):
        check_split(result, len(costs))
        assert result.solver.endswith(FALLBACK_SUFFIX)
    heuristic = split_balanced(costs, time_limit_s=0)
    assert first.ranks == heuristic.ranks and first.makespan == heuristic.makespan
    warnings = [r for r in caplog.records if "solver failed" in r.getMessage()]
    assert len(warnings) == 1 and "PulpSolverError" in warnings[0].getMessage()


def test_missing_cbc_binary_falls_back(monkeypatch):
    costs = off_bound_costs()
    monkeypatch.setattr(ilp, "available_solver", lambda: "cbc")
    monkeypatch.setattr(ilp.pulp, "PULP_CBC_CMD", lambda **kwargs: pulp.COIN_CMD(path="/nonexistent/cbc", msg=False))
    result = split_balanced(costs, time_limit_s=1.0)
    check_split(result, len(costs))
    assert result.solver.endswith(FALLBACK_SUFFIX)


def test_bad_costs_are_refused_not_fallen_back():
    costs = np.ones((8, 2))
    costs[3, 1] = np.nan
    with pytest.raises(ValueError, match="item 3"):
        split_balanced(costs, time_limit_s=1.0)


def test_errors_without_solver_are_not_hidden(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("bug in the heuristic")

    monkeypatch.setattr(partition, "solve", broken)  # where the dflop splitter looks it up
    with pytest.raises(RuntimeError, match="bug in the heuristic"):
        split_balanced(np.ones((8, 2)), time_limit_s=0)


def test_solver_without_a_solution_keeps_the_heuristic_split(monkeypatch):
    """A time-out or non-optimal status with no incumbent: the heuristic answer stands."""
    costs = off_bound_costs()
    calls = []

    def no_solution(*args, **kwargs):
        calls.append(1)
        return ilp.IlpResult(labels=None, optimal=False, infeasible=False, solver="cbc")

    monkeypatch.setattr(ilp, "solve_ilp", no_solution)
    result = split_balanced(costs, time_limit_s=1.0)
    heuristic = split_balanced(costs, time_limit_s=0)
    assert calls, "the exact solver was never tried"
    check_split(result, len(costs))
    assert result.ranks == heuristic.ranks and not result.solver.startswith("ilp")


def test_a_node_limited_exact_solve_is_repeatable_and_beats_the_heuristic():
    costs = off_bound_costs()
    heuristic = partition.partition_batch(costs, N_MB * DP, time_limit_s=0)
    runs = [partition.partition_batch(costs, N_MB * DP, time_limit_s=0, node_limit=2000, seed=3) for _ in range(3)]
    assert all(run.solver.startswith("ilp") for run in runs)
    assert runs[0].makespan < heuristic.makespan
    assert all(run.buckets == runs[0].buckets for run in runs)  # no clock: the same split every time
    result = split_balanced(costs, node_limit=2000)
    assert result.solver.startswith("ilp")
    with pytest.raises(ValueError, match="node_limit"):
        partition.partition_batch(costs, N_MB * DP, time_limit_s=0, node_limit=-5)
