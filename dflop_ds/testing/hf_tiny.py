"""A tiny random HF LLaVA model directory, built offline, for tests and demos.

:func:`build_tiny_llava` writes what ``save_pretrained`` writes for a real checkpoint: a
``LlavaForConditionalGeneration`` (CLIP or SigLIP vision tower; Llama, Qwen2 or Mistral text
model) and a ``LlavaProcessor`` (the tower's image processor and a byte-level BPE tokenizer
trained in-process with ``tokenizers`` on a few sentences). It loads back with
``AutoProcessor.from_pretrained`` and ``AutoModelForImageTextToText.from_pretrained`` and nothing
is downloaded. Sizes are tiny (32 px images, 8 px patches, 16 image tokens, 64-wide text model)
so that a forward takes milliseconds; ``vision_sizes`` and ``text_sizes`` override them (real
layer sizes for profiling, e.g. ``benchmarks/gpu_check.py``). A directory is built once per
argument set and process and copied afterwards.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

IMAGE_SIZE = 32
PATCH_SIZE = 8
VISION_LAYERS = 3
TEXT_LAYERS = 3
#: the text model's sizes in every family (grouped-query attention: 4 query heads, 2 key/value heads)
TEXT_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=TEXT_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
#: the encoder-heavy model's vision tower (6 layers of 256, ~0.8M parameters each) and text model
#: (4 layers of 128, ~0.15M each, long enough for 1024 tokens): its encoder does about half the
#: work of an image chat, and every layer is larger than the 5e4-element buckets of
#: ds_configs/zero*_small_buckets.json
ENCODER_HEAVY_VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4)
ENCODER_HEAVY_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, max_position_embeddings=1024)
#: size overrides of a config, as sorted ``(key, value)`` pairs (hashable, for the build cache)
Sizes = tuple[tuple[str, Any], ...]
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
VISIONS = ("clip", "siglip")
TEXTS = ("llama", "qwen2", "mistral")
CORPUS = (
    "A chat between a curious human and an artificial intelligence assistant.",
    "USER: what is shown in the picture? ASSISTANT: a red car on a road near the sea.",
    "compare the two images, look at this one, describe it. hello, hi there, thanks!",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
)


def build_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS, extra_special_tokens: dict | None = None):
    """A ``PreTrainedTokenizerFast``: byte-level BPE (any text encodes) with bos, eos, pad and unk
    (``<s>``, ``</s>``, ``<pad>``, ``<unk>``), ``special_tokens`` (LLaVA's by default) and the
    named ``extra_special_tokens`` (default ``{"image_token": "<image>"}``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(special_tokens),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
        extra_special_tokens=extra_special_tokens or {"image_token": "<image>"},
    )


def _vision_parts(vision: str, overrides: Sizes = ()):
    """``(vision_config, image_processor, select_strategy, extra_tokens)`` of a tower family
    (tiny sizes, ``overrides`` replacing any of them)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, SiglipImageProcessor, SiglipVisionConfig

    sizes: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": VISION_LAYERS,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        **dict(overrides),
    }
    side = int(sizes["image_size"])
    if vision == "clip":
        processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        # "default" drops CLIP's CLS token, so an image gives exactly TOKENS_PER_IMAGE features
        return CLIPVisionConfig(projection_dim=32, **sizes), processor, "default", 1
    if vision == "siglip":
        siglip_processor = SiglipImageProcessor(size={"height": side, "width": side})
        return SiglipVisionConfig(**sizes), siglip_processor, "full", 0
    raise ValueError(f"unknown vision tower {vision!r}; choose one of {VISIONS}")


def _text_config(
    text: str, vocab_size: int, tie_word_embeddings: bool, sliding_window: int | None, ids: dict, overrides: Sizes = ()
):
    """The text model's config of a family (tiny sizes, grouped-query attention; ``overrides``
    replacing any of :data:`TEXT_SIZES`)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    sizes = dict(
        vocab_size=vocab_size,
        **{**TEXT_SIZES, **dict(overrides)},
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    if text == "llama":
        if sliding_window is not None:
            raise ValueError("a Llama text model has no sliding window")
        return LlamaConfig(**sizes)
    if text == "qwen2":
        return Qwen2Config(
            use_sliding_window=sliding_window is not None, sliding_window=sliding_window, max_window_layers=1, **sizes
        )
    if text == "mistral":
        return MistralConfig(sliding_window=sliding_window, **sizes)
    raise ValueError(f"unknown text model {text!r}; choose one of {TEXTS}")


@cache
def _built(
    vision: str,
    text: str,
    tie_word_embeddings: bool,
    seed: int,
    sliding_window: int | None,
    vision_feature_layer: int,
    vision_sizes: Sizes = (),
    text_sizes: Sizes = (),
    dtype: str | None = None,
) -> Path:
    """Build and save one tiny model directory in a process-wide temporary folder (cached)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = build_tokenizer()
    vision_config, image_processor, strategy, extra = _vision_parts(vision, vision_sizes)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    text_config = _text_config(text, len(tokenizer), tie_word_embeddings, sliding_window, ids, text_sizes)
    tokenizer.model_max_length = int(text_config.max_position_embeddings)
    patch_size = int(vision_config.patch_size)
    tokens_per_image = (int(vision_config.image_size) // patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy=strategy,
        vision_feature_layer=vision_feature_layer,
        image_seq_length=tokens_per_image,
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra,
    )
    return saved(f"tiny_llava_{vision}_{text}_", model, processor)


def saved(prefix: str, *parts) -> Path:
    """A new process-wide temporary folder holding ``part.save_pretrained`` of every part."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    for part in parts:
        part.save_pretrained(folder)
    return folder


def copied(source: Path, dir: str | Path) -> Path:
    """``dir`` (created if needed) with the files of a built ``source`` folder copied in."""
    target = Path(dir)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, dirs_exist_ok=True)
    return target


def build_tiny_llava(
    dir: str | Path,
    *,
    vision: str = "clip",
    text: str = "llama",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    sliding_window: int | None = None,
    vision_feature_layer: int = -2,
    vision_sizes: Mapping[str, Any] | None = None,
    text_sizes: Mapping[str, Any] | None = None,
    dtype: str | None = None,
) -> Path:
    """Write a tiny random LLaVA model + processor to ``dir`` (``save_pretrained`` layout); returns ``dir``.

    ``vision``: ``"clip"`` (``vision_feature_select_strategy="default"``) or ``"siglip"``
    (``"full"``); ``text``: ``"llama"``, ``"qwen2"`` or ``"mistral"``; ``sliding_window`` gives
    Mistral (all layers) or Qwen2 (layers after the first) a sliding-window attention.
    Weights are drawn from ``seed``; every image becomes :data:`TOKENS_PER_IMAGE` tokens unless
    ``vision_sizes`` (vision config keys: ``hidden_size``, ``image_size``, ``patch_size``, ...)
    or ``text_sizes`` (keys of :data:`TEXT_SIZES`; the tokenizer's ``model_max_length`` follows
    ``max_position_embeddings``) replace the tiny sizes. ``dtype`` (a torch dtype name such as
    ``"bfloat16"``) is the saved weights' dtype (default float32).
    """
    built = _built(
        vision,
        text,
        bool(tie_word_embeddings),
        int(seed),
        sliding_window,
        int(vision_feature_layer),
        tuple(sorted((vision_sizes or {}).items())),
        tuple(sorted((text_sizes or {}).items())),
        dtype,
    )
    return copied(built, dir)


def widened(sizes: Mapping[str, Any], width: int, keys: tuple[str, ...]) -> dict[str, Any]:
    """``sizes`` with each of ``keys`` (hidden sizes and head counts) multiplied by ``width``: the
    same layers and head size, ``width`` x wider (``width`` x ``width`` the compute per token)."""
    if width < 1:
        raise ValueError(f"width must be a positive integer, not {width}")
    return {key: value * width if key in keys else value for key, value in sizes.items()}


#: the size keys :func:`widened` scales in a LLaVA's vision and text configs
WIDTH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def build_encoder_heavy_llava(dir: str | Path, *, seed: int = 0, width: int = 1) -> Path:
    """Write the encoder-heavy tiny LLaVA (CLIP + Llama, :data:`ENCODER_HEAVY_VISION` and
    :data:`ENCODER_HEAVY_TEXT`) to ``dir``: the vision tower carries about half the work, as in
    the models whose ZeRO-3 runs meet per module. Every tower layer feeds the projector
    (``vision_feature_layer=-1``), so every parameter gets a gradient in every step. ``width``
    widens both towers (:func:`widened`): with the same modules, compute grows against ZeRO-3's
    per-module gathers, which take most of a width-1 microbatch's time on CPU ranks."""
    vision = widened(ENCODER_HEAVY_VISION, width, WIDTH_KEYS)
    text = widened({**TEXT_SIZES, **ENCODER_HEAVY_TEXT}, width, WIDTH_KEYS)  # the head counts widen too
    return build_tiny_llava(dir, seed=seed, vision_feature_layer=-1, vision_sizes=vision, text_sizes=text)


__all__ = [
    "ENCODER_HEAVY_TEXT",
    "ENCODER_HEAVY_VISION",
    "IMAGE_SIZE",
    "PATCH_SIZE",
    "SPECIAL_TOKENS",
    "TEXT_SIZES",
    "TOKENS_PER_IMAGE",
    "VISION_LAYERS",
    "WIDTH_KEYS",
    "build_encoder_heavy_llava",
    "build_tiny_llava",
    "build_tokenizer",
    "copied",
    "saved",
    "widened",
]
