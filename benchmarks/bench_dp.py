"""`make bench-dp`: ZeRO-2 data parallel (2 ranks, plain engine, no pipeline) on an encoder-heavy mixture.

Builds a mixture of videos, multi-image and multi-tile samples and text from the records in
examples/data/*.jsonl, profiles the tiny model (unless a cost model is given), then launches
`deepspeed --num_gpus 2 benchmarks/dp_worker.py`, which trains the same global batches with
every method, interleaved round by round: the stock sampler, LLaVA's modality-grouped sampler,
verl's Karmarkar-Karp, the DFLOP sampler (lockstep), and the DFLOP sampler with the encoder's
tiles dispatched over the ranks (stock and LLaVA pad their microbatches, verl and dflop-ds pack
them); then the ZeRO-3 rows (``_z3``): stock, LLaVA, verl and DFLOP under ZeRO-3 with the buckets
of ds_configs/zero3_small_buckets.json (below a layer's size, so the encoder and the LLM meet
apart). Prints a table and ends with
`dp speedup_vs_stock=A speedup_vs_best_baseline=B dispatch_gain=C encoder_imbalance=D z3_speedup_vs_best_baseline=E`
(median step-time ratios; C = DFLOP with dispatch / without; D = measured encoder seconds
max/mean over ranks with dispatch, median over rounds; E = DFLOP under ZeRO-3 over the fastest
ZeRO-3 baseline).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_round_options,
    profiled_cost_model,
    round_output,
    run_round_worker,
    timed_rows,
)

BASELINES = ("stock", "llava", "verl")
#: the ZeRO-3 rows' baselines (the same splits trained under ZeRO-3 with buckets below a layer)
Z3_BASELINES = tuple(f"{method}_z3" for method in BASELINES)
#: records drawn from each file of examples/data for the encoder-heavy mixture
MIXTURE = {"multi_image": 224, "nextqa": 160, "coco": 64, "alpaca": 64}


def build_mixture(path: Path, seed: int = 0) -> Path:
    """Write the benchmark's mixture (shuffled records of :data:`MIXTURE`) to ``path``."""
    rng = np.random.default_rng(seed)
    records = []
    for name, count in MIXTURE.items():
        lines = (ROOT / "examples" / "data" / f"{name}.jsonl").read_text().splitlines()
        records += [lines[i] for i in sorted(rng.choice(len(lines), size=count, replace=False))]
    path.write_text("\n".join(records[i] for i in rng.permutation(len(records))) + "\n")
    return path


def imbalance(per_rank: np.ndarray) -> float:
    """Median over rounds of max / mean over ranks (rows: rounds, columns: ranks)."""
    return float(np.median(per_rank.max(axis=1) / np.maximum(per_rank.mean(axis=1), 1e-12)))


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per method over the timed rounds: median step (min-max), encoder share and imbalance."""
    table: dict[str, dict] = {}
    for method, timed in timed_rows(rows).items():
        steps = np.array([r["step_s"] for r in timed])
        encoder = np.array([r["encoder_s"] for r in timed])  # (rounds, ranks)
        table[method] = {
            "median_step_s": float(np.median(steps)),
            "min_step_s": float(steps.min()),
            "max_step_s": float(steps.max()),
            "samples_per_s": float(timed[0]["samples"] / np.median(steps)),
            "encoder_share": float(np.median(encoder.mean(axis=1) / steps)),
            "encoder_imbalance": imbalance(encoder),
            "predicted_encoder_imbalance": imbalance(np.array([r["predicted_encoder"] for r in timed])),
            "rounds": len(timed),
        }
    for method, values in table.items():
        stock = "stock_z3" if method.endswith("_z3") else "stock"  # each engine against its own stock
        values["vs_stock"] = table[stock]["median_step_s"] / values["median_step_s"]
    return table


def z3_field(table: dict[str, dict]) -> str:
    """`` z3_speedup_vs_best_baseline=E`` when the ZeRO-3 rows ran, else nothing."""
    if "dflop_z3" not in table:
        return ""
    best = min(table[method]["median_step_s"] for method in Z3_BASELINES)
    return f" z3_speedup_vs_best_baseline={best / table['dflop_z3']['median_step_s']:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_options(parser, rounds=8, gas=4)
    args = parser.parse_args()
    out, cost_path = round_output(args)
    profiled_cost_model(cost_path, reuse=True)
    data = build_mixture(out / "dp_mixture.jsonl")
    raw = out / "dp_rows.json"
    table = summarize(run_round_worker("dp_worker.py", args, cost_path, raw, ["--data", str(data)]))

    print(
        f"\nZeRO-2 (ZeRO-3: _z3), 2 ranks, tiny MLLM, mixture {MIXTURE} "
        f"(global batch {args.global_batch}, GAS {args.gas})"
    )
    print(
        f"{'method':16s} {'median step s':>13s} {'min-max':>15s} {'samples/s':>10s} {'encoder share':>14s} "
        f"{'enc max/mean':>13s} {'predicted':>10s} {'vs stock':>9s}"
    )
    for method, v in table.items():
        print(
            f"{method:16s} {v['median_step_s']:13.3f} {v['min_step_s']:7.3f}-{v['max_step_s']:<7.3f} "
            f"{v['samples_per_s']:10.2f} {v['encoder_share']:14.1%} {v['encoder_imbalance']:13.3f} "
            f"{v['predicted_encoder_imbalance']:10.3f} "
            f"{v['vs_stock']:9.3f}"
        )
    dispatch = table["dflop_dispatch"]
    best = min(table[m]["median_step_s"] for m in BASELINES)
    print(
        f"\n{dispatch['rounds']} timed rounds per method; encoder share = measured encoder seconds (forward + "
        f"backward, mean over ranks) / step, median over rounds; enc max/mean: measured encoder seconds, "
        f"predicted: the cost model's, both max/mean over ranks per step; rows in {raw}"
    )
    print(
        f"dp speedup_vs_stock={dispatch['vs_stock']:.3f} "
        f"speedup_vs_best_baseline={best / dispatch['median_step_s']:.3f} "
        f"dispatch_gain={table['dflop']['median_step_s'] / dispatch['median_step_s']:.3f} "
        f"encoder_imbalance={dispatch['encoder_imbalance']:.3f}{z3_field(table)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
