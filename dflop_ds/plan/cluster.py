"""The cluster the planner targets: GPU counts, memory, links, and the planner's own cost terms.

Tensor parallelism, communication and optimizer-state memory are the planner's business (the
cost model only predicts tp=1 compute), so their formulas live here, each one stated:

- tensor-parallel speed-up: ``tp / (1 + tp_overhead * log2(tp))`` (communication and smaller
  matmuls eat ``tp_overhead`` of the time per doubling); tp groups stay inside one node;
- ring all-reduce of ``b`` bytes over ``dp`` ranks: ``2 (dp - 1) / dp * b / bandwidth``, with the
  inter-node bandwidth once the group leaves a node;
- point-to-point transfer: ``bytes / bandwidth`` (intra- or inter-node);
- training state per weight byte (bf16 weights): weights 1x + bf16 gradients 1x + fp32
  master copy and Adam moments 6x, the 6x divided by dp under ZeRO stage 1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

Number = Any  # a float for scalar arguments, an array for array arguments


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
        zero_stage: 0 (no sharding) or 1 (optimizer states sharded over data parallel ranks).
        memory_reserve_bytes: per-GPU memory kept free (CUDA context, allocator, comm buffers).
        max_tp: largest tensor-parallel degree considered (default: ``gpus_per_node``).
    """

    gpus: int
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80e9
    intra_node_bw: float = 200e9
    inter_node_bw: float = 25e9
    tp_overhead: float = 0.1
    zero_stage: int = 1
    memory_reserve_bytes: float = 6e9
    max_tp: int | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Cluster needs gpus >= 1 and gpus_per_node >= 1, got {self.gpus}, {self.gpus_per_node}")
        if self.gpu_memory_bytes <= self.memory_reserve_bytes:
            raise ValueError(
                f"Cluster.gpu_memory_bytes={self.gpu_memory_bytes:.3g} "
                f"must exceed memory_reserve_bytes={self.memory_reserve_bytes:.3g}"
            )
        if self.zero_stage not in (0, 1):
            raise ValueError(f"Cluster.zero_stage must be 0 or 1, got {self.zero_stage}")

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
        """Training-state bytes per bf16 weight byte (weights, gradients, optimizer; elementwise over arrays)."""
        dp = np.asarray(dp, dtype=float)
        optimizer = 6.0 / dp if self.zero_stage >= 1 else np.full_like(dp, 6.0)
        return _scalar_or_array(2.0 + optimizer)

    def allreduce_seconds(self, nbytes: ArrayLike, dp: ArrayLike, inner: ArrayLike) -> Number:
        """Ring all-reduce of ``nbytes`` over ``dp`` ranks spaced ``inner`` GPUs apart (elementwise over arrays)."""
        nbytes, dp, inner = (np.asarray(x, dtype=float) for x in (nbytes, dp, inner))
        bw = np.where(dp * inner <= self.gpus_per_node, self.intra_node_bw, self.inter_node_bw)
        ring = 2.0 * np.maximum(dp - 1.0, 0.0) / np.maximum(dp, 1.0)
        return _scalar_or_array(ring * np.maximum(nbytes, 0.0) / bw)

    def p2p_seconds(self, nbytes: ArrayLike, stride: int) -> Number:
        """Send ``nbytes`` to a GPU ``stride`` ranks away (inter-node once the stride spans a node; elementwise)."""
        bw = self.intra_node_bw if stride < self.gpus_per_node else self.inter_node_bw
        return _scalar_or_array(np.asarray(nbytes, dtype=float) / bw)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields."""
        return asdict(self)


def _scalar_or_array(x: np.ndarray) -> Number:
    """A 0-d result as a Python float (scalar callers keep plain numbers), arrays as they are."""
    return float(x) if x.ndim == 0 else x
