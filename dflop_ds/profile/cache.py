"""A profiled cost model kept on disk and reused while the model, the machine and the software are the same.

The key is the model's identity (its config), the machine (architecture, CPU model, core count,
accelerator), the torch / DeepSpeed / dflop-ds versions and the profiling options. A file whose
key differs is never reused: the model is profiled again and written under its own key. Processes
that ask at once (the ranks of one launch) take a file lock, so one profiles and the others load.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflop_ds.profile.costmodel import CostModel
from dflop_ds.profile.tiny import ProfileTarget

#: the environment variable naming the cache folder (default ``$XDG_CACHE_HOME/dflop-ds``)
CACHE_ENV = "DFLOP_DS_CACHE"


def default_cache_folder() -> Path:
    """``$DFLOP_DS_CACHE``, else ``$XDG_CACHE_HOME/dflop-ds``, else ``~/.cache/dflop-ds``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflop-ds"


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_key() -> dict[str, Any]:
    """What identifies this machine for timing: architecture, CPU model, cores and accelerator."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    device = accelerator.device_name()
    return {
        "arch": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "accelerator": device,
        "device_name": "" if device == "cpu" else str(accelerator.get_device_name()),
    }


def software_key() -> dict[str, str]:
    """The versions whose kernels and profiler the timings depend on."""
    import deepspeed
    import torch

    import dflop_ds

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "dflop_ds": dflop_ds.__version__}


def profile_key(model: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The full cache key of ``model`` (its identity, JSON-serializable) profiled with ``options``."""
    return {"model": model, "machine": machine_key(), "software": software_key(), "options": options}


def key_digest(key: dict[str, Any]) -> str:
    """A short stable hash of a cache key."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_cost_model(
    model: dict[str, Any],
    make_target: Callable[[], ProfileTarget],
    folder: str | Path | None = None,
    *,
    log: Callable[[str], None] = print,
    progress: bool = True,
    **options: Any,
) -> tuple[CostModel, Path]:
    """The fitted CostModel of ``model`` on this machine and software, and its file.

    Loaded from ``folder`` (default :func:`default_cache_folder`) when a cost model of the same
    key is there; otherwise ``make_target()`` is profiled with ``options`` (keyword arguments of
    :func:`~dflop_ds.profile.model.profile_model`, e.g. ``repeats``), fitted and written there.
    """
    from dflop_ds.profile.model import profile_model

    folder = Path(folder) if folder is not None else default_cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    key = profile_key(model, options)
    path = folder / f"costmodel-{key_digest(key)}.json"
    key_path = path.with_suffix(".key.json")
    with open(folder / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process profiles, the others wait and load its file
        if path.exists() and key_path.exists() and json.loads(key_path.read_text()) == json.loads(json.dumps(key)):
            log(f"[dflop-ds] cost model: reusing {path} (same model, machine and versions)")
            return CostModel.load(path), path
        log(f"[dflop-ds] cost model: profiling {model} once on this machine into {path} ...")
        started = time.perf_counter()
        target = make_target()
        profile = profile_model(**target.profile_kwargs(), progress=progress, **options)
        cost_model = CostModel().fit(profile, target.policy)
        cost_model.save(path)
        key_path.write_text(json.dumps(key, indent=1, sort_keys=True))
        log(
            f"[dflop-ds] cost model: profiled {len(profile.encoder)} encoder and {len(profile.llm)} LLM shapes in "
            f"{time.perf_counter() - started:.1f} s"
        )
        return cost_model, path


def cached_tiny_cost_model(
    model_overrides: dict[str, Any], folder: str | Path | None = None, **kwargs: Any
) -> tuple[CostModel, Path]:
    """:func:`cached_cost_model` of the bundled tiny MLLM with ``model_overrides`` of its config."""
    from dataclasses import asdict

    from dflop_ds.models import TinyMLLMConfig
    from dflop_ds.profile.tiny import tiny_target

    config = TinyMLLMConfig(**model_overrides)
    return cached_cost_model({"name": "tiny_mllm", **asdict(config)}, lambda: tiny_target(config), folder, **kwargs)
