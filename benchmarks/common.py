"""Shared steps of the benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dflop_ds.launch import launch_env
from dflop_ds.profile import CostModel

ROOT = Path(__file__).resolve().parent.parent


def profiled_cost_model(path: str | Path, reuse: bool = True) -> CostModel:
    """The tiny model's CostModel at ``path``, profiled now (1 thread, as training ranks run) unless
    ``reuse`` and the file exists."""
    if not (reuse and Path(path).exists()):
        print(f"profiling the tiny model into {path} ...", flush=True)
        subprocess.run([sys.executable, "-m", "dflop_ds.cli", "profile", "model", "--no-progress", "-o", str(path)],
                       check=True, cwd=ROOT, env=launch_env())
    return CostModel.load(path)
