"""Starting `deepspeed` launches from Python (demo, benchmarks, tests) with this interpreter's tools."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence


def launch_env(**extra: str) -> dict[str, str]:
    """The environment with this interpreter's ``bin`` first on PATH, where pip put the
    ``deepspeed`` launcher and ``ninja`` (DeepSpeed JIT-builds a communication op with it),
    plus ``extra`` variables."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def deepspeed_launcher() -> str:
    """Path of the ``deepspeed`` launcher next to this interpreter, else the one on PATH."""
    local = Path(sys.executable).parent / "deepspeed"
    found = str(local) if local.exists() else shutil.which("deepspeed")
    if found is None:
        raise FileNotFoundError("the `deepspeed` launcher is not installed (run `make setup`)")
    return found


def free_port() -> int:
    """A TCP port free on this host right now (for the launcher's ``--master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def deepspeed_command(script: str | Path, args: Sequence[str], *, ranks: int = 2,
                      master_port: int | None = None) -> list[str]:
    """``deepspeed --num_gpus ranks --master_port PORT script args...`` (a free port unless given)."""
    port = free_port() if master_port is None else master_port
    return [deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", str(port), str(script),
            *map(str, args)]


def run_deepspeed(script: str | Path, args: Sequence[str], *, ranks: int = 2, master_port: int | None = None,
                  cwd: str | Path | None = None, extra_env: dict[str, str] | None = None,
                  **run_kwargs) -> subprocess.CompletedProcess:
    """Run :func:`deepspeed_command` with :func:`launch_env` (plus ``extra_env``);
    ``run_kwargs`` go to ``subprocess.run``."""
    command = deepspeed_command(script, args, ranks=ranks, master_port=master_port)
    return subprocess.run(command, cwd=cwd, env=launch_env(**(extra_env or {})), **run_kwargs)


def share_cpu_threads() -> int:
    """On the CPU accelerator, give each local rank its share of the cores as torch threads.

    Several ranks on one machine each default to every core, oversubscribing it (steps then
    stall unpredictably). Does nothing on GPUs. Returns the thread count in effect.
    """
    import torch
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    return torch.get_num_threads()
