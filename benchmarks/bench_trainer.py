"""`make bench-trainer`: transformers.Trainer's sampling strategies against DFLOPTrainer, 2 ranks, ZeRO-2 and ZeRO-3.

Two rows, each on its tiny random HF model and dataset (made once, with its profiled cost model,
by `make bench-hf`'s :func:`benchmarks.bench_hf.prepare`): LLaVA (CLIP + Llama; text-only chats,
one to three images of varied size) and Qwen2-VL (images of varied size and aspect ratio, each its
own patch grid, text-only chats and short videos). Every row launches
`deepspeed --num_gpus 2 benchmarks/trainer_worker.py`: the same Trainer script trains one epoch
with each strategy, interleaved round by round from the same initial weights: ``random`` (stock),
``group_by_length``, ``batch_rebalance``, ``padding_free`` (transformers'
``DataCollatorWithFlattening``, with M-RoPE positions for Qwen2-VL, and sdpa: the padding-free
path transformers offers on this device), and the project's: ``dflop`` (the padded collator),
``dflop_packed`` (padding-free with the project's per-sample attention, ``use_segment_attention``,
balanced on the packed cost) and ``stock_packed`` (the same collator and attention in random
order: packing's gain without balancing, not counted as a baseline).

Each baseline first runs one epoch as its users run it, without the blank-image guard. One that
crashes is shown as crashed with its error, and is measured with the project's guard
(``BlankImageGuardMixin``, which DFLOPTrainer always has) and labelled so. Prints per row a table
(samples/s median and min-max over rounds, padding efficiency, rank imbalance measured on the
forward passes and, for the strategies DFLOPTrainer runs, as the cost model predicts it, with
the predicted step over its lower bound under the row's sync model: how much any split could still
gain over that strategy by the cost model's account; the median measured step and, for those
strategies, the predicted one: the share of a step the cost model sees) and ends with
`trainer speedup_vs_random=A speedup_vs_batch_rebalance=B speedup_vs_best=C padding_efficiency=D
z3_speedup_vs_best=E`: A-D of the Qwen2-VL row (DFLOP's best variant over each baseline, over the
fastest baseline), E the same over the fastest baseline of the ZeRO-3 rows (the smallest of them).

The ZeRO-3 rows: ``llava_z3`` trains the encoder-heavy tiny LLaVA, twice as wide as the tests'
(:func:`dflop_ds.testing.hf_tiny.build_encoder_heavy_llava`, ``bench_hf.WIDENED``: at the
tests' width ZeRO-3's per-module gathers take most of a microbatch on CPU ranks) on LLaVA's data;
``qwen2_vl_z3`` the encoder-heavy tiny Qwen2-VL four times as wide (its tower as wide as its LLM)
on Qwen2-VL's data (images of varied size, text-only chats and, a third, videos); both under
ds_configs/zero3_small_buckets.json (buckets below a layer's size, as real models have them: the
vision tower and the LLM meet apart), with the Trainer loading data in 2 worker processes
(``dataloader_num_workers``) as its users configure it, against transformers' ``random`` and
``batch_rebalance`` samplers, stock + packing (``padding_free``) and the packers of LLaMA-Factory
(``llamafactory_packing``, its greedy knapsack) and ms-swift (``swift_packing``, best-fit
decreasing), run by DFLOPTrainer's packing path with those splitters; every baseline with the
blank-image guard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_hf import prepare  # noqa: E402
from benchmarks.common import mean_of  # noqa: E402
from dflop_ds.launch import run_deepspeed  # noqa: E402

WORKER = ROOT / "benchmarks" / "trainer_worker.py"
#: the strategies of the ZeRO-2 rows (transformers' baselines first)
STRATEGIES = ("random", "group_by_length", "batch_rebalance", "padding_free", "stock_packed", "dflop", "dflop_packed")
#: the ZeRO-3 row's: transformers' random and batch_rebalance samplers, stock + packing (transformers'
#: padding-free collator), LLaMA-Factory's and ms-swift's packers, and the project's
Z3_STRATEGIES = (
    "random",
    "batch_rebalance",
    "padding_free",
    "llamafactory_packing",
    "swift_packing",
    "dflop",
    "dflop_packed",
)


@dataclass(frozen=True)
class Row:
    """One row: the data and model :func:`prepare` makes, the worker's model family, the
    strategies, the DeepSpeed config, the Trainer's ``dataloader_num_workers`` and whether the
    baselines first run unguarded (under ZeRO-3 a rank skipping the vision tower while another
    gathers it blocks both, so that row measures every baseline guarded)."""

    data: str
    family: str
    strategies: tuple[str, ...]
    deepspeed: str = "ds_configs/hf_trainer_zero2.json"
    workers: int = 0
    probe: bool = True


ROWS = {
    "llava": Row("llava", "llava", STRATEGIES),
    "qwen2_vl": Row("qwen2_vl", "qwen2_vl", STRATEGIES),
    "llava_z3": Row(
        "llava_encoder_heavy", "llava", Z3_STRATEGIES, "ds_configs/zero3_small_buckets.json", workers=2, probe=False
    ),
    "qwen2_vl_z3": Row(
        "qwen2_vl_encoder_heavy",
        "qwen2_vl",
        Z3_STRATEGIES,
        "ds_configs/zero3_small_buckets.json",
        workers=2,
        probe=False,
    ),
}
#: the ZeRO-3 rows: ``z3_speedup_vs_best`` is the smallest gain over them
Z3_ROWS = tuple(name for name, row in ROWS.items() if "zero3" in row.deepspeed)
#: the project's configurations; every other strategy is a transformers baseline
PROJECT = ("stock_packed", "dflop", "dflop_packed")


def is_dflop(strategy: str) -> bool:
    return strategy.startswith("dflop")


def launch(paths: dict, row: Row, options: list, timeout: float) -> tuple[list[dict] | None, str]:
    """Run the worker on ``paths`` (``prepare``'s) as ``row`` asks; ``(its results, "")`` or ``(None, the error)``."""
    out = Path(paths["data"]).parent.parent / "results.json"
    out.unlink(missing_ok=True)
    media = ["--images", paths["images"]] + (["--videos", paths["videos"]] if row.family == "qwen2_vl" else [])
    args = ["--out", out, "--model", paths["model"], "--data", paths["data"], "--family", row.family, *media]
    args += ["--cost_model", paths["cost_model"], "--deepspeed", ROOT / row.deepspeed, "--workers", row.workers]
    args += options
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    try:
        result = run_deepspeed(
            WORKER, [str(a) for a in args], cwd=ROOT, extra_env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"no result in {timeout:.0f} s"
    if result.returncode != 0 or not out.exists():
        return None, first_error(result.stdout + result.stderr) or f"exit code {result.returncode}"
    return json.loads(out.read_text()), ""


def first_error(log: str) -> str:
    """The error of a failed launch's output: a C++ abort's ``what():`` (gloo's), else the first
    ``SomethingError: ...`` line."""
    lines = [line.split("]:", 1)[-1].strip() if line.startswith("[rank") else line.strip() for line in log.splitlines()]
    for text in lines:
        if text.startswith("what():"):
            return text.removeprefix("what():").strip()[:300]
    for text in lines:
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return text[:300]
    return ""


def unguarded_runs(paths: dict, row: Row, baselines: tuple, timeout: float) -> dict[str, str]:
    """Each baseline's unguarded epoch: ``"crashed: <error>"``, or how it ran (the microbatch slots
    where one rank had images and another none, which break ZeRO-2's reduction unguarded)."""
    outcomes = {}
    for strategy in baselines:
        print(f"[{row.data}] {strategy}: one epoch without the blank-image guard ...", flush=True)
        results, error = launch(paths, row, ["--strategies", strategy, "--rounds", "1"], timeout)
        if results is None:
            outcomes[strategy] = f"crashed: {error}"
        else:
            mixed = results[0]["mixed_microbatches"]
            outcomes[strategy] = f"ran ({mixed} microbatch slots with images on one rank only)"
        print(f"[{row.data}] {strategy} unguarded: {outcomes[strategy]}", flush=True)
    return outcomes


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per strategy: samples/s median, min, max over rounds; mean padding efficiency and imbalance."""
    table: dict[str, dict] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in results):
        rows = [r for r in results if r["strategy"] == strategy]
        rates = [r["samples_per_s"] for r in rows]
        table[strategy] = {
            "median": float(np.median(rates)),
            "min": min(rates),
            "max": max(rates),
            "padding_efficiency": float(np.mean([r["padding_efficiency"] for r in rows])),
            "imbalance": float(np.mean([r["imbalance"] for r in rows])),
            "predicted": mean_of(rows, "predicted_imbalance"),
            "over_bound": mean_of(rows, "predicted_step_over_bound"),
            "step_s": float(np.median([r["step_s"] for r in rows])),
            "predicted_step_s": mean_of(rows, "predicted_step_s"),
        }
    return table


def cell(value: float | None) -> str:
    """A table cell of 11 characters: the value to 3 decimals, or a dash."""
    return f"{value:>11.3f}" if value is not None else f"{'-':>11}"


def report(row: str, table: dict[str, dict], unguarded: dict[str, str]) -> str:
    """The row's table: how each baseline ran unguarded, then every measured strategy (a baseline
    that crashed unguarded is measured guarded, and labelled so)."""
    lines = [f"[{row}] unguarded epoch of {name}: {outcome}" for name, outcome in unguarded.items()]
    lines.append(
        f"[{row}] {'strategy':<28}{'samples/s':>10}{'min-max':>16}{'padding eff':>13}{'imbalance':>11}{'predicted':>11}"
        f"{'step/bound':>11}{'step s':>11}{'predicted':>11}"
    )
    for name, entry in table.items():
        label = f"{name} (guarded)" if not unguarded.get(name, "ran").startswith("ran") else name
        lines.append(
            f"[{row}] {label:<28}{entry['median']:>10.2f}{entry['min']:>8.2f}-{entry['max']:<7.2f}"
            f"{entry['padding_efficiency']:>13.3f}{entry['imbalance']:>11.3f}"
            + cell(entry["predicted"])
            + cell(entry["over_bound"])
            + f"{entry['step_s']:>11.3f}"
            + cell(entry["predicted_step_s"])
        )
    return "\n".join(lines)


def fastest_dflop(table: dict[str, dict]) -> str:
    """The name of DFLOP's fastest variant in a row's table."""
    return max((name for name in table if is_dflop(name)), key=lambda name: table[name]["median"])


def speedup_vs_best(table: dict[str, dict]) -> float:
    """DFLOP's fastest variant over the fastest baseline of a row's table (median samples/s)."""
    best = max(entry["median"] for name, entry in table.items() if name not in PROJECT)
    return table[fastest_dflop(table)]["median"] / best


def last_line(tables: dict[str, dict[str, dict]]) -> str:
    """DFLOP's fastest variant over random, batch_rebalance and the fastest baseline of the Qwen2-VL
    row (else the first ZeRO-2 row that ran), and ``z3_speedup_vs_best`` of the ZeRO-3 row if it ran."""
    fields = []
    main_rows = [row for row in ("qwen2_vl", *tables) if row in tables and row not in Z3_ROWS]
    if main_rows:
        table = tables[main_rows[0]]
        rate = table[fastest_dflop(table)]["median"]
        fields += [
            f"speedup_vs_random={rate / table['random']['median']:.2f}",
            f"speedup_vs_batch_rebalance={rate / table['batch_rebalance']['median']:.2f}",
            f"speedup_vs_best={speedup_vs_best(table):.2f}",
            f"padding_efficiency={table[fastest_dflop(table)]['padding_efficiency']:.3f}",
        ]
    z3 = [speedup_vs_best(tables[row]) for row in Z3_ROWS if row in tables]
    if z3:
        fields.append(f"z3_speedup_vs_best={min(z3):.2f}")
    return "trainer " + " ".join(fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "bench_trainer"))
    parser.add_argument("--records", type=int, default=160, help="records per dataset (a multiple of 16: full steps)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows of {list(ROWS)}")
    parser.add_argument("--no-probe", action="store_true", help="skip the unguarded epochs; guard every baseline")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    tables = {}
    for row in args.rows.split(","):
        spec = ROWS[row]
        paths = prepare(Path(args.out) / f"records{args.records}", args.records, spec.data)
        baselines = tuple(s for s in spec.strategies if s not in PROJECT)
        if args.no_probe or not spec.probe:
            why = "--no-probe" if args.no_probe else "ZeRO-3: a rank skipping the vision tower blocks the others"
            unguarded = dict.fromkeys(baselines, f"not run ({why}): measured guarded")
        else:
            unguarded = unguarded_runs(paths, spec, baselines, args.timeout)
        guarded = [name for name, outcome in unguarded.items() if not outcome.startswith("ran")]
        options = ["--strategies", ",".join(spec.strategies), "--guarded", ",".join(guarded), "--rounds", args.rounds]
        results, error = launch(paths, spec, options, args.timeout)
        if results is None:
            sys.exit(f"bench-trainer [{row}]: the worker failed: {error}")
        tables[row] = summarize(results)
        print(report(row, tables[row], unguarded), flush=True)
        if "stock_packed" in tables[row]:
            gain = tables[row]["dflop_packed"]["median"] / tables[row]["stock_packed"]["median"]
            print(f"[{row}] balancing alone (dflop_packed over stock_packed, both padding-free): x{gain:.2f}")
    print(last_line(tables))


if __name__ == "__main__":
    main()
