"""LoRA fine-tuning of a LLaVA model's language model with ``peft``, as LLaVA's own scripts train.

:func:`apply_lora` injects low-rank adapters into the language model's linear layers in place,
so the layer lists built afterwards (or before: the decoder layers are the same objects) train
the adapters. Trainable afterwards: the adapters and the multimodal projector (LLaVA trains its
projector in LoRA runs too); the vision tower, the embeddings, the base linears and the head
stay frozen. The trained model is written back by merging the adapters into the base weights
(``merge_and_unload``), so transformers loads it as a plain checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: linear layers of a Llama/Qwen2/Mistral decoder layer that get adapters by default
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_KEYS: dict[str, type | tuple[type, ...]] = {
    "r": int,
    "alpha": (int, float),
    "dropout": (int, float),
    "target_modules": list,
}


@dataclass(frozen=True)
class LoraSettings:
    """The ``dflop.model.lora`` section: adapter rank ``r``, scaling ``alpha``, ``dropout`` and the
    ``target_modules`` (names of the language model's linear layers) that get adapters."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    @classmethod
    def from_dict(cls, block: Mapping[str, Any], source: str = "dflop.model.lora") -> LoraSettings:
        """Validated settings with defaults (``r`` 8, ``alpha`` 16, ``dropout`` 0.0, the attention
        and MLP projections); unknown keys and bad values are refused by name."""
        unknown = sorted(set(block) - set(LORA_KEYS))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(LORA_KEYS)}")
        settings = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": list(DEFAULT_TARGETS), **block}
        for key, kind in LORA_KEYS.items():
            value = settings[key]
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{source}.{key} has an invalid value {value!r}")
        if settings["r"] < 1 or settings["alpha"] <= 0 or not 0 <= settings["dropout"] < 1:
            raise ValueError(f"{source}: need r >= 1, alpha > 0 and 0 <= dropout < 1, got {settings}")
        if not settings["target_modules"] or not all(isinstance(m, str) for m in settings["target_modules"]):
            raise ValueError(f"{source}.target_modules must be a non-empty list of module names")
        return cls(**{**settings, "target_modules": tuple(settings["target_modules"])})


def lora_targets(model: Any, pattern: str, targets: Sequence[str]) -> None:
    """Check that the modules whose full name matches ``pattern`` (as peft matches a string of
    ``target_modules``: ``re.fullmatch``) are all ``torch.nn.Linear`` layers; ``ValueError`` saying
    that none matches, or naming a few matched modules that are not Linear layers."""
    import torch

    matched = [(name, module) for name, module in model.named_modules() if re.fullmatch(pattern, name)]
    if not matched:
        raise ValueError(f"LoRA: no module of the language model matches target_modules {list(targets)}")
    other = [f"{name} ({type(module).__name__})" for name, module in matched if not isinstance(module, torch.nn.Linear)]
    if other:
        more = f" and {len(other) - 3} more" if len(other) > 3 else ""
        raise ValueError(
            f"LoRA: target_modules {list(targets)} match {len(matched)} module(s) of the language model, but"
            f" {len(other)} of them are not Linear layers: {', '.join(other[:3])}{more}; name Linear layers"
            f" such as {list(DEFAULT_TARGETS)}"
        )


def apply_lora(model: Any, settings: LoraSettings, *, keep_trainable: str = "multi_modal_projector") -> Any:
    """Inject LoRA adapters into ``model``'s language model (in place); returns the ``PeftModel``.

    Only modules under the language model are targeted (never the vision tower or the
    projector); parameters whose name contains ``keep_trainable`` (the projector: LLaVA's
    ``multi_modal_projector``, Qwen2-VL's ``visual.merger``) stay trained in full. Raises
    ``ValueError`` when no module of the language model matches ``target_modules``, or when a
    matched module is not a Linear layer (:func:`lora_targets`).
    """
    from peft import LoraConfig, get_peft_model

    names = "|".join(sorted(set(settings.target_modules)))
    pattern = rf".*language_model.*\.({names})$"
    lora_targets(model, pattern, settings.target_modules)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft scales by alpha / r: a float works
        lora_dropout=settings.dropout,
        target_modules=pattern,
    )
    peft_model = get_peft_model(model, config)
    for name, parameter in model.named_parameters():
        if keep_trainable in name:
            parameter.requires_grad_(True)
    return peft_model
