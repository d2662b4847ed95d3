"""Scripts the tests run on DeepSpeed ranks: the launch, the exit-code check and the per-rank reports."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from direct_ranks import run_ranks

from dflop_ds.host import clear_stale_build_locks, release_shm_buffers
from dflop_ds.launch import free_port, launch_env, run_deepspeed

REPO = Path(__file__).resolve().parents[1]


def repo_first_pythonpath() -> str:
    """``PYTHONPATH`` with this repository first: the scripts the tests launch import its dflop_ds."""
    return f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


#: how :func:`run_on_ranks` starts the ranks: directly (:func:`direct_ranks.run_ranks`), or through
#: the ``deepspeed`` launcher as a user does (:func:`dflop_ds.launch.run_deepspeed`)
Launcher = Literal["direct", "deepspeed"]


def run_on_ranks(
    script: Path,
    args: Sequence[Any],
    *,
    ranks: int = 2,
    timeout: float = 600,
    expect: int | None = 0,
    extra_env: dict[str, str] | None = None,
    launcher: Launcher = "direct",
) -> subprocess.CompletedProcess:
    """``script args`` on ``ranks`` DeepSpeed ranks, from the repository root with the output
    captured as text; asserts the exit code is ``expect`` (None: any failure), showing the output's
    tail when it is not, and returns the finished process. The ranks are started directly, with the
    environment and arguments the launcher gives them (5 s less per launch); ``launcher="deepspeed"``
    runs the real launcher, for tests whose subject is the launch itself or the user's command line
    (the launcher's exit code is then the first failing rank's, 256 + code for a signal)."""
    if launcher == "direct":
        result = run_ranks(script, args, ranks=ranks, cwd=REPO, extra_env=extra_env, timeout=timeout)
    else:
        result = run_deepspeed(
            script, args, ranks=ranks, cwd=REPO, extra_env=extra_env, capture_output=True, text=True, timeout=timeout
        )
    output = f"exit code {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    if expect is None:
        assert result.returncode != 0, output
    else:
        assert result.returncode == expect, output
    return result


def hf_data_args(model: Path, data: Path, images: Path, *args: Any) -> list[str]:
    """examples/train.py's options for an HF model: the ``model`` folder, the LLaVA ``data`` and
    its ``images`` folder, then ``args``."""
    return [
        "--model_name_or_path",
        str(model),
        "--data_path",
        str(data),
        "--image_folder",
        str(images),
        *map(str, args),
    ]


def run_train_batch(runs: Mapping[str, Sequence[Any]], folder: Path, *, timeout: float = 900) -> dict[str, dict]:
    """examples/train.py's runs ``{name: command line}`` in one 2-rank launch
    (``ds_scripts/train_runs.py``: runs of one engine kind, trained in turn), each with
    ``--summary folder/NAME.summary.json`` added; asserts the launch exits 0 and returns each run's
    summary (``{"summary": ..., "steps": [...]}``) by name. One launch starts the ranks once: the
    imports are most of a tiny model's run."""
    given = [name for name, argv in runs.items() if "--summary" in map(str, argv)]
    assert not given, f"run_train_batch adds --summary itself; runs {given} give their own"
    summaries = {name: folder / f"{name}.summary.json" for name in runs}
    options = [
        arg
        for name, argv in runs.items()
        for arg in ("--run", shlex.join([*map(str, argv), "--summary", str(summaries[name])]))
    ]
    extra_env = {"PYTHONPATH": repo_first_pythonpath()}
    run_on_ranks(REPO / "tests" / "ds_scripts" / "train_runs.py", options, extra_env=extra_env, timeout=timeout)
    return {name: json.loads(path.read_text()) for name, path in summaries.items()}


def run_with_accelerate(
    script: Path,
    args: Sequence[Any],
    *,
    config_file: Path,
    deepspeed_config_file: Path,
    ranks: int = 2,
    timeout: float = 600,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``script args`` under ``accelerate launch --config_file config_file`` (a DeepSpeed plugin
    config) with its ``deepspeed_config_file`` replaced, on ``ranks`` processes, from the repository
    root; asserts it exits 0 (showing the output's tail otherwise) and returns the finished process."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config_file),
        "--deepspeed_config_file", str(deepspeed_config_file), "--num_processes", str(ranks),
        "--main_process_port", str(port), str(script), *map(str, args),
    ]  # fmt: skip
    clear_stale_build_locks()
    try:
        result = subprocess.run(
            command, cwd=REPO, env=launch_env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout
        )
    finally:
        release_shm_buffers(port)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def run_pipeline_variants(
    script: Path, out: Path, args: Sequence[Any], variants: dict[str, Sequence[str]], *, timeout: float
) -> dict[str, list[dict]]:
    """Two-stage pipeline check runs of ``script`` with ``args``, one per ``--variant NAME=OPTIONS``
    (see ``ds_scripts/pipe_checks.py``), in one launch on 2 ranks with this repository first on
    PYTHONPATH: the ``rank{r}.json`` reports each wrote into ``out/NAME``, stage 0's then stage 1's."""
    extra_env = {
        "PYTHONPATH": repo_first_pythonpath(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    options = [a for name, opts in variants.items() for a in ("--variant", f"{name}={shlex.join(opts)}")]
    run_on_ranks(script, [*args, *options], extra_env=extra_env, timeout=timeout)
    reports = {}
    for name in variants:
        reports[name] = [json.loads((out / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["stage"] for r in reports[name]] == [0, 1], name
    return reports
