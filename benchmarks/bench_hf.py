"""`make bench-hf`: the samplers of the end-to-end benchmark on tiny HuggingFace models, pipeline (pp2) and ZeRO-2.

Builds a tiny random ``LlavaForConditionalGeneration`` (CLIP + Llama, saved offline) and a LLaVA
JSON dataset with real PNG/JPEG files (text-only chats, one to three images, answers of 2 to 45
words), and a tiny random ``Qwen2VLForConditionalGeneration``, ``LlavaOnevisionForConditionalGeneration``
(AnyRes) and ``InternVLForConditionalGeneration`` (dynamic tiles), each with its own dataset: images
of varied sizes and aspect ratios, multi-image and text-only chats and short real videos (mpeg4,
4-12 frames, written with PyAV). Profiles each model's real layers (``dflop-ds profile model
--model_name_or_path``), then launches `deepspeed --num_gpus 2 benchmarks/hf_worker.py` once per
row (LLaVA on pp2 and ZeRO-2, Qwen2-VL, LLaVA-OneVision and InternVL on ZeRO-2); each launch
trains the same global batches with every method, interleaved round by round. The methods run as their users run them
(:mod:`benchmarks.e2e_methods`): stock and LLaVA's modality grouping pad their microbatches,
verl and dflop-ds pack them (dflop-ds balancing on the packed cost), and ``stock_packed``
(stock's split, packed) separates packing's gain from balancing's. Prints a table (samples/s
median with min-max over rounds) and ends with
`hf speedup_pp2=<x> balancing_pp2=<b> speedup_zero2=<y> ...` (median samples/s: dflop over
stock, and dflop over stock_packed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import profile_model_into, run_worker, timed_rows  # noqa: E402
from benchmarks.e2e_methods import ONE_ENGINE_METHODS  # noqa: E402
from dflop_ds.cost import reusable_fitted_model  # noqa: E402

#: the rows: (name, model family, engine)
RUNS = (
    ("pp2", "llava", "pp2"),
    ("zero2", "llava", "zero2"),
    ("qwen2_vl_zero2", "qwen2_vl", "zero2"),
    ("llava_ov_zero2", "llava_onevision", "zero2"),
    ("internvl_zero2", "internvl", "zero2"),
)
#: the profile's encoder sweep per family: LLaVA, LLaVA-OneVision and InternVL tiles, Qwen2-VL patches
TILE_SWEEPS = {
    "llava": "1,2,4,8,16",
    "llava_encoder_heavy": "1,2,4,8,16",
    "qwen2_vl": "4,16,64,128,256,512",
    "qwen2_vl_encoder_heavy": "4,16,64,128,256,512",
    "llava_onevision": "1,2,4,8,16,32",
    "internvl": "1,2,4,8,16,32",
}
#: the Qwen2-VL dataset: images up to 64x64 px after resizing (256 patches); a third of the records of
#: every family but LLaVA are videos
QWEN_MAX_PIXELS, VIDEO_SHARE = 64 * 64, 3
#: the families whose datasets hold images only (LLaVA's)
IMAGE_ONLY = ("llava", "llava_encoder_heavy")
#: how many times wider than the tests' each encoder-heavy model is (the same layers,
#: :func:`dflop_ds.testing.hf_tiny.widened`; its folder names the width, so a cached model of another
#: width is not reused): at width 1 ZeRO-3's per-module gathers take most of a microbatch's time on
#: CPU ranks, whatever its samples (benchmarks/bench_frameworks.py's traces); packed Qwen2-VL rows
#: still did at width 2
WIDENED = {"llava_encoder_heavy": 2, "qwen2_vl_encoder_heavy": 4}


def prepare(out: Path, records: int, family: str) -> dict[str, Path]:
    """The model directory, data file, media folders and cost model of ``family`` (made once, then
    reused); ``llava_encoder_heavy`` is LLaVA's data on the encoder-heavy tiny LLaVA,
    ``qwen2_vl_encoder_heavy`` Qwen2-VL's data on the encoder-heavy tiny Qwen2-VL."""
    from dflop_ds.testing.hf_tiny import build_encoder_heavy_llava, build_tiny_llava
    from dflop_ds.testing.internvl_tiny import build_tiny_internvl
    from dflop_ds.testing.llava_data import write_llava_dataset
    from dflop_ds.testing.llava_onevision_tiny import build_tiny_llava_onevision
    from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl
    from dflop_ds.testing.video import add_video_records

    root = out if family == "llava" else out / (f"{family}_w{WIDENED[family]}" if family in WIDENED else family)
    model = root / "model"
    if not (model / "config.json").exists():
        if family == "llava":
            build_tiny_llava(model, vision="clip", text="llama")
        elif family == "llava_encoder_heavy":
            build_encoder_heavy_llava(model, width=WIDENED[family])  # a 6-layer, 512-wide CLIP tower
        elif family == "llava_onevision":
            build_tiny_llava_onevision(model)  # 16 px tiles, grids up to 3 x 3, pooled over 2 tiles' worth
        elif family == "internvl":
            build_tiny_internvl(model)  # 16 px tiles, 1-6 tiles and a thumbnail
        elif family == "qwen2_vl_encoder_heavy":
            build_tiny_qwen2_vl(model, max_pixels=QWEN_MAX_PIXELS, encoder_heavy=True, width=WIDENED[family])
        else:
            build_tiny_qwen2_vl(model, max_pixels=QWEN_MAX_PIXELS)
    data, images, videos = root / "data" / "data.json", root / "data" / "images", root / "data" / "videos"
    if not data.exists():
        n_videos = 0 if family in IMAGE_ONLY else records // VIDEO_SHARE
        write_llava_dataset(root / "data", records - n_videos, seed=1, answer_words=(2, 45))
        if n_videos:
            add_video_records(data, videos, n_videos, seed=1)
    cost_model = root / "costmodel.json"
    if reusable_fitted_model(cost_model) is None:
        print(f"profiling {model} into {cost_model} ...", flush=True)
        sweep = ["--tiles", TILE_SWEEPS[family], "--seq-lens", "32,64,128,256,512"]
        profile_model_into(cost_model, ["--model_name_or_path", str(model), *sweep])
    return {"model": model, "data": data, "images": images, "videos": videos, "cost_model": cost_model}


def per_method(rows: list[dict]) -> dict[str, dict]:
    """Samples/s of the timed rounds per method: median, min, max; padding efficiency."""
    table = {}
    for method, timed in timed_rows(rows).items():
        rates = [r["samples"] / r["step_s"] for r in timed]
        table[method] = {
            "median": float(np.median(rates)),
            "min": float(min(rates)),
            "max": float(max(rates)),
            "padding": sum(r["tokens"] for r in timed) / sum(r["padded_tokens"] for r in timed),
            "rounds": len(timed),
        }
    return table


def ratios(results: dict[str, dict[str, dict]]) -> dict[str, float]:
    """Median samples/s of dflop over stock (``speedup_<run>``) and over stock_packed
    (``balancing_<run>``: balancing's gain alone), for the runs that have both methods."""
    out = {}
    for name, table in results.items():
        for figure, base in (("speedup", "stock"), ("balancing", "stock_packed")):
            if "dflop" in table and base in table:
                out[f"{figure}_{name}"] = table["dflop"]["median"] / table[base]["median"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "out" / "bench_hf"))
    parser.add_argument("--records", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (every method once per round)")
    parser.add_argument(
        "--qwen-rounds", type=int, default=6, help="timed rounds of the Qwen2-VL, LLaVA-OneVision and InternVL rows"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--methods", default=",".join(ONE_ENGINE_METHODS), help="comma-separated methods (default: all)"
    )
    parser.add_argument(
        "--runs", default=",".join(name for name, _, _ in RUNS), help="comma-separated rows to run (default: all)"
    )
    args = parser.parse_args()
    wanted = args.runs.split(",")
    unknown = sorted(set(wanted) - {name for name, _, _ in RUNS})
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {[name for name, _, _ in RUNS]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, family, engine in (run for run in RUNS if run[0] in wanted):
        paths = prepare(out, args.records, family)
        path = out / f"{name}.json"
        rounds = args.rounds if family == "llava" else args.qwen_rounds
        written = run_worker(
            "hf_worker.py",
            [
                "--engine",
                engine,
                "--model",
                str(paths["model"]),
                "--data",
                str(paths["data"]),
                "--images",
                str(paths["images"]),
                "--videos",
                str(paths["videos"]),
                "--cost-model",
                str(paths["cost_model"]),
                "--methods",
                args.methods,
                "--rounds",
                str(rounds),
                "--warmup",
                str(args.warmup),
                "--out",
                str(path),
            ],
            path,
            timeout=1800,
        )
        results[name] = per_method(written["rows"])
    print(f"\n{'run':15s} {'method':12s} {'samples/s median':>17s} {'min-max':>13s} {'padding eff':>12s}")
    for name, table in results.items():
        for method, row in table.items():
            print(
                f"{name:15s} {method:12s} {row['median']:17.1f} {row['min']:6.1f}-{row['max']:<6.1f} "
                f"{row['padding']:12.3f}"
            )
    print("hf " + " ".join(f"{figure}={ratio:.3f}" for figure, ratio in ratios(results).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
