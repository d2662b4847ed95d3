"""Starting `deepspeed` launches from Python (demo, benchmarks, tests) with this interpreter's tools,
and reading how their ranks exited. Host clean-up: :mod:`dflop_ds.host`; a rank's own start and end:
:mod:`dflop_ds.rank_lifecycle`."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from dflop_ds.host import clear_stale_build_locks, extensions_dir_setting, interpreter_first_path, release_shm_buffers


def launch_env(**extra: str) -> dict[str, str]:
    """The environment with this interpreter's ``bin`` first on PATH, where pip put the
    ``deepspeed`` launcher and ``ninja`` (DeepSpeed JIT-builds a communication op with it),
    ``TORCH_EXTENSIONS_DIR`` set to this environment's build folder (:func:`extensions_dir_setting`),
    plus ``extra`` variables."""
    env = {**os.environ, "PATH": interpreter_first_path()}
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


#: the lowest port :func:`free_port` draws from (below it sit well-known services' ports)
LOWEST_DRAWN_PORT = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports(setting: Path | None = None) -> range:
    """The ports the kernel hands to sockets bound to port 0 and to outgoing connections
    (Linux's ``ip_local_port_range``, or the file ``setting``; the kernel's default 32768-60999
    where it cannot be read)."""
    try:
        low, high = (int(field) for field in (setting or _EPHEMERAL_RANGE).read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def _bindable(port: int) -> bool:
    """Whether ``port`` can be bound on every interface, as rank 0's rendezvous store binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def drawn_ports(ephemeral: range) -> list[range]:
    """The ports :func:`free_port` draws from: those from :data:`LOWEST_DRAWN_PORT` up that lie
    outside ``ephemeral`` (below it and above it)."""
    below = range(LOWEST_DRAWN_PORT, max(LOWEST_DRAWN_PORT, ephemeral.start))
    above = range(max(LOWEST_DRAWN_PORT, ephemeral.stop), 65536)
    return [gap for gap in (below, above) if len(gap)]


def free_port(tries: int = 64) -> int:
    """A TCP port free on this host right now (for the launcher's ``--master_port``).

    Drawn at random outside the kernel's ephemeral range: a port the kernel gave out (``bind`` to
    port 0) could be handed again, between this call and rank 0 binding it, to any outgoing
    connection on the host, such as a concurrent launch's gloo connections (pytest-xdist runs two
    launches at once). Falls back to a kernel-chosen port when the ephemeral range leaves no room
    or every try is taken."""
    drawn = secrets.SystemRandom()
    gaps = drawn_ports(ephemeral_ports())
    weights = [len(gap) for gap in gaps]
    for _ in range(tries if gaps else 0):
        port = drawn.choice(drawn.choices(gaps, weights=weights)[0])
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
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
        " shut down cleanly (see dflop_ds.rank_lifecycle.finish_rank)"
    )
