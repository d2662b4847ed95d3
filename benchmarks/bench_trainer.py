"""`make bench-trainer`: transformers.Trainer's sampling strategies against DFLOPTrainer, 2 ranks, ZeRO-2.

Builds a tiny random LLaVA (CLIP + Llama, offline) and a LLaVA JSON dataset with real image files
(30% text-only chats, one to three images of varied size, answers of 3 to 45 words), then
launches `deepspeed --num_gpus 2 benchmarks/trainer_worker.py` once: the same Trainer script
(examples/hf_trainer.py's Dataset and padded collator) trains with ``random``, ``group_by_length``,
``batch_rebalance`` and ``dflop``, interleaved round by round from the same initial weights.
The three transformers strategies run with the blank-image guard: without it a microbatch
without images on one rank aborts ZeRO-2's gradient reduction (a gloo size mismatch, measured
with batch_rebalance here and by tests/test_hf_trainer.py for the unguarded DFLOP sampler), so
every baseline is measured guarded. No padding-free collator runs for LLaVA here, so "best" is
the fastest measured baseline. Prints a table (samples/s median and min-max over rounds,
padding efficiency, rank imbalance) and ends with
`trainer speedup_vs_random=A speedup_vs_batch_rebalance=B speedup_vs_best=C padding_efficiency=D`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflop_ds.launch import run_deepspeed  # noqa: E402
from dflop_ds.testing.hf_tiny import build_tiny_llava  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402

WORKER = ROOT / "benchmarks" / "trainer_worker.py"
BASELINES = ("random", "group_by_length", "batch_rebalance")


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
        }
    return table


def report(table: dict[str, dict]) -> str:
    """The table and the last line."""
    lines = [f"{'strategy':<27}{'samples/s':>10}{'min-max':>16}{'padding eff':>13}{'imbalance':>11}"]
    for name, row in table.items():
        label = name if name == "dflop" else f"{name} (guarded)"
        lines.append(
            f"{label:<27}{row['median']:>10.2f}{row['min']:>8.2f}-{row['max']:<7.2f}"
            f"{row['padding_efficiency']:>13.3f}{row['imbalance']:>11.3f}"
        )
    dflop = table["dflop"]["median"]
    best = max(table[b]["median"] for b in BASELINES)
    lines.append(
        f"trainer speedup_vs_random={dflop / table['random']['median']:.2f}"
        f" speedup_vs_batch_rebalance={dflop / table['batch_rebalance']['median']:.2f}"
        f" speedup_vs_best={dflop / best:.2f} padding_efficiency={table['dflop']['padding_efficiency']:.3f}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp:
        root = Path(tmp)
        model = build_tiny_llava(root / "model")
        data, images = write_llava_dataset(root / "data", args.records, seed=5, text_only=0.3, answer_words=(3, 45))
        out = root / "results.json"
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
        options = ["--out", out, "--model", model, "--data", data, "--images", images]
        options += ["--rounds", args.rounds, "--steps", args.steps]
        result = run_deepspeed(
            WORKER,
            [str(o) for o in options],
            cwd=ROOT,
            extra_env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if result.returncode != 0:
            sys.exit(f"bench-trainer: the worker failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
        print(report(summarize(json.loads(out.read_text()))))


if __name__ == "__main__":
    main()
