"""A test script's ranks started by the test process itself, each with the environment and the command
line DeepSpeed's launcher gives it on one host, without the launcher's processes.

``deepspeed --num_gpus N script`` runs the runner, which runs ``deepspeed.launcher.launch``, which
starts the ranks and polls them once a second: two more Python interpreters that each import
deepspeed, and up to a second after the last rank ends, about 5 s of a 2-rank launch on 2 busy
cores. Starting the ranks here costs only the ranks. What the launcher does for a rank is small
(DeepSpeed 0.19.8, ``launcher/runner.py`` and ``launcher/launch.py``, one host): :func:`rank_environment`
and :func:`rank_command` repeat it, and a test in ``test_launch.py`` compares them with the launcher's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from dflop_ds.launch import launch_env, launch_on_port

#: the launcher's ``--master_addr`` on one host
MASTER_ADDR = "127.0.0.1"
#: how often the ranks are polled for an exit
POLL_S = 0.05
#: seconds the ranks left get to end on SIGTERM once one rank failed (the launcher's grace too)
STOP_GRACE_S = 30.0


def rank_environment(base: Mapping[str, str], rank: int, ranks: int, master_port: int) -> dict[str, str]:
    """The environment the launcher gives local rank ``rank`` of ``ranks`` on one host, from the
    environment ``base`` it was started with: the variables of ``torch.distributed``'s env://
    rendezvous and DeepSpeed's (``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``), every device
    visible (the accelerator's variable), and what ``import deepspeed`` sets in the launcher."""
    from deepspeed.accelerator import get_accelerator

    env = dict(base)
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    get_accelerator().set_visible_devices_envs(env, list(range(ranks)))
    env.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(ranks),
        CROSS_RANK="0",
        CROSS_SIZE="1",
        LOCAL_SIZE=str(ranks),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    return env


def rank_command(script: str | Path, args: Sequence[Any], rank: int) -> list[str]:
    """The launcher's command line of local rank ``rank``: this interpreter, unbuffered, on
    ``script`` with ``--local_rank=R`` before ``args``."""
    return [sys.executable, "-u", str(script), f"--local_rank={rank}", *map(str, args)]


class _PipeReader:
    """Everything written to the read end ``fd`` of a pipe, collected by a thread until every writer closed it."""

    def __init__(self, fd: int) -> None:
        self.chunks: list[str] = []
        self._file = os.fdopen(fd, encoding="utf-8", errors="replace")
        self._thread = threading.Thread(target=self._read, name="dflop-rank-output", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._file:
            for line in self._file:
                self.chunks.append(line)

    def text(self, wait_s: float) -> str:
        """What was read, after waiting up to ``wait_s`` seconds for the writers to close the pipe."""
        self._thread.join(timeout=wait_s)
        return "".join(self.chunks)


def stop_ranks(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    """End ``processes`` and their children (a rank's loader workers) as the launcher does: SIGTERM,
    then SIGKILL for those still alive after ``grace_s`` seconds."""
    tree: list[psutil.Process] = []
    for process in processes:
        try:
            parent = psutil.Process(process.pid)
            tree += [*parent.children(recursive=True), parent]
        except psutil.Error:
            pass
    for member in tree:
        try:
            if grace_s > 0:
                member.terminate()
            else:
                member.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for member in alive:
        try:
            member.kill()
        except psutil.Error:
            pass
    for process in processes:
        process.wait()


def _wait_for_ranks(processes: Sequence[subprocess.Popen], deadline: float) -> tuple[int, int | None] | None:
    """``(exit code, failed rank)``: ``(0, None)`` once every rank exited 0, else the code and rank
    of the first rank seen to exit non-zero; None past ``deadline``."""
    while True:
        codes = [process.poll() for process in processes]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return code, rank
        if all(code == 0 for code in codes):
            return 0, None
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)


def run_ranks(
    script: str | Path,
    args: Sequence[Any],
    *,
    ranks: int = 2,
    cwd: str | Path | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess:
    """``script args`` on ``ranks`` local ranks started here (:func:`rank_environment` on
    :func:`launch_env` plus ``extra_env``, :func:`rank_command`), on the port of
    :func:`launch_on_port` (its set-up and clean-up included). The ranks share one stdout and one
    stderr pipe, as they share the launcher's; both come back as text. When a rank exits non-zero
    the others are stopped (:func:`stop_ranks`) and its exit code (negative: a signal) is the
    launch's, with a line on stderr naming it. Past ``timeout`` seconds every rank is killed and
    ``subprocess.TimeoutExpired`` raised with the output so far."""
    commands = [rank_command(script, args, rank) for rank in range(ranks)]
    with launch_on_port() as port:
        base = launch_env(**(extra_env or {}))
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        stdout, stderr = _PipeReader(out_read), _PipeReader(err_read)
        processes: list[subprocess.Popen] = []
        deadline = time.monotonic() + timeout
        try:
            try:
                for rank, command in enumerate(commands):
                    env = rank_environment(base, rank, ranks, port)
                    processes.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=out_write, stderr=err_write))
            finally:  # the ranks hold the write ends now: the pipes end when the last rank does
                os.close(out_write)
                os.close(err_write)
            ended = _wait_for_ranks(processes, deadline)
            if ended is None:
                stop_ranks(processes, 0)
                raise subprocess.TimeoutExpired(commands, timeout, stdout.text(5.0), stderr.text(5.0))
            code, failed = ended
            if failed is not None:
                stop_ranks(processes, STOP_GRACE_S)
        finally:
            if any(process.poll() is None for process in processes):  # an error or an interrupt here
                stop_ranks(processes, 0)
        wait_s = max(1.0, deadline - time.monotonic())
        output, errors = stdout.text(wait_s), stderr.text(wait_s)
    if failed is not None:
        errors += f"[tests] rank {failed} exited with code {code}: the other ranks were stopped\n"
    return subprocess.CompletedProcess(commands, code, output, errors)
