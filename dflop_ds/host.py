"""What launches share on one host: the folder where torch JIT-builds DeepSpeed's ops for this
environment (and its build locks), and DeepSpeed's CPU all-reduce buffers in /dev/shm."""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path

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


def interpreter_first_path() -> str:
    """``PATH`` with this interpreter's ``bin`` first: where pip put the ``deepspeed`` launcher and
    ``ninja``. Launches and the op build use it alike: torch keys a JIT build on the ninja that
    ran it (ninja 1.11 and 1.13 log their commands under different hashes), so a build run by
    another ninja than the launches' is rebuilt by the next launch, and that one by the next build."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def build_deepspeed_ops() -> str:
    """JIT-build (or find built) the DeepSpeed op every CPU launch loads, its shared-memory
    communication op, in this environment's folder (:func:`extensions_dir_setting`) with the
    launches' ninja (:func:`interpreter_first_path`), so that the first launch does not pay for the
    build (about a minute of two cores). ``make setup`` calls it once per environment. Nothing to
    build where the accelerator has no such op (GPUs). Returns what was done."""
    setting = extensions_dir_setting()
    if setting is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = setting
    from deepspeed.comm.torch import build_shm_op

    path = os.environ.get("PATH")
    os.environ["PATH"] = interpreter_first_path()
    try:
        built = build_shm_op()
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path
    if built is None:
        return "no JIT-built communication op on this accelerator"
    return f"DeepSpeed's communication op is built in {extensions_root()}"
