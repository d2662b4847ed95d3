"""`make bench-hf`: stock vs DFLOP sampler on a tiny HuggingFace LLaVA, pipeline (pp2) and ZeRO-2.

Builds a tiny random ``LlavaForConditionalGeneration`` (CLIP + Llama, saved offline) and a LLaVA
JSON dataset with real PNG/JPEG files (text-only chats, one to three images, answers of 2 to 45
words), profiles the model's real layers (``dflop-ds profile model --model_name_or_path``), then
launches `deepspeed --num_gpus 2 benchmarks/hf_worker.py` once per engine kind; each launch
trains the same global batches with both samplers, interleaved round by round. Prints a table
(samples/s median with min-max over rounds) and ends with
`hf speedup_pp2=<x> speedup_zero2=<y>` (median samples/s, DFLOP over stock).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflop_ds.launch import launch_env, run_deepspeed  # noqa: E402

ENGINES = ("pp2", "zero2")


def prepare(out: Path, records: int) -> tuple[Path, Path, Path, Path]:
    """The model directory, data file, image folder and cost model (made once, then reused)."""
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset

    model = out / "model"
    if not (model / "config.json").exists():
        build_tiny_llava(model, vision="clip", text="llama")
    data, images = out / "data" / "data.json", out / "data" / "images"
    if not data.exists():
        write_llava_dataset(out / "data", records, seed=1, answer_words=(2, 45))
    cost_model = out / "costmodel.json"
    if not cost_model.exists():
        print(f"profiling {model} into {cost_model} ...", flush=True)
        subprocess.run([sys.executable, "-m", "dflop_ds.cli", "profile", "model", "--no-progress",
                        "--model_name_or_path", str(model), "--tiles", "1,2,4,8,16", "--seq-lens",
                        "32,64,128,256,512", "-o", str(cost_model)], check=True, cwd=ROOT, env=launch_env())
    return model, data, images, cost_model


def per_method(rows: list[dict]) -> dict[str, dict]:
    """Samples/s of the timed rounds per method: median, min, max; padding efficiency."""
    table = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        timed = [r for r in rows if r["method"] == method and not r["warmup"]]
        rates = [r["samples"] / r["step_s"] for r in timed]
        table[method] = {"median": float(np.median(rates)), "min": float(min(rates)), "max": float(max(rates)),
                         "padding": sum(r["tokens"] for r in timed) / sum(r["padded_tokens"] for r in timed),
                         "rounds": len(timed)}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "out" / "bench_hf"))
    parser.add_argument("--records", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (both samplers once per round)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data, images, cost_model = prepare(out, args.records)
    results = {}
    for engine in ENGINES:
        path = out / f"{engine}.json"
        result = run_deepspeed(
            ROOT / "benchmarks" / "hf_worker.py",
            ["--engine", engine, "--model", str(model), "--data", str(data), "--images", str(images),
             "--cost-model", str(cost_model), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
             "--out", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            print(result.stdout[-3000:] + result.stderr[-3000:])
            return result.returncode
        results[engine] = per_method(json.loads(path.read_text())["rows"])
    print(f"\n{'engine':7s} {'sampler':8s} {'samples/s median':>17s} {'min-max':>13s} {'padding eff':>12s}")
    for engine, table in results.items():
        for method, row in table.items():
            print(f"{engine:7s} {method:8s} {row['median']:17.1f} {row['min']:6.1f}-{row['max']:<6.1f} "
                  f"{row['padding']:12.3f}")
    ratios = {engine: table["dflop"]["median"] / table["stock"]["median"] for engine, table in results.items()}
    print(f"hf speedup_pp2={ratios['pp2']:.3f} speedup_zero2={ratios['zero2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
