"""Starting `deepspeed` launches from Python (demo, benchmarks, tests) with this interpreter's tools."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


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


def deepspeed_command(
    script: str | Path, args: Sequence[str], *, ranks: int = 2, master_port: int | None = None
) -> list[str]:
    """``deepspeed --num_gpus ranks --master_port PORT script args...`` (a free port unless given)."""
    port = free_port() if master_port is None else master_port
    return [deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", str(port), str(script), *map(str, args)]


def run_deepspeed(
    script: str | Path,
    args: Sequence[str],
    *,
    ranks: int = 2,
    master_port: int | None = None,
    cwd: str | Path | None = None,
    extra_env: dict[str, str] | None = None,
    **run_kwargs,
) -> subprocess.CompletedProcess:
    """Run :func:`deepspeed_command` with :func:`launch_env` (plus ``extra_env``);
    ``run_kwargs`` go to ``subprocess.run``. Stale extension build locks are cleared first
    (:func:`clear_stale_build_locks`); afterwards, however the run ended, the CPU all-reduce
    buffers of its port are removed (:func:`release_shm_buffers`)."""
    port = free_port() if master_port is None else master_port
    command = deepspeed_command(script, args, ranks=ranks, master_port=port)
    clear_stale_build_locks()
    try:
        return subprocess.run(command, cwd=cwd, env=launch_env(**(extra_env or {})), **run_kwargs)
    finally:
        release_shm_buffers(port)


def extensions_root() -> Path:
    """Where torch JIT-builds C++ extensions (DeepSpeed's ops among them)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def clear_stale_build_locks(max_age_s: float = 300.0, root: Path | None = None) -> list[Path]:
    """Remove extension build locks older than ``max_age_s``; returns what was removed.

    Every DeepSpeed launch takes a lock file in the build folder of each JIT op it loads (on
    CPUs: the shared-memory communication op), even when the op is built already. A process
    killed while holding it leaves the file behind, and every later launch then waits for it
    forever, silently. A build here takes seconds, so an old lock is a dead one.
    """
    folder = extensions_root() if root is None else root
    removed = []
    now = time.time()
    for lock in folder.glob("*/*/lock"):
        try:
            if now - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(lock)
                print(
                    f"[dflop-ds] removed a stale extension build lock {lock} (a killed launch left it; "
                    "DeepSpeed would wait for it forever)",
                    file=sys.stderr,
                    flush=True,
                )
        except FileNotFoundError:
            pass
    return removed


#: DeepSpeed's CPU communication op keeps one shared-memory all-reduce buffer per rank (tens of
#: MB) under this name and never unlinks it: without clean-up every CPU run leaves them in
#: /dev/shm until the machine runs out of memory.
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
SHM_DIR = Path("/dev/shm")


def shm_buffer_name(master_addr: str, master_port: int | str, rank: int | str) -> str:
    """The buffer DeepSpeed's CPU op creates for ``rank`` of the job at ``master_addr:master_port``."""
    return f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{master_addr}_{master_port}_{rank}"


def release_shm_buffers(master_port: int | str, *, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove this user's DeepSpeed CPU all-reduce buffers of the job on ``master_port`` (every
    address and rank); returns what was removed. Call it once the job's processes are gone."""
    pattern = glob.escape(f"{SHM_BUFFER_PREFIX}_{os.getuid()}_") + "*" + glob.escape(f"_{master_port}_") + "*"
    removed = []
    for path in sorted(shm_dir.glob(pattern)):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def release_own_shm_buffer(*, shm_dir: Path = SHM_DIR) -> bool:
    """From inside a rank at the end of training, after the last collective: unlink this rank's
    DeepSpeed CPU all-reduce buffer (peers still holding it keep their mapping until they exit).
    Does nothing where DeepSpeed made none (GPUs, ranks on several hosts). Returns whether a
    buffer was removed."""
    rank = os.environ.get("RANK")
    if rank is None:
        return False
    path = shm_dir / shm_buffer_name(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank)
    try:
        path.unlink()
    except (FileNotFoundError, PermissionError):
        return False
    return True


def release_shm_buffer_once_mapped(*, shm_dir: Path = SHM_DIR) -> bool:
    """Call on every rank right after ``deepspeed.init_distributed``: unlink this rank's DeepSpeed
    CPU all-reduce buffer as soon as every rank has mapped it, so that nothing stays in /dev/shm
    however the run ends (an error in set-up or training, a kill by the launcher or by hand).

    DeepSpeed's CPU op maps the buffers of all its peers (opening them by name) before
    ``init_distributed`` returns and never opens them again; a barrier therefore means every
    rank holds every mapping, and the name is no longer needed. Does nothing where DeepSpeed made
    no buffer (GPUs, ranks on several hosts: the same on every rank). Returns whether one was removed.
    """
    import torch.distributed as dist

    rank = os.environ.get("RANK")
    if rank is None or not dist.is_initialized():
        return False
    path = shm_dir / shm_buffer_name(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank)
    if not path.exists():
        return False
    dist.barrier()
    return release_own_shm_buffer(shm_dir=shm_dir)


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
