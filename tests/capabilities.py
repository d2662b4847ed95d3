"""What the tests may ask of the accelerator, and how a run pretends a device lacks a precision.

``DFLOP_DS_TEST_DENY_PRECISIONS=fp16,bf16`` (or ``pytest --deny-precisions fp16,bf16``, which sets
it) makes DeepSpeed's accelerator report those precisions unsupported, in the pytest process
(tests/conftest.py) and in every test script on DeepSpeed ranks that calls :func:`deny_from_env`,
so the suite can be proved green on a device without them. It is test code only: dflop_ds itself
always asks the real accelerator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

#: comma-separated precisions (fp16, bf16) the accelerator is made to report unsupported
DENY_ENV = "DFLOP_DS_TEST_DENY_PRECISIONS"
#: precision -> (the accelerator's question, the torch dtype it lists in supported_dtypes())
_QUERIES = {"fp16": ("is_fp16_supported", "float16"), "bf16": ("is_bf16_supported", "bfloat16")}


def parse_denied(value: str) -> list[str]:
    """The precisions of a ``DFLOP_DS_TEST_DENY_PRECISIONS`` value; an unknown one is refused by name."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - set(_QUERIES))
    if unknown:
        raise ValueError(f"{DENY_ENV}: unknown precisions {unknown}; choose from {sorted(_QUERIES)}")
    return names


def deny_precisions(precisions: list[str], patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make DeepSpeed's accelerator report ``precisions`` unsupported (``patch(obj, name, value)``
    sets the attributes: ``setattr``, or a pytest monkeypatch's ``setattr`` to undo it)."""
    if not precisions:
        return
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    denied_dtypes = [getattr(torch, _QUERIES[p][1]) for p in precisions]
    listed = accelerator.supported_dtypes
    for precision in precisions:
        patch(accelerator, _QUERIES[precision][0], lambda: False)
    patch(accelerator, "supported_dtypes", lambda: [d for d in listed() if d not in denied_dtypes])


def deny_from_env() -> list[str]:
    """Apply :data:`DENY_ENV` in this process (a script on DeepSpeed ranks); the precisions denied."""
    denied = parse_denied(os.environ.get(DENY_ENV, ""))
    deny_precisions(denied)
    return denied
