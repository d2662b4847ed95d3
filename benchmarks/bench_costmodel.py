"""Cost-model accuracy on the tiny MLLM: fit on one set of shapes, predict held-out ones.

1. Profile the tiny model on the default sweeps plus held-out shapes (other tile counts, and
   ``(batch, seq_len)`` pairs with batch 3 and sequence lengths never fitted), all in one
   session so that a change of machine speed between two runs does not count as model error.
2. Fit a :class:`FittedCostModel` on the default sweeps only; compare its predictions with the
   held-out shapes' measurements.
3. Held-out real microbatches: draw samples from ``examples/data/mixture.jsonl`` under
   ``TINY_POLICY``, group them into microbatches of 1..4 samples as a sampler does, collate
   them with the tiny model's collate and time the real forward+backward of the whole tiny
   model (loss included), and of its encoder part and LLM part, against
   ``predict_microbatch``; the same microbatches packed (one row, attention per sample) against
   :class:`~dflop_ds.cost.PackedCost`'s ``predict_microbatch``, timed in the same rounds.

Prints the mean absolute percentage error (MAPE) per module and, for real microbatches, the
MAPE after one fitted scale factor (``scale_free``: balancing needs the cost ratios right, and the
adaptive correction absorbs a common scale); the last line reads
``costmodel heldout mape encoder=<x> llm=<y> microbatch=<z> packed_microbatch=<w>
scale_free_microbatch=<u> scale_free_packed_microbatch=<v>`` (fractions), with the load average.
``--protocol layer`` profiles each layer on its own instead of inside one connected pass of the
profiled layers (the default, ``chain``), and ``--no-calibrate`` skips the profiler's full-depth
calibration, for an A/B of the profiler's timing conditions.

Run: ``.venv/bin/python benchmarks/bench_costmodel.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import FittedCostModel, PackedCost  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.models import TinyMLLMConfig, TinyMLLMDataset, build_reference, collate_microbatch  # noqa: E402
from dflop_ds.models.tiny_profile import tiny_target  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.profile import ModelProfile, profile_model  # noqa: E402
from dflop_ds.profile.model import (  # noqa: E402
    DEFAULT_BATCH_SIZES,
    DEFAULT_SEQ_LENS,
    DEFAULT_TILES,
    PROTOCOLS,
    torch_threads,
)
from dflop_ds.profile.timing import clock_function, resolve_clock, robust_statistic  # noqa: E402
from dflop_ds.shapes import TINY_POLICY, SampleShape  # noqa: E402

HELDOUT_TILES = (3, 6, 12, 24, 40, 56, 80)
HELDOUT_LLM = (
    (1, 100),
    (1, 200),
    (1, 320),
    (1, 600),
    (2, 96),
    (2, 300),
    (2, 480),
    (3, 64),
    (3, 200),
    (3, 420),
    (4, 150),
    (4, 350),
    (4, 700),
)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, as a fraction."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(np.mean(np.abs(p - m) / m))


def scale_free_mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """:func:`mape` after scaling the predictions by the one factor that minimizes the squared
    relative errors: what balancing sees, since only ratios matter to it."""
    ratio = np.asarray(predicted, dtype=float) / np.asarray(measured, dtype=float)
    return mape(np.asarray(predicted, dtype=float) * ratio.sum() / (ratio**2).sum(), measured)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``), or ``n/a`` where there is none."""
    try:
        return "/".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def split_profile(
    profile: ModelProfile, tiles: Sequence[int], llm_shapes: Sequence[tuple[int, int]]
) -> tuple[ModelProfile, ModelProfile]:
    """``(selected, rest)``: the measurements at ``tiles`` / ``llm_shapes``, and the others."""

    def pick(keep: bool) -> ModelProfile:
        return ModelProfile(
            encoder=[m for m in profile.encoder if (m.tiles in tiles) == keep],
            llm=[m for m in profile.llm if ((m.batch, m.seq_len) in llm_shapes) == keep],
            encoder_layers=profile.encoder_layers,
            llm_layers=profile.llm_layers,
            param_bytes=profile.param_bytes,
            hidden_bytes_per_token=profile.hidden_bytes_per_token,
            meta=profile.meta,
        )

    return pick(True), pick(False)


def draw_microbatches(shapes: Sequence[SampleShape], count: int, seed: int, max_size: int) -> list[list[int]]:
    """``count`` microbatches of 1..``max_size`` distinct sample indices (seeded)."""
    rng = random.Random(seed)
    return [rng.sample(range(len(shapes)), rng.randint(1, max_size)) for _ in range(count)]


class RealMicrobatch:
    """A collated microbatch and closures running the whole model, or its two parts, fwd+bwd.

    ``microbatch`` is ``(inputs, labels)`` as a collate returns it, or the tiny model's samples
    (collated here, padded or ``packed``); ``synchronize`` runs after every pass (an
    accelerator's, so that a wall clock around a pass times its kernels)."""

    def __init__(
        self,
        model: torch.nn.Sequential,
        n_encoder: int,
        microbatch: list | tuple,
        packed: bool = False,
        synchronize: Callable[[], None] = lambda: None,
    ) -> None:
        self.inputs, self.labels = (
            microbatch if isinstance(microbatch, tuple) else collate_microbatch(microbatch, packed=packed)
        )
        self.model = model
        self.encoder = model[:n_encoder]
        self.llm = model[n_encoder:]
        self.synchronize = synchronize
        with torch.no_grad():
            self.hidden = tuple(t.detach() for t in self.encoder(self.inputs))
        self.hidden[0].requires_grad_(True)

    def whole(self) -> None:
        token_normalized_loss(self.model(self.inputs), self.labels).backward()
        self.synchronize()

    def encoder_part(self) -> None:
        out = self.encoder(self.inputs)[0]
        out.backward(torch.ones_like(out))
        self.synchronize()

    def llm_part(self) -> None:
        token_normalized_loss(self.llm(self.hidden), self.labels).backward()
        self.synchronize()


def time_real(batches: Sequence[RealMicrobatch], repeats: int, statistic: str, clock: str) -> np.ndarray:
    """``(n, 3)`` robust seconds ``[whole, encoder part, llm part]``, timed in interleaved rounds
    (round 0 untimed): each pass follows another one, as a microbatch follows another in training."""
    now = clock_function(clock)
    samples: list[list[list[float]]] = [[[], [], []] for _ in batches]
    for round_index in range(repeats + 1):
        for b, batch in enumerate(batches):
            for slot, run in enumerate((batch.whole, batch.encoder_part, batch.llm_part)):
                start = now()
                run()
                if round_index > 0:
                    samples[b][slot].append(now() - start)
    return np.array([[robust_statistic(s, statistic) for s in row] for row in samples])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--statistic", default="min", choices=("min", "median", "trimmed_mean"))
    parser.add_argument("--clock", default="auto", choices=("auto", "wall", "cpu"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--max-microbatch", type=int, default=4)
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "mixture.jsonl"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--protocol", default="chain", choices=PROTOCOLS, help="how the profiler times layers")
    parser.add_argument("--no-calibrate", action="store_true", help="skip the profiler's full-depth calibration")
    args = parser.parse_args(argv)
    clock = resolve_clock(args.clock)
    timing = dict(
        repeats=args.repeats,
        statistic=args.statistic,
        clock=clock,
        threads=args.threads,
        progress=False,
        protocol=args.protocol,
        calibrate=not args.no_calibrate,
    )
    load_before = load_average()

    started = time.perf_counter()
    fit_llm = [(b, s) for b in DEFAULT_BATCH_SIZES for s in DEFAULT_SEQ_LENS]
    session = profile_model(
        **tiny_target(seed=args.seed).profile_kwargs(),
        tiles=DEFAULT_TILES + HELDOUT_TILES,
        llm_shapes=fit_llm + list(HELDOUT_LLM),
        **timing,
    )
    fit_profile, held = split_profile(session, DEFAULT_TILES, fit_llm)
    model = FittedCostModel().fit(fit_profile)
    print(
        f"profiled {len(session.encoder)} encoder + {len(session.llm)} LLM shapes in "
        f"{time.perf_counter() - started:.1f} s wall ({clock} clock, {args.statistic} of {args.repeats}); "
        f"fitted on {len(fit_profile.encoder)} + {len(fit_profile.llm)}, held out {len(held.encoder)} + {len(held.llm)}"
    )
    for note in session.meta["scaling"]:
        print(f"  {note}")
    enc_pred = model.encoder_time([m.tiles for m in held.encoder])
    enc_meas = [m.time_s for m in held.encoder]
    llm_pred = model.llm_time([m.batch for m in held.llm], [m.seq_len for m in held.llm])
    llm_meas = [m.time_s for m in held.llm]
    print("\nheld-out encoder shapes (ms)        tiles  measured  predicted  error")
    for m, p in zip(held.encoder, enc_pred):
        print(f"  {'':30s}{m.tiles:7d} {m.time_s * 1e3:9.2f} {p * 1e3:10.2f} {p / m.time_s - 1:+6.1%}")
    print("held-out LLM shapes (ms)        batch x seq  measured  predicted  error")
    for m, p in zip(held.llm, llm_pred):
        print(f"  {'':28s}{m.batch:3d} x {m.seq_len:5d} {m.time_s * 1e3:9.2f} {p * 1e3:10.2f} {p / m.time_s - 1:+6.1%}")

    shapes = read_dataset(args.data, TINY_POLICY)
    groups = draw_microbatches(shapes, args.microbatches, args.seed, args.max_microbatch)
    config = TinyMLLMConfig()
    dataset = TinyMLLMDataset(shapes, config, seed=args.seed)
    reference = build_reference(config, seed=args.seed).train()
    n_encoder = 1 + config.vision_layers + 1  # patch embedding, vision blocks, projector
    with torch_threads(args.threads):
        batches = [
            RealMicrobatch(reference, n_encoder, [dataset[i] for i in group], packed)
            for packed in (False, True)
            for group in groups
        ]
        real, real_packed = np.split(time_real(batches, args.repeats, args.statistic, clock), 2)
    predicted = np.array([model.predict_microbatch([shapes[i] for i in group]) for group in groups])
    packed_model = PackedCost(model)
    predicted_packed = np.array([packed_model.predict_microbatch([shapes[i] for i in group]) for group in groups])
    print("\nreal microbatches (ms)   B  tiles  longest   whole  predicted  error | encoder  pred | llm    pred")
    for group, row, pred in zip(groups, real, predicted):
        mb = [shapes[i] for i in group]
        longest = max(s.llm_tokens for s in mb)
        tiles = sum(s.encoder_tiles for s in mb)
        print(
            f"  {'':21s}{len(mb):3d} {tiles:6d} {longest:8d} {row[0] * 1e3:7.2f} {pred.sum() * 1e3:10.2f} "
            f"{pred.sum() / row[0] - 1:+6.1%} | {row[1] * 1e3:7.2f} {pred[0] * 1e3:5.2f} | "
            f"{row[2] * 1e3:6.2f} {pred[1] * 1e3:6.2f}"
        )
    print("\npacked microbatches (ms) B  tiles   tokens   whole  predicted  error | speed-up over padded")
    for group, row, pred, padded in zip(groups, real_packed, predicted_packed, real):
        mb = [shapes[i] for i in group]
        print(
            f"  {'':21s}{len(mb):3d} {sum(s.encoder_tiles for s in mb):6d} {sum(s.llm_tokens for s in mb):8d} "
            f"{row[0] * 1e3:7.2f} {pred.sum() * 1e3:10.2f} {pred.sum() / row[0] - 1:+6.1%} | x{padded[0] / row[0]:.2f}"
        )
    enc_real = [(p, m) for p, m in zip(predicted[:, 0], real[:, 1]) if m > 0]
    print(
        f"\nreal microbatch parts: encoder mape={mape(*zip(*enc_real)):.3f} "
        f"llm mape={mape(predicted[:, 1], real[:, 2]):.3f}"
    )
    padded_whole, packed_whole = predicted.sum(axis=1), predicted_packed.sum(axis=1)
    print(
        f"real / predicted, median: microbatch x{np.median(real[:, 0] / padded_whole):.3f} "
        f"packed x{np.median(real_packed[:, 0] / packed_whole):.3f}"
    )
    print(
        f"total benchmark wall time {time.perf_counter() - started:.1f} s; load average {load_before} before, "
        f"{load_average()} after; profiler protocol {args.protocol}, "
        f"{'not ' if args.no_calibrate else ''}calibrated at full depth"
    )
    print(
        f"costmodel heldout mape encoder={mape(enc_pred, enc_meas):.3f} llm={mape(llm_pred, llm_meas):.3f} "
        f"microbatch={mape(padded_whole, real[:, 0]):.3f} "
        f"packed_microbatch={mape(packed_whole, real_packed[:, 0]):.3f} "
        f"scale_free_microbatch={scale_free_mape(padded_whole, real[:, 0]):.3f} "
        f"scale_free_packed_microbatch={scale_free_mape(packed_whole, real_packed[:, 0]):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
