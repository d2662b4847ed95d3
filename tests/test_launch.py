"""dflop_ds.launch: DeepSpeed's CPU all-reduce buffers do not outlive a run."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from dflop_ds.launch import (
    SHM_BUFFER_PREFIX,
    SHM_DIR,
    clear_stale_build_locks,
    deepspeed_command,
    free_port,
    launch_env,
    release_own_shm_buffer,
    release_shm_buffers,
    shm_buffer_name,
)

REPO = Path(__file__).resolve().parents[1]


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


def test_only_old_build_locks_are_cleared(tmp_path, capsys) -> None:
    old, fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "other_op" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.write_text("")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert clear_stale_build_locks(max_age_s=300, root=tmp_path) == [old]
    assert not old.exists() and fresh.exists()
    assert "stale extension build lock" in capsys.readouterr().err


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
    env = launch_env(PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    leaked = [p.name for p in SHM_DIR.glob(f"{SHM_BUFFER_PREFIX}_{os.getuid()}_*_{port}_*")]
    release_shm_buffers(port)  # whatever the outcome, leave the machine clean
    assert result.returncode != 0 and "missing.jsonl" in result.stdout + result.stderr, result.stderr[-2000:]
    assert leaked == []
