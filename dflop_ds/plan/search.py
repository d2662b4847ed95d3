"""The parallelism search: enumerate layouts, rank them by a cheap estimate, simulate the best.

Three families are searched for a cluster, a cost model and the data (a list of sample shapes
global batches are drawn from):

- ``separate``: DFLOP's general space, encoder and LLM on separate GPU sets,
  ``E_tp*E_pp*E_dp + L_tp*L_pp*L_dp = GPUs``, our balanced microbatches;
- ``deepspeed``: one DeepSpeed pipeline, shared tp and dp, ``GPUs = stages * tp * dp``, layers
  split by cost (a stage may hold encoder and LLM layers), our balanced microbatches; ``dp * n_mb``
  divides the global batch, so DeepSpeed's ``train_batch_size`` equals it;
- ``monolithic``: the stock baseline, same space as ``deepspeed`` but DeepSpeed's uniform layer
  split and fixed-size sequential microbatches.

Pruning, in order: (1) every layout gets a vectorised memory estimate and step-time estimate
``max(n_mb * d_mean, d_heavy) + (stages - 1) * d_max + all-reduce`` (``d_mean`` the average
per-stage time of a microbatch, ``d_heavy`` that of the heaviest sample, ``d_max`` the larger of
the two; stock microbatches are charged their expected padding by order statistics); layouts over the
memory estimate are dropped; (2) only the ``top_k`` best estimates per family are simulated, on
the first sampled global batch, with a padding-aware vector LPT; a simulated layout whose
exact memory check fails is replaced by the next; those within ``refine_margin`` of their
family's best are scored on the other sampled batches too; (3) the best few are re-scored with
our scheduler's ``partition_batch`` (heuristic with improving moves measured by the cost
model's padded microbatch cost, no ILP), as the sampler would split the batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.evaluate import Evaluation, evaluate
from dflop_ds.plan.stages import layer_costs
from dflop_ds.plan.layout import Layout, Segment, balanced_bounds, separate_stages, stages_from_bounds, uniform_bounds
from dflop_ds.shapes import SampleShape

FAMILIES = ("separate", "deepspeed", "monolithic")
DEFAULT_NMB = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class PlanError(ValueError):
    """No layout fits the cluster (memory, GPU count or batch size)."""


@dataclass
class Scored:
    """A simulated layout.

    Attributes:
        layout: the layout.
        family: ``"separate"``, ``"deepspeed"`` or ``"monolithic"``.
        step_time: mean simulated step seconds over the sampled batches.
        step_times: per batch.
        bubble_fraction: mean pipeline idle share (slowest rank).
        memory: ``(n_stages,)`` peak bytes per GPU of each stage over the batches.
        estimate: the analytic estimate that ranked it.
        evaluations: the per-batch evaluations (simulations, microbatches).
    """

    layout: Layout
    family: str
    step_time: float
    step_times: list[float]
    bubble_fraction: float
    memory: np.ndarray
    estimate: float
    evaluations: list[Evaluation] = field(repr=False, default_factory=list)

    @property
    def feasible(self) -> bool:
        """Every batch fitted in memory."""
        return all(e.feasible for e in self.evaluations)


@dataclass
class SearchResult:
    """The outcome of :func:`search`.

    Attributes:
        best: best layout overall (any family).
        best_deepspeed: best layout stock DeepSpeed runs as is (ours: balanced, cost split).
        monolithic: the stock baseline (uniform split, fixed-size microbatches); None when no
            such layout fits in memory (ours may still fit: its split is memory-aware).
        candidates: every simulated layout.
        n_layouts: layouts enumerated (before pruning).
        seconds: wall time of the search.
    """

    best: Scored
    best_deepspeed: Scored
    monolithic: Scored | None
    candidates: list[Scored]
    n_layouts: int
    seconds: float

    @property
    def gap(self) -> float:
        """How much slower the best DeepSpeed-runnable plan is than the best overall (0.1 = 10%)."""
        return self.best_deepspeed.step_time / self.best.step_time - 1.0

    def speedup(self, scored: Scored) -> float | None:
        """Predicted speed-up of ``scored`` over the monolithic baseline (None without a baseline)."""
        return None if self.monolithic is None else self.monolithic.step_time / scored.step_time


def sample_batches(n_pool: int, global_batch: int, n_batches: int, seed: int) -> list[np.ndarray]:
    """``n_batches`` random global batches (indices into the pool; with replacement only if the pool is smaller)."""
    if n_pool < 1:
        raise PlanError("no sample shapes to draw global batches from")
    rng = np.random.default_rng(seed)
    replace = n_pool < global_batch
    return [rng.choice(n_pool, size=global_batch, replace=replace) for _ in range(n_batches)]


@dataclass
class _Data:
    """Batch statistics the estimates use (seconds at tp=1, bytes over the whole depth)."""

    batch: int
    work: np.ndarray  # (2,) mean per-batch seconds [enc, llm]
    heavy: np.ndarray  # (2,) seconds of the heaviest sample
    act_mean: np.ndarray  # (2,) mean activation bytes per sample
    act_heavy: np.ndarray  # (2,) largest single-sample activation bytes
    work_bytes: np.ndarray  # (2,) largest single-sample one-layer working bytes
    llm_sorted: np.ndarray  # per-sample LLM seconds of the sampled batches, ascending

    def padded_llm_work(self, k: np.ndarray) -> np.ndarray:
        """Expected LLM seconds of a batch cut into random microbatches of ``k`` samples, each
        padded to its longest: ``batch * E[max of k sample costs]`` (order statistics)."""
        c = self.llm_sorted
        n = len(c)
        ks, inverse = np.unique(np.asarray(k, dtype=float), return_inverse=True)
        frac = np.arange(n + 1) / n
        cdf = frac[None, :] ** ks[:, None]  # P(max of k <= c_(i))
        expected_max = (cdf[:, 1:] - cdf[:, :-1]) @ c
        return self.batch * expected_max[inverse]


def _data_stats(model: Any, pool: Sequence[SampleShape], costs: np.ndarray, batches: list[np.ndarray]) -> _Data:
    used = np.unique(np.concatenate(batches))
    act = np.array([model.predict_activation_bytes([pool[i]]) for i in used])
    if hasattr(model, "predict_working_bytes"):
        work = np.array([model.predict_working_bytes([pool[i]]) for i in used]).max(axis=0)
    else:
        work = np.zeros(2)
    return _Data(
        batch=len(batches[0]),
        work=np.mean([costs[b].sum(axis=0) for b in batches], axis=0),
        heavy=costs[used].max(axis=0),
        act_mean=act.mean(axis=0),
        act_heavy=act.max(axis=0),
        work_bytes=work,
        llm_sorted=np.sort(np.concatenate([costs[b, 1] for b in batches])),
    )


def _allreduce(nbytes, dp, tp, cluster: Cluster):
    bw = np.where(dp * tp <= cluster.gpus_per_node, cluster.intra_node_bw, cluster.inter_node_bw)
    return cluster.sync_factor * 2.0 * (dp - 1) / np.maximum(dp, 1) * nbytes / bw


def _speed(tp, cluster: Cluster):
    return tp / (1.0 + cluster.tp_overhead * np.log2(tp))


def _state(dp, cluster: Cluster):
    return cluster.state_factor(dp)


def _segment_grid(n_layers: int, max_gpus: int, cluster: Cluster) -> np.ndarray:
    """All (tp, pp, dp) with pp <= n_layers and tp*pp*dp <= max_gpus, as an int array (k, 3)."""
    rows = [(tp, pp, dp) for tp in cluster.tp_degrees() for pp in range(1, n_layers + 1)
            for dp in range(1, max_gpus // (tp * pp) + 1)]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def _nmb_grid(nmb: Sequence[int], batch: int) -> np.ndarray:
    return np.array([m for m in nmb if m <= batch], dtype=np.int64)


def _shared_grid(cluster: Cluster, n_flat: int, batch: int, nmb: Sequence[int]) -> np.ndarray:
    """(tp, pp, dp, n_mb) of one DeepSpeed pipeline using every GPU."""
    rows = []
    for tp in cluster.tp_degrees():
        if cluster.gpus % tp:
            continue
        rest = cluster.gpus // tp
        for pp in range(1, min(n_flat, rest) + 1):
            if rest % pp or not cluster.runs_shared(tp, pp):
                continue
            dp = rest // pp
            rows.extend((tp, pp, dp, m) for m in nmb if dp * m <= batch)
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def _shared_estimates(model: Any, cluster: Cluster, data: _Data, grid: np.ndarray, uniform: bool):
    """Step-time and stage-0 memory estimates of shared layouts (rows of ``grid``)."""
    E, L = model.encoder_layers, model.llm_layers
    pb = model.param_bytes
    tp, pp, dp, m = (grid[:, i].astype(float) for i in range(4))
    sp = _speed(tp, cluster)
    slots = dp * m
    per_mb = np.maximum(data.batch / slots, 1.0)
    act_mb = np.maximum(per_mb[:, None] * data.act_mean, data.act_heavy)
    seg_w = np.array([pb["encoder"], pb["llm"]])
    if uniform:
        # exact stage fractions of DeepSpeed's uniform split; the heaviest stage sets the pace;
        # random fixed-size microbatches are padded to their longest sample
        k = data.batch / slots
        works = np.column_stack([np.full(len(grid), data.work[0]), data.padded_llm_work(k)])
        heavies = np.column_stack([np.full(len(grid), data.heavy[0]), k * data.heavy[1]])
        d_mean = np.empty(len(grid))
        d_heavy = np.empty(len(grid))
        stage_w = np.empty(len(grid))
        mem = np.empty(len(grid))
        for i, (t, p, d, mb) in enumerate(grid.tolist()):
            stg = stages_from_bounds(uniform_bounds(E + 1 + L, p), E, 1, L)
            fr = np.array([[s[0] / E, s[2] / L] for s in stg])
            w = fr @ seg_w + pb["projector"] * np.array([s[1] for s in stg])
            j = int(np.argmax(fr @ works[i]))
            d_mean[i] = fr[j] @ works[i]
            d_heavy[i] = fr[j] @ heavies[i]
            stage_w[i] = w.max()
            in_flight = np.minimum(p - np.arange(p), mb)
            mem[i] = np.max(w / t * _state(d, cluster) + in_flight * (fr @ act_mb[i]) / t)
        d_mean = d_mean / (slots * sp)
        d_heavy = d_heavy / sp
        mem = mem + data.work_bytes.max() / tp
    else:
        layer = np.maximum(data.work[0] / E, data.work[1] / L)
        d_mean = (data.work.sum() / pp + 0.5 * layer) / (slots * sp)
        d_heavy = data.heavy.sum() / pp / sp
        stage_w = (pb["encoder"] + pb["projector"] + pb["llm"]) / pp
        act0 = act_mb.sum(axis=1) / pp / tp
        mem = stage_w / tp * _state(dp, cluster) + np.minimum(pp, m) * act0 + data.work_bytes.max() / tp
    d_max = np.maximum(d_mean, d_heavy)
    # a rank is no faster than its share of the work nor than its heaviest sample; fill and
    # drain cost (pp - 1) microbatches that may hold a heavy sample
    est = np.maximum(m * d_mean, d_heavy) + (pp - 1) * d_max + _allreduce(stage_w / tp, dp, tp, cluster)
    return est, mem


def _separate_candidates(model: Any, cluster: Cluster, data: _Data, nmb: Sequence[int], keep: int):
    """Vectorised estimates over DFLOP's separate-sets space.

    Returns ``(rows, n_layouts, estimates)``: the ``keep`` best rows ``(E_tp, E_pp, E_dp, L_tp,
    L_pp, L_dp, n_mb)`` within the memory estimate, best first, and how many were enumerated.
    """
    E, L, G = model.encoder_layers, model.llm_layers, cluster.gpus
    none = (np.zeros((0, 7), dtype=np.int64), 0, np.zeros(0))
    if G < 2:
        return none
    pb = model.param_bytes
    enc = _segment_grid(E, G - 1, cluster)
    llm = _segment_grid(L, G - 1, cluster)
    # weights and optimizer states alone are a lower bound of a stage's memory: drop what cannot fit
    enc = enc[pb["encoder"] * np.ceil(E / enc[:, 1]) / E / enc[:, 0] * _state(enc[:, 2], cluster) <= cluster.usable_memory]
    llm = llm[(pb["llm"] * np.ceil(L / llm[:, 1]) / L + pb["projector"]) / llm[:, 0] * _state(llm[:, 2], cluster)
              <= cluster.usable_memory]
    n_e, n_l = enc.prod(axis=1), llm.prod(axis=1)
    order = np.argsort(n_l, kind="stable")
    llm, n_l = llm[order], n_l[order]
    lo = np.searchsorted(n_l, G - n_e, side="left")
    hi = np.searchsorted(n_l, G - n_e, side="right")
    counts = hi - lo
    ei = np.repeat(np.arange(len(enc)), counts)
    li = np.repeat(lo, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    e, l = enc[ei].astype(float), llm[li].astype(float)
    not_shared = (e[:, 0] != l[:, 0]) | (e[:, 2] != l[:, 2])
    e, l = e[not_shared], l[not_shared]
    ms = _nmb_grid(nmb, data.batch).astype(float)
    n_layouts = len(e) * len(ms)
    if n_layouts == 0:
        return none
    fe = np.ceil(E / e[:, 1]) / E  # heaviest encoder stage's share
    fl = np.ceil(L / l[:, 1]) / L
    se, sl = _speed(e[:, 0], cluster), _speed(l[:, 0], cluster)
    M = ms[None, :]
    d_e = data.work[0] * fe[:, None] / (e[:, 2:3] * M * se[:, None])
    d_l = data.work[1] * fl[:, None] / (l[:, 2:3] * M * sl[:, None])
    h_e = np.where(e[:, 2] == l[:, 2], data.heavy[0] * fe / se, 0.0)[:, None]
    h_l = (data.heavy[1] * fl / sl)[:, None]
    d_mean = np.maximum(d_e, d_l)
    d_max = np.maximum(d_mean, np.maximum(h_e, h_l))
    P = (e[:, 1] + l[:, 1])[:, None]
    ar = np.maximum(_allreduce(pb["encoder"] * fe / e[:, 0], e[:, 2], e[:, 0], cluster),
                    _allreduce((pb["llm"] * fl + pb["projector"]) / l[:, 0], l[:, 2], l[:, 0], cluster))
    est = np.maximum(M * d_mean, np.maximum(h_e, h_l)) + (P - 1) * d_max + ar[:, None]
    per_e = np.maximum(data.batch / (e[:, 2:3] * M), 1.0)
    per_l = np.maximum(data.batch / (l[:, 2:3] * M), 1.0)
    act_e = np.maximum(per_e * data.act_mean[0], data.act_heavy[0]) * fe[:, None] / e[:, 0:1]
    act_l = np.maximum(per_l * data.act_mean[1], data.act_heavy[1]) * fl[:, None] / l[:, 0:1]
    mem_e = (pb["encoder"] * fe / e[:, 0] * _state(e[:, 2], cluster))[:, None] + np.minimum(P, M) * act_e + data.work_bytes[0] / e[:, 0:1]
    mem_l = ((pb["llm"] * fl + pb["projector"]) / l[:, 0] * _state(l[:, 2], cluster))[:, None] + np.minimum(l[:, 1:2], M) * act_l + data.work_bytes[1] / l[:, 0:1]
    ok = (np.maximum(mem_e, mem_l) <= cluster.usable_memory) & (l[:, 2:3] * M <= data.batch)
    est = np.where(ok, est, np.inf)
    flat = est.ravel()
    k = min(keep, int(np.isfinite(flat).sum()))
    if k == 0:
        return none[0], n_layouts, none[2]
    pick = np.argpartition(flat, k - 1)[:k]
    pick = pick[np.argsort(flat[pick])]
    rows, cols = np.unravel_index(pick, est.shape)
    out = np.column_stack([e[rows], l[rows], ms[cols]]).astype(np.int64)
    return out, n_layouts, flat[pick]


def _shared_layout(model: Any, cluster: Cluster, data: _Data, tp: int, pp: int, dp: int, m: int, uniform: bool) -> Layout | None:
    E, L = model.encoder_layers, model.llm_layers
    if uniform:
        stages = stages_from_bounds(uniform_bounds(E + 1 + L, pp), E, 1, L)
    else:
        pb = model.param_bytes
        weights = layer_costs(data.work, model)
        per_mb = max(data.batch / (dp * m), 1.0)
        act_mb = np.maximum(per_mb * data.act_mean, data.act_heavy)
        layer_mem = ([pb["encoder"] / E * _state(dp, cluster) / tp] * E + [pb["projector"] * _state(dp, cluster) / tp]
                     + [pb["llm"] / L * _state(dp, cluster) / tp] * L)
        layer_act = [act_mb[0] / E / tp] * E + [0.0] + [act_mb[1] / L / tp] * L
        pm = np.concatenate([[0.0], np.cumsum(layer_mem)])
        pa = np.concatenate([[0.0], np.cumsum(layer_act)])
        work = data.work_bytes.max() / tp

        def stage_memory(stage: int, lo: int, hi: int) -> float:
            return pm[hi] - pm[lo] + min(pp - stage, m) * (pa[hi] - pa[lo]) + work

        bounds = balanced_bounds(weights, pp, stage_memory, cluster.usable_memory)
        if bounds is None:
            return None
        stages = stages_from_bounds(bounds, E, 1, L)
    e_pp = sum(1 for s in stages if s[0] > 0)
    l_pp = sum(1 for s in stages if s[2] > 0 or s[1] > 0)
    return Layout(Segment(tp, e_pp, dp), Segment(tp, l_pp, dp), m, stages, balanced=not uniform)


def _layout_key(layout: Layout, family: str) -> tuple[int, ...]:
    """The search key of a layout: ``(tp, pp, dp, n_mb)`` for one pipeline, the 7 degrees otherwise."""
    e, l = layout.encoder, layout.llm
    if family == "separate":
        return (e.tp, e.pp, e.dp, l.tp, l.pp, l.dp, layout.n_mb)
    return (l.tp, layout.n_stages, l.dp, layout.n_mb)


def _score(model, cluster, layout, family, pool, costs, batches, estimate, fast, seed, done=()) -> Scored:
    """Evaluate ``layout`` on ``batches`` (after the evaluations ``done``), stopping at a memory failure."""
    evals = list(done)
    for i in range(len(evals), len(batches)):
        if evals and not evals[-1].feasible:
            break
        b = batches[i]
        shapes = [pool[j] for j in b]
        evals.append(evaluate(model, cluster, layout, shapes, costs[b], fast=fast, seed=seed + i))
    times = [e.sim.step_time for e in evals]
    return Scored(
        layout=layout,
        family=family,
        step_time=float(np.mean(times)),
        step_times=times,
        bubble_fraction=float(np.mean([e.sim.bubble_fraction for e in evals])),
        memory=np.max([e.memory for e in evals], axis=0),
        estimate=float(estimate),
        evaluations=evals,
    )


def search(
    model: Any,
    cluster: Cluster,
    shapes: Sequence[SampleShape],
    global_batch: int,
    *,
    n_batches: int = 3,
    top_k: int = 6,
    refine_margin: float = 0.1,
    max_tries: int = 4,
    refine_layouts: int = 2,
    nmb_choices: Sequence[int] = DEFAULT_NMB,
    families: Sequence[str] = FAMILIES,
    final_partition: bool = True,
    final_k: int = 2,
    seed: int = 0,
) -> SearchResult:
    """Find the best layout of each family for ``cluster``, the data ``shapes`` and ``global_batch``.

    Args:
        model: a cost model (planner interface in docs/architecture.md).
        cluster: GPUs, memory and links.
        shapes: the data: a list of sample shapes or a ``DataProfile`` (its ``.shapes``);
            global batches of ``global_batch`` samples are drawn from it.
        n_batches: sampled batches each simulated layout is scored on (mean step time).
        top_k: layouts simulated per family (more if some fail the exact memory check), on
            the first sampled batch.
        max_tries: at most ``max_tries * top_k`` layouts per family are tried (simulated or
            found over memory) before giving up.
        refine_layouts: the best this many layouts (tp, pp, dp) are also simulated with every
            other microbatch count in ``nmb_choices``.
        refine_margin: layouts within this fraction of their family's best on the first batch
            are simulated on the other batches too; the winners come from those.
        nmb_choices: microbatch counts per rank considered.
        families: which of ``FAMILIES`` to search (``"deepspeed"`` is required).
        final_partition: re-score the ``final_k`` best layouts of the balanced families with our
            scheduler's ``partition_batch`` and pick the winners by those scores (the separate
            family only when its fast score beats the DeepSpeed family's).
        seed: batch sampling and tie-breaking.

    Raises:
        PlanError: no layout stock DeepSpeed can run fits.
    """
    start = time.perf_counter()
    if global_batch < 1:
        raise PlanError(f"global_batch must be >= 1, got {global_batch}")
    pool = list(getattr(shapes, "shapes", shapes))  # a DataProfile or a list of shapes
    batches = sample_batches(len(pool), global_batch, n_batches, seed)
    costs = np.asarray(model.predict_samples(pool), dtype=float)
    data = _data_stats(model, pool, costs, batches)
    E, L = model.encoder_layers, model.llm_layers
    n_layouts = 0
    scored: dict[str, list[Scored]] = {f: [] for f in FAMILIES}

    def run(family: str, ranked: list[tuple[float, Any]], build, valid_mb) -> None:
        def simulate(estimate: float, key: tuple[int, ...]) -> None:
            layout = build(key)
            tried.add(key)
            if layout is not None:
                scored[family].append(_score(model, cluster, layout, family, pool, costs, batches[:1], estimate, True, seed))

        # first pass: one batch each, in order of estimate, at most two microbatch counts per
        # layout, until top_k layouts fit in memory
        tried: set[tuple[int, ...]] = set()
        per_layout: dict[tuple[int, ...], int] = {}
        estimates: dict[tuple[int, ...], float] = {}
        for estimate, key in ranked:
            if sum(1 for s in scored[family] if s.feasible) >= top_k:
                break
            if per_layout.get(key[:-1], 0) >= 2:
                continue
            per_layout[key[:-1]] = per_layout.get(key[:-1], 0) + 1
            estimates[key[:-1]] = estimate
            simulate(estimate, key)
        # the best layouts so far with every other microbatch count (the estimate ranks them poorly)
        best_keys: dict[tuple[int, ...], Scored] = {}
        for sc in sorted((s for s in scored[family] if s.feasible), key=lambda s: s.step_time):
            best_keys.setdefault(_layout_key(sc.layout, family)[:-1], sc)
        for group, sc in list(best_keys.items())[:refine_layouts]:
            for m in nmb_choices:
                other = group + (m,)
                if other not in tried and valid_mb(other):
                    simulate(sc.estimate, other)
        # second pass: the remaining batches only for layouts close to the family's best
        fits = [s for s in scored[family] if s.feasible]
        if not fits:
            return
        cutoff = (1.0 + refine_margin) * min(s.step_time for s in fits)
        scored[family] = [
            _score(model, cluster, s.layout, family, pool, costs, batches, s.estimate, True, seed, s.evaluations)
            if s.feasible and s.step_time <= cutoff else s
            for s in scored[family]
        ]

    for family in ("deepspeed", "monolithic"):
        if family not in families:
            continue
        grid = _shared_grid(cluster, E + 1 + L, global_batch, nmb_choices)
        uniform = family == "monolithic"
        # DeepSpeed's train_batch_size = micro * n_mb * dp must equal the sampler's global batch
        grid = grid[global_batch % (grid[:, 2] * grid[:, 3]) == 0]
        n_layouts += len(grid)
        if len(grid) == 0:
            continue
        est, mem = _shared_estimates(model, cluster, data, grid, uniform)
        ok = np.flatnonzero(mem <= cluster.usable_memory)
        # ties (common: with pp = 1 the estimate ignores n_mb) go to more, smaller microbatches
        ok = ok[np.lexsort((-grid[ok, 3], est[ok]))][: max_tries * top_k]
        run(family, [(est[i], tuple(int(x) for x in grid[i])) for i in ok],
            lambda key, u=uniform: _shared_layout(model, cluster, data, *key, uniform=u),
            lambda key: global_batch % (key[2] * key[3]) == 0)

    if "separate" in families and cluster.runs_pipelines:  # separate GPU sets form a pipeline
        rows, n_sep, ests = _separate_candidates(model, cluster, data, nmb_choices, max_tries * top_k)
        n_layouts += n_sep

        def build_separate(r: tuple[int, ...]) -> Layout:
            e_tp, e_pp, e_dp, l_tp, l_pp, l_dp, m = r
            return Layout(Segment(e_tp, e_pp, e_dp), Segment(l_tp, l_pp, l_dp), m, separate_stages(E, L, e_pp, l_pp))

        run("separate", [(float(x), tuple(int(v) for v in r)) for x, r in zip(ests, rows)], build_separate,
            lambda key: key[5] * key[6] <= global_batch)

    def best_of(family_names: Sequence[str]) -> Scored | None:
        pool_ = [s for f in family_names for s in scored[f] if s.feasible and len(s.evaluations) == len(batches)]
        return min(pool_, key=lambda s: s.step_time) if pool_ else None

    winners = {f: best_of([f]) for f in FAMILIES}
    for f in ("deepspeed",):
        if winners[f] is None:
            raise PlanError(
                f"no {f} layout fits {cluster.gpus} GPUs of {cluster.gpu_memory_bytes / 1e9:.0f} GB "
                f"for a global batch of {global_batch} (memory or batch size too small)"
            )
    if final_partition:
        for f in ("deepspeed", "separate"):
            if f == "separate" and (winners[f] is None or winners[f].step_time >= winners["deepspeed"].step_time):
                continue  # it would not be the best overall: keep its fast score
            done = [s for s in scored[f] if s.feasible and len(s.evaluations) == len(batches)]
            finalists = sorted(done, key=lambda s: s.step_time)[:final_k]
            finals = [_score(model, cluster, s.layout, f, pool, costs, batches, s.estimate, False, seed) for s in finalists]
            finals = [s for s in finals if s.feasible]
            if finals:  # report what the sampler's partition_batch gives
                scored[f].extend(finals)
                winners[f] = min(finals, key=lambda s: s.step_time)
    best_ds = winners["deepspeed"]
    best = min((w for w in (winners["separate"], best_ds) if w is not None), key=lambda s: s.step_time)
    return SearchResult(
        best=best,
        best_deepspeed=best_ds,
        monolithic=winners["monolithic"],
        candidates=[s for f in FAMILIES for s in scored[f]],
        n_layouts=n_layouts,
        seconds=time.perf_counter() - start,
    )
