"""`make bench-scale`: the projection (``dflop-ds project``) of every sampler from 8 to 512 GPUs under
ZeRO-1, ZeRO-2 and ZeRO-3, and DFLOP's gain as the encoder's share of the work grows.

1. The bundled mixture (``examples/data/mixture.jsonl``, each reference model's shape policy:
   :func:`~dflop_ds.cost.reference_policy`) with the analytic H100 reference cost models whose
   encoder carries a large share of the work (LLaVA-OneVision 0.5B, Qwen2-VL 2B, InternVL2.5 26B)
   and LLaVA-OneVision 7B and 72B, at 8, 64 and 512 GPUs (``--gpus`` adds sizes, e.g. 4096, at
   several minutes more), under each ZeRO stage. Under ZeRO-1 and ZeRO-2 every method runs on its
   best plan (:mod:`dflop_ds.plan.projection`; global batch 2 x GPUs). Under ZeRO-3 every method
   runs on the layout ZeRO-3 users run (:func:`stage_setting`): pure data parallelism over all GPUs
   (tensor parallelism under ZeRO-3 is rare), 8 samples per GPU in 4 microbatches (gradient
   accumulation), the same layout and batches for every method; single-stage plans
   scored under the stage's sync model (ZeRO-1: ranks meet at the accumulation boundary; ZeRO-2
   and 3: per module, :meth:`~dflop_ds.plan.cluster.Cluster.sync_model`), DFLOP's gain over the
   best baseline with its range over the sampled global batches, and DFLOP's step over the
   granularity-aware lower bound of its plan (:func:`dflop_step_over_bound`).
2. The encoder's share of the work: the 7B model's encoder time scaled so that the encoder does
   10%, 25%, 40% and 50% of the data's work (summed encoder seconds over summed total seconds),
   at 64 GPUs, ZeRO-1.

ALL FIGURES ARE PREDICTIONS OF ANALYTIC COST MODELS AND THE SIMULATOR, NOT MEASUREMENTS; the
simulator's last measured error against real runs is printed with them. Last line:
``scale gain@8=A gain@64=B gain@512=C gain_at_enc10=E gain_at_enc50=F z3_gain@64=G z3_gain@512=H
min_gain=I z3_gap_to_bound=J``: A-C (one per ``--gpus`` size) the geometric mean over the models with a plan
at that size under ZeRO-1 of DFLOP's gain over the best baseline; E and F the gain at 10% and 50%
encoder share; G and H the smallest ZeRO-3 gain at 64 and 512 GPUs over the reference models whose
encoder does at least 25% of the mixture's work; I the smallest gain of any row (model, size,
ZeRO stage); J the largest, over the ZeRO-3 rows, of DFLOP's mean step over its lower bound, minus 1.

Run: ``.venv/bin/python benchmarks/bench_scale.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import PackedView, reference_model, reference_policy  # noqa: E402
from dflop_ds.data import read_manifest  # noqa: E402
from dflop_ds.plan import Cluster  # noqa: E402
from dflop_ds.plan.calibration import load_calibration  # noqa: E402
from dflop_ds.plan.planner import simulate_layout  # noqa: E402
from dflop_ds.plan.projection import (  # noqa: E402
    SHARED_FAMILIES,
    SizeProjection,
    encoder_share,
    project,
    table_lines,
    with_encoder_share,
)
from dflop_ds.plan.search import sample_batches  # noqa: E402
from dflop_ds.shapes import SampleShape  # noqa: E402
from dflop_ds.sync import step_lower_bound  # noqa: E402

SHARES = (0.10, 0.25, 0.40, 0.50)
ZERO_STAGES = (1, 2, 3)
MODELS = ("llava-ov-0.5b-h100", "qwen2-vl-2b-h100", "internvl2.5-26b-h100", "llava-ov-7b-h100", "llava-ov-72b-h100")
#: a reference model is encoder-heavy when its encoder does at least this share of the mixture's work
ENCODER_HEAVY = 0.25
#: ZeRO-3 users run pure data parallelism (tensor parallelism under ZeRO-3 is rare) with the
#: gradient accumulation of their DeepSpeed config: the ZeRO-3 rows give every method this layout
#: (dp = all GPUs, tp = pp = 1, no colocated encoder), these samples per GPU in this many
#: microbatches, the same for all
ZERO3_BATCH_PER_GPU = 8
ZERO3_MICROBATCHES = 4


@dataclass(frozen=True)
class Row:
    """One model at one size under one ZeRO stage."""

    model: str
    share: float
    zero_stage: int
    size: SizeProjection
    over_bound: float  # DFLOP's mean step over its plan's lower bound (nan: no plan or no bound)


def geomean(values: Sequence[float]) -> float:
    """Geometric mean (nan for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def dflop_step_over_bound(
    model: Any, cluster: Cluster, size: SizeProjection, shapes: list[SampleShape], n_batches: int, seed: int = 0
) -> float:
    """DFLOP's mean step over the mean lower bound of any split of the same batches on its plan.

    The bound, per sampled batch: :func:`~dflop_ds.sync.step_lower_bound` of the samples' packed
    ``(encoder, llm)`` seconds at the plan's tensor-parallel speed-up, over its ``dp`` ranks and
    ``n_mb`` microbatches under the cluster's sync model (a sample cannot be split), plus the
    plan's gradient communication (which any split pays). Single-stage shared plans only (a
    pipeline's or a colocated encoder's step has no such bound here): nan otherwise.
    """
    dflop = size.of("dflop")
    layout = dflop.layout
    if layout is None or layout.n_stages != 1 or layout.colocated:
        return float("nan")
    cluster = replace(cluster, gpus=size.gpus)
    view = PackedView(model)
    evaluations = simulate_layout(view, cluster, layout, shapes, size.global_batch, n_batches=n_batches, seed=seed)
    speed = cluster.tp_speedup(layout.llm.tp)
    bounds = []
    for evaluation, batch in zip(evaluations, sample_batches(len(shapes), size.global_batch, n_batches, seed)):
        costs = np.asarray(view.predict_samples([shapes[i] for i in batch]), dtype=float) / speed
        compute = step_lower_bound(costs, layout.llm.dp, layout.n_mb, cluster.sync_model())
        bounds.append(compute + float(evaluation.sim.allreduce.max()))
    return dflop.step_time / float(np.mean(bounds))


def stage_setting(model: Any, zero_stage: int, args: argparse.Namespace) -> tuple[Cluster, int, dict[str, Any], str]:
    """The cluster, samples per GPU, search options and a one-line description of the layout of
    ``zero_stage``'s rows: ZeRO-1 and ZeRO-2 let every method take its best plan (any tp, pp,
    family, microbatch count) at ``args.batch_per_gpu``; ZeRO-3 gives every method the layout its
    users run: pure data parallelism over all GPUs, ``args.z3_batch_per_gpu`` samples per GPU in
    ``args.z3_microbatches`` microbatches (gradient accumulation), one shared engine."""
    cluster = Cluster(gpus=1, gpu_memory_bytes=model.gpu_memory_bytes, zero_stage=zero_stage)
    if zero_stage != 3:
        return cluster, args.batch_per_gpu, {}, f"each method's best plan, {args.batch_per_gpu} samples per GPU"
    options = {"nmb_choices": (args.z3_microbatches,), "families": SHARED_FAMILIES}
    layout = (
        f"every method on the ZeRO-3 user's layout: dp = all GPUs, tp = pp = 1, {args.z3_batch_per_gpu} samples"
        f" per GPU in {args.z3_microbatches} microbatches"
    )
    return replace(cluster, max_tp=1), args.z3_batch_per_gpu, options, layout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "examples/data/mixture.jsonl"))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--zero-stages", type=int, nargs="+", default=list(ZERO_STAGES))
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--batch-per-gpu", type=int, default=2)
    parser.add_argument("--batches", type=int, default=2, help="sampled global batches per plan")
    parser.add_argument(
        "--z3-batch-per-gpu", type=int, default=ZERO3_BATCH_PER_GPU, help="ZeRO-3 rows: samples per GPU"
    )
    parser.add_argument(
        "--z3-microbatches", type=int, default=ZERO3_MICROBATCHES, help="ZeRO-3 rows: microbatches per GPU and step"
    )
    parser.add_argument("--sweep-gpus", type=int, default=64, help="cluster size of the encoder-share sweep")
    parser.add_argument("--sweep-model", default="llava-ov-7b-h100", help="the model of the encoder-share sweep")
    args = parser.parse_args()

    start_all = time.perf_counter()
    if hasattr(os, "getloadavg"):
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print("PREDICTIONS of ANALYTIC cost models (FLOP counts / assumed throughput) and the simulator, not measured")
    print(load_calibration().describe())
    print(
        f"data: {args.data} under each model's reference shape policy; global batch {args.batch_per_gpu} x GPUs "
        f"under ZeRO-1 and ZeRO-2 (each method on its best plan), {args.z3_batch_per_gpu} x GPUs under ZeRO-3 "
        f"(every method on one layout: dp = all GPUs, tp = pp = 1, {args.z3_microbatches} microbatches per GPU); "
        f"{args.batches} sampled global batches per plan; 8 GPUs per node, 80 GB, bf16; ZeRO stages "
        f"{args.zero_stages}: one-stage plans scored under the stage's sync model, pipelines (ZeRO-0/1 only) 1F1B"
    )
    rows: list[Row] = []
    for name in args.models:
        model = reference_model(name)
        shapes = list(read_manifest(args.data, reference_policy(name)))
        share = encoder_share(model, shapes)
        for zero_stage in args.zero_stages:
            cluster, batch_per_gpu, options, layout = stage_setting(model, zero_stage, args)
            start = time.perf_counter()
            sizes = project(
                model,
                shapes,
                args.gpus,
                batch_per_gpu=batch_per_gpu,
                cluster=cluster,
                n_batches=args.batches,
                **options,
            )
            bounds = [dflop_step_over_bound(model, cluster, s, shapes, args.batches) for s in sizes]
            print(
                f"\n{name} ({reference_policy(name).name} policy), ZeRO-{zero_stage}, sync "
                f"{cluster.sync_model().describe()}: encoder {share:.1%} of the work; {layout} "
                f"({time.perf_counter() - start:.0f} s to project)"
            )
            print("\n".join(table_lines(sizes)), flush=True)
            rows.extend(Row(name, share, zero_stage, s, b) for s, b in zip(sizes, bounds))

    print("\nsummary: DFLOP's gain over the best baseline; DFLOP's step over its plan's lower bound (one-stage plans)")
    print(f"{'model':<22} {'enc':>6} {'ZeRO':>4} {'GPUs':>5}  {'best baseline':<30} {'gain':>7} {'over bound':>10}")
    for row in rows:
        best = row.size.best_baseline
        bound = "-" if math.isnan(row.over_bound) else f"x{row.over_bound:.3f}"
        gain = "n/a" if math.isnan(row.size.gain) else f"x{row.size.gain:.3f}"
        print(
            f"{row.model:<22} {row.share:>6.1%} {row.zero_stage:>4} {row.size.gpus:>5}  "
            f"{best.method.label if best else '-':<30} {gain:>7} {bound:>10}"
        )

    sweep_model = reference_model(args.sweep_model)
    sweep_shapes = list(read_manifest(args.data, reference_policy(args.sweep_model)))
    print(f"\nencoder share sweep: {sweep_model.name}, encoder time scaled, {args.sweep_gpus} GPUs, ZeRO-1")
    print(
        f"{'encoder share':>13} {'x encoder':>9} {'best baseline':<30} {'step_s':>8} {'DFLOP step_s':>12} {'gain':>7}"
    )
    by_share: dict[float, float] = {}
    for share in SHARES:
        scaled = with_encoder_share(sweep_model, sweep_shapes, share)
        [size] = project(
            scaled, sweep_shapes, [args.sweep_gpus], batch_per_gpu=args.batch_per_gpu, n_batches=args.batches
        )
        best = size.best_baseline
        if best is None:
            raise SystemExit(f"no baseline plan fits {args.sweep_gpus} GPUs at encoder share {share:.0%}")
        low, high = size.gain_range
        by_share[share] = size.gain
        dflop_layout = size.of("dflop").layout
        print(
            f"{share:>13.0%} {scaled.factor:>9.2f} {best.method.label:<30} {best.step_time:>8.3f} "
            f"{size.of('dflop').step_time:>12.3f} {size.gain:>7.3f} (x{low:.3f}-{high:.3f}; "
            f"DFLOP {dflop_layout.describe() if dflop_layout else '-'})",
            flush=True,
        )

    def gains(zero_stage: int, gpus: int, heavy: bool = False) -> list[float]:
        return [
            r.size.gain
            for r in rows
            if r.zero_stage == zero_stage
            and r.size.gpus == gpus
            and not math.isnan(r.size.gain)
            and (not heavy or r.share >= ENCODER_HEAVY)
        ]

    z1 = " ".join(f"gain@{g}={geomean(gains(1, g)):.3f}" for g in args.gpus)
    z3 = " ".join(f"z3_gain@{g}={min(gains(3, g, heavy=True), default=float('nan')):.3f}" for g in (64, 512))
    every = [r.size.gain for r in rows if not math.isnan(r.size.gain)]
    gaps = [r.over_bound - 1.0 for r in rows if r.zero_stage == 3 and not math.isnan(r.over_bound)]
    print(
        "(gain@N: geometric mean over the models with ZeRO-1 plans; z3_gain@N: the smallest ZeRO-3 gain over the"
        f" models whose encoder does >= {ENCODER_HEAVY:.0%} of the work; min_gain over {len(every)} rows;"
        f" z3_gap_to_bound over {len(gaps)} one-stage ZeRO-3 rows; {time.perf_counter() - start_all:.0f} s in all;"
        " predictions)"
    )
    print(
        f"scale {z1} gain_at_enc10={by_share[0.10]:.3f} gain_at_enc50={by_share[0.50]:.3f} {z3} "
        f"min_gain={min(every, default=float('nan')):.3f} z3_gap_to_bound={max(gaps, default=float('nan')):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
