"""`make bench-e2e`: end-to-end training throughput of the tiny MLLM on a real data mixture.

Profiles the tiny model (unless a cost model is given), splits dflop's two pipeline stages by
per-layer costs measured on its own packed microbatches (:mod:`dflop_ds.profile.layer_split`: the
layer profile's encoder/LLM ratio picked a boundary one layer off), then launches
`deepspeed --num_gpus 2 benchmarks/e2e_worker.py`, which trains the same global batches with
every method, interleaved. Prints a table, writes a CSV and a PNG
bar chart to out/, and ends with
`e2e speedup_vs_stock=<x> speedup_vs_best_baseline=<y> padding_efficiency=<p> idle=<i>` (samples/s
ratios; padding efficiency and idle fraction of dflop). ``stock_packed`` (stock's split, packed
microbatches) is an ablation like ``dflop_uniform``: dflop over it is balancing's gain alone.
"""

from __future__ import annotations

import argparse
import csv
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
from benchmarks.e2e_methods import split_for  # noqa: E402
from dflop_ds.cost import sampler_cost_model  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.models import TinyMLLMConfig, TinyMLLMDataset, collate_microbatch, tiny_mllm_layers  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.pipe.stage_bounds import split_stages  # noqa: E402
from dflop_ds.plan.stages import cost_balanced_bounds  # noqa: E402
from dflop_ds.profile.layer_split import measure_layer_costs  # noqa: E402
from dflop_ds.profile.model import torch_threads  # noqa: E402
from dflop_ds.schedule.epoch import epoch_permutation, global_batches  # noqa: E402
from dflop_ds.schedule.index import ScheduledIndex  # noqa: E402
from dflop_ds.shapes import TINY_POLICY, SampleShape  # noqa: E402
from dflop_ds.telemetry.record import throughput  # noqa: E402

BASELINES = ("stock", "llava", "verl")  # dflop_uniform is an ablation of dflop, not a baseline


def packed_microbatches(
    method: str, cost_model, shapes: list[SampleShape], global_batch: int, gas: int, n_batches: int = 2
) -> list:
    """``method``'s collated packed microbatches (one rank) of the first ``n_batches`` global batches
    (seed 0, as the worker draws them)."""
    dataset = TinyMLLMDataset(shapes, TinyMLLMConfig(), seed=0)
    costs = sampler_cost_model(cost_model, packed=True).predict_samples(shapes)
    microbatches = []
    for batch in global_batches(epoch_permutation(len(shapes), 0, 0), global_batch, gas)[:n_batches]:
        for mb in split_for(method, batch.tolist(), shapes, costs[batch], gas, 1)[0]:
            microbatches.append(collate_microbatch([dataset[ScheduledIndex(i, 1.0)] for i in mb], packed=True))
    return microbatches


def flat_tiny_layers() -> list:
    """The tiny MLLM's pipeline layer list as built modules."""
    encoder, projector, llm = tiny_mllm_layers(TinyMLLMConfig(), as_specs=False)
    return [*encoder, projector, *llm]


def measured_bounds(cost_model, shapes: list[SampleShape], global_batch: int, gas: int) -> list[int]:
    """dflop's 2-stage bounds from per-layer costs measured (one thread, as a rank runs) on its own
    packed microbatches (:func:`packed_microbatches`)."""
    microbatches = packed_microbatches("dflop", cost_model, shapes, global_batch, gas)
    with torch_threads(1):
        seconds = measure_layer_costs(flat_tiny_layers(), microbatches, token_normalized_loss)
    bounds = split_stages("measured", seconds, 2)
    assert bounds is not None  # no memory cap: every split fits
    return bounds.to_list()


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per method over the timed rounds: throughput, median step, padding, ratio to stock."""
    table: dict[str, dict] = {}
    for method, timed in timed_rows(rows).items():
        table[method] = {
            **throughput(timed),
            "idle_fraction": float(np.mean([r["idle_fraction"] for r in timed])),
            "median_schedule_ms": 1e3 * float(np.median([r["schedule_s"] for r in timed])),
            "rounds": len(timed),
        }
    for values in table.values():
        values["vs_stock"] = values["samples_per_s"] / table["stock"]["samples_per_s"]
    return table


def write_outputs(table: dict[str, dict], out: Path) -> None:
    """CSV and a PNG bar chart of samples/s per method."""
    fields = ["method", *next(iter(table.values())).keys()]
    with open(out / "e2e.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for method, values in table.items():
            writer.writerow({"method": method, **values})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(table)
    ax.bar(names, [table[n]["samples_per_s"] for n in names], color=["#999"] * (len(names) - 1) + ["#2a7"])
    for i, n in enumerate(names):
        ax.text(i, table[n]["samples_per_s"], f"x{table[n]['vs_stock']:.2f}", ha="center", va="bottom")
    ax.set_ylabel("samples / s")
    ax.set_title("tiny MLLM, 2 pipeline stages, same global batches")
    fig.tight_layout()
    fig.savefig(out / "e2e.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_options(parser, rounds=12, gas=8)
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "mixture.jsonl"))
    args = parser.parse_args()
    out, cost_path = round_output(args)
    cost_model = profiled_cost_model(cost_path, reuse=args.cost_model is not None)
    shapes = read_dataset(args.data, TINY_POLICY)
    predicted = cost_balanced_bounds(cost_model, shapes, 2)
    bounds = measured_bounds(cost_model, shapes, args.global_batch, args.gas)
    print(
        f"dflop stage bounds from layer costs measured on its packed microbatches: {bounds} (from the cost "
        f"model's layer profile: {predicted}; baselines: split by layer count)",
        flush=True,
    )

    raw = out / "e2e_rows.json"
    extra = ["--dflop-bounds", ",".join(map(str, bounds)), "--data", args.data]
    rows = run_round_worker("e2e_worker.py", args, cost_path, raw, extra)
    table = summarize(rows)
    write_outputs(table, out)

    print(
        f"\n{'method':14s} {'samples/s':>10s} {'tokens/s':>10s} {'median step s':>14s} {'idle':>6s} "
        f"{'padding eff':>12s} {'sched ms':>9s} {'vs stock':>9s}"
    )
    for method, v in table.items():
        print(
            f"{method:14s} {v['samples_per_s']:10.2f} {v['tokens_per_s']:10.0f} {v['median_step_s']:14.3f} "
            f"{v['idle_fraction']:6.1%} {v['padding_efficiency']:12.3f} {v['median_schedule_ms']:9.1f} "
            f"{v['vs_stock']:9.3f}"
        )
    best_baseline = max(table[m]["samples_per_s"] for m in BASELINES if m in table)
    print(f"\n{table['dflop']['rounds']} timed rounds per method; CSV and PNG in {out}")
    if "stock_packed" in table:
        print(
            f"packing alone (stock_packed / stock) x{table['stock_packed']['vs_stock']:.3f}; balancing over it "
            f"(dflop / stock_packed) x{table['dflop']['samples_per_s'] / table['stock_packed']['samples_per_s']:.3f}"
        )
    if "dflop_colocated" in table:
        phases = timed_rows(rows)["dflop_colocated"]
        medians = {phase: np.median([r[phase] for r in phases]) for phase in ("encode", "pipeline", "encoder_backward")}
        print("dflop_colocated median phase seconds (rank 0): " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
        print(
            f"colocated encoder (dflop_colocated / dflop, same sampler, encoder beside the pipeline) "
            f"x{table['dflop_colocated']['samples_per_s'] / table['dflop']['samples_per_s']:.3f}; its idle "
            "fraction counts the encoder phase outside the pipeline as idle"
        )
    print(
        f"e2e speedup_vs_stock={table['dflop']['vs_stock']:.3f} "
        f"speedup_vs_best_baseline={table['dflop']['samples_per_s'] / best_baseline:.3f} "
        f"padding_efficiency={table['dflop']['padding_efficiency']:.3f} idle={table['dflop']['idle_fraction']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
