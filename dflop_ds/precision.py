"""Whether this device trains in a precision, asked of DeepSpeed's accelerator before DeepSpeed is.

DeepSpeed refuses an unsupported 16-bit precision only once its engine is being built, with
``Type fp16 is not supported on your device.``; on its CPU accelerator fp16 support depends on the
processor's instruction set (AVX-512 FP16), so a config that trains on one machine fails on
another. :func:`check_precisions` refuses earlier, naming the precision, the device and the
config or plan that asked for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: precision -> the accelerator's question (fp32 is every device's)
_SUPPORT_QUERIES = {"fp16": "is_fp16_supported", "bf16": "is_bf16_supported"}


class UnsupportedPrecisionError(ValueError):
    """The device cannot train in a precision a config or plan asks for (the message names both)."""


def _accelerator(accelerator: Any = None) -> Any:
    if accelerator is not None:
        return accelerator
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def describe_device(accelerator: Any = None) -> str:
    """The device DeepSpeed trains on, in words: its name and DeepSpeed's accelerator class."""
    accelerator = _accelerator(accelerator)
    return f"the {accelerator.device_name()} device (DeepSpeed's {type(accelerator).__name__})"


def precision_supported(precision: str, accelerator: Any = None) -> bool:
    """Whether DeepSpeed's accelerator reports ``precision`` (``"fp32"``, ``"fp16"``, ``"bf16"``) as supported."""
    query = _SUPPORT_QUERIES.get(precision)
    return query is None or bool(getattr(_accelerator(accelerator), query)())


def check_precisions(precisions: Iterable[str], where: str, accelerator: Any = None) -> None:
    """Raise :class:`UnsupportedPrecisionError` for the first of ``precisions`` the device cannot
    train in, naming it, the device and ``where`` (the config or plan that asked for it)."""
    for precision in precisions:
        if not precision_supported(precision, accelerator):
            others = [p for p in ("bf16", "fp32") if p != precision and precision_supported(p, accelerator)]
            raise UnsupportedPrecisionError(
                f"{where} trains in {precision}, which {describe_device(accelerator)} does not support"
                f" (its is_{precision}_supported() is false): use {' or '.join(others)} instead"
                f" ({precision}.enabled false in the DeepSpeed config, or re-plan with --precision)"
            )
