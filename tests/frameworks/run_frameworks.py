"""`make test-frameworks`: DFLOP through each framework's own command, on 2 CPU ranks.

For each framework (its environment, ``.venv-swift`` / ``.venv-llamafactory``, built by
benchmarks/framework_envs.sh), tiny HF LLaVA and tiny Qwen2-VL (tests/frameworks/inputs.py, built
offline) train one epoch of 28 chat rows under ZeRO-2 and under ZeRO-3 with the ``"dflop"`` block
in the DeepSpeed config; each run must:

* lower the loss (last logged loss below the first);
* fetch every row index exactly once over both ranks (a test plugin lists each fetch);
* log DFLOP's telemetry (``dflop_predicted_imbalance``), so DFLOP's sampler made the microbatches.

Before them, ``zero3_weights.py`` loads the encoder-heavy tiny LLaVA under ZeRO-3 on 2 ranks as
the plugins do and checks every gathered weight against the checkpoint (DeepSpeed 0.18.4 on CPU
ranks otherwise leaves parts of them unwritten: dflop_ds/zero_gather.py).

In LLaMA-Factory, tiny Qwen2-VL also trains under ZeRO-3 with ``packing: true``: each of
DFLOP's microbatches packed into one row (dflop_ds/integrations/llamafactory.py), the same checks.

Then a LLaVA ZeRO-2 run of 2 epochs is stopped after step 6 (a checkpoint, in epoch 1) and resumed
from it: the checkpoint holds DFLOP's sampler state (``dflop_sampler.json``, which the resume
checks), and every row is fetched exactly twice over both runs (once per epoch).

Usage: python tests/frameworks/run_frameworks.py [--frameworks swift] [--out DIR] [--only NAME]
Prints one line per check and ``N passed, M failed``; exits 1 when any failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ROWS = 28
#: per-device batch and microbatches per step: 28 rows = 3 global batches of 8 and a last step of 4
BATCH, GAS = 2, 2
STEPS_PER_EPOCH = 4
STOP_AT = 6
#: Qwen2-VL's pixel range (tests/frameworks/inputs.py builds the model with the same)
QWEN_PIXELS = {"MIN_PIXELS": str(4 * 28 * 28), "MAX_PIXELS": str(8 * 28 * 28)}


def deepspeed_config(stage: int, path: Path, dflop: dict | None = None) -> Path:
    """A ZeRO-``stage`` config with "auto" batch keys, fp32, and a ``"dflop"`` block (``dflop``,
    default: DFLOP's sampler with the proxy cost)."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "dflop": dflop if dflop is not None else {"sampler": {"kind": "dflop"}},
    }
    path.write_text(json.dumps(config, indent=1))
    return path


def venv_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a launch in ``venv``: its tools first, its DeepSpeed op folder, one thread."""
    env = dict(os.environ)
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        TORCH_EXTENSIONS_DIR=str(venv / "torch_extensions"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        NPROC_PER_NODE="2",
        **extra,
    )
    env["PYTHONPATH"] = str(REPO)  # this checkout's dflop_ds, wherever the venv's editable install points
    return env


@dataclass
class Run:
    """One launch: its name, output folder, fetch log prefix and whether it exited 0."""

    name: str
    out: Path
    fetch_log: Path
    ok: bool = False
    seconds: float = 0.0
    tail: str = ""
    losses: list[float] = field(default_factory=list)
    telemetry: int = 0

    def fetched(self) -> list[int]:
        """Every row index fetched, over both ranks."""
        indices = []
        for rank in (0, 1):
            path = Path(f"{self.fetch_log}.rank{rank}")
            if path.is_file():
                indices += [json.loads(line)["index"] for line in path.read_text().splitlines()]
        return indices


def swift_options(
    model: str, family: str, ds: Path, out: Path, epochs: int = 1, batch: int = BATCH, gas: int = GAS
) -> list[str]:
    """``swift sft`` and its options for a full fp32 CPU training of ``model`` on the chat data, one
    log line per step, without a plugin."""
    kind = (
        ["--model_type", "llava1_5_hf"] if family == "llava" else ["--model_type", "qwen2_vl", "--template", "qwen2_vl"]
    )
    command = ["swift", "sft", "--model", model, *kind, "--dataset", str(INPUTS["data"]), "--tuner_type", "full"]
    command += ["--deepspeed", str(ds), "--use_cpu", "true", "--torch_dtype", "float32", "--fp16", "false"]
    command += ["--bf16", "false", "--num_train_epochs", str(epochs), "--per_device_train_batch_size", str(batch)]
    command += ["--gradient_accumulation_steps", str(gas), "--learning_rate", "5e-3", "--output_dir", str(out)]
    command += ["--add_version", "false", "--logging_steps", "1", "--report_to", "none", "--check_model", "false"]
    command += ["--dataloader_num_workers", "0", "--data_seed", "7"]
    return command


def swift_plugin(venv: Path, env: dict[str, str] | None = None) -> str:
    """The DFLOP plugin file, as ``dflop-ds plugin-path swift`` prints it in ``venv`` (``env``: its
    environment, default this process's)."""
    command = [str(venv / "bin" / "dflop-ds"), "plugin-path", "swift"]
    return subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout.strip()


def swift_command(
    venv: Path, model: str, family: str, ds: Path, out: Path, epochs: int, resume: Path | None, env: dict[str, str]
) -> list[str]:
    """``swift sft`` with the DFLOP plugin (and the test's recording plugin); ``env``: the launch's."""
    command = swift_options(model, family, ds, out, epochs)
    command += ["--save_strategy", "steps", "--save_steps", str(STOP_AT), "--save_only_model", "false"]
    command += ["--external_plugins", swift_plugin(venv, env), str(HERE / "swift_recorder.py")]
    command += ["--callbacks", "dflop", "record"]
    if resume is not None:
        command += ["--resume_from_checkpoint", str(resume)]
    return command


def llamafactory_config(
    model: str, family: str, ds: Path, out: Path, epochs: int = 1, batch: int = BATCH, gas: int = GAS
) -> dict:
    """LLaMA-Factory's options for a full fp32 CPU training of ``model`` on the chat data, one log
    per step, no checkpoints."""
    return {
        "model_name_or_path": model,
        "template": "llava" if family == "llava" else "qwen2_vl",
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "dflop_chat",
        "dataset_dir": INPUTS["dataset_dir"],
        "cutoff_len": 4096,
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": gas,
        "learning_rate": 5e-3,
        "num_train_epochs": epochs,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "deepspeed": str(ds),
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "dataloader_num_workers": 0,
        "preprocessing_num_workers": 1,
        "data_seed": 7,
        "image_max_pixels": int(QWEN_PIXELS["MAX_PIXELS"]),
        "image_min_pixels": int(QWEN_PIXELS["MIN_PIXELS"]),
    }


def write_config(config: dict, path: Path) -> Path:
    """``config`` written to ``path`` as JSON, which is YAML."""
    path.write_text(json.dumps(config, indent=1))
    return path


def llamafactory_command(
    venv: Path,
    model: str,
    family: str,
    ds: Path,
    out: Path,
    epochs: int,
    resume: Path | None,
    stop_at: int = 0,
    packing: str | None = None,
) -> list[str]:
    """``dflop-ds llamafactory train`` on a config written beside the run (``stop_at``: ``max_steps``,
    the first half of a stopped-and-resumed run; ``packing``: that option of LLaMA-Factory's set,
    e.g. ``"packing"``)."""
    config = llamafactory_config(model, family, ds, out, epochs)
    config.update(overwrite_output_dir=resume is None, save_strategy="steps", save_steps=STOP_AT)
    if packing:
        config[packing] = True
    if stop_at:
        config["max_steps"] = stop_at
    if resume is not None:
        config["resume_from_checkpoint"] = str(resume)
    path = write_config(config, out.with_suffix(".yaml"))
    return [str(venv / "bin" / "dflop-ds"), "llamafactory", "train", str(path)]


def llamafactory_losses(run: Run) -> None:
    """The run's logged losses and telemetry count, from the Trainer's saved ``trainer_state.json``."""
    path = run.out / "trainer_state.json"
    if not path.is_file():
        return
    for entry in json.loads(path.read_text())["log_history"]:
        if "loss" in entry:
            run.losses.append(float(entry["loss"]))
        run.telemetry += int("dflop_predicted_imbalance" in entry)


def swift_losses(run: Run) -> None:
    """The run's logged losses and telemetry count, from ms-swift's ``logging.jsonl``."""
    path = run.out / "logging.jsonl"
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry and "global_step/max_steps" in entry:
            run.losses.append(float(entry["loss"]))
        run.telemetry += int("dflop_predicted_imbalance" in entry)


INPUTS: dict[str, str] = {}
FRAMEWORKS = ["swift", "llamafactory"]


def launch(framework: str, venv: Path, name: str, work: Path, family: str, stage: int, **kw) -> Run:
    """Launch one training; returns its :class:`Run`."""
    run = Run(name, work / name, work / f"{name}.fetch")
    ds = deepspeed_config(stage, work / f"ds_zero{stage}.json")
    env = venv_env(venv, DFLOP_FETCH_LOG=str(run.fetch_log), DFLOP_STOP_AT=str(kw.get("stop_at", 0)), **QWEN_PIXELS)
    epochs, resume = kw.get("epochs", 1), kw.get("resume")
    if framework == "swift":
        command = swift_command(venv, INPUTS[family], family, ds, run.out, epochs, resume, env)
    else:
        hooks = os.pathsep.join([str(HERE / "lf_hooks"), env["PYTHONPATH"]])
        env.update(FORCE_TORCHRUN="1", PYTHONPATH=hooks, MASTER_PORT=str(29500 + os.getpid() % 1000))
        command = llamafactory_command(
            venv, INPUTS[family], family, ds, run.out, epochs, resume, kw.get("stop_at", 0), kw.get("packing")
        )
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work, timeout=1800)
    run.seconds = time.perf_counter() - start
    run.ok = result.returncode == 0
    run.tail = (result.stdout + result.stderr)[-3000:]
    (work / f"{name}.log").write_text(result.stdout + result.stderr)
    (swift_losses if framework == "swift" else llamafactory_losses)(run)
    return run


def once_each(indices: list[int], times: int = 1) -> str | None:
    """None when each of the ``ROWS`` indices appears ``times`` times, else what is wrong."""
    counts = collections.Counter(indices)
    wrong = {i: counts.get(i, 0) for i in range(ROWS) if counts.get(i, 0) != times}
    extra = sorted(set(counts) - set(range(ROWS)))
    return None if not wrong and not extra else f"fetch counts off: {wrong} unknown: {extra}"


def check_zero3_weights(venv: Path, work: Path) -> str | None:
    """What is wrong with the encoder-heavy tiny LLaVA's weights once loaded under ZeRO-3 on 2 ranks
    in ``venv`` (tests/frameworks/zero3_weights.py), or None."""
    model = work / "inputs" / "llava_encoder_heavy"
    build = f"from dflop_ds.testing.hf_tiny import build_encoder_heavy_llava; build_encoder_heavy_llava({str(model)!r})"
    env = venv_env(venv, MASTER_PORT=str(29500 + os.getpid() % 1000))
    subprocess.run([str(venv / "bin" / "python"), "-c", build], env=env, capture_output=True, check=True)
    command = [str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += [f"--master_port={env['MASTER_PORT']}", str(HERE / "zero3_weights.py"), str(model)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work, timeout=900)
    (work / "zero3_weights.log").write_text(result.stdout + result.stderr)
    return None if result.returncode == 0 else (result.stdout + result.stderr)[-3000:]


def check_epoch(run: Run) -> str | None:
    """What is wrong with a one-epoch run, or None."""
    if not run.ok:
        return "exited non-zero:\n" + run.tail
    if len(run.losses) < 2 or not run.losses[-1] < run.losses[0]:
        return f"loss did not fall: {run.losses}"
    if not run.telemetry:
        return "no dflop_predicted_imbalance in the logs: DFLOP's sampler did not run"
    return once_each(run.fetched())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=FRAMEWORKS, choices=FRAMEWORKS)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "frameworks")
    parser.add_argument("--only", default=None, help="run the checks whose name contains this")
    cli = parser.parse_args()
    passed = failed = 0
    for framework in cli.frameworks:
        venv = REPO / f".venv-{framework}"
        work = (cli.out / framework).resolve()
        subprocess.run(["rm", "-rf", str(work)], check=True)
        work.mkdir(parents=True)
        built = subprocess.run(
            [str(venv / "bin" / "python"), str(HERE / "inputs.py"), str(work / "inputs"), "--records", str(ROWS)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            check=True,
        )
        INPUTS.update(json.loads(built.stdout.strip().splitlines()[-1]))
        if not cli.only or cli.only in f"{framework}_zero3_weights":
            problem = check_zero3_weights(venv, work)
            passed, failed = passed + (problem is None), failed + (problem is not None)
            print(f"{'PASS' if problem is None else 'FAIL'} {framework}_zero3_weights")
            if problem:
                print("   ", problem)
        checks: list[tuple[str, str, int, str | None]] = [
            (f"{framework}_{family}_zero{stage}", family, stage, None)
            for family in ("llava", "qwen2_vl")
            for stage in (2, 3)
        ]
        if framework == "llamafactory":  # its packing: each balanced microbatch packed into one row
            checks.append((f"{framework}_qwen2_vl_zero3_packing", "qwen2_vl", 3, "packing"))
        for name, family, stage, packing in checks:
            if cli.only and cli.only not in name:
                continue
            run = launch(framework, venv, name, work, family, stage, packing=packing)
            problem = check_epoch(run)
            passed, failed = passed + (problem is None), failed + (problem is not None)
            verdict = "PASS" if problem is None else "FAIL"
            print(f"{verdict} {name} ({run.seconds:.0f} s, loss {run.losses[:1]} -> {run.losses[-1:]})")
            if problem:
                print("   ", problem)
        name = f"{framework}_llava_zero2_resume"
        if cli.only and cli.only not in name:
            continue
        first = launch(framework, venv, name + "_a", work, "llava", 2, epochs=2, stop_at=STOP_AT)
        checkpoint = first.out / f"checkpoint-{STOP_AT}"
        second = launch(framework, venv, name + "_b", work, "llava", 2, epochs=2, resume=checkpoint)
        problem = None
        if not (first.ok and second.ok):
            problem = "exited non-zero:\n" + (first.tail if not first.ok else second.tail)
        elif not (checkpoint / "dflop_sampler.json").is_file():
            problem = f"{checkpoint} has no dflop_sampler.json, so the resume could not check the schedule"
        elif len(first.fetched()) != STOP_AT * BATCH * GAS * 2 - 4:  # 6 steps: 5 of 8 rows and the short one of 4
            problem = f"the first run fetched {len(first.fetched())} rows before its stop"
        else:
            problem = once_each(first.fetched() + second.fetched(), times=2)
        passed, failed = passed + (problem is None), failed + (problem is not None)
        print(f"{'PASS' if problem is None else 'FAIL'} {name} ({first.seconds + second.seconds:.0f} s)")
        if problem:
            print("   ", problem)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
