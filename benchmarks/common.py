"""Shared steps of the benchmarks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflop_ds.cost import FittedCostModel, load_cost_model, reusable_fitted_model
from dflop_ds.launch import exit_fault_message, launch_env, run_deepspeed

ROOT = Path(__file__).resolve().parent.parent


def profile_model_into(path: str | Path, options: Sequence[str] = ()) -> None:
    """Run ``dflop-ds profile model --no-progress <options> -o path`` (1 thread, as training ranks run)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dflop_ds.commands.main",
            "profile",
            "model",
            "--no-progress",
            *options,
            "-o",
            str(path),
        ],
        check=True,
        cwd=ROOT,
        env=launch_env(),
    )


def profiled_cost_model(path: str | Path, reuse: bool = True) -> FittedCostModel:
    """The tiny model's FittedCostModel at ``path``, profiled now unless ``reuse`` and the file
    holds one this version reads (:func:`~dflop_ds.cost.reusable_fitted_model`)."""
    model = reusable_fitted_model(path) if reuse else None
    if model is not None:
        return model
    print(f"profiling the tiny model into {path} ...", flush=True)
    profile_model_into(path)
    model = load_cost_model(path)
    assert isinstance(model, FittedCostModel), path
    return model


def worker_ds_config(global_batch: int, gas: int, dp: int, zero_stage: int | None = None, bf16: bool = False) -> dict:
    """The DeepSpeed config of a benchmark worker's engine: the batch keys (micro batch derived
    from the global batch, GAS and dp), no step printing, a ZeRO stage when given, and bf16
    mixed precision when asked."""
    config = {
        "train_batch_size": global_batch,
        "gradient_accumulation_steps": gas,
        "train_micro_batch_size_per_gpu": max(1, global_batch // (gas * dp)),
        "steps_per_print": 10**9,
    }
    if zero_stage is not None:
        config["zero_optimization"] = {"stage": zero_stage}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def add_worker_options(parser: argparse.ArgumentParser, *, global_batch: int, gas: int, rounds: int) -> None:
    """The options every benchmark worker (one rank under `deepspeed`) takes: the launcher's
    ``--local_rank``, the cost model, the batch sizes, the rounds, the seed and the output file."""
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--cost-model", required=True)
    parser.add_argument("--global-batch", type=int, default=global_batch)
    parser.add_argument("--gas", type=int, default=gas)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def add_round_options(parser: argparse.ArgumentParser, *, rounds: int, gas: int) -> None:
    """The options of the benchmarks that train every method on the same global batches, round by
    round: cost model, rounds, warm-up rounds, global batch, GAS and output folder."""
    parser.add_argument("--cost-model", help="a profiled FittedCostModel JSON (default: profile now into out/)")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds (every method once per round)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--gas", type=int, default=gas)
    parser.add_argument("--out", default=str(ROOT / "out"))


def round_output(args: argparse.Namespace) -> tuple[Path, str]:
    """The output folder of a round benchmark (created) and its cost-model path: ``--cost-model``,
    or ``costmodel_tiny.json`` in that folder."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out, args.cost_model or str(out / "costmodel_tiny.json")


def run_worker(worker: str, options: Sequence[str], out: Path, timeout: float | None = None) -> dict:
    """Launch ``benchmarks/<worker> options`` (``worker``: a file name there, or an absolute path)
    under `deepspeed` (its output shown as it comes) and
    return the JSON object it wrote to ``out`` once every round was done. A launch that fails before
    writing ``out`` raises; one that wrote it and then exited non-zero is an exit fault (a rank that
    did not shut down cleanly): printed, naming the rank, and its results are kept."""
    out.unlink(missing_ok=True)  # what is there afterwards, this launch wrote
    result = run_deepspeed(ROOT / "benchmarks" / worker, options, cwd=ROOT, echo=True, timeout=timeout)
    if result.returncode != 0 and not out.exists():
        raise RuntimeError(f"benchmarks/{worker} failed with exit code {result.returncode} before writing {out}")
    if result.returncode != 0:
        print(f"\n{exit_fault_message(result.stdout, result.returncode, f'every round of {worker}')}\n", flush=True)
    return json.loads(out.read_text())


def run_round_worker(
    worker: str, args: argparse.Namespace, cost_path: str, raw: Path, extra: Sequence[str] = ()
) -> list[dict]:
    """Launch ``benchmarks/<worker>`` under `deepspeed` with the round options of ``args`` (see
    :func:`add_round_options`), the cost model and ``extra`` options (:func:`run_worker`); return the
    rows it wrote to ``raw``."""
    return run_worker(
        worker,
        [
            "--cost-model",
            cost_path,
            *extra,
            "--rounds",
            str(args.rounds),
            "--warmup",
            str(args.warmup),
            "--global-batch",
            str(args.global_batch),
            "--gas",
            str(args.gas),
            "--out",
            str(raw),
        ],
        raw,
    )["rows"]


def timed_train_step(train_step: Callable[[Any], Any], microbatches: Sequence[Any]) -> tuple[Any, float]:
    """``train_step(iter(microbatches))`` started on every rank together (a barrier first): its
    result (the loss) and its wall seconds on this rank."""
    torch.distributed.barrier()
    start = time.perf_counter()
    loss = train_step(iter(microbatches))
    return loss, time.perf_counter() - start


def round_row(round_id: int, warmup: int, method: str, step_s: float, **figures: Any) -> dict:
    """A worker's row of one method in one round: the round, whether it is one of the first ``warmup``
    (untimed) rounds, the method, the step seconds, then its other ``figures`` (read back by :func:`timed_rows`)."""
    return {"round": round_id, "warmup": round_id < warmup, "method": method, "step_s": step_s, **figures}


def timed_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of the timed (not warm-up) rounds of each method, methods in the order they first appear."""
    return {
        method: [r for r in rows if r["method"] == method and not r["warmup"]]
        for method in dict.fromkeys(r["method"] for r in rows)
    }


def mean_of(entries: Sequence[dict], key: str) -> float | None:
    """The mean of ``key`` over the entries (log records, result rows) that give it, not None;
    None where none does."""
    values = [entry[key] for entry in entries if entry.get(key) is not None]
    return float(sum(values) / len(values)) if values else None
