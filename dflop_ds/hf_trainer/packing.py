"""Padding-free microbatches through a user's HF model on any device: attention inside each sample.

A padding-free collator (``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
TRL's ``padding_free=True``, or :class:`PaddingFreeCollator`) joins a microbatch into one row and
names the samples' bounds (``cu_seq_lens_q/k``). Flash attention reads them on GPUs that have it;
elsewhere HF's ``sdpa`` masks a full ``N x N`` product (or, with a cache or no per-sample
``position_ids``, attends across samples). :func:`use_segment_attention` makes the text model run
one causal attention per sample instead (:func:`dflop_ds.models.hf.base.packed.segment_attention`), so
attention costs the sum of the squared sample lengths and the loss is the padded batch's.

``DFLOPTrainer(dflop={"model": {"packing": True}})`` uses all of it: :func:`packing_collator`
picks (or checks) the collator, :func:`use_segment_attention` switches the attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from dflop_ds.models.hf.base.packed import PACKED_ATTENTION, register_segment_attention
from dflop_ds.models.hf.registry import trainer_parts_of
from dflop_ds.models.hf.trainer_parts import DEFAULT_MEDIA_KEYS

#: per-sample media tensors of a model no family registers, concatenated along dim 0 in sample order
MEDIA_KEYS = DEFAULT_MEDIA_KEYS


def no_cache(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: the call runs without a KV cache (a cache would make HF build a mask
    across the samples of a padding-free row), leaving the model's config as the user saved it."""
    return args, {**kwargs, "use_cache": False}


def use_segment_attention(model: Any) -> str:
    """Switch ``model``'s text attention to per-sample attention for padding-free training
    microbatches (every batch must then carry ``cu_seq_lens_q`` and no ``attention_mask``; a
    padded one is refused by name), and its forward calls to no cache (a pre-hook: the config,
    and so the saved model, keeps the user's ``use_cache``); a flash-attention implementation is
    kept (it reads the same bounds). Returns the text model's attention implementation now in use."""
    from transformers.utils.generic import is_flash_attention_requested

    text_config = model.config.get_text_config()
    if not getattr(model, "_dflop_no_cache", False):
        model.register_forward_pre_hook(no_cache, with_kwargs=True)
        model._dflop_no_cache = True
    if not is_flash_attention_requested(text_config):
        register_segment_attention()
        text_config._attn_implementation_internal = PACKED_ATTENTION
    return str(text_config._attn_implementation)


def padded_to_largest(parts: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """``parts`` zero-padded after their data to the largest size of every dim but the first
    (``ValueError`` naming ``key`` when their ranks differ)."""
    if len({part.dim() for part in parts}) > 1:
        raise ValueError(f"padding-free batch: the samples' {key!r} have different ranks {[p.dim() for p in parts]}")
    largest = [max(part.shape[d] for part in parts) for d in range(1, parts[0].dim())]
    out = []
    for part in parts:
        pad: list[int] = []
        for d in reversed(range(1, part.dim())):
            pad += [0, largest[d - 1] - part.shape[d]]
        out.append(torch.nn.functional.pad(part, pad) if any(pad) else part)
    return out


def concatenated_media(items: list[dict], keys: tuple[str, ...] = MEDIA_KEYS, padded: tuple[str, ...] = ()) -> dict:
    """Every sample's media of ``keys``, concatenated along dim 0 in sample order (``padded`` ones
    zero-padded to the largest sample's shape first); a sample whose value is None or absent has
    none (a text-only item may say ``pixel_values=None``); keys no sample has are left out. A value
    that is not a tensor, or shapes that cannot be joined, raise ``ValueError`` naming the key."""
    out = {}
    for key in keys:
        parts = [item[key] for item in items if item.get(key) is not None]
        if not parts:
            continue
        bad = next((i for i, part in enumerate(parts) if not torch.is_tensor(part)), None)
        if bad is not None:
            raise ValueError(
                f"padding-free batch: {key!r} of a sample is a {type(parts[bad]).__name__}, not a tensor (or None)"
            )
        if key in padded:
            parts = padded_to_largest(parts, key)
        try:
            out[key] = torch.cat(parts)
        except RuntimeError as error:
            shapes = [tuple(part.shape) for part in parts]
            raise ValueError(
                f"padding-free batch: the samples' {key!r} cannot be joined (shapes {shapes}): {error}"
            ) from error
    return out


def token_lists(item: Any, position: int) -> dict[str, list[int]]:
    """``item``'s ``input_ids`` and ``labels`` as lists for the flattening, refusing an item that
    lacks one, holds one that is not a 1-D tensor, or whose labels do not match its tokens one for
    one (packed, they would supervise the wrong tokens), naming its position in the batch."""
    lists = {}
    for key in ("input_ids", "labels"):
        value = item.get(key) if isinstance(item, dict) else None
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ""
            raise ValueError(
                f"padding-free collator: batch item {position} needs {key!r} as a 1-D tensor (one sample, no batch"
                f" dimension), got {type(value).__name__}{shape}"
            )
        lists[key] = value.tolist()
    if len(lists["labels"]) != len(lists["input_ids"]):
        raise ValueError(
            f"padding-free collator: batch item {position} has {len(lists['input_ids'])} input_ids but"
            f" {len(lists['labels'])} labels: give one label per token (-100 where none is learned)"
        )
    return lists


class PaddingFreeCollator:
    """Padding-free: transformers' ``DataCollatorWithFlattening`` (one row, ``labels`` separated,
    per-sample text ``position_ids``) over items with ``input_ids`` and ``labels`` tensors, the
    samples' media of ``media_keys`` concatenated (``padded_keys`` padded first,
    :func:`concatenated_media`); with ``rope_index`` (a Qwen2-VL model's ``get_rope_index``, which
    also needs each item's ``mm_token_type_ids``) each sample's M-RoPE rows are prepended with the
    text row into ``position_ids [4, 1, N]``; ``sample_bounds``: also the flattening's
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` (what per-sample attention reads)."""

    def __init__(
        self,
        rope_index: Callable[..., Any] | None = None,
        sample_bounds: bool = False,
        media_keys: tuple[str, ...] = MEDIA_KEYS,
        padded_keys: tuple[str, ...] = (),
    ) -> None:
        self.rope_index = rope_index
        self.media_keys, self.padded_keys = tuple(media_keys), tuple(padded_keys)
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=sample_bounds)

    def __call__(self, items: list[dict]) -> dict:
        flat = self.flatten([token_lists(item, n) for n, item in enumerate(items)])
        batch = {**flat, **concatenated_media(items, self.media_keys, self.padded_keys)}
        if self.rope_index is None:
            return batch
        rows = []
        for item in items:
            positions, _ = self.rope_index(
                item["input_ids"][None],
                item["mm_token_type_ids"][None],
                image_grid_thw=item.get("image_grid_thw"),
                video_grid_thw=item.get("video_grid_thw"),
            )
            rows.append(positions)
        batch["position_ids"] = torch.cat([flat["position_ids"][None], torch.cat(rows, dim=2)], dim=0)
        batch["mm_token_type_ids"] = torch.cat([item["mm_token_type_ids"] for item in items])[None]
        return batch


def padding_free_collator(model: Any, sample_bounds: bool = True) -> PaddingFreeCollator:
    """The :class:`PaddingFreeCollator` ``model``'s family gives (looked up once through the
    registry, :func:`~dflop_ds.models.hf.registry.trainer_parts_of`): its media keys and, for
    M-RoPE families, positions from the model's own ``get_rope_index``; a model no family registers
    gets per-sample text positions and :data:`MEDIA_KEYS`."""
    parts = trainer_parts_of(model.config)
    if parts is None:
        return PaddingFreeCollator(sample_bounds=sample_bounds)
    return PaddingFreeCollator(parts.rope_index(model), sample_bounds, parts.media_keys, parts.padded_keys)


def chosen_collator(passed: Any | None, in_use: Any) -> Any | None:
    """The collator a packed run must respect: the one ``passed`` to the Trainer, else the one a
    Trainer subclass chose itself (``in_use``, e.g. TRL's ``SFTTrainer``'s), else None when
    ``in_use`` is only transformers' default (``default_data_collator``, ``DataCollatorWithPadding``)."""
    from transformers import DataCollatorWithPadding, default_data_collator

    if passed is not None:
        return passed
    return None if in_use is default_data_collator or isinstance(in_use, DataCollatorWithPadding) else in_use


def packing_collator(model: Any, collator: Any | None) -> Any:
    """The collator of a packed run (``dflop.model.packing=true``): ``collator`` when it is padding
    free with the samples' bounds (a :class:`PaddingFreeCollator` or transformers'
    ``DataCollatorWithFlattening``, both with them), :func:`padding_free_collator` when None; any
    other collator is refused by class (it is never replaced silently)."""
    if collator is None:
        return padding_free_collator(model)
    flattening = collator.flatten if isinstance(collator, PaddingFreeCollator) else collator
    if not isinstance(flattening, DataCollatorWithFlattening):
        raise ValueError(
            f"dflop.model.packing=true, but data_collator is a {type(collator).__qualname__}, which is not padding"
            " free: pass no data_collator (DFLOPTrainer then packs with dflop_ds.hf_trainer.padding_free_collator),"
            " or leave packing out of the dflop block to keep your collator (the sampler then balances padded cost)"
        )
    if not flattening.return_flash_attn_kwargs:
        raise ValueError(
            f"dflop.model.packing=true: the {type(collator).__qualname__} gives no sample bounds (cu_seq_lens_q),"
            " which the per-sample attention reads: build it with"
            " DataCollatorWithFlattening(return_flash_attn_kwargs=True)"
        )
    return collator


__all__ = [
    "MEDIA_KEYS",
    "PaddingFreeCollator",
    "chosen_collator",
    "concatenated_media",
    "packing_collator",
    "padding_free_collator",
    "use_segment_attention",
]
