"""The DeepSpeed config's own keys that dflop-ds reads, read in one place (:func:`deepspeed_keys`).

DeepSpeed owns these keys; dflop-ds only reads them, to check a setup (batch arithmetic, a plan's
assumptions), size the memory cap (ZeRO stage, precision) and place the model (tensor parallel).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the DeepSpeed batch keys: global batch, microbatch per GPU, microbatches per step
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
#: DeepSpeed config sections of the mixed precisions (at most one is enabled)
MIXED_PRECISIONS = ("bf16", "fp16")
#: a key's value that leaves it to the HuggingFace Trainer (accelerate's DeepSpeed plugin fills it)
AUTO = "auto"
#: the ZeRO stages DeepSpeed has
ZERO_STAGES = (0, 1, 2, 3)

#: a batch key as written: a number, ``"auto"``, or None where the config leaves it out
BatchValue = int | str | None


@dataclass(frozen=True)
class DeepSpeedKeys:
    """What dflop-ds reads of a DeepSpeed config.

    Attributes:
        zero_stage: ``zero_optimization.stage`` as written: a stage, ``"auto"`` (the HF Trainer's
            accelerate fills it in) or None (not set; DeepSpeed runs stage 0); :attr:`stage` reads it.
        precisions: the mixed-precision sections (:data:`MIXED_PRECISIONS`) with ``enabled`` true.
        autotp_size: ``tensor_parallel.autotp_size`` (1 without tensor parallelism).
        train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: the batch
            keys as written (a number, ``"auto"`` or None when absent); :meth:`batch_key` checks one.
    """

    zero_stage: int | str | None = None
    precisions: tuple[str, ...] = ()
    autotp_size: int = 1
    train_batch_size: BatchValue = None
    train_micro_batch_size_per_gpu: BatchValue = None
    gradient_accumulation_steps: BatchValue = None

    def check_stage_given(self) -> None:
        """A ``ValueError`` naming the key when the ZeRO stage is ``"auto"``, which only the HF
        Trainer (its accelerate DeepSpeed plugin) fills in: DeepSpeed itself needs a number."""
        if self.zero_stage == AUTO:
            raise ValueError(
                'DeepSpeed config: zero_optimization.stage is "auto", which only the HF Trainer (its accelerate'
                f" DeepSpeed plugin) fills in: give the ZeRO stage, one of {list(ZERO_STAGES)}"
            )

    @property
    def stage(self) -> int:
        """The ZeRO stage the run trains with (0 when the config sets none); ``"auto"`` is refused
        (:meth:`check_stage_given`)."""
        self.check_stage_given()
        return int(self.zero_stage or 0)

    @property
    def precision(self) -> str:
        """The training precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (no mixed precision enabled)."""
        return self.precisions[0] if self.precisions else "fp32"

    def batch_key(self, key: str) -> int | None:
        """Batch key ``key`` (one of :data:`BATCH_KEYS`) as a positive int, None when absent; a
        ``ValueError`` naming it for anything else (``"auto"`` is resolved by the Trainer, not here)."""
        value = getattr(self, key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"DeepSpeed config: {key} must be a positive integer, got {value!r}")
        return value


def zero_stage(value: Any) -> int | str | None:
    """``zero_optimization.stage`` as written, checked: None (not set), ``"auto"``, or a stage of
    :data:`ZERO_STAGES` (an integer, or its digits as a string); anything else is a ``ValueError``
    naming the key and the value."""
    if value is None or value == AUTO:
        return value
    stage = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str) and value.strip().isdigit():
        stage = int(value)
    if stage not in ZERO_STAGES:
        raise ValueError(
            f'DeepSpeed config: zero_optimization.stage must be one of {list(ZERO_STAGES)} or "auto", got {value!r}'
        )
    return stage


def deepspeed_keys(ds_config: Mapping[str, Any]) -> DeepSpeedKeys:
    """The keys of DeepSpeed config ``ds_config`` that dflop-ds reads (:class:`DeepSpeedKeys`): the
    one place they are read; a missing section reads as DeepSpeed's default."""
    return DeepSpeedKeys(
        zero_stage=zero_stage((ds_config.get("zero_optimization") or {}).get("stage")),
        precisions=tuple(key for key in MIXED_PRECISIONS if (ds_config.get(key) or {}).get("enabled")),
        autotp_size=int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1),
        **{key: ds_config.get(key) for key in BATCH_KEYS},
    )
