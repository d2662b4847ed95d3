"""A LLaVA directory's processor: its ``AutoProcessor``, or one built from its tokenizer and image
processor (directories saved without a processor class), checked to expand an image to as many
tokens as the model makes features."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop_ds.jsonio import read_json_object
from dflop_ds.models.hf.base.chat_template import LEGACY_TEMPLATE_FILE


def load_processor(model_dir: Path, config: Any) -> Any:
    """The directory's ``AutoProcessor``; failing that, a ``LlavaProcessor`` from its tokenizer and
    image processor. Checks that an image expands to as many tokens as the model makes features."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, LlavaProcessor

    legacy = Path(model_dir) / LEGACY_TEMPLATE_FILE
    if legacy.is_file():  # AutoProcessor fails on a corrupt one, and the fallback below would hide why
        read_json_object(legacy)
    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        if not hasattr(processor, "image_processor"):
            raise ValueError("not a multimodal processor")
    except (OSError, ValueError, TypeError, KeyError) as first:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{model_dir}: no processor ({first}) and no tokenizer + image processor to build one from ({exc})"
            ) from exc
        processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    # a processor saved without these would not expand <image> to the model's feature count
    cls_token = 1 if config.vision_config.model_type == "clip_vision_model" else 0
    for name, value in (
        ("patch_size", config.vision_config.patch_size),
        ("vision_feature_select_strategy", config.vision_feature_select_strategy),
        ("num_additional_image_tokens", cls_token),
    ):
        if getattr(processor, name, None) is None:
            setattr(processor, name, value)
    expected = image_features_per_image(config)
    got = getattr(processor, "image_seq_length", None) or processor_image_tokens(processor, config)
    if got != expected:
        raise ValueError(
            f"{model_dir}: the processor expands an image to {got} tokens but the model makes {expected} "
            "features per image (patch size, image size or select strategy disagree)"
        )
    return processor


def image_features_per_image(config: Any) -> int:
    """Features one image gives: patches, plus CLIP's CLS token unless the "default" strategy drops it."""
    vision = config.vision_config
    patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
    cls_token = 1 if vision.model_type == "clip_vision_model" else 0
    return patches + cls_token - (1 if config.vision_feature_select_strategy == "default" else 0)


def processor_image_tokens(processor: Any, config: Any) -> int:
    """Image tokens the processor writes for one image."""
    from PIL import Image

    encoded = processor(images=[Image.new("RGB", (20, 20))], text=["<image>"], return_tensors="pt")
    return int((encoded["input_ids"] == config.image_token_id).sum())


__all__ = ["image_features_per_image", "load_processor", "processor_image_tokens"]
