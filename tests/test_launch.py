"""dflop_ds.launch: DeepSpeed's CPU all-reduce buffers do not outlive a run; each virtual environment
builds DeepSpeed's ops in its own folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ds_runs import REPO

from dflop_ds.launch import (
    clear_stale_build_locks,
    extensions_root,
    launch_env,
    release_own_shm_buffer,
    release_shm_buffers,
    shm_buffer_name,
)


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
