"""FittedCostModel: fitted forward+backward time and memory of the encoder and the LLM.

Fitted on a :class:`~dflop_ds.cost.measurements.ModelProfile`. The encoder's cost is a function of
the tiles it processes (plus, for encoders whose profile knows their attention windows, such as
Qwen2-VL's per-image and per-frame-group attention, the attention units ``A``: the sum over
windows of their squared patches, so one large image costs more than as many patches in small
ones), the LLM's of ``(batch, longest sequence)``, because the collate pads
every sample of a microbatch to its longest one: a microbatch of one long and three short
samples costs the LLM as much as four long ones. Per-sample predictions treat each sample as
a microbatch of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from dflop_ds.cost.fit import MonotoneFit
from dflop_ds.cost.measurements import Measurement, ModelProfile
from dflop_ds.cost.protocol import CostModel
from dflop_ds.shapes import SampleShape, ShapePolicy, without_length_rule

if TYPE_CHECKING:
    from dflop_ds.cost.columns import Microbatches

ENCODER_TIME = ("1", "T")
#: the encoder time of a profile with attention units: linear work plus attention within windows
ENCODER_WINDOW_TIME = ("1", "T", "A")
LLM_LINEAR_TIME = ("1", "B", "B*S", "B*S^2")
LLM_ATTENTION_TIME = ("B*S", "B*S^2")
ENCODER_BYTES = ("1", "T")
LLM_BYTES = ("B", "B*S", "B*S^2")


def _encoder_vars(points: Sequence[Measurement]) -> dict[str, np.ndarray]:
    variables = {"T": np.array([p.tiles for p in points], dtype=float)}
    if points and all(p.attention_units is not None for p in points):
        variables["A"] = np.array([p.attention_units for p in points], dtype=float)
    return variables


def _llm_vars(points: Sequence[Measurement]) -> dict[str, np.ndarray]:
    return {
        "B": np.array([p.batch for p in points], dtype=float),
        "S": np.array([p.seq_len for p in points], dtype=float),
    }


class FittedCostModel:
    """Measured cost model with the planner's and the scheduler's interface
    (a :class:`~dflop_ds.cost.CostModel`; saved and loaded by :mod:`dflop_ds.cost.io`).

    Args:
        encoder_features: features of the encoder time in the tile count ``T``.
        llm_linear_features: features of the LLM's non-attention time in ``B`` and ``S``.
        llm_attention_features: features of the LLM's attention time (quadratic in ``S``).
        separate_attention: fit attention and the rest separately when attention was timed;
            otherwise one fit of the total on the union of both feature sets.

    Fitted attributes: ``encoder_time_``, ``llm_time_`` (list of fits summed),
    ``encoder_bytes_``, ``llm_bytes_``, ``encoder_peak_``, ``llm_peak_`` (``None`` when peak
    memory was not measured), ``profile_``. Planner attributes (a
    :class:`~dflop_ds.cost.PlannerCostModel` once fitted): ``encoder_layers``, ``llm_layers``,
    ``param_bytes``, ``hidden_bytes_per_token``, ``layer_shares`` (measured share of each layer
    in its segment's time, or ``None``), and the capabilities declared below.
    ``shape_policy``: :meth:`ShapePolicy.describe` of the policy the shapes it predicts for
    must be made under (``None`` when unknown); see :func:`check_policy`.
    """

    kind = "fitted"
    # capabilities (:class:`~dflop_ds.cost.CostModel`): a padded, measured, whole-model prediction
    additive = False
    per_stage = False
    memory_per_device = False
    predicts_memory = True
    is_analytic = False
    # what the planner reads of a profiled model beyond its profile (:class:`~dflop_ds.cost.PlannerCostModel`)
    #: the profiler measures layers without recompute
    activation_checkpointing = False
    #: the profiled model is not known to have layers AutoTP shards
    tensor_parallel_layers = False
    #: forward FLOPs are a third of forward+backward without recompute
    forward_fraction = 1.0 / 3.0
    #: the profile does not record the GPU's memory
    gpu_memory_bytes: float | None = None
    # set by fit / from_dict (:meth:`_set_planner_attributes`)
    encoder_layers: int
    llm_layers: int
    param_bytes: dict[str, int]
    hidden_bytes_per_token: float
    layer_shares: dict[str, list[float]] | None

    def __init__(
        self,
        encoder_features: Sequence[str] = ENCODER_TIME,
        llm_linear_features: Sequence[str] = LLM_LINEAR_TIME,
        llm_attention_features: Sequence[str] = LLM_ATTENTION_TIME,
        separate_attention: bool = True,
    ) -> None:
        self.encoder_features = tuple(encoder_features)
        self.llm_linear_features = tuple(llm_linear_features)
        self.llm_attention_features = tuple(llm_attention_features)
        self.separate_attention = separate_attention

    # -- fitting -------------------------------------------------------------------------
    shape_policy: dict[str, Any] | None = None

    def fit(self, profile: ModelProfile, shape_policy: ShapePolicy | None = None) -> FittedCostModel:
        """Fit every regressor on ``profile``; returns ``self``.

        ``shape_policy`` is the policy of the profiled model (stored, checked by :func:`check_policy`).
        """
        self.shape_policy = None if shape_policy is None else shape_policy.describe()
        if not profile.encoder or not profile.llm:
            raise ValueError("the profile needs both encoder and LLM measurements to fit a FittedCostModel")
        enc, llm = _encoder_vars(profile.encoder), _llm_vars(profile.llm)
        if "A" in enc and self.encoder_features == ENCODER_TIME:
            self.encoder_features = ENCODER_WINDOW_TIME
        self.encoder_time_ = MonotoneFit(self.encoder_features).fit(enc, [p.time_s for p in profile.encoder])
        timed_attention = all(p.attention_s is not None for p in profile.llm)
        if self.separate_attention and timed_attention:
            attention = [p.attention_s or 0.0 for p in profile.llm]
            total = [p.time_s for p in profile.llm]
            rest = [t - a for t, a in zip(total, attention)]
            self.llm_time_ = [
                MonotoneFit(self.llm_linear_features).fit(llm, rest, scale=total),
                MonotoneFit(self.llm_attention_features).fit(llm, attention, scale=total),
            ]
        else:
            union = tuple(dict.fromkeys(self.llm_linear_features + self.llm_attention_features))
            self.llm_time_ = [MonotoneFit(union).fit(llm, [p.time_s for p in profile.llm])]
        self.encoder_bytes_ = MonotoneFit(ENCODER_BYTES, relative=False).fit(
            enc, [p.activation_bytes for p in profile.encoder]
        )
        self.llm_bytes_ = MonotoneFit(LLM_BYTES, relative=False).fit(llm, [p.activation_bytes for p in profile.llm])
        self.encoder_peak_ = self._fit_peak(ENCODER_BYTES, enc, profile.encoder)
        self.llm_peak_ = self._fit_peak(LLM_BYTES, llm, profile.llm)
        self._set_planner_attributes(profile)
        return self

    @staticmethod
    def _fit_peak(features: Sequence[str], variables: dict, points: Sequence[Measurement]) -> MonotoneFit | None:
        peaks = [p.peak_bytes for p in points]
        if any(peak is None for peak in peaks):
            return None
        return MonotoneFit(features, relative=False).fit(variables, [float(peak) for peak in peaks if peak is not None])

    def _set_planner_attributes(self, profile: ModelProfile) -> None:
        self.profile_ = profile
        self.encoder_layers = profile.encoder_layers
        self.llm_layers = profile.llm_layers
        self.param_bytes = dict(profile.param_bytes)
        self.hidden_bytes_per_token = profile.hidden_bytes_per_token
        self.layer_shares = profile.layer_shares

    @property
    def name(self) -> str:
        """Label in plans and printouts: the class name."""
        return type(self).__name__

    @property
    def encoder_hidden_bytes_per_token(self) -> float:
        """Bytes sent between encoder stages per encoder token: the profile records one hidden size,
        the LLM's (:attr:`hidden_bytes_per_token`)."""
        return self.hidden_bytes_per_token

    def _check_fitted(self) -> None:
        if not hasattr(self, "encoder_time_"):
            raise RuntimeError("this FittedCostModel is not fitted: call fit(profile) or load_cost_model(path)")

    # -- raw curves ----------------------------------------------------------------------
    def typical_window(self) -> float:
        """Attention units per tile of the profiled encoder inputs (median; 0 without attention units):
        what a tile is assumed to add to ``A`` when a shape does not say."""
        ratios = [
            p.attention_units / p.tiles for p in self.profile_.encoder if p.attention_units is not None and p.tiles > 0
        ]
        return float(np.median(ratios)) if ratios else 0.0

    def encoder_time(self, tiles: ArrayLike, attention: Sequence[float | None] | None = None) -> np.ndarray:
        """Encoder (+projector) seconds for microbatches of ``tiles`` tiles in total and ``attention``
        attention units (where not given or 0: ``tiles x`` :meth:`typical_window`)."""
        self._check_fitted()
        variables = {"T": np.asarray(tiles, dtype=float)}
        if "A" in self.encoder_time_.features:
            given = [0.0 if a is None else float(a) for a in (attention or [None] * len(variables["T"]))]
            variables["A"] = np.where(np.asarray(given) > 0, given, variables["T"] * self.typical_window())
        return self.encoder_time_.predict(variables)

    def llm_time(self, batch: ArrayLike, seq_len: ArrayLike) -> np.ndarray:
        """LLM seconds for microbatches of ``batch`` samples padded to ``seq_len``."""
        self._check_fitted()
        variables = {"B": np.asarray(batch, dtype=float), "S": np.asarray(seq_len, dtype=float)}
        return np.sum([fit.predict(variables) for fit in self.llm_time_], axis=0)

    def llm_attention_time(self, batch: ArrayLike, seq_len: ArrayLike) -> np.ndarray | None:
        """The attention share of :meth:`llm_time`, or ``None`` when attention was not separated."""
        self._check_fitted()
        if len(self.llm_time_) < 2:
            return None
        return self.llm_time_[1].predict({"B": np.asarray(batch, dtype=float), "S": np.asarray(seq_len, dtype=float)})

    # -- the scheduling and planning interface ------------------------------------------
    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(n, 2)`` seconds ``[encoder, llm]`` of each sample alone, over the full depth.

        A sample without tiles costs the encoder nothing; one without tokens costs the LLM nothing.
        """
        tiles = np.array([s.encoder_tiles for s in shapes], dtype=float)
        tokens = np.array([s.llm_tokens for s in shapes], dtype=float)
        encoder = np.where(tiles > 0, self.encoder_time(tiles, [s.encoder_attention for s in shapes]), 0.0)
        llm = np.where(tokens > 0, self.llm_time(np.ones_like(tokens), tokens), 0.0)
        return np.stack([encoder, llm], axis=1).reshape(-1, 2)

    @staticmethod
    def _microbatch_vars(shapes: Sequence[SampleShape]) -> tuple[float, float, float]:
        tiles = float(sum(s.encoder_tiles for s in shapes))
        longest = float(max(s.llm_tokens for s in shapes))
        return tiles, float(len(shapes)), longest

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)`` seconds ``[encoder, llm]`` of one collated microbatch (padded to its longest)."""
        if not shapes:
            return np.zeros(2)
        tiles, batch, longest = self._microbatch_vars(shapes)
        attention = float(sum(s.encoder_attention for s in shapes))
        return np.array([self.encoder_time([tiles], [attention])[0], self.llm_time([batch], [longest])[0]])

    @staticmethod
    def _microbatches_vars(groups: Microbatches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_microbatch_vars` of every microbatch of ``groups``."""
        tiles = groups.sums(groups.columns.tiles).astype(float)
        return tiles, groups.sizes.astype(float), groups.maxima(groups.columns.tokens).astype(float)

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """``(n, 2)`` :meth:`predict_microbatch` of each microbatch of ``groups``, vectorised."""
        tiles, batch, longest = self._microbatches_vars(groups)
        attention = groups.sums(groups.columns.attention).astype(float).tolist()
        costs = np.stack([self.encoder_time(tiles, attention), self.llm_time(batch, longest)], axis=1)
        return np.where(groups.filled[:, None], costs, 0.0)

    def predict_microbatches_activation_bytes(self, groups: Microbatches) -> np.ndarray:
        """``(n, 2)`` :meth:`predict_activation_bytes` of each microbatch of ``groups``, vectorised."""
        self._check_fitted()
        tiles, batch, longest = self._microbatches_vars(groups)
        kept = np.stack(
            [self.encoder_bytes_.predict({"T": tiles}), self.llm_bytes_.predict({"B": batch, "S": longest})], axis=1
        )
        return np.where(groups.filled[:, None], kept, 0.0)

    def predict_microbatches_working_bytes(self, groups: Microbatches) -> np.ndarray:
        """``(n, 2)`` zeros (:meth:`predict_working_bytes`)."""
        return np.zeros((len(groups), 2))

    def predict_activation_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)`` activation bytes kept for backward by one microbatch over the full depth."""
        self._check_fitted()
        if not shapes:
            return np.zeros(2)
        tiles, batch, longest = self._microbatch_vars(shapes)
        return np.array(
            [
                self.encoder_bytes_.predict({"T": [tiles]})[0],
                self.llm_bytes_.predict({"B": [batch], "S": [longest]})[0],
            ]
        )

    def predict_working_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)`` zeros: a profiled model's transient bytes are not apart from its kept ones (the
        measured peak of :meth:`predict_memory` holds them)."""
        return np.zeros(2)

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)`` peak bytes above the parameters while one microbatch runs forward+backward.

        Uses the measured peak where the platform measured one, else the activation bytes.
        """
        if not shapes:
            return np.zeros(2)
        activations = self.predict_activation_bytes(shapes)
        tiles, batch, longest = self._microbatch_vars(shapes)
        peaks = [
            None if self.encoder_peak_ is None else self.encoder_peak_.predict({"T": [tiles]})[0],
            None if self.llm_peak_ is None else self.llm_peak_.predict({"B": [batch], "S": [longest]})[0],
        ]
        return np.array([a if p is None else max(a, p) for a, p in zip(activations, peaks)])

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state: constructor parameters, fits and the measurements (the file's header
        is :func:`dflop_ds.cost.io.cost_model_to_dict`'s)."""
        self._check_fitted()
        return {
            "params": {
                "encoder_features": list(self.encoder_features),
                "llm_linear_features": list(self.llm_linear_features),
                "llm_attention_features": list(self.llm_attention_features),
                "separate_attention": self.separate_attention,
            },
            "fits": {
                "encoder_time": self.encoder_time_.to_dict(),
                "llm_time": [fit.to_dict() for fit in self.llm_time_],
                "encoder_bytes": self.encoder_bytes_.to_dict(),
                "llm_bytes": self.llm_bytes_.to_dict(),
                "encoder_peak": None if self.encoder_peak_ is None else self.encoder_peak_.to_dict(),
                "llm_peak": None if self.llm_peak_ is None else self.llm_peak_.to_dict(),
            },
            "profile": self.profile_.to_dict(),
            "shape_policy": self.shape_policy,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "cost model") -> FittedCostModel:
        """Inverse of :meth:`to_dict`; a malformed state is an error naming ``source``."""
        try:
            model = cls(**data["params"])
            fits = data["fits"]
            model.encoder_time_ = MonotoneFit.from_dict(fits["encoder_time"])
            model.llm_time_ = [MonotoneFit.from_dict(f) for f in fits["llm_time"]]
            model.encoder_bytes_ = MonotoneFit.from_dict(fits["encoder_bytes"])
            model.llm_bytes_ = MonotoneFit.from_dict(fits["llm_bytes"])
            model.encoder_peak_ = None if fits["encoder_peak"] is None else MonotoneFit.from_dict(fits["encoder_peak"])
            model.llm_peak_ = None if fits["llm_peak"] is None else MonotoneFit.from_dict(fits["llm_peak"])
            model._set_planner_attributes(ModelProfile.from_dict(data["profile"]))
            model.shape_policy = data.get("shape_policy")
            if model.shape_policy is not None and not isinstance(model.shape_policy, dict):
                raise TypeError(f"shape_policy must be an object or null, got {type(model.shape_policy).__name__}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{source}: malformed cost model, {type(exc).__name__}: {exc}") from exc
        return model


def check_policy(cost_model: CostModel, policy: ShapePolicy, *, source: str = "the cost model") -> None:
    """Refuse ``cost_model`` if it was profiled under a shape policy other than ``policy``.

    A cost model predicts from encoder tiles and LLM tokens; the same data gives other tiles
    and tokens under another policy, so its predictions would be for another model. A model
    that records no policy (an analytic or proxy model) is accepted with a logged warning.
    The sequence-length rule (``max_length``, ``truncation``; :func:`~dflop_ds.shapes.length_rule`)
    is not compared: it decides which lengths the data has, not what a sample of a given shape
    costs, so a model profiled without truncation predicts a truncating run's shapes as well.

    Raises:
        ValueError: naming both policies and every field in which they differ.
    """
    recorded = getattr(cost_model, "shape_policy", None)
    wanted = _comparable(policy.describe())
    if recorded is None:
        logging.getLogger(__name__).warning(
            "%s records no shape policy; cannot check it against the %r policy in use", source, wanted["name"]
        )
        return
    recorded = _comparable(recorded)
    differ = sorted(
        key for key in set(recorded) | set(wanted) if key != "name" and recorded.get(key) != wanted.get(key)
    )
    if differ:
        details = "; ".join(f"{key}: {recorded.get(key)!r} vs {wanted.get(key)!r}" for key in differ)
        raise ValueError(
            f"{source} was profiled under the shape policy {recorded.get('name')!r}, but the data is "
            f"shaped with the policy {wanted['name']!r}; they differ in {details}. Profile the model "
            "with the policy you train with (or pick the policy the cost model was made for)"
        )


def _comparable(described: dict[str, Any]) -> dict[str, Any]:
    """A policy description without what per-shape costs do not depend on (the length rule)."""
    tokenizer = described.get("tokenizer")
    if not isinstance(tokenizer, str):
        return described
    return {**described, "tokenizer": without_length_rule(tokenizer)}
