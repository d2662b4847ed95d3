"""A tiny checkpoint builder for every registered HF model family, by the family's name: what the
parametrised family tests (tests/test_family_contract.py, the Trainer's packing test) run on. A
family registered without a builder here fails ``test_every_registered_family_has_a_tiny_builder``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from dflop_ds.testing.hf_tiny import build_tiny_llava
from dflop_ds.testing.internvl_tiny import build_tiny_internvl
from dflop_ds.testing.llava_onevision_tiny import build_tiny_llava_onevision
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl

#: family name -> ``(dir) -> dir`` writing a tiny random checkpoint of it (model, tokenizer, image processor)
FAMILY_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "LLaVA": partial(build_tiny_llava, vision="clip", text="llama"),
    "Qwen2-VL": build_tiny_qwen2_vl,
    "LLaVA-OneVision": build_tiny_llava_onevision,
    "InternVL": build_tiny_internvl,
}
