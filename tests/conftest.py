"""Fixtures the test files share: JSONL data files, bundled DeepSpeed configs written to
``tmp_path`` with keys overridden, and 2-rank runs of ``examples/train.py``; the
``--deny-precisions`` option (see tests/capabilities.py); how pytest-xdist's workers (``make
test``) share the test files (see tests/xdist_groups.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from capabilities import DENY_ENV, deny_precisions, parse_denied
from ds_runs import REPO, Launcher, hf_data_args, run_on_ranks
from tiny_plans import tiny_plan
from xdist_groups import schedule_key, scope_of

from dflop_ds.config import set_settings
from dflop_ds.plan.layout import Layout, Segment


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--deny-precisions",
        default=os.environ.get(DENY_ENV, ""),
        help=f"comma-separated precisions (fp16,bf16) DeepSpeed's accelerator reports unsupported for the run, "
        f"in this process and in test scripts on DeepSpeed ranks (default: ${DENY_ENV})",
    )


def pytest_configure(config: pytest.Config) -> None:
    denied = parse_denied(config.getoption("--deny-precisions"))
    if denied:  # the environment carries it to the scripts the tests launch (tests/capabilities.py)
        patcher = pytest.MonkeyPatch()
        patcher.setenv(DENY_ENV, ",".join(denied))
        deny_precisions(denied, patcher.setattr)
        config.add_cleanup(patcher.undo)


def pytest_report_header(config: pytest.Config) -> str | None:
    denied = config.getoption("--deny-precisions")
    return f"precisions reported unsupported by the accelerator: {denied}" if denied else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n N``: each worker takes whole groups of test files (:mod:`xdist_groups`), the
    groups in the order the workers collected them (:func:`pytest_collection_modifyitems`)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker, the groups with more slow tests first (:func:`xdist_groups.schedule_key`;
    a stable sort: each file's own order stays)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: schedule_key(item.nodeid))


def _write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def write_jsonl() -> Callable[[Path, list], Path]:
    """``write_jsonl(path, records) -> path``: one record per line, objects as JSON and strings as
    they are (for malformed lines)."""
    return _write_jsonl


def write_ds_config(path: Path, name: str, dflop: dict[str, Any] | None = None, **keys: Any) -> Path:
    """The bundled ``ds_configs/<name>`` with the top-level DeepSpeed ``keys`` and the ``"dflop"``
    block's ``dflop`` keys overridden, written to ``path``; returns ``path``. A CSV monitor the
    bundled config writes into the repository writes beside ``path`` instead (``monitor/``), so
    that launches of two test workers never share its files."""
    config = json.loads((REPO / "ds_configs" / name).read_text())
    if "csv_monitor" in config:
        config["csv_monitor"] = {**config["csv_monitor"], "output_path": str(path.parent / "monitor")}
    config.update(keys)
    set_settings(config["dflop"], **(dflop or {}))
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def ds_config(tmp_path: Path) -> Callable[..., Path]:
    """``ds_config(name, dflop=None, **keys) -> path``: :func:`write_ds_config` to
    ``tmp_path / "config.json"``."""

    def write(name: str, dflop: dict[str, Any] | None = None, **keys: Any) -> Path:
        return write_ds_config(tmp_path / "config.json", name, dflop, **keys)

    return write


def run_train_script(
    config: Path, *args: Any, expect: int | None = 0, timeout: float = 400, launcher: Launcher = "direct"
) -> subprocess.CompletedProcess:
    """``examples/train.py`` on 2 DeepSpeed ranks (started by ``launcher``: see :func:`run_on_ranks`)
    with ``--deepspeed_config config`` and ``args``; asserts the exit code is ``expect`` (None: any
    failure) and returns the finished process (output captured as text)."""
    return run_on_ranks(
        REPO / "examples" / "train.py",
        ["--deepspeed_config", str(config), *args],
        expect=expect,
        timeout=timeout,
        launcher=launcher,
    )


@pytest.fixture
def run_train() -> Callable[..., subprocess.CompletedProcess]:
    """``run_train(config, *args, expect=0, timeout=400, launcher="direct")``: :func:`run_train_script`."""
    return run_train_script


@pytest.fixture
def train(tmp_path: Path, ds_config, run_train) -> Callable[..., dict]:
    """``train(config, model, data, images, *args, dflop=None, ds=None)``: examples/train.py on 2 ranks
    with a bundled config (``dflop`` and DeepSpeed keys ``ds`` overridden) on an HF model; its summary."""

    def launch(
        config: str,
        model: Path,
        data: Path,
        images: Path,
        *args: str,
        dflop: dict | None = None,
        ds: dict | None = None,
    ) -> dict:
        summary = tmp_path / "summary.json"
        run_train(
            ds_config(config, dflop, **(ds or {})),
            *hf_data_args(model, data, images, "--summary", summary, *args),
            timeout=500,
        )
        return json.loads(summary.read_text())

    return launch


#: the shared DFLOP pp2 run's settings: tiny_mllm_pp2.json with global batches of 16 in 4 microbatches
#: of the first 640 samples, a node-limited exact solver (the same answer on every rank)
DFLOP_PP2 = {
    "ds": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
    "dflop": {"sampler": "dflop", "max_samples": 640, "lr": 0.003, "ilp_nodes": 200},
}


@pytest.fixture(scope="session")
def dflop_pp2_run(tmp_path_factory) -> dict:
    """One 20-step run of :data:`DFLOP_PP2` on 2 ranks that several test files assert on:
    ``{"run": summary, "trace": trace path}``."""
    folder = tmp_path_factory.mktemp("dflop_pp2")
    dflop = {**DFLOP_PP2["dflop"], "steps": 20, "warmup_steps": 2}
    config = write_ds_config(folder / "config.json", "tiny_mllm_pp2.json", dflop, **DFLOP_PP2["ds"])
    summary, trace = folder / "summary.json", folder / "trace.jsonl"
    run_train_script(config, "--summary", summary, "--trace", trace)
    return {"run": json.loads(summary.read_text()), "trace": trace}


def run_colocated_check(out: Path, engines: str, ranks: int = 2) -> dict[str, dict]:
    """``ds_scripts/tiny_colocated_check.py`` comparing the local and the colocated encoder on the
    comma-separated ``engines`` in one launch on ``ranks`` ranks: each engine's report."""
    script = REPO / "tests" / "ds_scripts" / "tiny_colocated_check.py"
    run_on_ranks(script, ["--out", out, "--engines", engines], ranks=ranks, timeout=1500)
    return {engine: json.loads((out / f"{engine}.json").read_text()) for engine in engines.split(",")}


@pytest.fixture(scope="session")
def colocated_reports(tmp_path_factory) -> dict[str, dict]:
    """The colocated-encoder comparison on ZeRO-2 dp2 and on pp2, both in one 2-rank launch."""
    return run_colocated_check(tmp_path_factory.mktemp("colocated"), "zero2,pp2")


@pytest.fixture(scope="session")
def colocated_plan_run(tmp_path_factory) -> dict:
    """A colocated ZeRO-2 plan file (the encoder dispatched over both ranks, 4 microbatches of a
    global batch of 16) driving one DFLOP epoch of the first 96 samples (6 steps) on 2 ranks:
    ``{"run": summary, "trace": trace path}``."""
    folder = tmp_path_factory.mktemp("colocated_plan")
    layout = Layout(Segment(1, 1, 2), Segment(1, 1, 2), n_mb=4, stages=((5, 1, 5),), colocated=True)
    tiny_plan(layout, 16, family="colocated", zero_stage=2).save(folder / "plan.json")
    dflop = set_settings(
        {}, plan=str(folder / "plan.json"), sampler="dflop", max_samples=96, steps=6, warmup_steps=1, lr=0.003
    )
    config = folder / "config.json"
    config.write_text(json.dumps({"steps_per_print": 10**6, "zero_optimization": {"stage": 2}, "dflop": dflop}))
    summary, trace = folder / "summary.json", folder / "trace.jsonl"
    run_train_script(config, "--summary", summary, "--trace", trace, timeout=600)
    return {"run": json.loads(summary.read_text()), "trace": trace}
