"""The 1F1B schedule (against DeepSpeed's own) and the discrete-event simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.plan.instructions import KINDS, format_schedule, stage_instructions, stage_order, train_schedule
from dflop_ds.plan.simulator import simulate_1f1b, simulate_stage_times


def _deepspeed_order(stages: int, n_mb: int, stage: int) -> list[tuple[str, int]]:
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    sched = TrainSchedule(micro_batches=n_mb, stages=stages, stage_id=stage)
    ops = []
    for step in range(2 * (n_mb + stages - 1)):
        mb, is_forward = sched._step_to_micro_batch(step)
        if 0 <= mb < n_mb:
            ops.append(("F" if is_forward else "B", mb))
    return ops


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n_mb", [1, 2, 5, 8])
def test_stage_order_matches_deepspeed_train_schedule(stages: int, n_mb: int) -> None:
    for s in range(stages):
        ours = [("F" if op.kind == "forward" else "B", op.microbatch) for op in stage_order(s, stages, n_mb)]
        assert ours == _deepspeed_order(stages, n_mb, s)


def test_schedule_table_is_plain_data() -> None:
    table = train_schedule(3, 4)
    assert len(table) == 2 * (4 + 3 - 1)
    for s in range(3):
        ops = [row[s] for row in table if row[s] is not None]
        assert sorted((o.kind, o.microbatch) for o in ops) == sorted(
            [("forward", j) for j in range(4)] + [("backward", j) for j in range(4)]
        )
    text = format_schedule(3, 4)
    assert text.splitlines()[0].split()[2] == "F0" and len(text.splitlines()) == 3


@pytest.mark.parametrize("stages,n_mb", [(1, 3), (2, 4), (3, 2), (4, 6)])
def test_instruction_stream_numbers_microbatches_so_neighbours_pair_up(stages: int, n_mb: int) -> None:
    from dflop_ds.telemetry import timers

    assert timers.KINDS is KINDS  # one vocabulary for the simulator and telemetry
    streams = [stage_instructions(s, stages, n_mb) for s in range(stages)]
    for stream in streams:
        flat = [i for slot in stream for i in slot]
        assert {i.name for i in flat} <= set(KINDS)
        for name in {i.name for i in flat if i.microbatch >= 0}:
            assert [i.microbatch for i in flat if i.name == name] == list(range(n_mb))
        assert [i.kind for i in stream[-1][-3:]] == ["reduce", "reduce", "optimizer"]
    pairs = {"SendGrad": "RecvGrad", "RecvActivation": "SendActivation"}
    for s in range(1, stages):
        for upper, lower in zip(streams[s], streams[s - 1]):
            for name, partner in pairs.items():
                mine = [i.microbatch for i in upper if i.name == name]
                theirs = [i.microbatch for i in lower if i.name == partner]
                assert mine == theirs  # the same slot, the same microbatch on both sides of the link


@pytest.mark.parametrize("p,m", [(1, 1), (1, 6), (2, 1), (2, 4), (4, 4), (4, 16), (8, 3), (5, 32)])
def test_bubble_fraction_of_equal_microbatches(p: int, m: int) -> None:
    res = simulate_1f1b(np.full((m, p), 1.0), np.full((m, p), 2.0))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert res.step_time == pytest.approx((m + p - 1) * 3.0)
    np.testing.assert_allclose(res.busy[0], 3.0 * m)


def test_transfers_and_allreduce_add_up_on_the_critical_path() -> None:
    # 2 stages, 1 microbatch: F0 -> send -> F1 B1 -> send -> B0 -> all-reduce of stage 0
    res = simulate_1f1b(np.array([[1.0, 2.0]]), np.array([[3.0, 4.0]]), act_comm=0.5, allreduce=np.array([0.25, 0.1]))
    assert res.pipeline_time[0] == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3)
    assert res.step_time == pytest.approx(11.0 + 0.25)


def test_slowest_rank_sets_the_step() -> None:
    fwd = np.ones((3, 4, 2))
    fwd[2, 1, 0] = 5.0
    res = simulate_1f1b(fwd, 2 * fwd)
    assert res.critical_rank == 2
    assert res.step_time == pytest.approx(res.rank_step_times.max())
    assert res.rank_step_times[0] < res.rank_step_times[2]


def test_simulate_stage_times_accepts_nested_lists() -> None:
    res = simulate_stage_times([[1, 1], [1, 1]], [[2, 2], [2, 2]], p2p_s=0.0)
    assert res.step_time == pytest.approx(9.0)
    with pytest.raises(ValueError, match="bwd"):
        simulate_1f1b(np.ones((2, 2)), np.ones((3, 2)))


def _reference_sim(fwd: np.ndarray, bwd: np.ndarray, comm: float) -> float:
    """Independent check: relax start times over each stage's DeepSpeed order until nothing moves."""
    m, p = fwd.shape
    orders = [stage_order(s, p, m) for s in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    changed = True
    while changed:
        changed = False
        for s in range(p):
            t = 0.0
            for op in orders[s]:
                key = (op.kind, op.microbatch, s)
                if op.kind == "forward":
                    dep = end.get(("forward", op.microbatch, s - 1), 0.0) + comm if s > 0 else 0.0
                    dur = fwd[op.microbatch, s]
                else:
                    dep = (
                        end.get(("backward", op.microbatch, s + 1), 0.0) + comm
                        if s < p - 1
                        else end.get(("forward", op.microbatch, s), 0.0)
                    )
                    dur = bwd[op.microbatch, s]
                t = max(t, dep) + dur
                if end.get(key) != t:
                    end[key], changed = t, True
    return max(end.values())


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 5),
    m=st.integers(1, 6),
    comm=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 10_000),
)
def test_vectorised_simulation_matches_a_naive_one(p: int, m: int, comm: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.1, 2.0, (m, p))
    bwd = rng.uniform(0.1, 4.0, (m, p))
    res = simulate_1f1b(fwd, bwd, act_comm=comm, transfers="overlapped")
    assert res.pipeline_time[0] == pytest.approx(_reference_sim(fwd, bwd, comm))
    # every operation respects its stage order and its inputs
    assert np.all(res.f_end >= res.f_start) and np.all(res.b_start >= res.f_end - 1e-12)


def _deepspeed_instruction_sim(fwd: np.ndarray, bwd: np.ndarray, act: np.ndarray, grad: np.ndarray) -> float:
    """Independent check of blocking transfers: run DeepSpeed's own ``TrainSchedule`` command
    lists; in every step a stage's sends/receives pair with its neighbour's, both wait for the
    later of the two, then spend the message's transfer time together."""
    from deepspeed.runtime.pipe import schedule as ds

    m, p = fwd.shape
    commands = [list(ds.TrainSchedule(m, p, s).steps()) for s in range(p)]
    free = np.zeros(p)
    done = {"ForwardPass": [0] * p, "BackwardPass": [0] * p}
    for step in range(len(commands[0])):
        for s in range(1, p):
            upper = [type(c).__name__ for c in commands[s][step]]
            lower = [type(c).__name__ for c in commands[s - 1][step]]
            assert ("SendGrad" in upper) == ("RecvGrad" in lower)
            assert ("RecvActivation" in upper) == ("SendActivation" in lower)
            seconds = 0.0
            if "SendGrad" in upper:  # the microbatch stage s ran backward on last
                seconds += grad[done["BackwardPass"][s] - 1, s - 1]
            if "RecvActivation" in upper:
                seconds += act[done["ForwardPass"][s], s - 1]
            if "SendGrad" in upper or "RecvActivation" in upper:
                free[s - 1] = free[s] = max(free[s - 1], free[s]) + seconds
        for s in range(p):
            for command in commands[s][step]:
                kind = type(command).__name__
                if kind in done:
                    times = fwd if kind == "ForwardPass" else bwd
                    free[s] += times[done[kind][s], s]
                    done[kind][s] += 1
    return float(free.max())


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_blocking_transfers_match_deepspeeds_own_schedule(p: int, m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.uniform(0.1, 2.0, (m, p)), rng.uniform(0.1, 4.0, (m, p))
    act, grad = rng.uniform(0.0, 0.5, (m, max(p - 1, 1))), rng.uniform(0.0, 0.5, (m, max(p - 1, 1)))
    res = simulate_1f1b(fwd, bwd, act_comm=act[:, : p - 1], grad_comm=grad[:, : p - 1])
    assert res.pipeline_time[0] == pytest.approx(_deepspeed_instruction_sim(fwd, bwd, act, grad))


def test_blocking_transfers_hold_both_stages() -> None:
    # 2 stages, 2 microbatches, 1 s per transfer: a blocking exchange also stalls the sender,
    # so the step is longer than with background transfers
    fwd, bwd = np.ones((2, 2)), 2 * np.ones((2, 2))
    blocking = simulate_1f1b(fwd, bwd, act_comm=1.0).step_time
    overlapped = simulate_1f1b(fwd, bwd, act_comm=1.0, transfers="overlapped").step_time
    assert blocking > overlapped
    with pytest.raises(ValueError, match="transfers"):
        simulate_1f1b(fwd, bwd, transfers="async")


def test_gantt_png_is_written(tmp_path) -> None:
    from dflop_ds.plan.gantt import plot_gantt

    a = simulate_1f1b(np.ones((4, 3)), 2 * np.ones((4, 3)), allreduce=0.5)
    b = simulate_1f1b(np.ones((2, 2)), 2 * np.ones((2, 2)))
    out = plot_gantt([("a", a), ("b", b)], tmp_path / "g.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
