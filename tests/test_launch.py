"""dflop_ds.launch: DeepSpeed's CPU all-reduce buffers do not outlive a run."""

from __future__ import annotations

import os
import time

from dflop_ds.launch import clear_stale_build_locks, release_own_shm_buffer, release_shm_buffers, shm_buffer_name


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
