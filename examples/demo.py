"""`make demo`: short 2-rank DeepSpeed pipeline trainings of the tiny MLLM with the stock and the
DFLOP sampler, interleaved in rounds on the same global batches, then their figures side by side.

    python examples/demo.py [--config ds_configs/tiny_mllm_pp2.json] [--rounds 5] [--steps 12] [--gpus 2]

The tiny model is profiled once (cached per model, machine and software versions; see
``dflop_ds.profile.cache``) and both samplers run on the fitted cost model. Every round launches
each sampler once, in an order that rotates from round to round so that the machine's drift hits
both alike; the table shows the median over rounds with the min-max. The last lines give the
correlation of predicted microbatch cost and observed compute per pipeline stage, compute timed by
the wall clock and by the CPU time of each rank's computing thread (which other processes on a
shared machine do not inflate).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dflop_ds.jsonio import read_json_object
from dflop_ds.launch import run_deepspeed
from dflop_ds.models.tiny_profile import cached_tiny_cost_model
from dflop_ds.profile.cache import default_cache_folder
from dflop_ds.telemetry.report import scatter_points

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("stock", "dflop")
#: per-run figures shown per method: label, summary key, format
FIELDS = [
    ("samples/s (all timed steps)", "samples_per_s", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("median step (s)", "median_step_s", "{:.3f}"),
    ("predicted imbalance stage 0 (max/mean)", "imbalance_encoder", "{:.3f}"),
    ("predicted imbalance last stage", "imbalance_llm", "{:.3f}"),
    ("observed imbalance (busiest stage)", "imbalance_observed", "{:.3f}"),
    ("padding efficiency", "padding_efficiency", "{:.3f}"),
]


def run(
    sampler: str, round_id: int, config: str, steps: int, gpus: int, cost_model: Path, out_dir: Path, extra: list[str]
) -> dict:
    """Launch one training run; its summary and step records."""
    summary = out_dir / f"demo_{sampler}_round{round_id}.json"
    args = [
        "--deepspeed_config",
        config,
        "--sampler",
        sampler,
        "--steps",
        str(steps),
        "--summary",
        str(summary),
        "--cost-model",
        str(cost_model),
        *(["--packing", "false"] if sampler == "stock" else []),
        *extra,
    ]  # stock pads, as its users run it
    print(
        f"\n=== round {round_id}, {sampler} sampler: deepspeed --num_gpus {gpus} examples/train.py {' '.join(args)}",
        flush=True,
    )
    result = run_deepspeed(ROOT / "examples" / "train.py", args, ranks=gpus, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"the {sampler} run of round {round_id} failed with exit code {result.returncode}")
    return json.loads(summary.read_text())


def rotated(methods: Sequence[str], round_id: int) -> list[str]:
    """The methods in the order of round ``round_id``: the first moves one place each round."""
    k = round_id % len(methods)
    return [*methods[k:], *methods[:k]]


def timed_telemetry(run_output: dict) -> list[dict]:
    """The telemetry records of a run's timed steps (warm-up steps left out, as its summary does)."""
    steps = run_output["steps"]
    timed = steps[len(steps) - run_output["summary"]["steps"] :]
    return [step["telemetry"] for step in timed if "telemetry" in step]


#: observed compute per microbatch: record key, label
OBSERVED = (("mb_observed", "wall"), ("mb_observed_cpu", "CPU time"))


def stage_correlations(telemetry: list[dict], observed: str = "mb_observed") -> dict[int, float]:
    """Per pipeline stage: Pearson r of predicted microbatch cost vs observed compute (``observed``:
    wall or CPU seconds, as ``dflop-ds report`` reads them); NaN where the predictions do not vary."""
    out = {}
    for stage, (x, y) in sorted(scatter_points(telemetry, observed).items()):
        out[stage] = float(np.corrcoef(x, y)[0, 1]) if x.size > 1 and np.ptp(x) > 0 and np.ptp(y) > 0 else float("nan")
    return out


def spread(values: Sequence[float], fmt: str) -> str:
    """``median (min-max)`` of ``values``."""
    return f"{fmt.format(float(np.median(values)))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(runs: dict[str, list[dict]]) -> str:
    """Median (min-max) over rounds of each method's figures, as aligned text."""
    lines = [f"{'':38s}" + "".join(f"{m:>24s}" for m in runs)]
    for label, key, fmt in FIELDS:
        values = {m: [r["summary"].get(key) for r in runs[m]] for m in runs}
        cells = [spread(v, fmt) if None not in v else "n/a" for v in values.values()]
        lines.append(f"{label:38s}" + "".join(f"{c:>24s}" for c in cells))
    losses = [f"{runs[m][0]['summary']['first_loss']:.2f}->{runs[m][0]['summary']['last_loss']:.2f}" for m in runs]
    lines.append(f"{'loss first -> last (round 0)':38s}" + "".join(f"{c:>24s}" for c in losses))
    return "\n".join(lines)


def speedups(runs: dict[str, list[dict]]) -> list[float]:
    """DFLOP over stock, one ratio per round (both ran the same global batches): samples/s at the
    median step, i.e. stock's median step time over DFLOP's (robust to the odd step a loaded
    machine stalls; every step trains the same number of samples)."""
    return [s["summary"]["median_step_s"] / d["summary"]["median_step_s"] for s, d in zip(runs["stock"], runs["dflop"])]


def correlation_lines(runs: dict[str, list[dict]]) -> list[str]:
    """r per stage over the timed steps of all rounds, compute timed by the wall clock and by the
    CPU-time clock: per method, and over both methods' microbatches together (the cost model's
    check over the widest range of microbatches), with the coefficient of variation of the
    predicted costs (balanced microbatches vary little, so timing noise weighs more in their r)."""
    telemetry = {method: [t for output in outputs for t in timed_telemetry(output)] for method, outputs in runs.items()}
    telemetry["both samplers"] = [t for records in telemetry.values() for t in records]
    lines = []
    for name, records in telemetry.items():
        for key, clock in OBSERVED:
            points = scatter_points(records, key)
            if not points and key != OBSERVED[0][0]:
                continue
            cells = ", ".join(
                f"stage {s} r={r:.3f} (cv {variation(points[s][0]):.2f})"
                for s, r in stage_correlations(records, key).items()
            )
            lines.append(
                f"{name}: predicted microbatch cost vs observed stage compute ({clock}): {cells or 'no telemetry'}"
            )
    return lines


def variation(values: np.ndarray) -> float:
    """Coefficient of variation (standard deviation over mean) of ``values``; NaN for none."""
    return float(np.std(values) / np.mean(values)) if values.size and np.mean(values) > 0 else float("nan")


def model_overrides(config: str) -> dict[str, Any]:
    """The tiny model's config overrides in the DeepSpeed config's ``"dflop"`` block."""
    return dict(read_json_object(ROOT / config).get("dflop", {}).get("model", {}))


#: the README's row of this demo: ``| `make demo` | x1.64 samples/s (3 runs: x1.40-1.69) | against | date, machine |``
README_ROW = re.compile(r"^\|\s*`make demo`\s*\|\s*x(?P<gain>\d+(?:\.\d+)?)(?P<rest>[^|]*)\|[^|]*\|(?P<when>[^|]*)\|")


def readme_figure(readme: str) -> tuple[float, str] | None:
    """``(speed-up, how it is described)`` of the README's ``make demo`` row (the figure, its runs
    and its date and machine), or None when the README has no such row."""
    for line in readme.splitlines():
        found = README_ROW.match(line.strip())
        if found:
            described = (
                f"x{found['gain']}{found['rest'].strip() and ' ' + found['rest'].strip()}, {found['when'].strip()}"
            )
            return float(found["gain"]), described
    return None


def comparison_line(measured: float, readme: str) -> str:
    """This run's median speed-up beside the README's figure, with the relative difference."""
    figure = readme_figure(readme)
    if figure is None:
        return f"README.md has no `make demo` row to compare x{measured:.3f} with"
    gain, described = figure
    return f"README.md says {described}; this run x{measured:.3f} ({(measured / gain - 1) * 100:+.1f}% against it)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="ds_configs/tiny_mllm_pp2.json")
    parser.add_argument("--rounds", type=int, default=5, help="launches of each sampler, interleaved")
    parser.add_argument("--steps", type=int, default=12, help="steps per launch (the config's warm-up ones untimed)")
    parser.add_argument("--gpus", type=int, default=2, help="ranks to launch (CPU processes here)")
    parser.add_argument("--out", default="out", help="folder for the run summaries")
    parser.add_argument("--cache", default=None, help=f"profile cache folder (default {default_cache_folder()})")
    args, extra = parser.parse_known_args()
    out_dir = ROOT / args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    _, cost_model = cached_tiny_cost_model(model_overrides(args.config), args.cache, repeats=3)
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for round_id in range(args.rounds):
        for method in rotated(METHODS, round_id):
            runs[method].append(run(method, round_id, args.config, args.steps, args.gpus, cost_model, out_dir, extra))
    ratios = speedups(runs)
    print("\n" + table(runs))
    print()
    print("\n".join(correlation_lines(runs)))
    readme = ROOT / "README.md"
    print("\n" + comparison_line(float(np.median(ratios)), readme.read_text() if readme.is_file() else ""))
    print(
        f"\ndemo speedup_vs_stock={np.median(ratios):.3f} (samples/s at the median step, median of {len(ratios)} "
        f"interleaved rounds, min-max {min(ratios):.3f}-{max(ratios):.3f}; {args.gpus} ranks, "
        f"{runs['dflop'][0]['summary']['steps']} timed steps per launch)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
