"""`make bench-scale`: the projection (``dflop-ds project``) of every sampler from 8 to 4096 GPUs, and
DFLOP's gain as the encoder's share of the work grows.

1. The bundled mixture (``examples/data/mixture.jsonl`` under the real-scale ``ShapePolicy()``)
   with the analytic LLaVA-OneVision 7B and 72B H100 reference cost models at 8, 64, 512 and 4096
   GPUs (global batch 2 x GPUs): every method on its best plan (:mod:`dflop_ds.plan.projection`),
   DFLOP's gain over the best baseline with its range over the sampled global batches.
2. The encoder's share of the work: the 7B model's encoder time scaled so that the encoder does
   10%, 25%, 40% and 50% of the data's work (summed encoder seconds over summed total seconds),
   at 64 GPUs.

ALL FIGURES ARE PREDICTIONS OF ANALYTIC COST MODELS AND THE 1F1B SIMULATOR, NOT MEASUREMENTS; the
simulator's last measured error against real runs is printed with them. Last line:
``scale gain@8=A gain@64=B gain@512=C gain@4096=D gain_at_enc10=E gain_at_enc50=F``: A-D the
geometric mean over the models with a plan at that size (72B fits no 8-GPU layout) of DFLOP's gain
over the best baseline, E and F
the gain at 10% and 50% encoder share.

Run: ``.venv/bin/python benchmarks/bench_scale.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import reference_model  # noqa: E402
from dflop_ds.data import read_manifest  # noqa: E402
from dflop_ds.plan.calibration import load_calibration  # noqa: E402
from dflop_ds.plan.projection import encoder_share, project, table_lines, with_encoder_share  # noqa: E402
from dflop_ds.shapes import ShapePolicy  # noqa: E402

SHARES = (0.10, 0.25, 0.40, 0.50)


def geomean(values: list[float]) -> float:
    """Geometric mean (nan for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "examples/data/mixture.jsonl"))
    parser.add_argument("--models", nargs="+", default=["llava-ov-7b-h100", "llava-ov-72b-h100"])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--batch-per-gpu", type=int, default=2)
    parser.add_argument("--batches", type=int, default=2, help="sampled global batches per plan")
    parser.add_argument("--sweep-gpus", type=int, default=64, help="cluster size of the encoder-share sweep")
    args = parser.parse_args()

    shapes = list(read_manifest(args.data, ShapePolicy()))
    if hasattr(os, "getloadavg"):
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print("PREDICTIONS of ANALYTIC cost models (FLOP counts / assumed throughput) and the 1F1B simulator, not measured")
    print(load_calibration().describe())
    print(
        f"data: {args.data}: {len(shapes)} samples under ShapePolicy(); global batch {args.batch_per_gpu} x GPUs, "
        f"{args.batches} sampled global batches per plan; 8 GPUs per node, 80 GB, ZeRO-1, bf16"
    )
    gains: dict[int, list[float]] = {g: [] for g in args.gpus}
    over_stock: dict[int, list[float]] = {g: [] for g in args.gpus}
    for name in args.models:
        model = reference_model(name)
        start = time.perf_counter()
        sizes = project(model, shapes, args.gpus, batch_per_gpu=args.batch_per_gpu, n_batches=args.batches)
        print(
            f"\n{name}: encoder {encoder_share(model, shapes):.1%} of the work "
            f"({time.perf_counter() - start:.0f} s to project)"
        )
        print("\n".join(table_lines(sizes)), flush=True)
        for size in sizes:
            if not math.isnan(size.gain):
                gains[size.gpus].append(size.gain)
            if size.of("stock").step_times and size.of("dflop").step_times:
                over_stock[size.gpus].append(size.of("stock").step_time / size.of("dflop").step_time)

    sweep_model = reference_model(args.models[0])
    print(f"\nencoder share sweep: {args.models[0]}, encoder time scaled, {args.sweep_gpus} GPUs")
    print(
        f"{'encoder share':>13} {'x encoder':>9} {'best baseline':<30} {'step_s':>8} {'DFLOP step_s':>12} {'gain':>7}"
    )
    by_share: dict[float, float] = {}
    for share in SHARES:
        scaled = with_encoder_share(sweep_model, shapes, share)
        [size] = project(scaled, shapes, [args.sweep_gpus], batch_per_gpu=args.batch_per_gpu, n_batches=args.batches)
        best = size.best_baseline
        if best is None:
            raise SystemExit(f"no baseline plan fits {args.sweep_gpus} GPUs at encoder share {share:.0%}")
        low, high = size.gain_range
        by_share[share] = size.gain
        print(
            f"{share:>13.0%} {scaled.factor:>9.2f} {best.method.label:<30} {best.step_time:>8.3f} "
            f"{size.of('dflop').step_time:>12.3f} {size.gain:>7.3f} (x{low:.3f}-{high:.3f}; "
            f"DFLOP {size.of('dflop').layout.describe() if size.of('dflop').layout else '-'})",
            flush=True,
        )
    cells = " ".join(f"gain@{g}={geomean(v):.3f}" for g, v in gains.items())
    counts = ", ".join(f"{len(v)} at {g}" for g, v in gains.items())
    print(
        f"(gain@N: geometric mean of DFLOP over the best baseline over the models with plans ({counts}); predictions)"
    )
    print("(DFLOP over stock, same means: " + " ".join(f"@{g}={geomean(v):.3f}" for g, v in over_stock.items()) + ")")
    print(f"scale {cells} gain_at_enc10={by_share[0.10]:.3f} gain_at_enc50={by_share[0.50]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
