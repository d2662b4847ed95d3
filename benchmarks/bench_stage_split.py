"""Where the 2-stage pipeline's idle goes: per-layer times measured on real packed microbatches,
replayed through the 1F1B simulator for every 2-stage split of the tiny MLLM.

For each method and GAS it measures every layer's forward and backward (CPU time of one thread,
as a rank runs, so other processes' load barely counts) on the method's packed microbatches of
a few global batches, then simulates DeepSpeed's 1F1B step (:mod:`dflop_ds.plan.simulator`, no
transfer or optimizer time) for each layer boundary and for an ideal split that cuts one layer
in two fractions (what finer pipeline layers would allow). Prints compute per step, simulated
step, idle and stage max/mean; ``*`` marks the cut of the ``measured`` stage split
(:func:`~dflop_ds.pipe.stage_bounds.split_stages`) on those costs.
Usage: ``python benchmarks/bench_stage_split.py [--cost-model F]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_e2e import flat_tiny_layers, packed_microbatches  # noqa: E402
from benchmarks.common import profiled_cost_model  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.pipe.stage_bounds import split_stages  # noqa: E402
from dflop_ds.plan.simulator import simulate_stage_times  # noqa: E402
from dflop_ds.profile.layer_split import measure_layer_times  # noqa: E402
from dflop_ds.profile.model import torch_threads  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402


def two_stages(times: np.ndarray, cut: float) -> tuple[np.ndarray, np.ndarray]:
    """``(fwd, bwd)`` of shape ``(m, 2)`` for a split after ``cut`` layers (a fraction splits one layer)."""
    whole, frac = int(cut), cut - int(cut)
    stages = []
    for kind in times:  # forward, backward: (m, L)
        first = kind[:, :whole].sum(1) + (frac * kind[:, whole] if frac else 0.0)
        stages.append(np.c_[first, kind.sum(1) - first])
    return stages[0], stages[1]


def simulate(per_batch: list[np.ndarray], cut: float) -> tuple[float, float, float]:
    """Mean over global batches of simulated step seconds, idle fraction and stage max/mean."""
    out = []
    for times in per_batch:
        fwd, bwd = two_stages(times, cut)
        busy = fwd.sum(0) + bwd.sum(0)
        step = simulate_stage_times(fwd, bwd).step_time
        out.append((step, 1 - busy.mean() / step, busy.max() / busy.mean()))
    return tuple(np.mean(out, axis=0))


def balanced_cut(layer_costs: np.ndarray) -> float:
    """The fractional layer count before which half the cost lies."""
    cum = np.cumsum(layer_costs)
    k = int(np.searchsorted(cum, cum[-1] / 2))
    return k + (cum[-1] / 2 - (cum[k - 1] if k else 0.0)) / layer_costs[k]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", default=str(ROOT / "out" / "costmodel_tiny.json"))
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "mixture.jsonl"))
    parser.add_argument("--methods", default="dflop,stock_packed")
    parser.add_argument("--gas", default="8,16")
    parser.add_argument("--batches", type=int, default=3, help="global batches measured")
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()
    cost_model = profiled_cost_model(args.cost_model)
    shapes = read_dataset(args.data, TINY_POLICY)
    layers = flat_tiny_layers()
    header = f"{'method':13s} {'gas':>4s} {'split':>8s} {'compute s':>10s} {'sim step s':>11s} {'idle':>6s}"
    print(f"{header} {'max/mean':>9s}")
    for method in args.methods.split(","):
        for gas in (int(g) for g in args.gas.split(",")):
            per_batch = []
            for b in range(args.batches):
                mbs = packed_microbatches(method, cost_model, shapes, args.global_batch, gas, b + 1)[b * gas :]
                with torch_threads(1):
                    per_batch.append(measure_layer_times(layers, mbs, token_normalized_loss, warmup=1))
            compute = float(np.mean([t.sum() for t in per_batch]))
            costs = np.mean([t.sum(axis=(0, 1)) for t in per_batch], axis=0)
            measured = split_stages("measured", costs.tolist(), 2)  # the split training would take
            for cut in [*range(1, len(layers)), balanced_cut(costs)]:
                step, idle, ratio = simulate(per_batch, cut)
                name = f"{cut:.2f}" if cut != int(cut) else str(cut) + ("*" if measured and cut == measured[1] else "")
                print(f"{method:13s} {gas:4d} {name:>8s} {compute:10.3f} {step:11.3f} {idle:6.1%} {ratio:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
