"""Discrete-event simulation of one training step under DeepSpeed's 1F1B schedule.

Each stage runs its operations in the order of DeepSpeed's own instruction stream
(:mod:`dflop_ds.plan.instructions`); an operation starts when its stage is free and its input
has arrived:

- forward of microbatch ``j`` on stage ``s``: after the forward of ``j`` on ``s - 1`` plus the
  activation transfer ``s - 1 -> s``;
- backward of ``j`` on ``s``: after the backward of ``j`` on ``s + 1`` plus the gradient transfer
  ``s + 1 -> s`` (on the last stage: after its own forward of ``j``).

Two transfer models:

- ``"blocking"`` (default): what DeepSpeed's engine does. A slot of ``TrainSchedule`` starts
  with the neighbours' exchange (``SendGrad``/``RecvActivation`` on the stage running a
  forward, ``RecvGrad``/``SendActivation`` on the one before it); the sends and receives
  block, so both stages wait for each other and then spend the transfer time together.
- ``"overlapped"``: each link transfers in the background, as with asynchronous sends.

A single stage without a pipeline is scored under the engine's synchronisation model instead
(:func:`simulate_synchronised`, :mod:`dflop_ds.sync`): ranks meet at the accumulation boundary,
every micro-step, or per module (encoder and LLM apart).

After its last backward each stage all-reduces its gradients across data-parallel replicas;
the step ends when every stage of every data-parallel rank is done. All ranks run the same
schedule, so the simulation is vectorised over ranks (and over the stages active in one
slot), which keeps a 128-rank, 32-microbatch, 16-stage step at a few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dflop_ds.plan.instructions import compute_of, stage_instructions
from dflop_ds.sync import SyncModel, as_sync_model


@dataclass
class SimResult:
    """The outcome of one simulated step.

    Arrays are indexed ``[rank, microbatch, stage]`` (times) or ``[rank, stage]``.

    Attributes:
        step_time: seconds from the first forward to the end of the last all-reduce, slowest rank.
        rank_step_times: ``(R,)`` the same per data-parallel rank.
        pipeline_time: ``(R,)`` seconds until each rank's last backward ends (no all-reduce).
        busy: ``(R, p)`` compute seconds per stage.
        idle: ``(R, p)`` ``pipeline_time - busy`` per stage (pipeline bubbles).
        bubble_fraction: idle share of the slowest rank's pipeline phase,
            ``sum(idle) / (p * pipeline_time)``; equals ``(p - 1) / (m + p - 1)`` for equal
            microbatches without transfer time.
        critical_rank: index of the slowest rank.
        f_start, f_end, b_start, b_end: ``(R, m, p)`` operation times.
        allreduce: ``(R, p)`` all-reduce seconds per stage, started after each stage's last backward.
        phases: seconds of the phases outside the pipeline (a colocated encoder's, see
            :func:`simulate_colocated`); empty otherwise.
    """

    step_time: float
    rank_step_times: np.ndarray
    pipeline_time: np.ndarray
    busy: np.ndarray
    idle: np.ndarray
    bubble_fraction: float
    critical_rank: int
    f_start: np.ndarray
    f_end: np.ndarray
    b_start: np.ndarray
    b_end: np.ndarray
    allreduce: np.ndarray
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        """Pipeline stages simulated."""
        return int(self.busy.shape[1])

    @property
    def n_mb(self) -> int:
        """Microbatches per rank."""
        return int(self.f_start.shape[1])

    def without_timelines(self) -> SimResult:
        """The same step without its per-operation times (``f_start`` .. ``b_end`` become empty
        ``(R, 0, p)`` arrays, so ``n_mb`` reads 0): what the search keeps of its many candidates.
        Simulate the layout again to draw it."""
        empty = np.empty((self.busy.shape[0], 0, self.busy.shape[1]))
        return replace(self, f_start=empty, f_end=empty, b_start=empty, b_end=empty)

    def summary(self) -> dict:
        """Plain numbers of the slowest rank (for printing and JSON)."""
        r = self.critical_rank
        return {
            "step_time_s": float(self.step_time),
            "pipeline_time_s": float(self.pipeline_time[r]),
            "bubble_fraction": float(self.bubble_fraction),
            "busy_s": [float(x) for x in self.busy[r]],
            "idle_s": [float(x) for x in self.idle[r]],
        }


def _as_rmp(name: str, x: np.ndarray | float, shape: tuple[int, int, int]) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    if arr.ndim == 2 and shape[0] == 1:
        arr = arr[None]
    try:
        return np.broadcast_to(arr, shape).astype(float, copy=True)
    except ValueError:
        raise ValueError(f"{name}: shape {arr.shape} does not broadcast to {shape}") from None


TRANSFERS = ("blocking", "overlapped")


def _slot_tables(n_stages: int, n_mb: int) -> list[tuple[np.ndarray, ...]]:
    """Per slot, from DeepSpeed's instruction stream: forward stages and their microbatches,
    backward stages and theirs, and the exchanges that open the slot: stages ``s`` trading with
    ``s - 1`` (``SendGrad``/``RecvActivation``), the microbatch whose gradient goes back and the
    one whose activation comes in (``-1``: none)."""
    stages = [stage_instructions(s, n_stages, n_mb) for s in range(n_stages)]
    tables = []
    for t in range(len(stages[0])):
        columns: tuple[list[int], ...] = ([], [], [], [], [], [], [])
        fs, fm, bs, bm, xs, xg, xa = columns
        for s in range(n_stages):
            slot = {i.name: i.microbatch for i in stages[s][t]}
            if "SendGrad" in slot or "RecvActivation" in slot:
                xs.append(s)
                xg.append(slot.get("SendGrad", -1))
                xa.append(slot.get("RecvActivation", -1))
            op = compute_of(stages[s][t])
            if op is not None:
                (fs if op.kind == "forward" else bs).append(s)
                (fm if op.kind == "forward" else bm).append(op.microbatch)
        tables.append(tuple(np.array(v, dtype=int) for v in columns))
    return tables


_TABLE_CACHE: dict[tuple[int, int], list] = {}


def _cached_tables(n_stages: int, n_mb: int) -> list:
    key = (n_stages, n_mb)
    if key not in _TABLE_CACHE:
        if len(_TABLE_CACHE) > 256:
            _TABLE_CACHE.clear()
        _TABLE_CACHE[key] = _slot_tables(n_stages, n_mb)
    return _TABLE_CACHE[key]


def simulate_1f1b(
    fwd: np.ndarray,
    bwd: np.ndarray,
    *,
    act_comm: np.ndarray | float = 0.0,
    grad_comm: np.ndarray | float | None = None,
    allreduce: np.ndarray | float = 0.0,
    transfers: str = "blocking",
) -> SimResult:
    """Simulate one step from per-microbatch, per-stage times.

    Args:
        fwd: forward seconds, ``(m, p)`` for one rank or ``(R, m, p)`` for R data-parallel ranks.
        bwd: backward seconds, same shape as ``fwd``.
        act_comm: activation transfer seconds ``s -> s + 1``: scalar, ``(m, p - 1)`` or ``(R, m, p - 1)``.
        grad_comm: gradient transfer seconds ``s + 1 -> s``, same shapes (default: ``act_comm``).
        allreduce: gradient all-reduce seconds per stage: scalar, ``(p,)`` or ``(R, p)``.
        transfers: ``"blocking"`` (DeepSpeed's engine: neighbours exchange at the start of a
            slot and both wait for it) or ``"overlapped"`` (background transfers).

    Returns:
        A :class:`SimResult`.
    """
    if transfers not in TRANSFERS:
        raise ValueError(f"unknown transfers {transfers!r}; choose one of {TRANSFERS}")
    blocking = transfers == "blocking"
    fwd = np.asarray(fwd, dtype=float)
    if fwd.ndim == 2:
        fwd = fwd[None]
    if fwd.ndim != 3:
        raise ValueError(f"fwd must be (m, p) or (R, m, p), got shape {fwd.shape}")
    n_ranks, n_mb, n_stages = fwd.shape
    if n_mb < 1 or n_stages < 1:
        raise ValueError(f"need at least one microbatch and one stage, got fwd shape {fwd.shape}")
    bwd = _as_rmp("bwd", bwd, fwd.shape)
    links = (n_ranks, n_mb, max(n_stages - 1, 0))
    act = _as_rmp("act_comm", act_comm, links)
    grad = act if grad_comm is None else _as_rmp("grad_comm", grad_comm, links)
    ar = np.asarray(allreduce, dtype=float)
    ar = np.broadcast_to(ar[None] if ar.ndim == 1 else ar, (n_ranks, n_stages)).astype(float)

    f_start = np.zeros_like(fwd)
    f_end = np.zeros_like(fwd)
    b_start = np.zeros_like(fwd)
    b_end = np.zeros_like(fwd)
    free = np.zeros((n_ranks, n_stages))
    for fs, fm, bs, bm, xs, xg, xa in _cached_tables(n_stages, n_mb):
        if blocking and xs.size:
            link = xs - 1
            seconds = np.where(xg >= 0, grad[:, np.maximum(xg, 0), link], 0.0) + np.where(
                xa >= 0, act[:, np.maximum(xa, 0), link], 0.0
            )
            done = np.maximum(free[:, link], free[:, xs]) + seconds
            free[:, link], free[:, xs] = done, done
        if fs.size:
            prev = np.maximum(fs - 1, 0)
            if links[2] and not blocking:
                arrived = f_end[:, fm, prev] + act[:, fm, np.minimum(prev, links[2] - 1)]
                ready = np.where(fs > 0, arrived, 0.0)
            else:
                ready = np.zeros((n_ranks, fs.size))
            start = np.maximum(free[:, fs], ready)
            end = start + fwd[:, fm, fs]
            f_start[:, fm, fs], f_end[:, fm, fs], free[:, fs] = start, end, end
        if bs.size:
            nxt = np.minimum(bs + 1, n_stages - 1)
            sent = grad[:, bm, np.minimum(bs, links[2] - 1)] if links[2] and not blocking else 0.0
            from_next = b_end[:, bm, nxt] + sent
            ready = np.where(bs < n_stages - 1, from_next, f_end[:, bm, bs])
            start = np.maximum(free[:, bs], ready)
            end = start + bwd[:, bm, bs]
            b_start[:, bm, bs], b_end[:, bm, bs], free[:, bs] = start, end, end

    busy = fwd.sum(axis=1) + bwd.sum(axis=1)
    last_backward = b_end.max(axis=1)
    pipeline_time = last_backward.max(axis=1)
    rank_step = (last_backward + ar).max(axis=1)
    idle = pipeline_time[:, None] - busy
    critical = int(np.argmax(rank_step))
    denom = n_stages * pipeline_time[critical]
    bubble = max(0.0, float(idle[critical].sum() / denom)) if denom > 0 else 0.0
    return SimResult(
        step_time=float(rank_step[critical]),
        rank_step_times=rank_step,
        pipeline_time=pipeline_time,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        critical_rank=critical,
        f_start=f_start,
        f_end=f_end,
        b_start=b_start,
        b_end=b_end,
        allreduce=ar,
    )


def simulate_synchronised(
    times: np.ndarray,
    sync: SyncModel | str,
    *,
    forward_fraction: float,
    allreduce: np.ndarray | float = 0.0,
) -> SimResult:
    """Simulate one single-stage step (no pipeline) whose data-parallel ranks meet as ``sync`` says.

    ``times[r, k, c]`` are the forward+backward seconds of rank ``r``'s ``k``-th microbatch in
    column ``c`` (encoder, LLM; any number of columns run one after the other), ``forward_fraction``
    their forward's share. Each microbatch opens a slot: under ``boundary`` a rank runs its own
    microbatches back to back (it waits only for the gradient reduction at the end); under
    ``microstep`` slot ``k`` lasts the slowest rank's ``k``-th microbatch; under ``module`` it lasts
    the slowest rank's column ``c`` summed over the columns (each module meets on its own). The
    compute part of the step equals :func:`dflop_ds.sync.step_cost`; ``allreduce`` (scalar,
    ``(1,)`` or ``(R, 1)``) follows the last slot. Raises ``ValueError`` for a pipeline.
    """
    sync = as_sync_model(sync)
    if sync.pipelined:
        raise ValueError("a pipeline is simulated by simulate_1f1b, not simulate_synchronised")
    t = np.asarray(times, dtype=float)
    if t.ndim != 3 or t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"times must be (ranks, microbatches, columns) with at least one of each, got {t.shape}")
    own = t.sum(axis=2)
    if sync is SyncModel.BOUNDARY:
        slot = own
    elif sync is SyncModel.MICROSTEP:
        slot = np.broadcast_to(own.max(axis=0), own.shape)
    else:
        slot = np.broadcast_to(t.max(axis=0).sum(axis=1), own.shape)
    start = np.cumsum(slot, axis=1) - slot
    f_start = start[..., None]
    f_end = (start + forward_fraction * own)[..., None]
    b_end = (start + own)[..., None]
    n_ranks = t.shape[0]
    ar = np.broadcast_to(np.asarray(allreduce, dtype=float), (n_ranks, 1)).astype(float)
    pipeline_time = slot.sum(axis=1)
    rank_step = pipeline_time + ar[:, 0]
    busy = own.sum(axis=1)[:, None]
    idle = pipeline_time[:, None] - busy
    critical = int(np.argmax(rank_step))
    bubble = float(idle[critical, 0] / pipeline_time[critical]) if pipeline_time[critical] > 0 else 0.0
    return SimResult(
        step_time=float(rank_step[critical]),
        rank_step_times=rank_step,
        pipeline_time=pipeline_time,
        busy=busy,
        idle=idle,
        bubble_fraction=max(0.0, bubble),
        critical_rank=critical,
        f_start=f_start,
        f_end=f_end,
        b_start=f_end.copy(),
        b_end=b_end,
        allreduce=ar,
    )


def simulate_stage_times(
    fwd: np.ndarray,
    bwd: np.ndarray,
    *,
    p2p_s: np.ndarray | float = 0.0,
    allreduce_s: np.ndarray | float = 0.0,
    transfers: str = "blocking",
) -> SimResult:
    """Simulate measured (or predicted) per-microbatch stage times, for validation runs.

    ``fwd[j][s]`` / ``bwd[j][s]`` are the forward / backward seconds of microbatch ``j`` on stage
    ``s`` of one data-parallel rank (nested lists are fine); ``p2p_s`` is the transfer time
    between neighbouring stages (scalar or ``(m, p - 1)``), ``allreduce_s`` the gradient
    all-reduce per stage. Compare ``result.step_time`` with a measured step.
    """
    return simulate_1f1b(
        np.asarray(fwd, float), np.asarray(bwd, float), act_comm=p2p_s, allreduce=allreduce_s, transfers=transfers
    )


def simulate_colocated(
    fwd: np.ndarray,
    bwd: np.ndarray,
    *,
    encoder_fwd: float,
    encoder_bwd: float,
    exchange: float = 0.0,
    act_comm: np.ndarray | float = 0.0,
    allreduce: np.ndarray | float = 0.0,
    encoder_allreduce: float = 0.0,
    transfers: str = "blocking",
    sync: SyncModel | str = SyncModel.PIPELINE,
) -> SimResult:
    """One step with a colocated encoder: the encoder forward, data-parallel over every GPU; the
    feature exchange (an all-to-all, a collective: every rank waits for the slowest); the LLM
    pipeline (:func:`simulate_1f1b` of the LLM stages' ``fwd``/``bwd``, ``act_comm``,
    ``allreduce``); the gradient exchange back; the encoder backward and its gradient all-reduce
    over every GPU.

    ``encoder_fwd``/``encoder_bwd`` are the phases' seconds on the slowest GPU, ``exchange`` one
    direction of the exchange. Operation times are shifted by the encoder phase before the
    pipeline; ``busy`` counts the encoder phases on every stage. A single LLM stage whose ranks
    meet as ``sync`` says (not ``pipeline``) is simulated by :func:`simulate_synchronised`.
    """
    if as_sync_model(sync).pipelined:
        pipe = simulate_1f1b(fwd, bwd, act_comm=act_comm, allreduce=allreduce, transfers=transfers)
    else:
        fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
        if fwd.shape[-1] != 1:
            raise ValueError(f"sync {sync}: a synchronised step has one stage, got {fwd.shape[-1]}")
        total = fwd + bwd
        share = float(fwd.sum() / total.sum()) if total.sum() > 0 else 0.0
        pipe = simulate_synchronised(
            total.reshape(-1, *total.shape[-2:]), sync, forward_fraction=share, allreduce=allreduce
        )
    before = float(encoder_fwd) + float(exchange)
    after = float(exchange) + float(encoder_bwd)
    step = before + pipe.step_time + after + float(encoder_allreduce)
    busy = pipe.busy + float(encoder_fwd) + float(encoder_bwd)
    pipeline_time = before + pipe.pipeline_time + after
    idle = pipeline_time[:, None] - busy
    critical = pipe.critical_rank
    denom = pipe.n_stages * pipeline_time[critical]
    return replace(
        pipe,
        step_time=step,
        rank_step_times=np.full_like(pipe.rank_step_times, step),  # the exchanges synchronise every rank
        pipeline_time=pipeline_time,
        busy=busy,
        idle=idle,
        bubble_fraction=max(0.0, float(idle[critical].sum() / denom)) if denom > 0 else 0.0,
        f_start=pipe.f_start + before,
        f_end=pipe.f_end + before,
        b_start=pipe.b_start + before,
        b_end=pipe.b_end + before,
        phases={
            "encoder_forward_s": float(encoder_fwd),
            "exchange_s": float(exchange),
            "encoder_backward_s": float(encoder_bwd),
            "encoder_allreduce_s": float(encoder_allreduce),
        },
    )
