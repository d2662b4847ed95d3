"""`make bench-frameworks`: each framework's own training against the same with dflop-ds, ZeRO-3, 2 CPU ranks.

Every run goes through the framework's own command, in its environment (``.venv-swift``,
``.venv-llamafactory``, `make framework-envs`), on the models of `make test-frameworks` made
:data:`MODEL_WIDTH` times wider (the same layers) and an
epoch of 96 chat rows drawn from the bundled users' mixture (tests/frameworks/inputs.py
``--mixture``, :data:`MIXTURE`: text-only, one-image, 2-4-image and video rows in its proportions,
a video's 4-16 frames as images, image sizes a quarter of the real ones), ``BATCH`` x ``GAS`` per
rank a step (16 samples a step, enough for a balancer to matter), with this checkout's dflop_ds
first on PYTHONPATH. dflop-ds's runs name each model's profiled cost model (``dflop-ds profile
model``, profiled once before the rounds, as a user would; ``--cost proxy``: the unitless proxy
cost instead). Per round, eight
launches, interleaved over the rounds (the order reversed every other round), the same data and
seed in each (both frameworks freeze the vision tower by default; here it trains in every run:
ms-swift's ``--freeze_vit false``, LLaMA-Factory's ``freeze_vision_tower: false``, full ViT + LLM
training, the case of ms-swift #6283):

* ``default``: the framework's own sampler, microbatches padded (encoder-heavy tiny LLaVA, its
  vision tower about half the work), against ``dflop``: the same command with DFLOP's sampler
  (ms-swift's ``--callbacks dflop``, ``dflop-ds llamafactory train``). LLaMA-Factory's own run is
  what ``llamafactory-cli train`` runs on each rank (framework_hooks/llamafactory_rank.py), after
  starting DeepSpeed's communication as ``dflop-ds llamafactory train`` does (without it, ZeRO-3
  on CPU ranks stops at DeepSpeed's batch assertion);
* ``packing``: the framework's own packing against what dflop-ds does with it. ms-swift:
  ``--packing true`` (offline bin packing into rows of ``--max_length`` tokens, one row per
  microbatch) against ``--padding_free true --callbacks dflop`` (DFLOP's balanced microbatches,
  each packed into one row by ms-swift, balanced on the packed cost; ``--lazy_tokenize false``,
  so that its dataset is encoded before training as ``--packing``'s must be and both epochs
  time training alone), on the encoder-heavy tiny Qwen2-VL (ms-swift's
  LLaVA template allows neither); both need a flash-attention build in ms-swift, which this CPU has
  none of, so a benchmark plugin (framework_hooks/swift_cpu.py, loaded by every ms-swift run)
  lifts that rule and both run with sdpa; it also starts DeepSpeed's communication before the
  model loads, as DFLOP's plugin does (ms-swift's own run stops at DeepSpeed's batch assertion
  under ZeRO-3 on CPU ranks otherwise). LLaMA-Factory: ``packing: true`` (offline greedy knapsack
  into rows of ``cutoff_len`` tokens, one row per microbatch) against ``dflop-ds llamafactory
  train`` with the same option, on the encoder-heavy tiny Qwen2-VL (LLaMA-Factory's packing of LLaVA fails, see
  :data:`PAIRS`): the plugin keeps the rows one sample each, balances microbatches on their packed
  cost and packs each into one row as LLaMA-Factory's packer does. Pack rows of the frameworks'
  own packing (:data:`PACK_TOKENS`) hold 4.8 (ms-swift) and 3.0 (LLaMA-Factory) samples on
  average, one row per microbatch; dflop-ds's packed microbatches hold :data:`PACKED_BATCH`
  samples, so each pair trains the same steps of about the same samples (5 of about 20, 8 of 12).

The time measured is one epoch of training: rank 0's Trainer callbacks ``on_train_begin`` to
``on_train_end`` (framework_hooks/sitecustomize.py), so process start-up, model loading and data
preparation are left out. A launch whose logged loss does not fall (a NaN loss is logged as 0)
is shown and left out of the medians. Prints a table (rounds timed, median and min-max over
them, rank 0's median step time over steps 2-N of every round, loss of the last step) and ends
with ``frameworks swift_speedup=A swift_packing_speedup=B llamafactory_speedup=C
llamafactory_packing_speedup=D``: each the framework's median epoch time over dflop-ds's.

Usage: python benchmarks/bench_frameworks.py [--rounds 3] [--rows 96] [--width 2] [--frameworks swift llamafactory]
       [--pairs swift_packing_speedup ...] [--cost profiled|proxy] [--out DIR] [--report]
(--report: the table and summary of the runs already in DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "benchmarks" / "framework_hooks"
sys.path.insert(0, str(ROOT / "tests" / "frameworks"))

import run_frameworks as fw  # noqa: E402

#: the shape manifest the epoch's rows are drawn from: what users train (text-only, one image,
#: 2-4 images, videos as 4-16 frames), tests/frameworks/inputs.py --mixture
MIXTURE = ROOT / "examples" / "data" / "mixture.jsonl"
#: how many times wider than the test models both models are (tests/frameworks/inputs.py ``--width``,
#: the same layers): at width 1 on these CPU ranks ZeRO-3's per-module gathers and hooks took about
#: 0.27 s of a 0.4-1.2 s microbatch whatever its samples (a fit over 60 traced microbatches of both
#: methods), so the work a balancer moves was a small part of a step; at width 2 (LLaVA's vision
#: tower 512 wide, its LLM 256) a microbatch's time follows its slowest rank's images (0.034 s
#: each) and padded tokens, as on a GPU with real model sizes
MODEL_WIDTH = 2
#: per-device batch x microbatches per step: 2 ranks x 4 x 2 = 16 samples a step (6 steps of 96 rows)
BATCH, GAS = 4, 2
#: tokens per pack row of the frameworks' own packing (``--max_length``, ``cutoff_len``): above the
#: data's longest sample (381 tokens on Qwen2-VL, by the shapes dflop-ds reads), so no sample is cut
#: or dropped. ms-swift's binpack fills 20 rows of 640 tokens with the 96 rows (4.8 samples a row,
#: 5 steps of 4 rows)
PACK_TOKENS = {"swift": 640, "llamafactory": 512}
#: per-device batch of dflop-ds's packed runs (samples per packed row): what fills one of the
#: framework's pack rows on average, so that both runs train about the same samples per step and
#: the same steps. ms-swift: 96 rows in 20 rows of 640 tokens (5 steps, 20 samples against 19.2);
#: LLaMA-Factory: 96 rows in 32 rows of 512 tokens (8 steps of 12)
PACKED_BATCH = {"swift": 5, "llamafactory": 3}


@dataclass(frozen=True)
class Variant:
    """One launch kind: framework, whether dflop-ds is on, whether the framework packs, model family."""

    framework: str
    dflop: bool
    packing: bool
    family: str

    @property
    def batch(self) -> int:
        """Per-device batch: one pack row for the framework's own packing, :data:`PACKED_BATCH`
        samples a packed row for dflop-ds's, else :data:`BATCH`."""
        if self.packing:
            return PACKED_BATCH[self.framework] if self.dflop else 1
        return BATCH

    @property
    def name(self) -> str:
        kind = "packing" if self.packing else "default"
        return f"{self.framework}_{self.family}_{kind}{'_dflop' if self.dflop else ''}"


#: each summary figure: (the framework's own run, the same with dflop-ds). LLaMA-Factory's
#: packing of the tiny LLaVA fails here (a packed row's 528 query tokens against 512 rotary
#: positions at the first forward), so that pair runs on Qwen2-VL
PAIRS = {
    "swift_speedup": (Variant("swift", False, False, "llava"), Variant("swift", True, False, "llava")),
    "swift_packing_speedup": (Variant("swift", False, True, "qwen2_vl"), Variant("swift", True, True, "qwen2_vl")),
    "llamafactory_speedup": (
        Variant("llamafactory", False, False, "llava"),
        Variant("llamafactory", True, False, "llava"),
    ),
    "llamafactory_packing_speedup": (
        Variant("llamafactory", False, True, "qwen2_vl"),
        Variant("llamafactory", True, True, "qwen2_vl"),
    ),
}


def deepspeed_file(work: Path, variant: Variant) -> Path:
    """ZeRO-3 config; the ``"dflop"`` block only for dflop-ds's runs, naming the family's profiled
    cost model when the run has one (:func:`profile_cost_models`)."""
    sampler = {"kind": "dflop"}
    if COST_MODELS.get(variant.family):
        sampler["cost_model"] = COST_MODELS[variant.family]
    path = fw.deepspeed_config(3, work / f"ds_{variant.name}.json", {"sampler": sampler})
    if not variant.dflop:
        config = json.loads(path.read_text())
        del config["dflop"]
        path.write_text(json.dumps(config, indent=1))
    return path


def swift_command(venv: Path, variant: Variant, ds: Path, out: Path, env: dict[str, str]) -> list[str]:
    """``swift sft`` for ``variant`` (``env``: the launch's environment)."""
    packs = variant.packing and not variant.dflop
    command = fw.swift_options(fw.INPUTS[variant.family], variant.family, ds, out, batch=variant.batch, gas=GAS)
    command += ["--save_strategy", "no", "--freeze_vit", "false"]
    plugins = [str(HOOKS / "swift_cpu.py")]
    if variant.dflop:
        plugins.insert(0, fw.swift_plugin(venv, env))
    command += ["--external_plugins", *plugins]
    if variant.dflop:
        command += ["--callbacks", "dflop"]
    if variant.packing:
        command += ["--padding_free", "true", "--lazy_tokenize", "false"] if variant.dflop else ["--packing", "true"]
        command += ["--max_length", str(PACK_TOKENS["swift"])] if packs else []
    return command


def llamafactory_command(venv: Path, variant: Variant, ds: Path, out: Path, env: dict[str, str]) -> list[str]:
    """``dflop-ds llamafactory train`` on a config for ``variant``, or without dflop-ds what
    ``llamafactory-cli train`` runs on each rank, under ``torchrun``
    (framework_hooks/llamafactory_rank.py: it starts DeepSpeed's communication first)."""
    config = fw.llamafactory_config(fw.INPUTS[variant.family], variant.family, ds, out, batch=variant.batch, gas=GAS)
    config["freeze_vision_tower"] = False
    if variant.packing:
        config.update(packing=True, cutoff_len=PACK_TOKENS["llamafactory"])
    path = fw.write_config(config, out.with_suffix(".yaml"))
    if variant.dflop:
        return [str(venv / "bin" / "dflop-ds"), "llamafactory", "train", str(path)]
    launcher = [str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--nproc_per_node=2"]
    return [*launcher, f"--master_port={env['MASTER_PORT']}", str(HOOKS / "llamafactory_rank.py"), str(path)]


#: each family's profiled cost model (``dflop-ds profile model``), by family; empty: the proxy cost
COST_MODELS: dict[str, str] = {}
#: the profile's sweeps per family: LLaVA image counts up to the data's 16 frames, Qwen2-VL patches
#: up to its 384 (16 frames of 24), and sequence lengths past the longest row (Qwen2-VL: past the
#: longest packed row too, about 1000 tokens, whose attention spans the row)
PROFILE_SWEEPS = {
    "llava": ["--tiles", "1,2,4,8,16", "--seq-lens", "32,64,128,256,512"],
    "qwen2_vl": ["--tiles", "4,16,64,128,256,512", "--seq-lens", "32,64,128,256,512,1024"],
}


def profile_cost_models(work: Path, families: list[str]) -> None:
    """Profile each family's model as a dflop-ds user would before training (``dflop-ds profile
    model``, in ms-swift's environment, one thread) into ``work`` and record it in :data:`COST_MODELS`."""
    python = ROOT / ".venv-swift" / "bin" / "python"
    for family in families:
        path = work / f"costmodel_{family}.json"
        command = [str(python), "-m", "dflop_ds.commands.main", "profile", "model", "--no-progress"]
        command += ["--model_name_or_path", fw.INPUTS[family], *PROFILE_SWEEPS[family], "-o", str(path)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(["nice", *command], env=env, capture_output=True, text=True, check=True)
        COST_MODELS[family] = str(path)


def train_seconds(step_log: Path) -> float:
    """Rank 0's ``on_train_begin`` to ``on_train_end``, from the hooks' log."""
    times: dict[str, float] = {}
    for line in step_log.read_text().splitlines():
        entry = json.loads(line)
        times.setdefault(entry["event"], entry["t"])
        if entry["event"] == "on_train_end":
            times["on_train_end"] = entry["t"]
    return times["on_train_end"] - times["on_train_begin"]


def training_ended(step_log: Path) -> bool:
    """Whether rank 0's Trainer reached ``on_train_end`` (the hooks' log)."""
    return step_log.is_file() and '"on_train_end"' in step_log.read_text()


def later_step_seconds(step_log: Path) -> list[float]:
    """Rank 0's seconds per step after the first (``on_step_end`` to the next; the first also pays
    ZeRO-3's first gathers and the loader's start), from the hooks' log."""
    ends = [json.loads(line)["t"] for line in step_log.read_text().splitlines() if '"on_step_end"' in line]
    return [later - earlier for earlier, later in zip(ends, ends[1:])]


class NotTrained(RuntimeError):
    """A launch that exited 0 but whose loss did not fall: the Trainer logs a NaN loss as 0 (its
    ``logging_nan_inf_filter``), and such a run's time is not a training time to compare."""


def launch(variant: Variant, work: Path, round_: int) -> tuple[float, float]:
    """One epoch of ``variant``; returns (train seconds, last logged loss). Raises with the log's
    tail when the launch fails, and when its logged loss did not fall (a run that trains nothing,
    such as a loss of 0 at every step, is not a time to compare)."""
    venv = ROOT / f".venv-{variant.framework}"
    name = f"{variant.name}_r{round_}"
    out, step_log = work / name, work / f"{name}.steps"
    ds = deepspeed_file(work, variant)
    env = fw.venv_env(venv, DFLOP_STEP_LOG=str(step_log), **fw.QWEN_PIXELS)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), str(ROOT)])  # this checkout's dflop_ds
    if variant.framework == "swift":
        command = swift_command(venv, variant, ds, out, env)
    else:
        env.update(FORCE_TORCHRUN="1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        command = llamafactory_command(venv, variant, ds, out, env)
    result = subprocess.run(["nice", *command], env=env, capture_output=True, text=True, cwd=work, timeout=1800)
    (work / f"{name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0 and training_ended(step_log):
        # ms-swift's ranks sometimes abort while exiting, after the epoch ended (std::terminate, with
        # dflop-ds and without): the epoch was trained and is timed; the exit is shown
        print(f"{name}: exit {result.returncode} after the epoch ended (timed; see {name}.log)", flush=True)
    elif result.returncode != 0 or not step_log.is_file():
        raise RuntimeError(f"{name} failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    return measured(variant, work, round_)


def measured(variant: Variant, work: Path, round_: int) -> tuple[float, float]:
    """(train seconds, last logged loss) of a finished launch, from its logs under ``work``; raises
    :class:`NotTrained` when its loss did not fall."""
    name = f"{variant.name}_r{round_}"
    out, step_log = work / name, work / f"{name}.steps"
    run = fw.Run(name, out, work / name)
    (fw.swift_losses if variant.framework == "swift" else fw.llamafactory_losses)(run)
    if variant.dflop and not run.telemetry:
        raise RuntimeError(f"{name}: no dflop_predicted_imbalance logged, so DFLOP's sampler did not run")
    if len(run.losses) < 2 or not 0 < run.losses[-1] < run.losses[0]:
        raise NotTrained(f"{name}: the loss did not fall ({run.losses}): this round of it is not timed")
    return train_seconds(step_log), run.losses[-1]


def load() -> str:
    """The 1-minute load average, for the report."""
    return f"{os.getloadavg()[0]:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=96, help="chat rows of the epoch")
    parser.add_argument("--width", type=int, default=MODEL_WIDTH, help="how many times wider than the test models")
    parser.add_argument("--cost", choices=("profiled", "proxy"), default="profiled", help="dflop-ds's cost model")
    parser.add_argument("--frameworks", nargs="+", default=fw.FRAMEWORKS, choices=fw.FRAMEWORKS)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS), help="the comparisons to run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_frameworks")
    parser.add_argument("--report", action="store_true", help="launch nothing: report the runs already in --out")
    cli = parser.parse_args()
    work = cli.out.resolve()
    if not cli.report:
        subprocess.run(["rm", "-rf", str(work)], check=True)
        work.mkdir(parents=True)
        built = subprocess.run(
            [str(ROOT / ".venv-swift" / "bin" / "python"), str(ROOT / "tests" / "frameworks" / "inputs.py")]
            + [str(work / "inputs"), "--records", str(cli.rows), "--encoder-heavy", "--mixture", str(MIXTURE)]
            + ["--width", str(cli.width)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        )
        fw.INPUTS.update(json.loads(built.stdout.strip().splitlines()[-1]))
    pairs = {key: pair for key, pair in PAIRS.items() if pair[0].framework in cli.frameworks and key in cli.pairs}
    if cli.cost == "profiled" and not cli.report:
        profile_cost_models(work, sorted({v.family for pair in pairs.values() for v in pair}))
    variants = list(dict.fromkeys(v for pair in pairs.values() for v in pair))
    seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    steps: dict[str, list[float]] = {v.name: [] for v in variants}  # steps 2-N, pooled over the rounds
    losses: dict[str, float] = {}
    start = time.time()
    header = f"{cli.rows} rows of {MIXTURE.name}, {BATCH} x {GAS} per rank a step, {cli.cost} cost, {cli.rounds} rounds"
    print(f"bench-frameworks: {header}, ZeRO-3, 2 ranks; load {load()}", flush=True)
    failed: dict[str, str] = {}
    for round_ in range(cli.rounds):
        order = variants if round_ % 2 == 0 else variants[::-1]
        for variant in order:
            if variant.name in failed:
                continue
            if cli.report and not (work / f"{variant.name}_r{round_}.steps").is_file():
                continue
            try:
                run = measured if cli.report else launch
                took, losses[variant.name] = run(variant, work, round_)
            except NotTrained as error:  # shown; the variant's other rounds still count
                print(f"round {round_} {variant.name}: NOT TRAINED, {error}", flush=True)
                continue
            except RuntimeError as error:  # shown, and its comparison reported as failed
                failed[variant.name] = str(error)
                print(f"round {round_} {variant.name}: FAILED\n{error}", flush=True)
                continue
            seconds[variant.name].append(took)
            steps[variant.name] += later_step_seconds(work / f"{variant.name}_r{round_}.steps")
            now = "" if cli.report else f" (load {load()})"
            print(f"round {round_} {variant.name}: {took:.1f} s train{now}", flush=True)
    for v in variants:  # a variant that never trained has nothing to compare
        if not seconds[v.name] and v.name not in failed:
            failed[v.name] = "no round trained"
    print(f"\n{'run':<36} {'rounds':>6} {'epoch s median':>14} {'min-max':>11} {'step 2-N s':>10} {'last loss':>9}")
    for v in variants:
        times = seconds[v.name]
        if v.name in failed:
            print(f"{v.name:<36} {len(times):>6} {'failed':>14}")
            continue
        spread = f"{min(times):.1f}-{max(times):.1f}"
        median = statistics.median(times)
        step = f"{statistics.median(steps[v.name]):.2f}" if steps[v.name] else "-"
        print(f"{v.name:<36} {len(times):>6} {median:>14.1f} {spread:>11} {step:>10} {losses[v.name]:>9.3f}")
    speedups: dict[str, str] = {}
    for key, (base, ours) in pairs.items():
        failure = base.name in failed or ours.name in failed
        ratio = 0.0 if failure else statistics.median(seconds[base.name]) / statistics.median(seconds[ours.name])
        speedups[key] = "failed" if failure else f"{ratio:.3f}"
    print(f"wall {time.time() - start:.0f} s, load {load()}")
    print("frameworks " + " ".join(f"{k}={v}" for k, v in speedups.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
