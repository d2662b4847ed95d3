"""`make demo`: a short 2-rank DeepSpeed pipeline training of the tiny MLLM, once with the stock
sampler and once with the DFLOP sampler, then their figures side by side.

    python examples/demo.py [--config ds_configs/tiny_mllm_pp2.json] [--steps 20] [--gpus 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflop_ds.launch import run_deepspeed

ROOT = Path(__file__).resolve().parent.parent


def run(sampler: str, config: str, steps: int, gpus: int, out_dir: Path, extra: list[str]) -> dict:
    """Launch one training run and return its summary."""
    summary = out_dir / f"demo_{sampler}.json"
    args = ["--deepspeed_config", config, "--sampler", sampler, "--steps", str(steps), "--summary", str(summary),
            *(["--packing", "false"] if sampler == "stock" else []), *extra]  # stock pads, as its users run it
    print(f"\n=== {sampler} sampler: deepspeed --num_gpus {gpus} examples/train.py {' '.join(args)}", flush=True)
    result = run_deepspeed(ROOT / "examples" / "train.py", args, ranks=gpus, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"the {sampler} run failed with exit code {result.returncode}")
    return json.loads(summary.read_text())["summary"]


def table(rows: dict[str, dict]) -> str:
    """The side-by-side comparison as aligned text."""
    fields = [("samples/s", "samples_per_s", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
              ("median step (s)", "median_step_s", "{:.3f}"),
              ("microbatch imbalance LLM (max/mean)", "imbalance_llm", "{:.3f}"),
              ("microbatch imbalance encoder", "imbalance_encoder", "{:.3f}"),
              ("padding efficiency", "padding_efficiency", "{:.3f}"),
              ("loss first -> last", None, None)]
    names = list(rows)
    lines = [f"{'':38s}" + "".join(f"{n:>14s}" for n in names)]
    for label, key, fmt in fields:
        if key is None:
            cells = [f"{rows[n]['first_loss']:.2f}->{rows[n]['last_loss']:.2f}" for n in names]
        else:
            cells = [fmt.format(rows[n][key]) for n in names]
        lines.append(f"{label:38s}" + "".join(f"{c:>14s}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="ds_configs/tiny_mllm_pp2.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=2, help="ranks to launch (CPU processes here)")
    parser.add_argument("--out", default="out", help="folder for the run summaries")
    args, extra = parser.parse_known_args()
    out_dir = ROOT / args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {name: run(name, args.config, args.steps, args.gpus, out_dir, extra) for name in ("stock", "dflop")}
    speedup = rows["dflop"]["samples_per_s"] / rows["stock"]["samples_per_s"]
    print("\n" + table(rows))
    print(f"\ndemo speedup_vs_stock={speedup:.3f} (samples/s, {args.gpus} ranks, "
          f"{rows['dflop']['steps']} timed steps each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
