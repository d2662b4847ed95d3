"""Parallelism planning at cluster scale with the analytic LLaVA-OneVision reference profiles.

For each reference profile (SigLIP-400M-class encoder with a 0.5B / 7B / 72B Qwen2-class LLM,
on A100-80GB and H100-80GB) and 8, 64, 256, 1024 and 16384 GPUs, search the plans for global
batches drawn from ``examples/data/mixture.jsonl`` (read under the real-scale
``ShapePolicy()``) and print:

- the chosen shared-pipeline plan: the best ``deepspeed``-family one (encoder and LLM layers in
  one pipeline, our balanced microbatches, cost split of the layers), its predicted step time,
  pipeline bubble and peak memory;
- its predicted speed-up over the monolithic baseline (same search space, DeepSpeed's uniform
  layer split, fixed-size sequential microbatches);
- the best plan overall (the faster of the shared-pipeline and the colocated families) and the gap to it;
- the search time (wall and CPU seconds) and the peak resident memory of the process that ran it
  (each grid point runs in a forked child, whose ``ru_maxrss`` counts the pages it touches,
  the interpreter's included; the parent's own is printed on the ``machine`` line).

A second table compares the families against the best shared-layout plan without tensor
parallelism (``deepspeed`` family, tp = 1: what a model without tensor-parallel layers runs),
from a second search with ``max_tp=1``: the predicted speed-up of the best colocated plan with
tp = 1, of the best tensor-parallel plan (the full search's shared-pipeline winner when its tp > 1)
and of the best colocated plan of the full search (any LLM tp).

ALL TIMES ARE PREDICTIONS OF ANALYTIC COST MODELS (FLOP counts over an assumed throughput),
NOT MEASUREMENTS. The last line reads
``plan speedup_vs_monolithic@256=<x> search_s@1024=<y> colocated_vs_shared@256=<c> tp_vs_shared@256=<t>
search_s@16384=<z> peak_mem_GB@16384=<m>``:
``x`` is the geometric mean over the six profiles of the chosen shared-pipeline plan's predicted
speed-up at 256 GPUs, ``y`` the longest search at 1024 GPUs (CPU seconds of the process that
searched: the machine may be shared; the table gives wall seconds too), ``c`` and ``t`` the
geometric means at 256 GPUs of the colocated (tp = 1) and the tensor-parallel plans' predicted
speed-ups over the best shared-layout tp = 1 plan (1.0 where the full search picks no tp > 1), ``z``
the longest search at 16384 GPUs (CPU seconds) and ``m`` the largest peak memory (GB) of a process searching there.

Run: ``.venv/bin/python benchmarks/bench_plan.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import reference_model, reference_names  # noqa: E402
from dflop_ds.data import read_manifest  # noqa: E402
from dflop_ds.plan import Cluster, PlanError, make_plans  # noqa: E402
from dflop_ds.plan.instructions import stage_instructions  # noqa: E402
from dflop_ds.shapes import ShapePolicy  # noqa: E402

GLOBAL_BATCH = {8: 64, 64: 256, 256: 512, 1024: 2048, 16384: 32768}


def geomean(values: list[float]) -> float:
    """Geometric mean (nan for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def family_row(name: str, gpus: int, plans, tp1) -> tuple[str, float | None, float | None]:
    """The second table's row and the colocated (tp = 1) and tensor-parallel speed-ups over the
    best shared-layout tp = 1 plan (``tp1``: the plans of the ``max_tp=1`` search)."""
    base = tp1.result.best_deepspeed
    colo1 = tp1.result.best_colocated
    tp_plan = plans.result.best_deepspeed if plans.result.best_deepspeed.layout.llm.tp > 1 else None
    colo = plans.result.best_colocated

    def cell(scored) -> tuple[str, float | None]:
        if scored is None:
            return f"{'-':>6} {'':<44}", None
        x = base.step_time / scored.step_time
        return f"{x:6.3f} {scored.layout.describe():<44}", x

    (c1, x_colo), (ct, x_tp), (cc, _) = cell(colo1), cell(tp_plan), cell(colo)
    text = f"{name:<20} {gpus:>5}  {base.layout.describe():<44} {base.step_time:>8.3f}  {c1} {ct} {cc}"
    return text, x_colo, x_tp


def _row(name: str, gpus: int, batch: int, plans, seconds: float, cpu: float) -> str:
    ds, best = plans.best_deepspeed, plans.best
    p = ds.predicted
    speedup = p["speedup_vs_monolithic"]
    mono = plans.monolithic.layout.describe() if plans.monolithic else "none fits"
    gap = plans.result.gap
    over = "same" if best is ds else f"{best.layout.describe()} ({gap:+.1%} for DeepSpeed)"
    vs = f"{speedup:6.3f}" if speedup is not None else "   n/a"
    return (
        f"{name:<20} {gpus:>5} {batch:>5}  {ds.layout.describe():<46} {p['step_time_s']:>8.3f} "
        f"{p['bubble_fraction']:>6.1%} {max(p['peak_memory_bytes']) / 1e9:>6.1f}  {vs}  "
        f"{seconds:>6.2f} {cpu:>6.2f}  mono: {mono}  best overall: {over}"
    )


def peak_rss_gb() -> float:
    """This process's peak resident memory (``ru_maxrss``, KiB on Linux) in GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def grid_point(name: str, gpus: int, shapes: list, n_batches: int) -> dict:
    """Both searches of one grid point (the full one and ``max_tp=1``): the printed rows and the
    figures the last line summarises, with this process's peak memory."""
    model = reference_model(name)
    batch = GLOBAL_BATCH.get(gpus, 2 * gpus)
    cluster = Cluster(gpus=gpus, gpu_memory_bytes=model.gpu.memory_bytes)
    out: dict = {"seconds": None, "cpu": None, "speedup": None, "family_row": None, "x_colo": None, "x_tp": None}
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        plans = make_plans(model, cluster, shapes, batch, n_batches=n_batches)
    except PlanError as error:
        out["row"] = f"{name:<20} {gpus:>5} {batch:>5}  no plan: {error}"
        out["peak_gb"] = peak_rss_gb()
        return out
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    out.update(seconds=seconds, cpu=cpu, speedup=plans.best_deepspeed.predicted["speedup_vs_monolithic"])
    out["peak_gb"] = peak_rss_gb()
    out["row"] = _row(name, gpus, batch, plans, seconds, cpu) + f"  peak {out['peak_gb']:.2f} GB"
    try:
        tp1 = make_plans(model, replace(cluster, max_tp=1), shapes, batch, n_batches=n_batches)
    except PlanError as error:
        out["family_row"] = f"{name:<20} {gpus:>5}  no tp = 1 plan: {error}"
        return out
    out["family_row"], out["x_colo"], out["x_tp"] = family_row(name, gpus, plans, tp1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "examples/data/mixture.jsonl"))
    parser.add_argument("--gpus", type=int, nargs="+", default=sorted(GLOBAL_BATCH))
    parser.add_argument("--profiles", nargs="+", default=reference_names("llava-ov"))
    parser.add_argument("--batches", type=int, default=3, help="sampled global batches per layout")
    args = parser.parse_args()

    shapes = list(read_manifest(args.data, ShapePolicy()))
    make_plans(reference_model(args.profiles[0]), Cluster(gpus=8), shapes, 64, n_batches=1)  # imports, caches
    # the pipeline simulator imports DeepSpeed's schedule on its first use (0.3-0.6 s of CPU); a
    # warm-up search whose plans are all single-stage (scored under the sync model) never gets
    # there, and the first searching child would pay that import as search time
    stage_instructions(0, 2, 2)
    if hasattr(os, "getloadavg"):
        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start "
            "(wall_s is the search's wall time, cpu_s its process CPU time; peak: the peak resident "
            f"memory of the forked process that searched; the parent holding the imports: {peak_rss_gb():.2f} GB)"
        )
    print(f"data: {args.data}: {len(shapes)} samples under ShapePolicy() (LLaVA-OneVision tiling)")
    print("cost models: ANALYTIC reference profiles (FLOP counts / assumed throughput), not measured")
    print(f"cluster: 8 GPUs per node, 80 GB each, ZeRO-1; global batch per GPU count: {GLOBAL_BATCH}")
    print(
        f"{'profile':<20} {'GPUs':>5} {'batch':>5}  {'chosen shared-pipeline plan':<46} "
        f"{'step_s':>8} {'bubble':>6} {'mem_GB':>6}  {'x_mono':>6}  {'wall_s':>6} {'cpu_s':>6}"
    )
    speedups_256: list[float] = []
    search_s: dict[int, list[float]] = {1024: [], 16384: []}
    peak_16384: list[float] = []
    family_rows: list[str] = []
    colocated_256: list[float] = []
    tp_256: list[float] = []
    fork = multiprocessing.get_context("fork")
    for name in args.profiles:
        for gpus in args.gpus:
            with ProcessPoolExecutor(1, mp_context=fork) as child:  # a fresh process: its own peak memory
                point = child.submit(grid_point, name, gpus, shapes, args.batches).result()
            print(point["row"], flush=True)
            if point["seconds"] is None:
                continue
            if gpus == 256 and point["speedup"] is not None:
                speedups_256.append(point["speedup"])
            if gpus in search_s:
                search_s[gpus].append(point["cpu"])
            if gpus == 16384:
                peak_16384.append(point["peak_gb"])
            if point["family_row"] is not None:
                family_rows.append(point["family_row"])
            if gpus == 256 and point["x_colo"] is not None:
                colocated_256.append(point["x_colo"])
                tp_256.append(1.0 if point["x_tp"] is None else point["x_tp"])
    print("\nspeed-up over the best shared-layout plan with tp = 1 (predicted; '-': no such plan)")
    print(
        f"{'profile':<20} {'GPUs':>5}  {'shared tp = 1 plan':<44} {'step_s':>8}  {'colocated tp = 1':<51} "
        f"{'tensor-parallel (shared)':<51} {'colocated (any tp)':<51}"
    )
    print("\n".join(family_rows))

    def slowest(values: list[float]) -> float:
        return max(values) if values else float("nan")

    x = geomean(speedups_256)
    print(
        f"(speed-ups: geometric means over {len(speedups_256)} profiles at 256 GPUs; search: slowest of "
        f"{len(search_s[1024])} searches at 1024 GPUs and of {len(search_s[16384])} at 16384, CPU seconds; "
        "predictions of analytic models)"
    )
    print(
        f"plan speedup_vs_monolithic@256={x:.3f} search_s@1024={slowest(search_s[1024]):.2f} "
        f"colocated_vs_shared@256={geomean(colocated_256):.3f} tp_vs_shared@256={geomean(tp_256):.3f} "
        f"search_s@16384={slowest(search_s[16384]):.2f} peak_mem_GB@16384={slowest(peak_16384):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
