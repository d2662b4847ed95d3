"""Analytic (not measured) cost models of LLaVA-OneVision-like MLLMs on A100 / H100 GPUs.

These models exist so the planner can be exercised at cluster scale without a cluster. Every
number they produce comes from FLOP counts divided by a *stated* achieved throughput and from
*stated* memory formulas; nothing here was timed. Each model says so: ``is_analytic = True``.

Formulas (``n`` tokens of one sample, ``h`` hidden size, ``f`` MLP size, ``P`` parameters):

- time of forward+backward = FLOPs / (peak_flops * mfu), with
  FLOPs = ``6 * P_layers * n`` (matmuls: 2 forward + 4 backward per parameter and token)
  + attention ``3 * c * n**2 * h`` per layer (``c = 4`` bidirectional encoder, ``2`` causal LLM)
  + the LM head ``6 * vocab * h * n``; activation checkpointing multiplies the forward share
  (one third) by two, i.e. all FLOPs by 4/3.
- the encoder column also holds the projector (a 2-layer MLP, ``merge * h_enc -> h -> h``, over
  every ``merge`` encoder tokens: Qwen2-VL's 2x2 patch merger and InternVL's pixel shuffle merge
  4, LLaVA's projector 1) and runs ``tokens_per_tile`` tokens for every tile, sampled video frame
  or other encoder unit of the shape policy;
- kept activations (bf16) per token and layer: ``2 * h`` bytes with checkpointing (the layer
  input), ``17 * h + 6 * f`` without (after Korthikanti et al. 2022 with flash attention and a
  gated MLP); the transient working set of one layer's recompute is reported by
  ``predict_working_bytes`` (fp32 logits are left out: a chunked or fused loss keeps them small);
- parameters in bf16 (2 bytes each); gradients and Adam states are the planner's business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dflop_ds.shapes import SampleShape

if TYPE_CHECKING:
    from dflop_ds.cost.columns import Microbatches


@dataclass(frozen=True)
class TransformerSpec:
    """Sizes of one transformer stack (encoder or LLM)."""

    name: str
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    gated_mlp: bool
    vocab: int = 0

    def __post_init__(self) -> None:
        """Refuse sizes that are not whole counts (at least 1; ``vocab`` at least 0), naming the field."""
        for key in ("layers", "hidden", "mlp", "heads", "kv_heads", "vocab"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "vocab" else 1):
                raise ValueError(
                    f"{self.name}.{key} must be a whole count >= {0 if key == 'vocab' else 1}, got {value!r}"
                )

    @property
    def layer_params(self) -> int:
        """Parameters of one block: attention projections plus the MLP (norms ignored)."""
        kv_dim = self.hidden * self.kv_heads // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.mlp
        return attention + mlp

    @property
    def embedding_params(self) -> int:
        """Token embedding plus an untied LM head (0 for an encoder)."""
        return 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class GPUSpec:
    """A GPU as the analytic models see it: bf16 dense peak and the achieved fraction of it."""

    name: str
    peak_flops: float
    mfu: float
    memory_bytes: float

    def __post_init__(self) -> None:
        """Refuse a peak, memory or achieved fraction that is not a finite number above 0 (``mfu`` at
        most 1), naming the field."""
        for key in ("peak_flops", "mfu", "memory_bytes"):
            value = getattr(self, key)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value <= 0 or (key == "mfu" and value > 1):
                bound = " and at most 1" if key == "mfu" else ""
                raise ValueError(f"gpu {self.name}.{key} must be a finite number above 0{bound}, got {value!r}")

    @property
    def achieved_flops(self) -> float:
        """FLOP/s actually reached: ``peak_flops * mfu`` (an assumption, stated per GPU)."""
        return self.peak_flops * self.mfu


SIGLIP_400M = TransformerSpec(
    "siglip-so400m-384", layers=27, hidden=1152, mlp=4304, heads=16, kv_heads=16, gated_mlp=False
)
QWEN2_0_5B = TransformerSpec(
    "qwen2-0.5b", layers=24, hidden=896, mlp=4864, heads=14, kv_heads=2, gated_mlp=True, vocab=151936
)
QWEN2_7B = TransformerSpec(
    "qwen2-7b", layers=28, hidden=3584, mlp=18944, heads=28, kv_heads=4, gated_mlp=True, vocab=152064
)
QWEN2_72B = TransformerSpec(
    "qwen2-72b", layers=80, hidden=8192, mlp=29568, heads=64, kv_heads=8, gated_mlp=True, vocab=152064
)

# Qwen2-VL-2B (Qwen/Qwen2-VL-2B-Instruct config.json): vision tower depth 32, embed_dim 1280,
# mlp_ratio 4 (5120, QuickGELU: not gated), 16 heads, patch 14, spatial merge 2, temporal patch 2
# (~0.63 B in its blocks, 675 M with the merger and patch embedding); LLM Qwen2-1.5B: 28 layers,
# hidden 1536, intermediate 8960, 12 heads, 2 KV heads, vocabulary 151936
QWEN2_VL_VIT = TransformerSpec(
    "qwen2-vl-vit-675m", layers=32, hidden=1280, mlp=5120, heads=16, kv_heads=16, gated_mlp=False
)
QWEN2_1_5B = TransformerSpec(
    "qwen2-1.5b", layers=28, hidden=1536, mlp=8960, heads=12, kv_heads=2, gated_mlp=True, vocab=151936
)
# InternVL2.5-26B (OpenGVLab/InternVL2_5-26B config.json): InternViT-6B-448px-V2.5, 45 layers, hidden
# 3200, intermediate 12800 (GELU), 25 heads, patch 14 at 448 px (1024 patches + a class token per
# tile), pixel shuffle 0.5 (256 LLM tokens per tile); LLM InternLM2.5-20B-chat: 48 layers, hidden
# 6144, intermediate 16384, 48 heads, 8 KV heads, vocabulary 92553
INTERNVIT_6B = TransformerSpec(
    "internvit-6b-448px-v2.5", layers=45, hidden=3200, mlp=12800, heads=25, kv_heads=25, gated_mlp=False
)
INTERNLM2_5_20B = TransformerSpec(
    "internlm2.5-20b", layers=48, hidden=6144, mlp=16384, heads=48, kv_heads=8, gated_mlp=True, vocab=92553
)

A100_80GB = GPUSpec("A100-80GB", peak_flops=312e12, mfu=0.45, memory_bytes=80e9)
H100_80GB = GPUSpec("H100-80GB", peak_flops=989e12, mfu=0.40, memory_bytes=80e9)

GPUS = {"a100": A100_80GB, "h100": H100_80GB}


@dataclass(frozen=True)
class ReferenceMLLM:
    """A reference model's sizes (its published config): encoder and LLM stacks, encoder tokens per
    unit of its shape policy (:func:`dflop_ds.cost.reference_policy`) and the projector's merge."""

    encoder: TransformerSpec
    llm: TransformerSpec
    tokens_per_tile: int
    merge: int = 1


#: the reference models by name (``<name>-<gpu>`` with a GPU of :data:`GPUS` is a cost model)
REFERENCE_MLLMS = {
    "llava-ov-0.5b": ReferenceMLLM(SIGLIP_400M, QWEN2_0_5B, 729),
    "llava-ov-7b": ReferenceMLLM(SIGLIP_400M, QWEN2_7B, 729),
    "llava-ov-72b": ReferenceMLLM(SIGLIP_400M, QWEN2_72B, 729),
    # one unit = one LLM token's 2x2 patches (Qwen2-VL's native resolution, no tiles)
    "qwen2-vl-2b": ReferenceMLLM(QWEN2_VL_VIT, QWEN2_1_5B, 4, merge=4),
    "internvl2.5-26b": ReferenceMLLM(INTERNVIT_6B, INTERNLM2_5_20B, 1025, merge=4),
}


@dataclass
class AnalyticMLLM:
    """FLOP-count cost model of encoder + projector + LLM with the planner's cost-model interface.

    Args:
        encoder, llm: transformer sizes.
        gpu: the GPU and its assumed achieved throughput.
        tokens_per_tile: encoder tokens per tile or video frame (729 for SigLIP at 384 px).
        merge: encoder tokens the projector merges into one LLM token (1: none).
        activation_checkpointing: recompute each layer in backward (LLaVA-OneVision trains so).
        name: label used in plans and printouts.
    """

    kind: ClassVar[str] = "analytic"
    # capabilities (:class:`~dflop_ds.cost.CostModel`): padded whole-model seconds and bytes from formulas
    additive = False
    per_stage = False
    memory_per_device = False
    predicts_memory = True
    encoder: TransformerSpec
    llm: TransformerSpec
    gpu: GPUSpec
    tokens_per_tile: int = 729
    activation_checkpointing: bool = True
    name: str = "analytic"
    merge: int = 1
    is_analytic: bool = field(default=True, init=False)
    #: the LLMs modelled (HuggingFace Qwen2 / Llama) declare a tp_plan DeepSpeed AutoTP shards
    tensor_parallel_layers: bool = field(default=True, init=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnalyticMLLM) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        # per-unit constants, so the planner's many microbatch predictions stay cheap
        rate = self._recompute_factor / self.gpu.achieved_flops
        self._s_per_tile = self.encoder_flops_per_tile() * rate
        self._s_lin = float(self.llm_flops(1.0) - self.llm_flops(0.0)) * rate - self._s_quad_raw() * rate
        self._s_quad = self._s_quad_raw() * rate
        self._kept = (
            self.tokens_per_tile * self._kept_per_token(self.encoder) * self.encoder.layers,
            self._kept_per_token(self.llm) * self.llm.layers,
        )
        self._work = (
            self.tokens_per_tile * self._layer_activation_per_token(self.encoder),
            self._layer_activation_per_token(self.llm),
        )

    def _s_quad_raw(self) -> float:
        return 3.0 * 2.0 * self.llm.hidden * self.llm.layers

    # -- the planner's interface -------------------------------------------------------------
    @property
    def encoder_layers(self) -> int:
        """Encoder depth the predictions refer to."""
        return self.encoder.layers

    @property
    def forward_fraction(self) -> float:
        """The forward's share of forward+backward FLOPs: 1/3, or 1/4 with recompute."""
        return 0.25 if self.activation_checkpointing else 1.0 / 3.0

    @property
    def gpu_memory_bytes(self) -> float:
        """The modelled GPU's memory."""
        return self.gpu.memory_bytes

    @property
    def llm_layers(self) -> int:
        """LLM depth the predictions refer to."""
        return self.llm.layers

    @property
    def layer_shares(self) -> dict[str, list[float]]:
        """FLOP shares of each encoder layer and the projector (last) in the encoder time, and of
        each LLM layer in the LLM time (the head's FLOPs spread over the layers)."""
        n, e = float(self.tokens_per_tile), self.encoder
        layer = 6.0 * e.layer_params * n + 3.0 * 4.0 * n * n * e.hidden
        projector = 6.0 * self._projector_params * self._projector_tokens
        total = layer * e.layers + projector
        return {
            "encoder": [layer / total] * e.layers + [projector / total],
            "llm": [1.0 / self.llm.layers] * self.llm.layers,
        }

    @property
    def param_bytes(self) -> dict[str, float]:
        """bf16 weight bytes of ``encoder``, ``projector`` and ``llm``."""
        return {
            "encoder": 2.0 * self.encoder.layer_params * self.encoder.layers,
            "projector": 2.0 * self._projector_params,
            "llm": 2.0 * (self.llm.layer_params * self.llm.layers + self.llm.embedding_params),
        }

    @property
    def hidden_bytes_per_token(self) -> float:
        """bf16 hidden state sent between LLM stages, per token."""
        return 2.0 * self.llm.hidden

    @property
    def encoder_hidden_bytes_per_token(self) -> float:
        """bf16 hidden state sent between encoder stages, per encoder token."""
        return 2.0 * self.encoder.hidden

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Forward+backward seconds ``(n, 2)`` ``[encoder, llm]`` of each sample at tp=1."""
        tiles = np.array([s.encoder_tiles for s in shapes], dtype=float)
        tokens = np.array([s.llm_tokens for s in shapes], dtype=float)
        return np.stack([self.encoder_seconds(tiles), self.llm_seconds(tokens)], axis=1).reshape(-1, 2)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Seconds ``(2,)`` of one microbatch: tiles batched, LLM sequences padded to the longest."""
        if not shapes:
            return np.zeros(2)
        tiles = sum(s.encoder_tiles for s in shapes)
        longest = max(s.llm_tokens for s in shapes)
        return np.array([tiles * self._s_per_tile, len(shapes) * longest * (self._s_lin + self._s_quad * longest)])

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """Seconds ``(n, 2)`` of each microbatch of ``groups`` (:meth:`predict_microbatch`, vectorised)."""
        tiles, padded, longest = self._microbatch_sizes(groups)
        return np.stack([tiles * self._s_per_tile, padded * (self._s_lin + self._s_quad * longest)], axis=1)

    def predict_microbatches_activation_bytes(self, groups: Microbatches) -> np.ndarray:
        """Kept bytes ``(n, 2)`` of each microbatch of ``groups`` (:meth:`predict_activation_bytes`, vectorised)."""
        tiles, padded, _ = self._microbatch_sizes(groups)
        return np.stack([tiles * self._kept[0], padded * self._kept[1]], axis=1)

    def predict_microbatches_working_bytes(self, groups: Microbatches) -> np.ndarray:
        """Transient bytes ``(n, 2)`` of each microbatch of ``groups`` (:meth:`predict_working_bytes`, vectorised)."""
        tiles, padded, _ = self._microbatch_sizes(groups)
        return np.stack([tiles * self._work[0], padded * self._work[1]], axis=1)

    @staticmethod
    def _microbatch_sizes(groups: Microbatches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per microbatch: tiles, padded LLM tokens (count x longest) and the longest sequence."""
        longest = groups.maxima(groups.columns.tokens)
        return groups.sums(groups.columns.tiles), groups.sizes * longest, longest

    def predict_activation_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Activation bytes ``(2,)`` kept for backward by one padded microbatch over the whole depth."""
        if not shapes:
            return np.zeros(2)
        tiles = sum(s.encoder_tiles for s in shapes)
        llm_tokens = len(shapes) * max(s.llm_tokens for s in shapes)
        return np.array([tiles * self._kept[0], llm_tokens * self._kept[1]], dtype=float)

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Bytes ``(2,)`` one microbatch needs beyond the parameters: the activations it keeps plus
        one layer's transient working set."""
        return self.predict_activation_bytes(shapes) + self.predict_working_bytes(shapes)

    def predict_working_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Transient bytes ``(2,)`` of one layer's recompute for a microbatch (logits not included)."""
        if not shapes:
            return np.zeros(2)
        tiles = sum(s.encoder_tiles for s in shapes)
        llm_tokens = len(shapes) * max(s.llm_tokens for s in shapes)
        return np.array([tiles * self._work[0], llm_tokens * self._work[1]], dtype=float)

    # -- formulas ------------------------------------------------------------------------------
    @property
    def _projector_params(self) -> int:
        return self.merge * self.encoder.hidden * self.llm.hidden + self.llm.hidden * self.llm.hidden

    @property
    def _projector_tokens(self) -> float:
        """Tokens the projector runs per unit: the encoder's, merged ``merge`` to one."""
        return float(self.tokens_per_tile // self.merge)

    @property
    def _recompute_factor(self) -> float:
        return 4.0 / 3.0 if self.activation_checkpointing else 1.0

    def encoder_flops_per_tile(self) -> float:
        """Forward+backward FLOPs of the encoder and projector for one tile (no recompute)."""
        n = float(self.tokens_per_tile)
        e = self.encoder
        matmul = 6.0 * (e.layer_params * e.layers * n + self._projector_params * self._projector_tokens)
        attention = 3.0 * 4.0 * n * n * e.hidden * e.layers
        return matmul + attention

    def llm_flops(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Forward+backward FLOPs of the LLM (head included) for sequences of ``tokens`` (no recompute)."""
        m = self.llm
        matmul = 6.0 * (m.layer_params * m.layers + m.vocab * m.hidden) * tokens
        attention = 3.0 * 2.0 * tokens * tokens * m.hidden * m.layers
        return matmul + attention

    def encoder_seconds(self, tiles: np.ndarray | float) -> np.ndarray | float:
        """Seconds for ``tiles`` tiles through encoder and projector at tp=1."""
        return tiles * self.encoder_flops_per_tile() * self._recompute_factor / self.gpu.achieved_flops

    def llm_seconds(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Seconds for one sequence of ``tokens`` tokens through the LLM at tp=1."""
        return self.llm_flops(tokens) * self._recompute_factor / self.gpu.achieved_flops

    @staticmethod
    def _layer_activation_per_token(spec: TransformerSpec) -> float:
        return 17.0 * spec.hidden + 6.0 * spec.mlp

    def _kept_per_token(self, spec: TransformerSpec) -> float:
        return 2.0 * spec.hidden if self.activation_checkpointing else self._layer_activation_per_token(spec)

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (the file's header is :func:`dflop_ds.cost.io.cost_model_to_dict`'s)."""
        return {
            "is_analytic": True,
            "note": "analytic: FLOP counts / assumed achieved throughput, stated memory formulas; not measured",
            "name": self.name,
            "encoder": asdict(self.encoder),
            "llm": asdict(self.llm),
            "gpu": asdict(self.gpu),
            "tokens_per_tile": self.tokens_per_tile,
            "activation_checkpointing": self.activation_checkpointing,
            "merge": self.merge,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "analytic cost model") -> AnalyticMLLM:
        """Inverse of :meth:`to_dict`; a malformed description is an error naming ``source``."""
        try:
            return cls._from_fields(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed analytic cost model, {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> AnalyticMLLM:
        return cls(
            encoder=TransformerSpec(**data["encoder"]),
            llm=TransformerSpec(**data["llm"]),
            gpu=GPUSpec(**data["gpu"]),
            tokens_per_tile=whole_count(data["tokens_per_tile"], "tokens_per_tile"),
            activation_checkpointing=bool(data["activation_checkpointing"]),
            name=str(data["name"]),
            merge=whole_count(data.get("merge", 1), "merge"),
        )


def whole_count(value: Any, key: str) -> int:
    """``value`` as a count of at least 1 (a float only when whole), else a ``ValueError`` naming ``key``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or value < 1
        or value != int(value)
    ):
        raise ValueError(f"{key} must be a whole count >= 1, got {value!r}")
    return int(value)


def reference_names(prefix: str = "") -> list[str]:
    """Names of the shipped reference models, ``<model>-<gpu>`` (those starting with ``prefix``)."""
    return [f"{model}-{gpu}" for model in REFERENCE_MLLMS for gpu in GPUS if model.startswith(prefix)]


def reference_model(name: str) -> AnalyticMLLM:
    """The analytic reference model called ``name`` (see :func:`reference_names`)."""
    model, _, gpu = name.lower().rpartition("-")
    if model not in REFERENCE_MLLMS or gpu not in GPUS:
        raise KeyError(f"unknown reference profile {name!r}; known: {', '.join(reference_names())}")
    sizes = REFERENCE_MLLMS[model]
    return AnalyticMLLM(
        encoder=sizes.encoder,
        llm=sizes.llm,
        gpu=GPUS[gpu],
        tokens_per_tile=sizes.tokens_per_tile,
        merge=sizes.merge,
        name=name.lower(),
    )
