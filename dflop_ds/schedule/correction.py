"""Adaptive correction: learn per-shape-bucket penalties from observed times, feed the scheduler.

The cost model predicts each sample's ``[encoder, llm]`` cost. Training observes, per pipeline
stage, the compute time of every microbatch. This module fits, per stage ``s``,

    t[s, m] ~= sum_{c, b} pooled[s, c] * penalty[s, c, b] * P[m, c, b]

where ``P[m, c, b]`` is the predicted column-``c`` cost of the samples of shape bucket ``b`` in
microbatch ``m`` and ``pooled[s, c]`` the bucket-free seconds per predicted unit. The fit is
non-negative least squares on exponentially decayed normal equations (old steps fade), shrunk
towards the pooled fit so that a bucket seen rarely or never keeps penalty 1; penalties are
clipped.

What the scheduler gets: while the correction applies, each sample's cost becomes its
predicted seconds *per pipeline stage*, ``sum_c pooled[s, c] * penalty[s, c, b] * cost[c]``
(one column per stage). Balancing the largest column of a microbatch then balances the
slowest stage, the pipeline's pace, whatever the stage split and the cost model's units.

A cost-benefit gate compares the expected gain (how much the raw cost columns misjudge the
step's microbatches against the corrected model, seconds per step) with the measured overhead
of tracking; it switches tracking off when the gain does not pay for it and probes again every
``probe_every`` steps.

Determinism: :meth:`CostCorrection.update` is a pure function of the state and the observation,
so ranks that feed it the same (all-gathered) observation hold the same state. Every state is
published under a version (steps completed); the sampler's background thread only reads
published versions through :meth:`CostCorrection.adjust`.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflop_ds.shapes import SampleShape
from dflop_ds.typecheck import check_setting

MODALITIES = ("text", "image", "video")


@dataclass(frozen=True)
class BucketScheme:
    """Shape buckets: modality x encoder-tile range x LLM-token range.

    ``tile_edges``/``token_edges`` are the lower edges of the ranges after the first, e.g.
    ``tile_edges=(4, 8)`` gives tiles ``[0, 4)``, ``[4, 8)``, ``[8, inf)``. Text-only samples
    have no tile ranges.
    """

    tile_edges: tuple[int, ...] = (4, 7, 12)
    token_edges: tuple[int, ...] = (160, 320)

    def __post_init__(self) -> None:
        for name in ("tile_edges", "token_edges"):
            edges = tuple(int(e) for e in getattr(self, name))
            if list(edges) != sorted(set(edges)) or any(e <= 0 for e in edges):
                raise ValueError(f"{name} must be strictly increasing positive integers, got {edges}")
            object.__setattr__(self, name, edges)

    @property
    def n_tile_ranges(self) -> int:
        """Tile ranges per visual modality."""
        return len(self.tile_edges) + 1

    @property
    def n_token_ranges(self) -> int:
        """Token ranges per modality/tile range."""
        return len(self.token_edges) + 1

    @property
    def n_buckets(self) -> int:
        """Number of buckets: text x tokens, then image and video x tiles x tokens."""
        return self.n_token_ranges * (1 + 2 * self.n_tile_ranges)

    def bucket(self, shape: SampleShape) -> int:
        """The bucket index of one sample."""
        tokens = bisect.bisect_right(self.token_edges, shape.llm_tokens)
        if shape.encoder_tiles == 0:
            return tokens
        modality = 2 if shape.video_frames > 0 else 1
        tiles = bisect.bisect_right(self.tile_edges, shape.encoder_tiles)
        return self.n_token_ranges * (1 + (modality - 1) * self.n_tile_ranges + tiles) + tokens

    def buckets(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Bucket index per sample."""
        return np.array([self.bucket(s) for s in shapes], dtype=np.int64)

    def label(self, bucket: int) -> str:
        """A readable name, e.g. ``image:tiles[7,12):tokens[160,320)``."""

        def span(edges: tuple[int, ...], k: int) -> str:
            low = 0 if k == 0 else edges[k - 1]
            high = "inf" if k == len(edges) else str(edges[k])
            return f"[{low},{high})"

        tokens = bucket % self.n_token_ranges
        group = bucket // self.n_token_ranges
        if group == 0:
            return f"text:tokens{span(self.token_edges, tokens)}"
        modality = MODALITIES[1 + (group - 1) // self.n_tile_ranges]
        tiles = (group - 1) % self.n_tile_ranges
        return f"{modality}:tiles{span(self.tile_edges, tiles)}:tokens{span(self.token_edges, tokens)}"


@dataclass(frozen=True)
class CorrectionSettings:
    """Settings of the adaptive correction (the ``"correction"`` entry of the ``"dflop"`` block).

    Attributes:
        enabled: track and correct at all.
        decay: weight kept by past observations per step (0 < decay < 1).
        shrinkage: pull of each bucket's coefficient towards the pooled one, relative to the
            mean diagonal of the normal equations (larger: more evidence needed).
        min_penalty, max_penalty: penalties are clipped to this range.
        warmup_steps: observations before any correction is applied.
        gate: switch tracking off when its expected gain is below its overhead.
        gate_margin: tracking must gain ``gate_margin`` times its overhead to stay on.
        gate_patience: consecutive losing steps before switching off.
        probe_every: while off, observe once every this many steps to re-evaluate.
        tile_edges, token_edges: the :class:`BucketScheme`.
    """

    enabled: bool = False
    decay: float = 0.8
    shrinkage: float = 0.05
    min_penalty: float = 0.25
    max_penalty: float = 8.0
    warmup_steps: int = 2
    gate: bool = True
    gate_margin: float = 1.0
    gate_patience: int = 5
    probe_every: int = 10
    tile_edges: list[int] = field(default_factory=lambda: [4, 7, 12])
    token_edges: list[int] = field(default_factory=lambda: [160, 320])

    @classmethod
    def from_dict(cls, block: dict[str, Any] | None, source: str = "correction") -> CorrectionSettings:
        """Build and validate; unknown keys and bad values name the key at fault."""
        block = dict(block or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
        settings = cls(**block)
        rules: dict[str, dict[str, Any]] = {
            "enabled": dict(kind="bool"),
            "decay": dict(kind="number", above=0, maximum=1),
            "shrinkage": dict(kind="number", minimum=0),
            "min_penalty": dict(kind="number", above=0, maximum=1),
            "max_penalty": dict(kind="number", minimum=1),
            "warmup_steps": dict(kind="int", minimum=0),
            "gate": dict(kind="bool"),
            "gate_margin": dict(kind="number", minimum=0),
            "gate_patience": dict(kind="int", minimum=1),
            "probe_every": dict(kind="int", minimum=1),
            "tile_edges": dict(kind="list"),
            "token_edges": dict(kind="list"),
        }
        for key, rule in rules.items():
            check_setting(f"{source}.{key}", getattr(settings, key), **rule)
        if settings.decay >= 1:
            raise ValueError(f"{source}.decay must be < 1, got {settings.decay!r}")
        try:
            settings.scheme()
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from error
        return settings

    def scheme(self) -> BucketScheme:
        """The bucket scheme these settings describe."""
        return BucketScheme(tuple(self.tile_edges), tuple(self.token_edges))


@dataclass(frozen=True)
class StepObservation:
    """What one training step showed, aggregated over all ranks.

    Attributes:
        composition: ``(M, C, B)`` predicted (unadjusted) column-``c`` cost of bucket ``b``'s
            samples in each of the step's ``M`` microbatches (all data-parallel ranks).
        stage_times: ``(S, M)`` observed compute seconds of each microbatch on each stage
            (NaN where not observed).
        overhead_s: measured seconds the tracking itself cost in a step (max over ranks).
        microbatches_per_rank: microbatches a rank runs per step (the gain's multiplier).
    """

    composition: np.ndarray
    stage_times: np.ndarray
    overhead_s: float = 0.0
    microbatches_per_rank: int = 1


def composition(
    microbatches: Sequence[Sequence[int]], costs: np.ndarray, buckets: np.ndarray, n_buckets: int
) -> np.ndarray:
    """``(M, C, B)``: per microbatch, the summed ``costs`` rows of its samples per bucket."""
    costs = np.asarray(costs, dtype=float)
    out = np.zeros((len(microbatches), costs.shape[1], n_buckets))
    for m, mb in enumerate(microbatches):
        idx = np.asarray(mb, dtype=np.int64)
        for c in range(costs.shape[1]):
            np.add.at(out[m, c], buckets[idx], costs[idx, c])
    return out


@dataclass(frozen=True)
class Snapshot:
    """A published correction state: what the scheduler applies for one version.

    ``seconds[s, c, b]`` is stage ``s``'s corrected seconds per predicted unit of column ``c``
    for bucket ``b`` (``pooled * penalty``); unused when ``active`` is False.
    """

    version: int
    active: bool
    seconds: np.ndarray

    def stage_costs(self, costs: np.ndarray, buckets: np.ndarray) -> np.ndarray:
        """``(n, S)`` predicted seconds per stage of samples with ``costs`` ``(n, C)``."""
        per_unit = self.seconds[:, :, buckets]  # (S, C, n)
        return np.einsum("scn,nc->ns", per_unit, np.asarray(costs, dtype=float))

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        return {"version": self.version, "active": self.active, "seconds": self.seconds.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> Snapshot:
        """Inverse of :meth:`to_dict`."""
        return cls(int(data["version"]), bool(data["active"]), np.asarray(data["seconds"], dtype=float))


def _solve(gram: np.ndarray, rhs: np.ndarray, prior: np.ndarray, strength: np.ndarray) -> np.ndarray:
    """Non-negative ``argmin ||A x - y||^2 + sum_f strength_f (x_f - prior_f)^2`` from the normal
    equations ``gram = A'A``, ``rhs = A'y``."""
    n = gram.shape[0]
    system = gram + np.diag(np.broadcast_to(strength, (n,)))
    target = rhs + strength * prior
    from scipy.optimize import nnls  # a third of a second to import: only a correction's update needs it

    # nnls wants a least-squares form: factor the (positive definite) system.
    try:
        root = np.linalg.cholesky(system + 1e-12 * np.eye(n))
    except np.linalg.LinAlgError:
        return np.clip(np.linalg.lstsq(system, target, rcond=None)[0], 0, None)
    solution, _ = nnls(root.T, np.linalg.solve(root, target), maxiter=50 * n)
    return solution


class CostCorrection:
    """Per-bucket penalties on predicted costs, learned from observed microbatch times.

    Use: every rank calls :meth:`update` with the same aggregated :class:`StepObservation` after
    each step, then :meth:`publish` with the number of completed steps; the sampler calls
    :meth:`adjust` (it implements the sampler's ``CostAdjuster`` protocol).

    Args:
        settings: :class:`CorrectionSettings`.
        n_columns: cost columns (2: encoder, LLM).
        n_stages: pipeline stages observed.
        wait_timeout_s: how long :meth:`adjust` waits for a version before failing.
    """

    #: active corrections return per-stage seconds, not the cost model's columns
    replaces_columns = True

    def __init__(
        self,
        settings: CorrectionSettings | None = None,
        *,
        n_columns: int = 2,
        n_stages: int = 1,
        wait_timeout_s: float = 600.0,
    ) -> None:
        self.settings = settings or CorrectionSettings(enabled=True)
        self.scheme = self.settings.scheme()
        self.n_columns = int(n_columns)
        self.n_stages = int(n_stages)
        self.wait_timeout_s = float(wait_timeout_s)
        features = self.n_columns * self.scheme.n_buckets
        self.gram_ = np.zeros((self.n_stages, features, features))
        self.rhs_ = np.zeros((self.n_stages, features))
        self.theta_ = np.zeros((self.n_stages, self.n_columns, self.scheme.n_buckets))
        self.pooled_ = np.zeros((self.n_stages, self.n_columns))
        self.column_units_ = np.zeros(self.n_columns)  # mean predicted units per microbatch, per column
        self.observations_ = 0
        self.active_ = bool(self.settings.enabled)
        self.gain_s_ = 0.0
        self.overhead_s_ = 0.0
        self.losing_steps_ = 0
        self.steps_since_probe_ = 0
        self.last_fit_error_ = (float("nan"), float("nan"))
        self._snapshots: dict[int, Snapshot] = {}
        self._latest = -1
        self._cond = threading.Condition()

    # -- state -------------------------------------------------------------------------------
    def penalties(self) -> np.ndarray:
        """``(S, C, B)`` current penalties (1 where nothing is known)."""
        pooled = np.broadcast_to(self.pooled_[:, :, None], self.theta_.shape)
        ratio = np.divide(self.theta_, pooled, out=np.ones_like(self.theta_), where=pooled > 0)
        return np.clip(ratio, self.settings.min_penalty, self.settings.max_penalty)

    def seconds(self) -> np.ndarray:
        """``(S, C, B)`` corrected seconds per predicted unit: pooled times clipped penalty."""
        return self.pooled_[:, :, None] * self.penalties()

    def applying(self) -> bool:
        """Whether published states change the costs (enabled, gate on, warmed up)."""
        return self.settings.enabled and self.active_ and self.observations_ >= self.settings.warmup_steps

    def tracking(self) -> bool:
        """Whether the next step should be observed (on, or a probe while the gate is off)."""
        if not self.settings.enabled:
            return False
        return self.active_ or self.steps_since_probe_ + 1 >= self.settings.probe_every

    def skip(self) -> None:
        """Record a step that was not observed (the gate is off)."""
        self.steps_since_probe_ += 1

    # -- learning ----------------------------------------------------------------------------
    def update(self, obs: StepObservation) -> None:
        """Fold one step's aggregated observation into the state (deterministic)."""
        comp = np.asarray(obs.composition, dtype=float)
        times = np.asarray(obs.stage_times, dtype=float)
        n_mb, n_col, n_b = comp.shape
        if n_col != self.n_columns or n_b != self.scheme.n_buckets or times.shape != (self.n_stages, n_mb):
            raise ValueError(
                f"observation shapes composition={comp.shape} stage_times={times.shape} do not match "
                f"columns={self.n_columns} buckets={self.scheme.n_buckets} stages={self.n_stages}"
            )
        X = comp.reshape(n_mb, -1)
        decay = self.settings.decay
        self.gram_ *= decay
        self.rhs_ *= decay
        for s in range(self.n_stages):
            ok = np.isfinite(times[s])
            weights = self._huber_weights(X[ok], times[s, ok], s)
            self.gram_[s] += (X[ok] * weights[:, None]).T @ X[ok]
            self.rhs_[s] += X[ok].T @ (weights * times[s, ok])
        self.column_units_ = (
            decay * self.column_units_ + (1 - decay) * comp.sum(axis=2).mean(axis=0)
            if self.observations_
            else comp.sum(axis=2).mean(axis=0)
        )
        self.observations_ += 1
        self.steps_since_probe_ = 0
        self._fit()
        self._update_gate(comp, times, obs)

    def _huber_weights(self, X: np.ndarray, y: np.ndarray, stage: int, c: float = 2.5) -> np.ndarray:
        """Down-weight microbatches the current fit calls outliers (a shared machine's hiccups):
        weight ``min(1, c * scale / |residual|)`` with the residuals' robust scale (MAD)."""
        if self.observations_ == 0 or y.size < 3:
            return np.ones(y.size)
        residual = y - X @ self.theta_[stage].ravel()
        scale = 1.4826 * np.median(np.abs(residual - np.median(residual)))
        if scale <= 0:
            return np.ones(y.size)
        return np.minimum(1.0, c * scale / np.maximum(np.abs(residual), 1e-300))

    def _fit(self) -> None:
        n_b = self.scheme.n_buckets
        pool = np.kron(np.eye(self.n_columns), np.ones((n_b, 1)))  # (C*B, C): sums buckets
        for s in range(self.n_stages):
            gram, rhs = self.gram_[s], self.rhs_[s]
            if not np.any(gram):
                continue
            pooled_gram = pool.T @ gram @ pool
            tiny = 1e-9 * np.diag(pooled_gram).max()
            self.pooled_[s] = _solve(pooled_gram, pool.T @ rhs, np.zeros(self.n_columns), tiny)
            prior = np.repeat(self.pooled_[s], n_b)
            # shrink each column's buckets relative to that column's typical evidence (unit-free)
            level = np.diag(gram).reshape(self.n_columns, n_b).mean(axis=1)
            strength = np.repeat(np.maximum(self.settings.shrinkage * level, tiny), n_b)
            self.theta_[s] = _solve(gram, rhs, prior, strength).reshape(self.n_columns, n_b)

    def _update_gate(self, comp: np.ndarray, times: np.ndarray, obs: StepObservation) -> None:
        n_mb = comp.shape[0]
        bucketed = np.einsum("mcb,scb->sm", comp, self.seconds())
        pooled = np.einsum("mc,sc->sm", comp.sum(axis=2), self.pooled_)
        # the raw scheduler's view of a microbatch: its largest predicted column, in seconds
        raw = comp.sum(axis=2).max(axis=1)
        raw_seconds = (
            raw[None, :]
            * np.divide(bucketed.mean(axis=1), raw.mean(), out=np.zeros(self.n_stages), where=raw.mean() > 0)[:, None]
        )
        # how far the raw view misjudges the slowest microbatch of a stage, per microbatch slot
        err = bucketed - raw_seconds
        excess = (err.max(axis=1) - err.mean(axis=1)).max() if n_mb else 0.0
        gain = float(excess) * obs.microbatches_per_rank
        ok = np.isfinite(times)
        if ok.any():
            self.last_fit_error_ = (
                float(np.abs(times - pooled)[ok].mean()),
                float(np.abs(times - bucketed)[ok].mean()),
            )
        weight = 1 - self.settings.decay
        first = self.observations_ == 1
        self.gain_s_ = gain if first else (1 - weight) * self.gain_s_ + weight * gain
        self.overhead_s_ = (
            float(obs.overhead_s) if first else (1 - weight) * self.overhead_s_ + weight * float(obs.overhead_s)
        )
        if not self.settings.gate or self.observations_ < self.settings.warmup_steps:
            return
        pays = self.gain_s_ > self.settings.gate_margin * self.overhead_s_
        if not self.active_:
            if pays:
                self.active_, self.losing_steps_ = True, 0
            return
        self.losing_steps_ = 0 if pays else self.losing_steps_ + 1
        if self.losing_steps_ >= self.settings.gate_patience:
            self.active_ = False

    # -- publishing and applying -------------------------------------------------------------
    def snapshot(self, version: int) -> Snapshot:
        """The state as the scheduler should apply it for ``version``."""
        return Snapshot(int(version), self.applying(), self.seconds())

    def publish(self, version: int, keep: int = 8) -> Snapshot:
        """Publish the current state as ``version`` (steps completed) and wake waiting readers."""
        snap = self.snapshot(version)
        with self._cond:
            self._snapshots[snap.version] = snap
            self._latest = max(self._latest, snap.version)
            for old in [v for v in self._snapshots if v <= self._latest - keep]:
                del self._snapshots[old]
            self._cond.notify_all()
        return snap

    def published(self, version: int, timeout_s: float | None = None) -> Snapshot:
        """The snapshot of ``version``, waiting for it to be published."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._latest >= version, timeout=self.wait_timeout_s if timeout_s is None else timeout_s
            )
            if not ready:
                raise TimeoutError(
                    f"correction version {version} was not published within the timeout "
                    f"(latest {self._latest}): is publish() called after every step?"
                )
            if version not in self._snapshots:
                raise KeyError(f"correction version {version} is no longer kept (have {sorted(self._snapshots)})")
            return self._snapshots[version]

    def snapshot_of(self, version: int) -> Snapshot | None:
        """The published snapshot of ``version`` if it is kept, without waiting."""
        with self._cond:
            return self._snapshots.get(int(version))

    def published_versions(self) -> list[int]:
        """Versions currently kept, oldest first."""
        with self._cond:
            return sorted(self._snapshots)

    def adjust(self, version: int, costs: np.ndarray, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Costs to schedule with under ``version``'s state (the sampler's ``CostAdjuster``).

        Inactive: ``costs`` unchanged. Active: ``(n, S)`` predicted seconds per pipeline stage.
        """
        snap = self.published(version)
        costs = np.asarray(costs, dtype=float)
        if not snap.active:
            return costs
        return snap.stage_costs(costs, self.scheme.buckets(shapes))

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue identically (statistics, gate, kept snapshots)."""
        with self._cond:
            snaps = [s.to_dict() for _, s in sorted(self._snapshots.items())]
        return {
            "settings": dataclasses.asdict(self.settings),
            "n_columns": self.n_columns,
            "n_stages": self.n_stages,
            "gram": self.gram_.tolist(),
            "rhs": self.rhs_.tolist(),
            "theta": self.theta_.tolist(),
            "pooled": self.pooled_.tolist(),
            "column_units": self.column_units_.tolist(),
            "observations": self.observations_,
            "active": self.active_,
            "gain_s": self.gain_s_,
            "overhead_s": self.overhead_s_,
            "losing_steps": self.losing_steps_,
            "steps_since_probe": self.steps_since_probe_,
            "snapshots": snaps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; refuses a state of another bucket scheme or layout."""
        mine = dataclasses.asdict(self.settings)
        for key in ("tile_edges", "token_edges"):
            if list(state["settings"][key]) != list(mine[key]):
                raise ValueError(f"correction state has {key}={state['settings'][key]}, this run has {mine[key]}")
        if (state["n_columns"], state["n_stages"]) != (self.n_columns, self.n_stages):
            raise ValueError(
                f"correction state is for {state['n_columns']} columns x {state['n_stages']} stages, "
                f"this run has {self.n_columns} x {self.n_stages}"
            )
        self.gram_ = np.asarray(state["gram"], dtype=float)
        self.rhs_ = np.asarray(state["rhs"], dtype=float)
        self.theta_ = np.asarray(state["theta"], dtype=float)
        self.pooled_ = np.asarray(state["pooled"], dtype=float)
        self.column_units_ = np.asarray(state["column_units"], dtype=float)
        self.observations_ = int(state["observations"])
        self.active_ = bool(state["active"])
        self.gain_s_, self.overhead_s_ = float(state["gain_s"]), float(state["overhead_s"])
        self.losing_steps_ = int(state["losing_steps"])
        self.steps_since_probe_ = int(state["steps_since_probe"])
        with self._cond:
            self._snapshots = {int(s["version"]): Snapshot.from_dict(s) for s in state["snapshots"]}
            self._latest = max(self._snapshots, default=-1)
            self._cond.notify_all()

    def summary(self) -> dict:
        """A small JSON-friendly view for telemetry."""
        penalty = self.penalties()
        # only (stage, column) pairs carrying at least 10% of the stage's predicted time count
        share = self.pooled_ * self.column_units_[None, :]
        total = share.sum(axis=1, keepdims=True)
        matters = np.divide(share, total, out=np.zeros_like(share), where=total > 0) >= 0.1
        effect = np.where(matters[:, :, None], penalty, -1.0)  # the most penalized (slowest) bucket
        worst = np.unravel_index(int(effect.argmax()), penalty.shape)
        return {
            "active": bool(self.applying()),
            "tracking": bool(self.tracking()),
            "observations": self.observations_,
            "gain_s": self.gain_s_,
            "overhead_s": self.overhead_s_,
            "penalty": float(penalty[worst]),
            "penalty_where": f"stage{int(worst[0])}:col{int(worst[1])}:{self.scheme.label(int(worst[2]))}",
            "fit_error_pooled_s": self.last_fit_error_[0],
            "fit_error_bucketed_s": self.last_fit_error_[1],
        }


def make_correction(settings: CorrectionSettings, n_stages: int) -> CostCorrection | None:
    """A :class:`CostCorrection` for the ``dflop.correction`` section, or None when it is not enabled."""
    if not settings.enabled:
        return None
    return CostCorrection(settings, n_columns=2, n_stages=n_stages)
