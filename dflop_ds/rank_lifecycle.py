"""What every rank of a launch does at its start and at its end: its share of the CPU cores, the
removal of its /dev/shm all-reduce buffer once mapped, and a clean shutdown (:func:`finish_rank`)."""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dflop_ds.host import SHM_DIR, shm_buffer_name

#: what :func:`finish_rank` prints once a rank has shut down, before its process exits
CLEAN_SHUTDOWN = "[dflop-ds] clean shutdown of rank"
#: seconds :func:`finish_rank` gives threads that are ending (a closed queue's feeder) to end
LEFTOVER_GRACE_S = 2.0


def _threads_after(grace_s: float) -> list[threading.Thread]:
    """The threads besides this one still alive after waiting up to ``grace_s`` seconds in all."""
    deadline = time.monotonic() + grace_s
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    for thread in others:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [t for t in others if t.is_alive()]


def collect_then_freeze() -> None:
    """Collect the garbage once (finalizers of objects in reference cycles run), then freeze the
    collector (:func:`gc.freeze`): the interpreter's teardown then skips re-examining the few
    hundred thousand objects torch and transformers keep alive, 1.2-1.4 s of a rank's exit here
    (0.2 s for this collection). Objects still alive at exit get no finalizer call, which CPython
    never promises them."""
    gc.collect()
    gc.freeze()


def close_running(*running: Any) -> None:
    """``close()`` each of ``running`` that is not None: what a run started and must stop before
    the next run or the rank's end (a sampler's scheduling thread, telemetry, a loader's epoch
    iterator, whose closing stops its DataLoader worker processes)."""
    for item in running:
        if item is not None:
            item.close()


def finish_rank(*running: Any) -> None:
    """End a finished launch on this rank (every entry point calls it last, on every rank).

    Close ``running`` (:func:`close_running`); wait for every rank; destroy the process group;
    unlink this rank's DeepSpeed CPU all-reduce buffer (:func:`release_own_shm_buffer`). A
    process group left to the interpreter's teardown can
    abort a finished run: gloo's C++ worker threads still hold work whose tensors need the
    interpreter (``terminate called without an active exception``, exit -6; torch issue 190489),
    as can a thread still computing then. Threads still alive after :data:`LEFTOVER_GRACE_S` and
    child processes still alive are named on stderr; then :data:`CLEAN_SHUTDOWN` and the rank are printed.
    At the interpreter's exit :func:`collect_then_freeze` runs first, about a second less of every
    rank's exit.
    """
    import torch.distributed as dist

    close_running(*running)
    rank = os.environ.get("RANK", "0")
    if dist.is_available() and dist.is_initialized():
        rank = str(dist.get_rank())
        dist.barrier()
        dist.destroy_process_group()
    release_own_shm_buffer()
    left = [t.name for t in _threads_after(LEFTOVER_GRACE_S)]
    left += [f"process {child.name}" for child in multiprocessing.active_children()]
    if left:  # one write per line: the ranks share the launcher's output
        sys.stderr.write(f"[dflop-ds] rank {rank}: still running at exit: {', '.join(left)}\n")
        sys.stderr.flush()
    atexit.register(collect_then_freeze)
    sys.stdout.write(f"{CLEAN_SHUTDOWN} {rank}\n")
    sys.stdout.flush()


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
