"""The parallelism search, its memory constraint, and the analytic reference models."""

from __future__ import annotations

import numpy as np
import pytest

from dflop_ds.cost import AnalyticMLLM, reference_model, reference_names
from dflop_ds.pipe.stage_bounds import min_max_bounds, split_stages, uniform_bounds
from dflop_ds.plan import Cluster, PlanError, make_plans, search
from dflop_ds.plan.layout import flat_bounds, stages_from_bounds
from dflop_ds.shapes import ShapePolicy


def _pool(n: int = 400, seed: int = 0) -> list:
    """A mixture of text, single images, multi-image and video samples (LLaVA-OneVision policy)."""
    rng = np.random.default_rng(seed)
    policy = ShapePolicy()
    shapes = []
    for i in range(n):
        kind = rng.choice(["text", "image", "multi", "video"], p=[0.3, 0.45, 0.1, 0.15])
        text = int(rng.integers(20, 1500))
        if kind == "text":
            shapes.append(policy.shape(f"t{i}", text_tokens=text))
        elif kind == "image":
            size = (int(rng.integers(200, 1600)), int(rng.integers(200, 1600)))
            shapes.append(policy.shape(f"i{i}", image_sizes=[size], text_tokens=text))
        elif kind == "multi":
            shapes.append(policy.shape(f"m{i}", image_sizes=[(640, 480)] * int(rng.integers(2, 5)), text_tokens=text))
        else:
            shapes.append(policy.shape(f"v{i}", video_frames=int(rng.integers(8, 200)), text_tokens=text))
    return shapes


POOL = _pool()


def _all_fit(scored, cluster: Cluster) -> bool:
    return bool(scored.memory.max() <= cluster.usable_memory) and scored.feasible


def test_search_returns_three_feasible_layouts_using_every_gpu() -> None:
    model = reference_model("llava-ov-7b-a100")
    cluster = Cluster(gpus=16)
    res = search(model, cluster, POOL, 64, n_batches=2, top_k=3)
    for scored in (res.best, res.best_deepspeed, res.monolithic):
        assert _all_fit(scored, cluster)
        assert scored.layout.gpus == cluster.gpus
        assert len(scored.step_times) == 2
    assert res.best_deepspeed.layout.deepspeed_compatible
    assert res.best.step_time <= res.best_deepspeed.step_time
    assert res.gap >= 0.0
    mono = res.monolithic.layout
    assert mono.splitter == "stock"
    assert flat_bounds(mono.stages) == uniform_bounds(27 + 1 + 28, mono.n_stages)
    assert 64 % (mono.llm.dp * mono.n_mb) == 0
    for s in res.candidates:
        if s.family == "separate":
            assert s.layout.encoder.gpus + s.layout.llm.gpus == cluster.gpus
            assert not s.layout.deepspeed_compatible
        else:
            assert s.layout.n_stages * s.layout.llm.tp * s.layout.llm.dp == cluster.gpus


def test_memory_infeasible_layouts_are_never_chosen() -> None:
    model = reference_model("llava-ov-72b-h100")
    roomy = Cluster(gpus=32, gpu_memory_bytes=160e9)
    tight = Cluster(gpus=32, gpu_memory_bytes=64e9)
    free = search(model, roomy, POOL, 64, n_batches=1, top_k=3)
    tight_res = search(model, tight, POOL, 64, n_batches=1, top_k=3)
    # the roomy winners would not fit the tight cluster's memory ...
    assert free.best_deepspeed.memory.max() > tight.usable_memory
    # ... and in the tight cluster nothing over the limit is chosen, though over-limit layouts were seen
    for scored in (tight_res.best, tight_res.best_deepspeed, tight_res.monolithic):
        assert _all_fit(scored, tight)
    assert tight_res.best_deepspeed.layout != free.best_deepspeed.layout
    # 48 GB: no uniform (stock) split fits, our memory-aware split still does
    tighter = Cluster(gpus=32, gpu_memory_bytes=48e9)
    res = search(model, tighter, POOL, 64, n_batches=1, top_k=2)
    assert res.monolithic is None and res.speedup(res.best_deepspeed) is None
    assert _all_fit(res.best_deepspeed, tighter)
    with pytest.raises(PlanError, match="no .* layout fits"):
        search(model, Cluster(gpus=4, gpu_memory_bytes=24e9), POOL, 16, n_batches=1, top_k=2)


def test_balanced_plan_beats_stock_microbatches_on_a_skewed_mixture() -> None:
    model = reference_model("llava-ov-0.5b-h100")
    plans = make_plans(model, Cluster(gpus=8), POOL, 64, n_batches=2, top_k=3)
    assert plans.best_deepspeed.predicted["speedup_vs_monolithic"] > 1.0
    assert plans.best.predicted["is_analytic"] is True
    assert plans.best.baseline == plans.monolithic.baseline


def test_balanced_bounds_split_is_optimal_for_small_cases() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        w = rng.uniform(0.1, 3.0, size=int(rng.integers(3, 9))).tolist()
        k = int(rng.integers(1, len(w) + 1))
        b = min_max_bounds(w, k)
        assert b is not None
        got = max(sum(w[lo:hi]) for lo, hi in zip(b, b[1:]))
        best = _brute_force(w, k)
        assert got == pytest.approx(best, rel=1e-6)


def _brute_force(w: list[float], k: int) -> float:
    from itertools import combinations

    n = len(w)
    best = float("inf")
    for cuts in combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        best = min(best, max(sum(w[lo:hi]) for lo, hi in zip(b, b[1:])))
    return best


def test_balanced_bounds_respects_memory() -> None:
    b = min_max_bounds([1.0] * 10, 3, stage_memory=lambda stage, lo, hi: (hi - lo) * (3 - stage), memory_cap=9.0)
    assert b is not None
    for stage, (lo, hi) in enumerate(zip(b, b[1:])):
        assert (hi - lo) * (3 - stage) <= 9.0
    assert min_max_bounds([1.0] * 10, 2, stage_memory=lambda stage, lo, hi: hi - lo, memory_cap=4.0) is None


def test_min_max_bounds_under_a_memory_cap_is_exact() -> None:
    """The best split among those whose every stage fits, against brute force; a cap that
    binds moves the cut away from the unconstrained optimum."""
    from itertools import combinations

    rng = np.random.default_rng(5)
    for _ in range(40):
        n = int(rng.integers(3, 9))
        w, mem = rng.uniform(0.1, 3.0, size=n), rng.uniform(0.5, 2.0, size=n)
        k = int(rng.integers(1, n + 1))
        pm = np.r_[0.0, np.cumsum(mem)]
        cap = float(rng.uniform(mem.max(), mem.sum()))

        def stage_memory(stage, lo, hi, pm=pm):
            return (pm[hi] - pm[lo]) * (1.0 + 0.1 * stage)

        splits = [[0, *cuts, n] for cuts in combinations(range(1, n), k - 1)]
        fits = [b for b in splits if all(stage_memory(s, lo, hi) <= cap for s, (lo, hi) in enumerate(zip(b, b[1:])))]
        got = min_max_bounds(w, k, stage_memory=stage_memory, memory_cap=cap)
        if not fits:
            assert got is None
            continue
        assert got is not None
        assert all(stage_memory(s, lo, hi) <= cap for s, (lo, hi) in enumerate(zip(got, got[1:])))
        best = min(max(w[lo:hi].sum() for lo, hi in zip(b, b[1:])) for b in fits)
        assert max(w[lo:hi].sum() for lo, hi in zip(got, got[1:])) == pytest.approx(best, rel=1e-9)


def test_uniform_split_is_deepspeeds() -> None:
    from deepspeed.runtime.utils import partition_uniform

    for n in range(1, 40):
        for k in range(1, n + 1):
            assert uniform_bounds(n, k) == partition_uniform(n, k)
    assert split_stages("uniform", [5.0, 1.0, 1.0], 2) == [0, 2, 3]  # the costs are not read
    assert split_stages("min_max", [5.0, 1.0, 1.0], 2) == [0, 1, 3]
    assert split_stages("measured", [5.0, 1.0, 1.0], 2) == [0, 1, 3]
    assert split_stages("uniform", [1.0] * 4, 2, stage_memory=lambda s, lo, hi: hi - lo, memory_cap=1.0) is None
    with pytest.raises(ValueError, match="unknown stage split 'even'"):
        split_stages("even", [1.0], 1)


def test_stage_bounds_split_segments() -> None:
    assert stages_from_bounds([0, 20, 30, 52], 27, 1, 24) == ((20, 0, 0), (7, 1, 2), (0, 0, 22))
    with pytest.raises(ValueError, match="not increasing"):
        stages_from_bounds([0, 30, 30, 52], 27, 1, 24)


def test_reference_models_are_analytic_flop_counts() -> None:
    assert len(reference_names("llava-ov")) == 6 and len(reference_names()) == 10
    m = reference_model("llava-ov-7b-a100")
    assert m.is_analytic is True
    assert m.encoder_layers == 27 and m.llm_layers == 28
    # 7B class: 7.0-8.0 B parameters; SigLIP-400M class encoder: ~0.4 B
    assert 7.0e9 < m.param_bytes["llm"] / 2 < 8.0e9
    assert 0.38e9 < m.param_bytes["encoder"] / 2 < 0.45e9
    # LLM seconds = (6 P n + 6 L n^2 h) * 4/3 (recompute) / (312 TFLOPS * 0.45)
    n = 4096.0
    P = m.llm.layer_params * 28 + m.llm.vocab * m.llm.hidden
    want = (6 * P * n + 6 * 28 * n * n * 3584) * (4 / 3) / (312e12 * 0.45)
    from dflop_ds.shapes import SampleShape

    got = m.predict_samples([SampleShape("x", text_tokens=int(n), llm_tokens=int(n))])[0, 1]
    assert got == pytest.approx(want)
    # H100 is faster by its throughput ratio
    h = reference_model("llava-ov-7b-h100")
    assert got / h.predict_samples([SampleShape("x", llm_tokens=4096)])[0, 1] == pytest.approx(
        (989 * 0.40) / (312 * 0.45)
    )
    # padding: a microbatch costs its size times the longest sample
    a, b = SampleShape("a", llm_tokens=100), SampleShape("b", llm_tokens=1000)
    assert m.predict_microbatch([a, b])[1] == pytest.approx(2 * m.predict_samples([b])[0, 1])
    assert AnalyticMLLM.from_dict(m.to_dict()) == m
    with pytest.raises(KeyError, match="unknown reference profile"):
        reference_model("llava-ov-13b-a100")


class _ContractOnly:
    """A cost model exposing only what docs/architecture.md requires of the planner's input."""

    additive = per_stage = memory_per_device = is_analytic = False
    predicts_memory = True
    name = "_ContractOnly"
    layer_shares = None
    activation_checkpointing = tensor_parallel_layers = False
    forward_fraction = 1.0 / 3.0
    gpu_memory_bytes = None

    def __init__(self) -> None:
        inner = reference_model("llava-ov-7b-a100")
        self._inner = inner
        self.encoder_layers, self.llm_layers = inner.encoder_layers, inner.llm_layers
        self.param_bytes = inner.param_bytes
        self.hidden_bytes_per_token = self.encoder_hidden_bytes_per_token = inner.hidden_bytes_per_token

    def predict_samples(self, shapes):
        return self._inner.predict_samples(shapes)

    def predict_microbatch(self, shapes):
        return self._inner.predict_microbatch(shapes)

    def predict_memory(self, shapes):
        return self._inner.predict_memory(shapes)

    def predict_activation_bytes(self, shapes):
        return self._inner.predict_activation_bytes(shapes)

    def predict_working_bytes(self, shapes):
        return np.zeros(2)


def test_search_needs_only_the_documented_cost_model_interface() -> None:
    from dflop_ds.cost import PlannerCostModel

    assert isinstance(_ContractOnly(), PlannerCostModel)
    plans = make_plans(_ContractOnly(), Cluster(gpus=8), POOL, 32, n_batches=1, top_k=2)
    assert plans.best_deepspeed.cost_model == {"name": "_ContractOnly", "is_analytic": False, "note": "measured"}
    assert plans.best_deepspeed.predicted["step_time_s"] > 0


def test_stage_shares_follow_the_models_layer_shares() -> None:
    from types import SimpleNamespace

    from dflop_ds.plan.stages import layer_costs, segment_layer_shares, stage_shares

    measured = SimpleNamespace(
        encoder_layers=2, llm_layers=3, layer_shares={"encoder": [0.4, 0.4, 0.2], "llm": [0.45, 0.45, 0.1]}
    )
    # flat list: enc, enc, projector | llm, llm, head
    np.testing.assert_allclose(stage_shares([0, 3, 6], measured), [[1.0, 0.0], [0.0, 1.0]])
    np.testing.assert_allclose(stage_shares([0, 2, 4, 6], measured), [[0.8, 0.0], [0.2, 0.45], [0.0, 0.55]])
    assert layer_costs([10.0, 20.0], measured) == pytest.approx([4, 4, 2, 9, 9, 2])
    # without measured shares: encoder layers share equally, the projector is free
    plain = SimpleNamespace(encoder_layers=2, llm_layers=2, layer_shares=None)
    np.testing.assert_allclose(np.concatenate(segment_layer_shares(plain)), [0.5, 0.5, 0.0, 0.5, 0.5])
    with pytest.raises(ValueError, match="layer_shares"):
        segment_layer_shares(SimpleNamespace(encoder_layers=3, llm_layers=3, layer_shares=measured.layer_shares))
    with pytest.raises(ValueError, match=r"stage_bounds \[0, 4\] end at layer 4, but the model has 6 layers"):
        stage_shares([0, 4], measured)


def test_reference_models_give_the_projector_its_flop_share() -> None:
    from dflop_ds.cost import reference_model

    model = reference_model("llava-ov-7b-h100")
    encoder = model.layer_shares["encoder"]
    assert len(encoder) == model.encoder_layers + 1 and sum(encoder) == pytest.approx(1.0)
    assert len(set(encoder[:-1])) == 1 and 0 < encoder[-1] < 2 * encoder[0]  # a projector costs about a layer


def test_search_freezes_the_existing_objects_only_while_it_runs() -> None:
    import gc

    frozen_during: list[int] = []
    model = reference_model("llava-ov-0.5b-a100")

    class Watching(AnalyticMLLM):
        def predict_samples(self, shapes):  # called inside the search
            frozen_during.append(gc.get_freeze_count())
            return super().predict_samples(shapes)

    watching = Watching(model.encoder, model.llm, model.gpu, name="watching")
    before = gc.get_freeze_count()
    search(watching, Cluster(gpus=8), POOL, 32, n_batches=1, top_k=1, families=("deepspeed",))
    assert frozen_during and frozen_during[0] > before  # the caller's objects were left out of the scans
    assert gc.get_freeze_count() == before
    with pytest.raises(PlanError):
        search(watching, Cluster(gpus=8), POOL, 0)
    assert gc.get_freeze_count() == before


def test_search_leaves_a_callers_own_freeze_in_place(monkeypatch) -> None:
    """Neither frozen again nor undone. (Not by comparing freeze counts: a frozen object the
    search releases, such as a cache entry it replaces, leaves the permanent generation too.)"""
    import gc

    calls: list[str] = []
    gc.freeze()  # e.g. a server that froze its imports before forking workers
    try:
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        with pytest.raises(PlanError):
            search(reference_model("llava-ov-0.5b-a100"), Cluster(gpus=8), POOL, 0)
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        gc.unfreeze()
