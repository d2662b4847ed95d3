"""Starting `deepspeed` launches from Python (demo, benchmarks, tests) with this interpreter's tools."""

from __future__ import annotations

import glob
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the folder of a virtual environment where torch JIT-builds that environment's C++ extensions
VENV_EXTENSIONS_FOLDER = "torch_extensions"


def extensions_dir_setting() -> str | None:
    """What ``TORCH_EXTENSIONS_DIR`` should be for this interpreter: the user's value when set,
    else ``<virtual environment>/torch_extensions`` (None outside a virtual environment: torch's
    default). Every environment builds DeepSpeed's ops in its own folder: two checkouts with two
    environments sharing torch's default folder would rebuild the ops in turn (torch keys a build
    on its sources and include paths, which differ between environments)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    if sys.prefix == sys.base_prefix:
        return None
    return str(Path(sys.prefix) / VENV_EXTENSIONS_FOLDER)


def launch_env(**extra: str) -> dict[str, str]:
    """The environment with this interpreter's ``bin`` first on PATH, where pip put the
    ``deepspeed`` launcher and ``ninja`` (DeepSpeed JIT-builds a communication op with it),
    ``TORCH_EXTENSIONS_DIR`` set to this environment's build folder (:func:`extensions_dir_setting`),
    plus ``extra`` variables."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    extensions = extensions_dir_setting()
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = extensions
    return {**env, **extra}


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
    echo: bool = False,
    **run_kwargs,
) -> subprocess.CompletedProcess:
    """Run :func:`deepspeed_command` with :func:`launch_env` (plus ``extra_env``) on the port of
    :func:`launch_on_port`; ``run_kwargs`` go to ``subprocess.run``. ``echo``: the launch's output
    (stdout and stderr merged) is shown as it comes and also returned as ``stdout`` (for
    :func:`rank_exits`); ``timeout`` is then the only keyword honoured."""
    with launch_on_port(master_port) as port:
        command = deepspeed_command(script, args, ranks=ranks, master_port=port)
        env = launch_env(**(extra_env or {}))
        if echo:
            return _run_echoed(command, cwd=cwd, env=env, timeout=run_kwargs.get("timeout"))
        return subprocess.run(command, cwd=cwd, env=env, **run_kwargs)


@contextmanager
def launch_on_port(master_port: int | None = None) -> Iterator[int]:
    """The master port of one launch on this host (a free one unless given), with the host's
    set-up before it and clean-up after it: stale extension build locks are cleared first
    (:func:`clear_stale_build_locks`); afterwards, however the launch ended, the CPU all-reduce
    buffers of its port are removed (:func:`release_shm_buffers`)."""
    port = free_port() if master_port is None else master_port
    clear_stale_build_locks()
    try:
        yield port
    finally:
        release_shm_buffers(port)


def _run_echoed(
    command: list[str], *, cwd: str | Path | None, env: dict[str, str], timeout: float | None
) -> subprocess.CompletedProcess:
    """``command`` with stdout and stderr merged, each line written to ``sys.stdout`` as it comes
    and all of them returned as ``stdout``."""
    lines: list[str] = []
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:

        def show() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                sys.stdout.write(line)
                sys.stdout.flush()

        reader = threading.Thread(target=show, name="dflop-launch-output", daemon=True)
        reader.start()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        reader.join()
    return subprocess.CompletedProcess(command, process.returncode, "".join(lines), None)


#: the DeepSpeed launcher's log lines: a rank started (its pid and ``--local_rank``), a rank exited
#: 0, and the exit code of the first rank that did not (the command it prints beside it is not
#: necessarily that rank's)
_SPAWNED = re.compile(r"process (\d+) spawned with command: .*'--local_rank=(\d+)'")
_EXITED_0 = re.compile(r"Process (\d+) exits successfully")
_FAILED = re.compile(r"exits with return code = (-?\d+)")


def rank_exits(output: str) -> dict[int, int | None]:
    """Each local rank's exit code, read from the DeepSpeed launcher's output of one launch: 0 for a
    rank the launcher saw exit 0; for the others, None (the launcher stops the remaining ranks
    when one fails, and names no rank beside the failing exit code: see :func:`launch_exit_code`)."""
    ok = {int(pid) for pid in _EXITED_0.findall(output)}
    return {int(rank): 0 if int(pid) in ok else None for pid, rank in _SPAWNED.findall(output)}


def launch_exit_code(output: str) -> int | None:
    """The exit code of the first rank that failed, as the DeepSpeed launcher reports it (None: none failed)."""
    found = _FAILED.search(output)
    return None if found is None else int(found.group(1))


def exit_fault_message(output: str, returncode: int, what: str) -> str:
    """The report of a launch that finished its work (``what``) and yet exited ``returncode`` != 0:
    the ranks that did not exit 0 and the failing exit code (a signal when negative), from its output."""
    exits = rank_exits(output)
    faulty = sorted(rank for rank, code in exits.items() if code != 0)
    ranks = f"rank {faulty[0]}" if len(faulty) == 1 else f"ranks {faulty}" if faulty else "a rank"
    code = launch_exit_code(output)
    how = f"exited with code {code}" if code is not None else f"did not exit 0 (launch exit code {returncode})"
    if code is not None and code < 0:
        how += f" (signal {-code})"
    return (
        f"EXIT FAULT: {what} completed and its results stand, but {ranks} {how} after it: a process did not"
        " shut down cleanly (see dflop_ds.launch.finish_rank)"
    )


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


def finish_rank(*running: Any) -> None:
    """End a finished launch on this rank (every entry point calls it last, on every rank).

    ``close()`` each of ``running`` that is not None (a sampler's background scheduling thread,
    telemetry, a loader's epoch iterator, whose closing stops its DataLoader worker processes);
    wait for every rank; destroy the process group; unlink this rank's DeepSpeed CPU all-reduce
    buffer (:func:`release_own_shm_buffer`). A process group left to the interpreter's teardown can
    abort a finished run: gloo's C++ worker threads still hold work whose tensors need the
    interpreter (``terminate called without an active exception``, exit -6; torch issue 190489),
    as can a thread still computing then. Threads still alive after :data:`LEFTOVER_GRACE_S` and
    child processes still alive are named on stderr; then :data:`CLEAN_SHUTDOWN` and the rank are printed.
    """
    import torch.distributed as dist

    for item in running:
        if item is not None:
            item.close()
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
    sys.stdout.write(f"{CLEAN_SHUTDOWN} {rank}\n")
    sys.stdout.flush()


def extensions_root() -> Path:
    """Where torch JIT-builds C++ extensions (DeepSpeed's ops among them) in the processes
    :func:`launch_env` starts: :func:`extensions_dir_setting`, else torch's default."""
    setting = extensions_dir_setting()
    if setting is not None:
        return Path(setting)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


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
    # <root>/<op>/lock under TORCH_EXTENSIONS_DIR; torch's default root adds a <python>_<device> level
    for lock in [*folder.glob("*/lock"), *folder.glob("*/*/lock")]:
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
