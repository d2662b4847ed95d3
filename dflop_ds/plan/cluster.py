"""The cluster the planner targets: GPU counts, memory, links, and the planner's own cost terms.

Tensor parallelism, communication and optimizer-state memory are the planner's business (the
cost model only predicts tp=1 compute), so their formulas live here, each one stated:

- tensor-parallel speed-up: ``tp / (1 + tp_overhead * log2(tp))`` (communication and smaller
  matmuls eat ``tp_overhead`` of the time per doubling); tp groups stay inside one node;
- ring all-reduce of ``b`` bytes over ``dp`` ranks: ``2 (dp - 1) / dp * b / bandwidth``, with the
  inter-node bandwidth once the group leaves a node;
- point-to-point transfer: ``bytes / bandwidth`` (intra- or inter-node);
- training state per weight byte (the cost model's ``param_bytes``, in the training precision)
  with Adam (:data:`STATE_TERMS`): bf16/fp16 mixed precision keeps 16-bit weights 1x + 16-bit
  gradients 1x + fp32 master copy and Adam moments 6x; fp32 keeps weights 1x + gradients 1x +
  Adam moments 2x; ZeRO stage 1 divides the optimizer term by dp, stage 2 the gradients too,
  stage 3 the weights too (:data:`ZERO_SHARDED`);
- gradient synchronisation under ZeRO stage 3 also gathers the weights in forward and backward:
  three ring collectives of ``(dp - 1) / dp * b`` instead of the all-reduce's two (x1.5);
- how data-parallel ranks meet in a single-stage (``pp = 1``) step (:meth:`Cluster.sync_model`,
  :mod:`dflop_ds.sync`): at the accumulation boundary under ZeRO-0/1, per module (encoder and LLM
  apart, every microbatch) under ZeRO-3 and under ZeRO-2 with reduce buckets smaller than a layer
  (``module_buckets``, true of every real model), per micro-step under ZeRO-2 otherwise.

DeepSpeed's pipeline engine runs ZeRO stages 0 and 1 only, so a pipeline (``pp > 1``) needs
``zero_stage <= 1``; DeepSpeed AutoTP (how HuggingFace models get tensor parallelism here) shards
the plain engine's model only, so with ``autotp=True`` a pipeline also needs ``tp == 1``
(:meth:`Cluster.runs_shared`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dflop_ds.sync import SyncModel, sync_model_for

#: the training-state terms (per weight byte) each ZeRO stage shards over data-parallel ranks:
#: ``(weights, gradients, optimizer)``, sharded when True
ZERO_SHARDED = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}
#: bytes per weight byte of weights, gradients and optimizer state (master weights + Adam moments)
STATE_TERMS = {"bf16": (1.0, 1.0, 6.0), "fp16": (1.0, 1.0, 6.0), "fp32": (1.0, 1.0, 2.0)}
#: training precisions the memory model covers; the 16-bit ones are DeepSpeed config sections
PRECISIONS = tuple(STATE_TERMS)


Number = Any  # a float for scalar arguments, an array for array arguments


#: memory per GPU when neither the user nor the cost model says (an 80 GB A100 or H100)
DEFAULT_GPU_MEMORY_BYTES = 80e9


@dataclass(frozen=True)
class Cluster:
    """GPUs and links.

    Args:
        gpus: GPUs in the job.
        gpus_per_node: GPUs sharing a fast intra-node link (tensor-parallel groups stay inside).
        gpu_memory_bytes: memory per GPU.
        intra_node_bw: bytes/s of one direction of the intra-node link (NVLink), effective.
        inter_node_bw: bytes/s per GPU across nodes (e.g. 200 Gb/s InfiniBand ~ 25e9), effective.
        tp_overhead: fraction of time lost per doubling of tensor parallelism.
        zero_stage: DeepSpeed ZeRO stage 0-3 (what is sharded over data-parallel ranks: nothing,
            optimizer states, + gradients, + weights).
        precision: ``"bf16"`` or ``"fp16"`` mixed precision, or ``"fp32"``; the cost model's weight
            and activation bytes are taken to be in this precision.
        memory_reserve_bytes: per-GPU memory kept free (CUDA context, allocator, comm buffers).
        autotp: tensor parallelism comes from DeepSpeed AutoTP (plain engine only: no ``tp > 1``
            with ``pp > 1``); False for engines with their own tensor-parallel layers.
        max_tp: largest tensor-parallel degree considered (None: ``gpus_per_node``;
            :func:`dflop_ds.plan.planner.make_plans` sets it from the model).
        module_buckets: ZeRO-2's reduce buckets are smaller than one layer (DeepSpeed's default
            5e8 elements against ~2e8 in a 7B decoder layer with its bucketed backward: true of
            real models), so the encoder and the LLM meet apart; False: ranks meet once per
            micro-step (a model small enough for one bucket).
    """

    gpus: int
    gpus_per_node: int = 8
    gpu_memory_bytes: float = DEFAULT_GPU_MEMORY_BYTES
    intra_node_bw: float = 200e9
    inter_node_bw: float = 25e9
    tp_overhead: float = 0.1
    zero_stage: int = 1
    precision: str = "bf16"
    autotp: bool = False
    memory_reserve_bytes: float = 6e9
    max_tp: int | None = None
    module_buckets: bool = True

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Cluster needs gpus >= 1 and gpus_per_node >= 1, got {self.gpus}, {self.gpus_per_node}")
        if self.gpu_memory_bytes <= self.memory_reserve_bytes:
            raise ValueError(
                f"Cluster.gpu_memory_bytes={self.gpu_memory_bytes:.3g} "
                f"must exceed memory_reserve_bytes={self.memory_reserve_bytes:.3g}"
            )
        if self.zero_stage not in ZERO_SHARDED:
            raise ValueError(f"Cluster.zero_stage must be one of {sorted(ZERO_SHARDED)}, got {self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Cluster.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.max_tp is not None and self.max_tp < 1:
            raise ValueError(f"Cluster.max_tp must be >= 1, got {self.max_tp}")

    @property
    def usable_memory(self) -> float:
        """Bytes per GPU the plan may fill: memory minus the reserve."""
        return self.gpu_memory_bytes - self.memory_reserve_bytes

    def tp_degrees(self) -> list[int]:
        """Tensor-parallel degrees considered: powers of two up to ``max_tp`` within a node."""
        limit = min(self.gpus_per_node, self.max_tp or self.gpus_per_node, self.gpus)
        return [1 << k for k in range(int(math.log2(limit)) + 1) if (1 << k) <= limit]

    def tp_speedup(self, tp: ArrayLike) -> Number:
        """Compute speed-up of ``tp``-way tensor parallelism (elementwise over arrays)."""
        tp = np.asarray(tp, dtype=float)
        return _scalar_or_array(tp / (1.0 + self.tp_overhead * np.log2(tp)))

    def state_factor(self, dp: ArrayLike) -> Number:
        """Training-state bytes per weight byte (weights, gradients, optimizer) on a GPU of a
        ``dp``-way data-parallel group under the ZeRO stage (elementwise over arrays)."""
        return state_factor(self.precision, self.zero_stage, dp)

    @property
    def sync_factor(self) -> float:
        """Gradient synchronisation bytes moved relative to a ring all-reduce (1.5 under ZeRO-3)."""
        return 1.5 if self.zero_stage == 3 else 1.0

    def sync_model(self, pipeline_stages: int = 1) -> SyncModel:
        """How data-parallel ranks meet in a step of ``pipeline_stages`` stages under this
        cluster's ZeRO stage (:func:`dflop_ds.sync.sync_model_for`): a pipeline, or for one stage
        ``boundary`` (ZeRO-0/1), ``module`` (ZeRO-3, and ZeRO-2 with ``module_buckets``) or ``microstep``."""
        return sync_model_for(self.zero_stage, pipeline_stages, self.module_buckets)

    def runs_shared(self, tp: int, pp: int) -> bool:
        """Whether one DeepSpeed engine runs ``tp``-way tensor parallelism with ``pp`` pipeline
        stages: a pipeline needs ZeRO 0/1, and no tensor parallelism under AutoTP."""
        return pp == 1 or (self.zero_stage <= 1 and (tp == 1 or not self.autotp))

    def allreduce_seconds(self, nbytes: ArrayLike, dp: ArrayLike, inner: ArrayLike) -> Number:
        """Gradient synchronisation of ``nbytes`` over ``dp`` ranks spaced ``inner`` GPUs apart: a
        ring all-reduce, times :attr:`sync_factor` (elementwise over arrays)."""
        nbytes, dp, inner = (np.asarray(x, dtype=float) for x in (nbytes, dp, inner))
        bw = np.where(dp * inner <= self.gpus_per_node, self.intra_node_bw, self.inter_node_bw)
        ring = 2.0 * np.maximum(dp - 1.0, 0.0) / np.maximum(dp, 1.0)
        return _scalar_or_array(self.sync_factor * ring * np.maximum(nbytes, 0.0) / bw)

    def p2p_seconds(self, nbytes: ArrayLike, stride: int) -> Number:
        """Send ``nbytes`` to a GPU ``stride`` ranks away (inter-node once the stride spans a node; elementwise)."""
        bw = self.intra_node_bw if stride < self.gpus_per_node else self.inter_node_bw
        return _scalar_or_array(np.asarray(nbytes, dtype=float) / bw)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields."""
        return asdict(self)


def state_factor(precision: str, zero_stage: int, dp: ArrayLike, trainable: bool = True) -> Number:
    """Training-state bytes per weight byte on a rank of a ``dp``-way data-parallel group:
    :data:`STATE_TERMS` of ``precision``, each term sharded over ``dp`` where ZeRO stage
    ``zero_stage`` shards it (:data:`ZERO_SHARDED`); a frozen weight (``trainable=False``) keeps
    its weights alone (elementwise over arrays)."""
    dp = np.asarray(dp, dtype=float)
    total = np.zeros_like(dp)
    for term, sharded in zip(STATE_TERMS[precision], ZERO_SHARDED[zero_stage]):
        total = total + (term / dp if sharded else term)
        if not trainable:
            break
    return _scalar_or_array(total)


def _scalar_or_array(x: np.ndarray) -> Number:
    """A 0-d result as a Python float (scalar callers keep plain numbers), arrays as they are."""
    return float(x) if x.ndim == 0 else x
