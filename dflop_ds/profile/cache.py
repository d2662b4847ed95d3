"""A profiled cost model kept on disk and reused while the model, the machine and the software are the same.

The key is the model's identity (its config), the machine (architecture, CPU model, core count,
accelerator), the torch / DeepSpeed / dflop-ds versions and the profiling options. A file whose
key differs is never reused: the model is profiled again and written under its own key. In a
training launch only global rank 0 asks (the other ranks receive its cost model, see
:mod:`dflop_ds.train.launch_inputs`); processes that ask at once (launches side by side) take a
file lock, so one profiles and the others load.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import platform
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from dflop_ds.cost import FittedCostModel, load_cost_model, reusable_fitted_model, save_cost_model
from dflop_ds.cost.io import FORMAT_VERSION as COST_MODEL_FORMAT_VERSION
from dflop_ds.profile.model import TIMING_PROTOCOL, profile_model
from dflop_ds.profile.target import ProfileTarget

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

    try:
        ours = metadata.version("dflop-ds")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        ours = "source"
    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "dflop_ds": ours,
        "cost_model_format": str(COST_MODEL_FORMAT_VERSION),
        "timing_protocol": str(TIMING_PROTOCOL),
    }


#: keyword arguments of :func:`~dflop_ds.profile.model.profile_model` that do not change what it measures
_NOT_MEASURED = {"progress"}


def effective_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with :func:`~dflop_ds.profile.model.profile_model`'s defaults filled in, so that
    passing a default explicitly keys the same file and a changed default keys a new one."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(profile_model).parameters.items()
        if parameter.default is not inspect.Parameter.empty and name not in _NOT_MEASURED
    }
    return {**defaults, **{name: value for name, value in options.items() if name not in _NOT_MEASURED}}


def profile_key(model: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The full cache key of ``model`` (its identity, JSON-serializable) profiled with ``options``
    (:func:`effective_options`)."""
    return {
        "model": model,
        "machine": machine_key(),
        "software": software_key(),
        "options": effective_options(options),
    }


def key_digest(key: dict[str, Any]) -> str:
    """A short stable hash of a cache key."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_files(folder: str | Path, key: dict[str, Any]) -> tuple[Path, Path]:
    """``(cost-model file, key file)`` of ``key`` in the cache ``folder``."""
    path = Path(folder) / f"costmodel-{key_digest(key)}.json"
    return path, path.with_suffix(".key.json")


def store_cost_model(cost_model: FittedCostModel, folder: str | Path, key: dict[str, Any]) -> Path:
    """Write ``cost_model`` into the cache ``folder`` under ``key`` (:func:`profile_key`), where
    :func:`cached_cost_model` finds it; its file."""
    path, key_path = cache_files(folder, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_cost_model(cost_model, path)
    key_path.write_text(json.dumps(key, indent=1, sort_keys=True))
    return path


def _cached(path: Path, key_path: Path, key: dict[str, Any], log: Callable[[str], None]) -> FittedCostModel | None:
    """The fitted cost model at ``path`` if its key file holds ``key`` and it loads as one; None
    otherwise (absent, another key, or a file this version cannot read: it is profiled again)."""
    if not key_path.exists() or json.loads(key_path.read_text()) != json.loads(json.dumps(key)):
        return None
    loaded = reusable_fitted_model(path, lambda message: log(f"[dflop-ds] cost model: {message}"))
    if loaded is None:
        return None
    log(f"[dflop-ds] cost model: reusing {path} (same model, machine and versions)")
    return loaded


def stored_fitted_model(path: Path) -> FittedCostModel:
    """The fitted cost model just written to ``path``, as read back from it."""
    model = load_cost_model(path)
    if not isinstance(model, FittedCostModel):
        raise TypeError(f"{path}: holds a {type(model).__name__}, not the fitted cost model written there")
    return model


def cached_cost_model(
    model: dict[str, Any],
    make_target: Callable[[], ProfileTarget],
    folder: str | Path | None = None,
    *,
    log: Callable[[str], None] = print,
    progress: bool = True,
    **options: Any,
) -> tuple[FittedCostModel, Path]:
    """The fitted cost model of ``model`` on this machine and software, and its file.

    Loaded from ``folder`` (default :func:`default_cache_folder`) when a cost model of the same
    key is there; otherwise ``make_target()`` is profiled with ``options`` (keyword arguments of
    :func:`~dflop_ds.profile.model.profile_model`, e.g. ``repeats``), fitted and written there.
    """
    folder = Path(folder) if folder is not None else default_cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    key = profile_key(model, options)
    path, key_path = cache_files(folder, key)
    with open(folder / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process profiles, the others wait and load its file
        cached = _cached(path, key_path, key, log)
        if cached is not None:
            return cached, path
        log(f"[dflop-ds] cost model: profiling {model} once on this machine into {path} ...")
        started = time.perf_counter()
        target = make_target()
        profile = profile_model(**target.profile_kwargs(), progress=progress, **options)
        cost_model = FittedCostModel().fit(profile, target.policy)
        store_cost_model(cost_model, folder, key)
        log(
            f"[dflop-ds] cost model: profiled {len(profile.encoder)} encoder and {len(profile.llm)} LLM shapes in "
            f"{time.perf_counter() - started:.1f} s"
        )
        # what the file holds, as a later launch (a resumed one) reuses it: every launch predicts alike
        return stored_fitted_model(path), path
