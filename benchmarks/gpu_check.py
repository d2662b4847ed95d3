"""`make gpu-check`: prove dflop-ds's GPU path and measure it, on one GPU from a bare machine, or small on a CPU.

Installs the wheels of ``make gpu-wheels`` (``.gpu-wheels/``) when DeepSpeed is not importable
(``pip install --no-index --no-deps --target``, then that folder on ``sys.path`` and
``PYTHONPATH``), then runs four parts, each timed, guarded (a failure is recorded and the next
part runs) and held to a time budget:

a. ``env``: device, torch / CUDA / DeepSpeed / transformers versions, bf16 support, a matmul
   against a float64 reference, and a single-rank DeepSpeed engine (NCCL on a GPU, the CPU
   accelerator's backend on a CPU; a torch optimizer, bf16 where supported) whose loss falls.
b. ``packed``: HF microbatches packed (one row, attention within each sample) vs padded, on a
   tiny LLaVA and a tiny Qwen2-VL (:mod:`dflop_ds.testing.hf_tiny`) in float32: loss, logits and
   every parameter's gradient agree, for every attention implementation the padded path can use
   here (eager, sdpa, flex_attention; flash_attention_2 only where flash-attn is installed).
c. ``profile``: a LLaVA with real layer sizes on a GPU (SigLIP-so400m-sized tower: hidden 1152,
   16 heads, MLP 4304, 384 px images in 14 px patches; Qwen2-0.5B-sized decoder layers: hidden
   896, 14 heads, 2 key/value heads, MLP 4864; 4 layers each, random bf16 weights; the tiny
   tokenizer's vocabulary, so the head is small) is profiled on fit and held-out shapes; the
   fitted cost model's held-out error, and its error on real microbatches of a LLaVA dataset
   (padded and packed, timed fwd+bwd against ``predict_microbatch``, as ``bench_costmodel`` does).
d. ``throughput``: that model trained on one device by ``benchmarks/hf_worker.py`` (ZeRO-2, bf16
   on a GPU): stock (padded), stock_packed and dflop on the same global batches, interleaved
   round by round; samples/s medians and dflop's speed-up over stock.

On a CPU every part runs small (tiny sizes, few rounds) and the report names what it skipped.
The JSON report (``--report``, default ``out/gpu_check.json``, and ``$OUT/gpu_check.json`` when
``OUT`` is set) is rewritten after every part, so a killed run leaves what it measured. The last
line reads ``gpu-check device=NAME parts_ok=K/N packed_rel_err=E microbatch_mape=M
speedup_vs_stock=S``. Exit status 0 when every part that ran passed, 1 otherwise (the report and
the last line are written either way).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: transformers attention implementations the packed-vs-padded part tries, in this order
ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2")
#: relative-error tolerances of packed vs padded in float32: loss and logits, gradients
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-4, 1e-3
#: real layer sizes of part c on a GPU (SigLIP-so400m tower, Qwen2-0.5B decoder), a few layers each
REAL_VISION = dict(
    hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=4, image_size=384, patch_size=14
)
REAL_TEXT = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    num_hidden_layers=4,
    max_position_embeddings=8192,
)


@dataclass(frozen=True)
class Sizes:
    """How big each part runs: on a GPU (``full``) or small on a CPU."""

    budgets: dict[str, float]
    engine_steps: int
    real_layers: bool
    fit_tiles: tuple[int, ...]
    heldout_tiles: tuple[int, ...]
    fit_llm: tuple[tuple[int, int], ...]
    heldout_llm: tuple[tuple[int, int], ...]
    profile_repeats: int
    records: int
    microbatches: int
    max_microbatch: int
    timing_repeats: int
    rounds: int
    warmup: int
    global_batch: int
    gas: int


GPU_SIZES = Sizes(
    budgets={"env": 60, "packed": 100, "profile": 100, "throughput": 120},
    engine_steps=20,
    real_layers=True,
    fit_tiles=(1, 2, 4, 8, 16),
    heldout_tiles=(3, 6, 12),
    fit_llm=tuple((b, s) for b in (1, 2, 4) for s in (256, 512, 1024, 2048, 3072)),
    heldout_llm=((1, 768), (1, 1536), (2, 640), (2, 2560), (3, 1024), (4, 1280)),
    profile_repeats=5,
    records=96,
    microbatches=24,
    max_microbatch=4,
    timing_repeats=5,
    rounds=10,
    # on an H100 (26 Nov) the first 6 rounds of every method ran 2.2-3.0 s a step, the later ones
    # 0.21-0.36 s: new microbatch shapes still pick kernels; 6 untimed rounds keep them out
    warmup=6,
    global_batch=16,
    gas=4,
)
CPU_SIZES = Sizes(
    budgets={"env": 240, "packed": 420, "profile": 420, "throughput": 480},
    engine_steps=10,
    real_layers=False,
    fit_tiles=(1, 2, 4),
    heldout_tiles=(3,),
    fit_llm=tuple((b, s) for b in (1, 2) for s in (32, 64, 128, 256)),
    heldout_llm=((1, 96), (2, 200), (3, 64)),
    profile_repeats=2,
    records=24,
    microbatches=6,
    max_microbatch=3,
    timing_repeats=2,
    rounds=2,
    warmup=1,
    global_batch=8,
    gas=2,
)

STARTED = time.perf_counter()


def shown_path(path: Path) -> str:
    """``path`` as a report shows it: relative to the working directory (the checkout) when inside
    it, else its file name alone (a machine's own folders mean nothing in a stored report)."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return (
            f"$OUT/{resolved.name}"
            if os.environ.get("OUT") and resolved.parent == Path(os.environ["OUT"]).resolve()
            else resolved.name
        )


def repository_relative(text: str, work: Path) -> str:
    """``text`` with the checkout's folder dropped (paths relative to the repository), the check's
    temporary folder written ``$WORK`` and the interpreter by its name, as a stored report keeps them."""
    text = text.replace(f"{ROOT}{os.sep}", "").replace(str(work), "$WORK")
    return text.replace(sys.executable, Path(sys.executable).name)


def log(message: str) -> None:
    """Print ``message`` with the UTC time and the seconds since the start."""
    print(f"[gpu-check {time.strftime('%H:%M:%S', time.gmtime())} +{time.perf_counter() - STARTED:6.1f}s] {message}")


# ---------------------------------------------------------------------------------------------
# wheels


def install_wheels(wheels: Path, site: Path) -> str:
    """Make DeepSpeed importable: nothing to do when it is; else install every wheel of ``wheels``
    into ``site`` offline (pip ``--target``; unzipped where pip fails) and put ``site`` on
    ``sys.path`` and ``PYTHONPATH`` (after the repository, whose ``dflop_ds`` wins over the
    wheel's). Returns what it did."""
    if importlib.util.find_spec("deepspeed") is not None:
        return "deepspeed importable: no wheels installed"
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"deepspeed is not importable and {wheels} holds no wheels: run `make gpu-wheels` first")
    marker = site / ".gpu-wheels-installed"
    names = "\n".join(path.name for path in found)
    if not marker.is_file() or marker.read_text() != names:
        started = time.perf_counter()
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        result = subprocess.run([*command, "--target", str(site), *map(str, found)], capture_output=True, text=True)
        how = "pip --target"
        if result.returncode != 0:  # no pip in this interpreter: a wheel is a zip of what is installed
            log(f"pip install failed ({result.stderr.strip()[-300:]}); unzipping the wheels instead")
            for path in found:
                with zipfile.ZipFile(path) as wheel:
                    wheel.extractall(site)
                    for member in wheel.infolist():  # extractall drops the executable bits (PuLP's CBC)
                        mode = member.external_attr >> 16
                        if mode & 0o111:
                            os.chmod(site / member.filename, mode & 0o777)
            how = "unzipped"
        marker.write_text(names)
        log(f"installed {len(found)} wheels into {site} ({how}) in {time.perf_counter() - started:.1f} s")
    sys.path.insert(1, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(ROOT), str(site), os.environ.get("PYTHONPATH", "")) if part
    )
    os.environ["PATH"] = f"{site / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    importlib.invalidate_caches()
    return f"{len(found)} wheels from {shown_path(wheels)} on sys.path at {site}"


# ---------------------------------------------------------------------------------------------
# report and parts


class PartTimeout(Exception):
    """A part ran past its time budget."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`PartTimeout` in the block after ``seconds`` (SIGALRM; nests: an enclosing
    limit that ends sooner still applies, and is restored on exit)."""
    previous_handler = signal.getsignal(signal.SIGALRM)
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    entered = time.monotonic()
    limit = min(seconds, outer_left) if outer_left > 0 else seconds

    def expire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"over its budget of {seconds:.0f} s")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(limit, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if outer_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - entered), 0.01))


@dataclass
class Report:
    """The JSON report, rewritten to every path after every part."""

    paths: list[Path]
    data: dict[str, Any] = field(default_factory=lambda: {"parts": {}, "skipped": {}})

    def write(self) -> None:
        text = json.dumps(self.data, indent=1, default=str)
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(text)
            partial.replace(path)

    def skip(self, what: str, why: str) -> None:
        """Name something the run skipped, and why."""
        self.data["skipped"][what] = why
        log(f"skipped {what}: {why}")


@dataclass
class Context:
    """What the parts share: device, sizes, work folder, report, and what one part leaves the next."""

    device: Any
    on_gpu: bool
    bf16: bool
    sizes: Sizes
    work: Path
    report: Report
    shared: dict[str, Any] = field(default_factory=dict)


def run_part(ctx: Context, name: str, part: Callable[[Context, dict], bool]) -> None:
    """Run ``part(ctx, entry)`` within its budget; ``entry`` (filled as the part goes, so a timeout
    keeps what it measured) gets ``ok``, ``seconds`` and any error, and the report is written."""
    budget = ctx.sizes.budgets[name]
    entry: dict[str, Any] = {}
    ctx.report.data["parts"][name] = entry
    log(f"part {name}: start (budget {budget:.0f} s)")
    started = time.perf_counter()
    try:
        with time_limit(budget):
            entry["ok"] = bool(part(ctx, entry))
    except (Exception, PartTimeout) as exc:  # one part's failure must not stop the others
        entry["ok"] = False
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc()[-4000:]
    entry["seconds"] = round(time.perf_counter() - started, 2)
    log(f"part {name}: {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']} s" + _error_tail(entry))
    ctx.report.write()


def _error_tail(entry: dict) -> str:
    return f" ({entry['error']})" if "error" in entry else ""


def synchronize() -> None:
    """Wait for the accelerator's queued work (nothing on a CPU)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def relative_error(a: Any, b: Any) -> float:
    """``max |a - b| / max |b|`` in float64 (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# a. environment, matmul, single-rank DeepSpeed engine


def part_env(ctx: Context, entry: dict) -> bool:
    import deepspeed
    import torch
    import transformers
    from deepspeed.accelerator import get_accelerator

    from dflop_ds.launch import free_port

    accelerator = get_accelerator()
    entry.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        deepspeed=deepspeed.__version__,
        transformers=transformers.__version__,
        python=sys.version.split()[0],
        accelerator=accelerator.device_name(),
        device_name=ctx.report.data["device"],
        bf16=ctx.bf16,
    )
    if ctx.on_gpu:
        entry["nccl"] = str(torch.cuda.nccl.version()) if accelerator.communication_backend_name() == "nccl" else None
        entry["memory_gib"] = round(accelerator.total_memory(0) / 2**30, 1)
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1024, 1024, dtype=torch.float64, generator=generator) for _ in range(2))
    reference = a @ b
    dtypes = [torch.float32] + ([torch.bfloat16] if ctx.bf16 else [])
    matmul = {}
    for dtype in dtypes:
        product = a.to(ctx.device, dtype) @ b.to(ctx.device, dtype)
        matmul[str(dtype).removeprefix("torch.")] = relative_error(product, reference)
    entry["matmul_rel_err"] = matmul
    matmul_ok = matmul["float32"] < 1e-3 and matmul.get("bfloat16", 0.0) < 5e-2

    port = str(free_port())
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    backend = accelerator.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)
    entry["backend"] = torch.distributed.get_backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": ctx.bf16},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # a torch optimizer: no FusedAdam JIT build
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = next(engine.module.parameters()).dtype
    inputs = torch.randn(16, 64, generator=generator).to(engine.device)
    targets = inputs[:, :1] * 2 - inputs[:, 1:2]
    losses = []
    for _ in range(ctx.sizes.engine_steps):
        loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    entry["engine"] = {"dtype": str(dtype), "zero_stage": 1, "losses": [round(x, 5) for x in losses]}
    engine_ok = losses[-1] < 0.5 * losses[0]
    log(
        f"env: {entry['device_name']} torch {torch.__version__} backend {entry['backend']} "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    return matmul_ok and engine_ok


# ---------------------------------------------------------------------------------------------
# b. packed vs padded HF microbatches, per attention implementation


def parameter_grads(model: Any) -> dict[str, Any]:
    """Copies of the model's gradients by parameter name."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_error(grads: dict[str, Any], reference: dict[str, Any]) -> float:
    """Largest relative gradient error over parameters: ``max |g - ref|`` over ``max |ref|``, the
    denominator floored at 1e-3 of the largest reference gradient (a gradient that is zero in exact
    arithmetic, such as a key projection's bias, is rounding noise relative to itself)."""
    if set(grads) != set(reference):
        raise AssertionError(f"gradients of different parameters: {sorted(set(grads) ^ set(reference))[:5]}")
    floor = 1e-3 * max(float(g.abs().max()) for g in reference.values())
    return max(
        float((grads[n].double() - ref.double()).abs().max()) / max(float(ref.abs().max()), floor)
        for n, ref in reference.items()
    )


def microbatch_loss(layers: list, inputs: tuple, labels: tuple) -> tuple[Any, Any]:
    """``(logits, loss)`` of one microbatch through the flat layer list, as one pipeline stage."""
    from dflop_ds.models.hf.check import run_stages
    from dflop_ds.pipe.loss import token_normalized_loss

    logits, _ = run_stages(layers, [0, len(layers)], inputs)
    return logits, token_normalized_loss(logits, labels)


def packed_vs_padded(model: Any, family: Any, path: Path, device: Any, seed: int) -> dict[str, float]:
    """Largest relative errors of packed against padded microbatches: loss, logits (real tokens)
    and gradients (:func:`gradient_error`), over check-model's synthetic microbatches."""
    import torch

    from dflop_ds.models.hf.check import packed_errors, synthetic_batches
    from dflop_ds.train.device import move_to

    build = family.microbatches(path, model.config)
    encoder, projector, llm = family.layers(model)
    layers = [*encoder, projector, *llm]
    worst = {"loss": 0.0, "logits": 0.0, "grads": 0.0}
    for _, samples in synthetic_batches(seed, family.image_mark) + family.extra_batches(seed, model.config):
        grads = []
        for packed in (False, True):
            model.zero_grad(set_to_none=True)
            logits, loss = microbatch_loss(layers, *move_to(build(samples, packed=packed), device))
            loss.backward()
            grads.append(parameter_grads(model))
            if not packed:
                padded_logits, padded_loss = logits.detach(), loss.detach()
        with torch.no_grad():
            packed_mb = move_to(build(samples, packed=True), device)
            errors = packed_errors(layers, [0, len(layers)], packed_mb, padded_logits, padded_loss)
        worst["loss"] = max(worst["loss"], errors["loss"])
        worst["logits"] = max(worst["logits"], errors["logits"])
        worst["grads"] = max(worst["grads"], gradient_error(grads[1], grads[0]))
    model.zero_grad(set_to_none=True)
    return worst


def padded_path_fails(model: Any, family: Any, path: Path, device: Any) -> str | None:
    """Why the HF model's own forward+backward (padded, one microbatch) fails with its attention
    implementation here, or None when it trains: an implementation HF cannot train with here is
    skipped; one that HF trains with and the layer lists do not is a failure."""
    from dflop_ds.models.hf.base.synthetic import hf_labels
    from dflop_ds.models.hf.check import synthetic_batches
    from dflop_ds.train.device import move_to

    samples = synthetic_batches(0, family.image_mark)[0][1]
    try:
        inputs, labels = move_to(family.microbatches(path, model.config)(samples), device)
        model(**family.hf_kwargs(model, inputs), labels=hf_labels(labels[0])).loss.backward()
    except Exception as exc:  # any failure of HF's own path makes the implementation unusable here
        return f"{type(exc).__name__}: {exc}"[:300]
    finally:
        model.zero_grad(set_to_none=True)
    return None


def part_packed(ctx: Context, entry: dict) -> bool:
    """Packed vs padded HF microbatches in float32 (TF32 off for the part)."""
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 comparisons
    try:
        return compare_attention_paths(ctx, entry)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def compare_attention_paths(ctx: Context, entry: dict) -> bool:
    """Part b's body: every family, every attention implementation (see :func:`part_packed`)."""
    import torch

    from dflop_ds.models.hf.registry import family_of
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl

    builders = {"llava": lambda d: build_tiny_llava(d, vision="clip", text="llama"), "qwen2_vl": build_tiny_qwen2_vl}
    budget = ctx.sizes.budgets["packed"]
    started = time.perf_counter()
    ok = True
    worst = 0.0
    for name, build in builders.items():
        path = build(ctx.work / f"tiny_{name}")
        family = family_of(path).check_parts()
        results: dict[str, Any] = {}
        entry[name] = results
        for impl in ATTENTION:
            if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
                ctx.report.skip(f"packed/{name}/{impl}", "flash-attn is not installed")
                continue
            left = budget - (time.perf_counter() - started)
            if left < 15:
                ctx.report.skip(f"packed/{name}/{impl}", "no time left in the part's budget")
                continue
            torch.manual_seed(0)
            model = family.load(path).to(ctx.device).eval()  # eval: no dropout, both paths deterministic
            try:
                model.set_attn_implementation(impl)
            except (ValueError, ImportError, RuntimeError) as exc:
                ctx.report.skip(f"packed/{name}/{impl}", f"transformers refuses it here: {exc}"[:300])
                continue
            impl_started = time.perf_counter()
            try:
                # what is left of the part's budget, ending before it: flex_attention compiles every new shape
                with time_limit(left - 5):
                    unusable = padded_path_fails(model, family, path, ctx.device)
                    if unusable is not None:
                        ctx.report.skip(f"packed/{name}/{impl}", f"the HF model cannot train with it here: {unusable}")
                        continue
                    errors = packed_vs_padded(model, family, path, ctx.device, seed=0)
            except PartTimeout:  # no verdict either way (flex_attention compiles every new shape)
                ctx.report.skip(f"packed/{name}/{impl}", "did not finish within the part's budget")
                continue
            except Exception as exc:
                results[impl] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                ok = False
                log(f"packed {name} {impl}: FAILED {results[impl]['error'][:300]}")
                continue
            passed = errors["loss"] <= LOSS_TOLERANCE and errors["logits"] <= LOSS_TOLERANCE
            passed = passed and errors["grads"] <= GRAD_TOLERANCE
            results[impl] = {"ok": passed, **errors, "seconds": round(time.perf_counter() - impl_started, 2)}
            ok = ok and passed
            worst = max(worst, *errors.values())
            entry["packed_rel_err"] = ctx.shared["packed_rel_err"] = worst
            log(
                f"packed {name} {impl}: loss {errors['loss']:.2e} logits {errors['logits']:.2e} "
                f"grads {errors['grads']:.2e}"
            )
            del model
    entry["tolerance"] = {"loss_logits": LOSS_TOLERANCE, "grads": GRAD_TOLERANCE}
    entry["packed_path"] = (
        "padded microbatches use the named implementation; packed ones transformers' varlen path under "
        "flash_attention_2, else dflop_segments (one causal SDPA per sample, dflop_ds.models.hf.base.packed)"
    )
    tried = [impl for family in ("llava", "qwen2_vl") for impl in entry.get(family, {})]
    return ok and bool(tried)


# ---------------------------------------------------------------------------------------------
# c. profile a model with real layer sizes; held-out and real-microbatch error


def build_profiled_llava(ctx: Context) -> Path:
    """The LLaVA of parts c and d: real layer sizes in bf16 on a GPU, tiny ones on a CPU."""
    from dflop_ds.testing.hf_tiny import build_tiny_llava

    if ctx.sizes.real_layers:
        return build_tiny_llava(
            ctx.work / "llava_real",
            vision="siglip",
            text="qwen2",
            vision_feature_layer=-1,
            vision_sizes=REAL_VISION,
            text_sizes=REAL_TEXT,
            dtype="bfloat16" if ctx.bf16 else None,
        )
    return build_tiny_llava(
        ctx.work / "llava_small",
        vision="siglip",
        text="qwen2",
        vision_feature_layer=-1,
        dtype="bfloat16" if ctx.bf16 else None,
    )


def part_profile(ctx: Context, entry: dict) -> bool:
    import numpy as np
    import torch

    from benchmarks.bench_costmodel import (
        RealMicrobatch,
        draw_microbatches,
        mape,
        scale_free_mape,
        split_profile,
        time_real,
    )
    from dflop_ds.cost import FittedCostModel, PackedCost, save_cost_model
    from dflop_ds.models.hf.profile import hf_target
    from dflop_ds.models.hf.source import hf_source
    from dflop_ds.profile import profile_model
    from dflop_ds.profile.model import torch_threads
    from dflop_ds.testing.llava_data import write_llava_dataset
    from dflop_ds.train.device import move_to

    sizes = ctx.sizes
    model_dir = build_profiled_llava(ctx)
    data, images = write_llava_dataset(ctx.work / "llava_data", sizes.records, seed=1, answer_words=(2, 45))
    ctx.shared.update(model=model_dir, data=data, images=images)
    target = hf_target(str(model_dir))
    layers = [*target.encoder_layers, target.projector, *target.llm_layers]
    entry["model"] = {
        "dir": str(model_dir.relative_to(ctx.work)),  # inside the check's temporary folder, gone after it
        "dtype": str(next(target.llm_layers[0].parameters()).dtype),
        "vision": REAL_VISION if sizes.real_layers else "tiny",
        "text": REAL_TEXT if sizes.real_layers else "tiny",
        "parameters": sum(p.numel() for layer in layers for p in layer.parameters()),
    }
    log(f"profile: {entry['model']['parameters'] / 1e6:.1f} M parameters ({entry['model']['dtype']}), profiling ...")
    session = profile_model(
        **target.profile_kwargs(),
        tiles=sizes.fit_tiles + sizes.heldout_tiles,
        llm_shapes=list(sizes.fit_llm + sizes.heldout_llm),
        repeats=sizes.profile_repeats,
        progress=False,
    )
    fit_profile, held = split_profile(session, sizes.fit_tiles, sizes.fit_llm)
    cost_model = FittedCostModel().fit(fit_profile, target.policy)
    cost_path = ctx.work / "costmodel.json"
    save_cost_model(cost_model, cost_path)
    ctx.shared["cost_model"] = cost_path
    enc_pred = cost_model.encoder_time([m.tiles for m in held.encoder])
    llm_pred = cost_model.llm_time([m.batch for m in held.llm], [m.seq_len for m in held.llm])
    entry["profile_seconds"] = session.meta["seconds"]
    entry["heldout_mape"] = {
        "encoder": mape(enc_pred, [m.time_s for m in held.encoder]),
        "llm": mape(llm_pred, [m.time_s for m in held.llm]),
    }
    entry["scaling"] = session.meta["scaling"]
    log(f"profile: held-out mape {entry['heldout_mape']} ({session.meta['seconds']:.1f} s profiling)")
    ctx.report.write()
    del target, layers
    source = hf_source(str(model_dir), image_folder=str(images))
    shapes = source.read_shapes(str(data), "error")
    dataset = source.make_dataset(shapes, str(data))
    encoder, projector, llm = source.layers()
    model = torch.nn.Sequential(*encoder, projector, *llm).to(ctx.device).train()
    assert source.packed_collate is not None
    groups = draw_microbatches(shapes, sizes.microbatches, 0, sizes.max_microbatch)

    batches = [
        RealMicrobatch(
            model,
            len(encoder) + 1,
            move_to(collate([dataset[i] for i in group]), ctx.device),
            synchronize=synchronize,
        )
        for collate in (source.collate, source.packed_collate)
        for group in groups
    ]
    # the profile's clock and threads: process CPU time of one thread on a CPU, wall time on a GPU
    with torch_threads(session.meta["threads"]):
        timed = time_real(batches, sizes.timing_repeats, "median", session.meta["clock"])
    real, real_packed = np.split(timed, 2)
    model.zero_grad(set_to_none=True)
    predicted = np.array([cost_model.predict_microbatch([shapes[i] for i in g]) for g in groups]).sum(axis=1)
    packed_cost = PackedCost(cost_model)
    predicted_packed = np.array([packed_cost.predict_microbatch([shapes[i] for i in g]) for g in groups]).sum(axis=1)
    entry["microbatches"] = [
        {
            "samples": len(g),
            "tokens": int(sum(shapes[i].llm_tokens for i in g)),
            "tiles": int(sum(shapes[i].encoder_tiles for i in g)),
            "padded_ms": round(float(real[k, 0]) * 1e3, 3),
            "predicted_ms": round(float(predicted[k]) * 1e3, 3),
            "packed_ms": round(float(real_packed[k, 0]) * 1e3, 3),
            "predicted_packed_ms": round(float(predicted_packed[k]) * 1e3, 3),
        }
        for k, g in enumerate(groups)
    ]
    entry["microbatch_mape"] = mape(predicted, real[:, 0])
    entry["packed_microbatch_mape"] = mape(predicted_packed, real_packed[:, 0])
    entry["scale_free_microbatch_mape"] = scale_free_mape(predicted, real[:, 0])
    entry["scale_free_packed_microbatch_mape"] = scale_free_mape(predicted_packed, real_packed[:, 0])
    ctx.shared["microbatch_mape"] = entry["microbatch_mape"]
    log(
        f"profile: microbatch mape padded {entry['microbatch_mape']:.3f} packed {entry['packed_microbatch_mape']:.3f} "
        f"(scale-free {entry['scale_free_microbatch_mape']:.3f} / {entry['scale_free_packed_microbatch_mape']:.3f})"
    )
    del batches, model, encoder, projector, llm, source
    if ctx.on_gpu:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().empty_cache()
    return True


# ---------------------------------------------------------------------------------------------
# d. training throughput on one device: stock vs stock_packed vs dflop, interleaved


def part_throughput(ctx: Context, entry: dict) -> bool:
    from benchmarks.bench_hf import per_method
    from dflop_ds.launch import free_port, launch_env

    if "cost_model" not in ctx.shared:
        raise RuntimeError("needs the model, data and cost model of part profile, which did not get that far")
    sizes = ctx.sizes
    out = ctx.work / "throughput.json"
    methods = ("stock", "stock_packed", "dflop")
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "hf_worker.py"),
        "--engine",
        "zero2",
        "--model",
        str(ctx.shared["model"]),
        "--data",
        str(ctx.shared["data"]),
        "--images",
        str(ctx.shared["images"]),
        "--cost-model",
        str(ctx.shared["cost_model"]),
        "--methods",
        ",".join(methods),
        "--rounds",
        str(sizes.rounds),
        "--warmup",
        str(sizes.warmup),
        "--global-batch",
        str(sizes.global_batch),
        "--gas",
        str(sizes.gas),
        "--out",
        str(out),
        *(["--bf16"] if ctx.bf16 else []),
    ]
    rank_env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env = launch_env(**rank_env, MASTER_PORT=str(free_port()))
    entry["command"] = repository_relative(" ".join(command), ctx.work)
    timeout = ctx.sizes.budgets["throughput"] - 5
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    steps = [line for line in result.stdout.splitlines() if line.startswith("[hf]")]
    entry["steps"] = steps
    if result.returncode != 0:
        entry["output_tail"] = (result.stdout[-2000:] + result.stderr[-4000:]).strip()
        raise RuntimeError(f"hf_worker.py exited {result.returncode}")
    table = per_method(json.loads(out.read_text())["rows"])
    entry["samples_per_s"] = table
    entry["global_batch"], entry["gas"], entry["bf16"] = sizes.global_batch, sizes.gas, ctx.bf16
    stock = table["stock"]["median"]
    entry["speedup_vs_stock"] = {method: table[method]["median"] / stock for method in methods}
    entry["balancing_vs_stock_packed"] = table["dflop"]["median"] / table["stock_packed"]["median"]
    ctx.shared["speedup_vs_stock"] = entry["speedup_vs_stock"]["dflop"]
    log(
        "throughput samples/s: "
        + ", ".join(f"{m} {table[m]['median']:.2f}" for m in methods)
        + f"; dflop over stock x{ctx.shared['speedup_vs_stock']:.3f}"
    )
    return True


PARTS: dict[str, Callable[[Context, dict], bool]] = {
    "env": part_env,
    "packed": part_packed,
    "profile": part_profile,
    "throughput": part_throughput,
}


def device_label(device: Any) -> str:
    """The report's device name: the card's name from torch's module for the accelerator's device
    type (spaces as ``_``), or the device type where that module names no card (``torch.cpu``)."""
    import torch

    module = torch.get_device_module(device)
    get_name = getattr(module, "get_device_name", None)
    if get_name is None:
        return device.type
    return str(get_name(device)).replace(" ", "_")


def summary_line(device: str, parts: dict[str, dict], shared: dict[str, Any]) -> str:
    """The last line: device, parts passed of parts run, and the three figures (``n/a`` when missing)."""

    def figure(key: str, spec: str) -> str:
        return format(shared[key], spec) if key in shared else "n/a"

    passed = sum(1 for entry in parts.values() if entry.get("ok"))
    return (
        f"gpu-check device={device} parts_ok={passed}/{len(parts)} packed_rel_err={figure('packed_rel_err', '.3e')} "
        f"microbatch_mape={figure('microbatch_mape', '.3f')} speedup_vs_stock={figure('speedup_vs_stock', '.3f')}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=str(ROOT / "out" / "gpu_check.json"))
    parser.add_argument("--wheels", default=str(ROOT / ".gpu-wheels"))
    parser.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "dflop_gpu_site"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    parser.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 weights and DeepSpeed bf16: auto = where the GPU supports it (on: also on a CPU, to test the path)",
    )
    args = parser.parse_args(argv)
    wanted = args.parts.split(",")
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    paths = [Path(args.report)] + ([Path(os.environ["OUT"]) / "gpu_check.json"] if os.environ.get("OUT") else [])
    report = Report(paths)
    log(install_wheels(Path(args.wheels), Path(args.site)))

    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    device = torch.device(accelerator.device_name(0))
    on_gpu = accelerator.device_name() != "cpu"  # DeepSpeed's CPU accelerator is the host itself
    name = device_label(device)
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and on_gpu and accelerator.is_bf16_supported())
    sizes = GPU_SIZES if on_gpu else CPU_SIZES
    report.data.update(
        device=name, started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), sizes=sizes.__dict__
    )
    if not bf16:
        report.skip("bf16", "no GPU with bf16 (or --bf16 off): float32")
    if not on_gpu:
        report.skip("real layer sizes", "no GPU: parts profile and throughput use the tiny LLaVA")
        report.skip("nccl", f"no GPU: the engine uses {accelerator.communication_backend_name()}")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        ctx = Context(device, on_gpu, bf16, sizes, Path(work), report)
        for part in wanted:
            run_part(ctx, part, PARTS[part])
        for part in PARTS:
            if part not in wanted:
                report.skip(part, "not asked for (--parts)")
        line = summary_line(name, report.data["parts"], ctx.shared)
        report.data["line"] = line
        report.data["seconds"] = round(time.perf_counter() - STARTED, 1)
        report.write()
    log(f"report: {', '.join(shown_path(path) for path in paths)}; total {report.data['seconds']} s")
    print(line, flush=True)
    return 0 if all(entry.get("ok") for entry in report.data["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
