"""dflop_ds.launch, dflop_ds.host and dflop_ds.rank_lifecycle: DeepSpeed's CPU all-reduce buffers do not
outlive a run; each virtual environment
builds DeepSpeed's ops in its own folder; every rank of a finished launch exits 0, and a benchmark
whose rank does not is reported as an exit fault, not a failed benchmark."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DFLOP_PP2
from deepspeed.accelerator import get_accelerator
from ds_runs import REPO, repo_first_pythonpath

from dflop_ds.host import (
    SHM_BUFFER_PREFIX,
    SHM_DIR,
    build_deepspeed_ops,
    clear_stale_build_locks,
    extensions_root,
    release_shm_buffers,
    shm_buffer_name,
)
from dflop_ds.launch import (
    LOWEST_DRAWN_PORT,
    deepspeed_command,
    drawn_ports,
    ephemeral_ports,
    free_port,
    launch_env,
    rank_exits,
)
from dflop_ds.rank_lifecycle import CLEAN_SHUTDOWN, release_own_shm_buffer


def test_release_removes_only_the_jobs_buffers(tmp_path) -> None:
    ours = [tmp_path / shm_buffer_name("127.0.0.1", 29512, rank) for rank in (0, 1)]
    other_port = tmp_path / shm_buffer_name("127.0.0.1", 29513, 0)
    port_prefix = tmp_path / shm_buffer_name("127.0.0.1", 295120, 0)  # 29512 is a prefix of it
    unrelated = tmp_path / "psm_other"
    for path in (*ours, other_port, port_prefix, unrelated):
        path.write_bytes(b"x")
    assert release_shm_buffers(29512, shm_dir=tmp_path) == sorted(ours)
    assert not any(p.exists() for p in ours)
    assert other_port.exists() and port_prefix.exists() and unrelated.exists()
    assert release_shm_buffers(29512, shm_dir=tmp_path) == []


def test_a_rank_releases_its_own_buffer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29600")
    mine, peer = (tmp_path / shm_buffer_name("127.0.0.1", 29600, r) for r in (1, 0))
    mine.write_bytes(b"x")
    peer.write_bytes(b"x")
    assert release_own_shm_buffer(shm_dir=tmp_path)
    assert not mine.exists() and peer.exists()
    assert not release_own_shm_buffer(shm_dir=tmp_path)  # already gone
    monkeypatch.delenv("RANK")
    assert not release_own_shm_buffer(shm_dir=tmp_path)
    assert str(os.getuid()) in peer.name


@pytest.mark.parametrize("levels", [("py311_cpu",), ()], ids=["default-root", "TORCH_EXTENSIONS_DIR"])
def test_only_old_build_locks_are_cleared(tmp_path, capsys, levels) -> None:
    old, fresh = tmp_path.joinpath(*levels, "deepspeed_shm_comm", "lock"), tmp_path.joinpath(*levels, "other", "lock")
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.write_text("")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert clear_stale_build_locks(max_age_s=300, root=tmp_path) == [old]
    assert not old.exists() and fresh.exists()
    assert "stale extension build lock" in capsys.readouterr().err


def as_virtual_environment(monkeypatch, prefix: Path) -> None:
    """This process as if its interpreter ran from the virtual environment at ``prefix``."""
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(sys, "base_prefix", "/usr")


def test_each_virtual_environment_builds_extensions_in_its_own_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    folders = []
    for checkout in ("first", "second"):
        as_virtual_environment(monkeypatch, tmp_path / checkout / ".venv")
        folders.append(launch_env()["TORCH_EXTENSIONS_DIR"])
        assert extensions_root() == Path(folders[-1])  # where stale build locks are looked for
    assert folders == [str(tmp_path / c / ".venv" / "torch_extensions") for c in ("first", "second")]


def test_a_torch_extensions_folder_the_user_set_is_kept(tmp_path: Path, monkeypatch) -> None:
    as_virtual_environment(monkeypatch, tmp_path / ".venv")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert launch_env()["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine") == str(extensions_root())
    assert launch_env(TORCH_EXTENSIONS_DIR="/elsewhere")["TORCH_EXTENSIONS_DIR"] == "/elsewhere"


def test_outside_a_virtual_environment_torch_keeps_its_default_folder(monkeypatch) -> None:
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)
    assert "TORCH_EXTENSIONS_DIR" not in launch_env()
    assert extensions_root() == Path(get_default_build_root())


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_makefile_gives_its_environment_the_same_folder(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "MAKEFLAGS", "MAKELEVEL")}
    venv = tmp_path / "venv"
    dry_run = subprocess.run(
        ["make", "-n", "demo", f"VENV={venv}"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert f'TORCH_EXTENSIONS_DIR="{venv}/torch_extensions"' in dry_run.stdout


def test_setup_builds_the_communication_op_into_the_environments_folder() -> None:
    """``make setup`` builds the op before any launch (see the Makefile's install recipe), into the
    folder every launch of this environment uses."""
    makefile = (REPO / "Makefile").read_text()
    assert "build_deepspeed_ops()" in makefile.split("touch $@")[0]
    if get_accelerator().device_name() != "cpu":
        pytest.skip("the shared-memory communication op is built for the CPU accelerator only")
    assert build_deepspeed_ops() == f"DeepSpeed's communication op is built in {extensions_root()}"
    assert any(extensions_root().glob("*shm_comm*/*.so")), list(extensions_root().iterdir())


def test_the_op_builds_with_the_ninja_launches_use_whatever_path_the_caller_has(monkeypatch) -> None:
    """torch keys a JIT build on the ninja that ran it: a build with the system's ninja (1.11 here)
    and launches with the environment's (1.13) rebuilt the op in turn, about 40 s each. The build
    sees the interpreter's ``bin`` first on PATH, as launches do, and the caller's PATH is kept."""
    import importlib

    seen: list[str] = []
    comm = importlib.import_module("deepspeed.comm.torch")  # not deepspeed.comm's `torch` attribute
    monkeypatch.setattr(comm, "build_shm_op", lambda: seen.append(os.environ["PATH"]))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert build_deepspeed_ops() == "no JIT-built communication op on this accelerator"
    assert seen == [f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin"]
    assert os.environ["PATH"] == "/usr/bin:/bin" and launch_env()["PATH"] == seen[0]


#: a short DFLOP pipeline run on 2 ranks: background scheduling, 2 loader workers per rank, gloo
SHORT_RUN = {**DFLOP_PP2["dflop"], "steps": 2, "warmup_steps": 0, "max_samples": 64, "cost_model": "proxy"}


@pytest.mark.slow
def test_repeated_two_rank_runs_exit_zero_on_every_rank(ds_config, run_train) -> None:
    """The first run goes through the ``deepspeed`` launcher, whose log shows each rank's exit (the
    subject here, and what a job scheduler sees); the next ones start the ranks directly, where the
    launch exits 0 only once every rank did."""
    config = ds_config("tiny_mllm_pp2.json", SHORT_RUN, **DFLOP_PP2["ds"])
    for attempt, launcher in enumerate(("deepspeed", "direct", "direct")):
        result = run_train(config, launcher=launcher)
        output = result.stdout + result.stderr
        if launcher == "deepspeed":
            assert rank_exits(output) == {0: 0, 1: 0}, f"launch {attempt}: {output[-3000:]}"
        assert all(f"{CLEAN_SHUTDOWN} {rank}\n" in output for rank in (0, 1)), f"launch {attempt}"
        assert "still running at exit" not in output, f"launch {attempt}: {output[-3000:]}"


def test_a_finished_rank_collects_then_freezes_before_the_interpreter_tears_down() -> None:
    """After :func:`finish_rank`, the interpreter's exit first collects the garbage (a finalizer in
    a reference cycle still runs) and then freezes the collector, so its teardown skips the
    objects torch made (about a second of every rank's exit, most of it collection). An exit
    handler registered before the rank finished runs after that and reports both."""
    code = (
        "import atexit, gc, torch\n"
        "from dflop_ds.rank_lifecycle import finish_rank\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "class Cycle:\n"
        "    def __del__(self):\n"
        "        print('finalized', flush=True)\n"
        "cycle = Cycle()\n"
        "cycle.me = cycle\n"
        "del cycle\n"
        "gc.disable()  # the cycle stays uncollected until exit\n"
        "print('frozen before:', gc.get_freeze_count())\n"
        "finish_rank()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "frozen before: 0\n" in result.stdout, result.stdout
    assert result.stdout.index("finalized") < result.stdout.index("frozen at exit:"), result.stdout
    frozen = int(result.stdout.split("frozen at exit:")[1])
    assert frozen > 10_000, result.stdout  # every object torch made, not a handful


FAULT_AFTER_FINISH = """
import json, os, sys, time
import deepspeed, torch
from deepspeed.accelerator import get_accelerator
from dflop_ds.rank_lifecycle import finish_rank
deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
if torch.distributed.get_rank() == 0:
    open(sys.argv[sys.argv.index("--out") + 1], "w").write(json.dumps({"rows": ["every round"]}))
finish_rank()
if os.environ["RANK"] == "1":  # dies after its work, once rank 0 has exited
    time.sleep(3)
    os._exit(3)
"""


@pytest.mark.slow
def test_a_benchmark_worker_failing_after_its_rounds_is_an_exit_fault_naming_the_rank(tmp_path: Path, capsys) -> None:
    from benchmarks.common import run_worker

    script = tmp_path / "worker.py"
    script.write_text(FAULT_AFTER_FINISH)
    out = tmp_path / "rows.json"
    assert run_worker(str(script), ["--out", str(out)], out, timeout=300) == {"rows": ["every round"]}
    printed = capsys.readouterr().out
    assert "EXIT FAULT: every round of" in printed and "but rank 1 exited with code 3 after it" in printed
    out.write_text("stale")  # a launch that fails before writing its results is a failure, not a fault
    script.write_text("raise SystemExit(5)")
    with pytest.raises(RuntimeError, match="failed with exit code 5 before writing"):
        run_worker(str(script), ["--out", str(out)], out, timeout=300)


def test_a_launch_port_is_drawn_outside_the_kernels_ephemeral_range_and_is_free() -> None:
    """Two pytest-xdist workers launch at once: a port the kernel handed out (bind to 0) can go
    to the other launch's outgoing gloo connections before rank 0 binds it; a drawn one cannot,
    and the global ``random`` state (which tests seed alike) does not decide the draw."""
    ephemeral = ephemeral_ports()
    ports = set()
    for _ in range(8):
        random.seed(0)
        port = free_port()
        assert port >= LOWEST_DRAWN_PORT and port not in ephemeral
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", port))
        ports.add(port)
    assert len(ports) > 1


def test_the_ephemeral_range_is_read_from_its_setting(tmp_path: Path, monkeypatch) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ephemeral_ports(setting) == range(40000, 50001)
    assert ephemeral_ports(tmp_path / "absent") == range(32768, 61000)
    assert drawn_ports(range(32768, 61000)) == [range(LOWEST_DRAWN_PORT, 32768), range(61000, 65536)]
    assert drawn_ports(range(40000, 65536)) == [range(LOWEST_DRAWN_PORT, 40000)]
    kernels = ephemeral_ports()
    setting.write_text("1024 65535\n")  # no room outside it: the kernel chooses
    monkeypatch.setattr("dflop_ds.launch._EPHEMERAL_RANGE", setting)
    assert drawn_ports(ephemeral_ports()) == []
    assert all(free_port() in kernels for _ in range(4))


def test_a_rank_that_fails_in_set_up_leaves_nothing_in_dev_shm(tmp_path) -> None:
    """Issue 25: a launch that failed after DeepSpeed's CPU op made its buffers left 2 x 66 MB in
    /dev/shm. Here `deepspeed` runs examples/train.py directly (no wrapper cleans up by port) on a
    missing data file, which fails after ``init_distributed``: the ranks released their own buffers."""
    port = free_port()
    command = deepspeed_command(
        REPO / "examples" / "train.py",
        ["--deepspeed_config", REPO / "ds_configs" / "tiny_mllm_pp2.json", "--data_path", tmp_path / "missing.jsonl"],
        ranks=2,
        master_port=port,
    )
    env = launch_env(PYTHONPATH=repo_first_pythonpath(), OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    leaked = [p.name for p in SHM_DIR.glob(f"{SHM_BUFFER_PREFIX}_{os.getuid()}_*_{port}_*")]
    release_shm_buffers(port)  # whatever the outcome, leave the machine clean
    assert result.returncode != 0 and "missing.jsonl" in result.stdout + result.stderr, result.stderr[-2000:]
    assert leaked == []
