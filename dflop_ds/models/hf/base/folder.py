"""Check a ``save_pretrained`` model folder before transformers reads it.

transformers reports a folder without weights or without a tokenizer with a long traceback (a
missing tokenizer even blames sentencepiece); :func:`check_model_folder` says which part is
missing, naming the folder and the files looked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dflop_ds.data.errors import PathArg
from dflop_ds.models.hf.base.chat_template import checkpoint_chat_template

#: Files holding a model's weights (one is enough; sharded weights come with an index).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
#: The file ``save_pretrained`` writes a chat template to (tokenizers and processors read it back).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: Files a tokenizer is loaded from (one is enough): fast, SentencePiece, BPE and WordPiece vocabularies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def missing_parts(model_dir: PathArg, *, weights: bool = True, tokenizer: bool = True) -> list[str]:
    """What the folder ``model_dir`` lacks of a ``save_pretrained`` model (empty when nothing)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return ["config.json (the folder does not exist or is not a folder)"]
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if weights and not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append(f"weights (none of {', '.join(WEIGHT_PATTERNS)})")
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return missing


def check_model_folder(model_dir: PathArg, *, weights: bool = True, tokenizer: bool = True) -> None:
    """Raise ``FileNotFoundError`` naming ``model_dir`` and every part it lacks (:func:`missing_parts`).

    ``weights`` / ``tokenizer``: whether the caller reads them (a tokenizer-only reader does not
    need weights).
    """
    missing = missing_parts(model_dir, weights=weights, tokenizer=tokenizer)
    if missing:
        raise FileNotFoundError(
            f"model folder {model_dir}: no {'; no '.join(missing)} (expected what save_pretrained of the "
            "model and of its processor or tokenizer writes)"
        )


def load_text_and_image_parts(model_dir: PathArg) -> tuple[Any, Any, Any]:
    """``(tokenizer, image_processor, config)`` of a ``save_pretrained`` directory, offline, after
    :func:`check_model_folder` (weights not needed): what a family's preprocessor is built from."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    path = str(model_dir)
    check_model_folder(path, weights=False)
    return (
        AutoTokenizer.from_pretrained(path, local_files_only=True),
        AutoImageProcessor.from_pretrained(path, local_files_only=True),
        AutoConfig.from_pretrained(path, local_files_only=True),
    )


Loaded = TypeVar("Loaded")


def from_model_dir(cls: Callable[..., Loaded], model_dir: PathArg, prefix: str, **kwargs: Any) -> Loaded:
    """``cls(tokenizer, image_processor, config, **kwargs)`` of a ``save_pretrained`` directory
    (offline), named ``prefix:<directory name>`` unless ``kwargs`` name it; with ``chat_template``
    unset or ``True`` it gets the checkpoint's own template, its legacy ``chat_template.json`` included."""
    tokenizer, image_processor, config = load_text_and_image_parts(model_dir)
    kwargs.setdefault("name", f"{prefix}:{Path(model_dir).name}")
    if kwargs.get("chat_template", True) is True:
        kwargs["chat_template"] = checkpoint_chat_template(tokenizer, model_dir=model_dir) or False
    return cls(tokenizer, image_processor, config, **kwargs)


def save_text_and_image_parts(preprocessor: Any, directory: PathArg) -> None:
    """Save a preprocessor's tokenizer and image processor into ``directory`` (what
    :func:`from_model_dir` loads back), with the chat template it tokenizes with (``chat_template.jinja``)
    when the tokenizer does not carry it (one from a legacy ``chat_template.json`` or passed in)."""
    preprocessor.tokenizer.save_pretrained(directory)
    preprocessor.image_processor.save_pretrained(directory)
    template = getattr(preprocessor, "chat_template", None)
    if template is not None and template.source != preprocessor.tokenizer.chat_template:
        (Path(directory) / CHAT_TEMPLATE_FILE).write_text(template.source, encoding="utf-8")


def load_tokenizer_and_image_processor(model_dir: PathArg) -> tuple[Any, Any]:
    """``(tokenizer, image_processor)`` of a ``save_pretrained`` directory, offline (check-model's
    synthetic microbatches); ``ValueError`` naming the directory when either is missing."""
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_dir}: no tokenizer + image processor ({exc})") from exc
    return tokenizer, image_processor


__all__ = [
    "TOKENIZER_FILES",
    "WEIGHT_PATTERNS",
    "check_model_folder",
    "from_model_dir",
    "load_text_and_image_parts",
    "load_tokenizer_and_image_processor",
    "missing_parts",
    "save_text_and_image_parts",
]
