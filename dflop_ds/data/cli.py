"""``dflop-ds validate``: check a dataset file and print every problem found."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import fields
from typing import Any

from dflop_ds.data.media import MediaOptions
from dflop_ds.data.validate import check_dataset, format_problems
from dflop_ds.models.hf.source import hf_policy
from dflop_ds.shapes import DEFAULT_POLICY, TINY_POLICY, ShapePolicy

POLICIES = {"tiny": TINY_POLICY, "default": DEFAULT_POLICY}


def parse_size(text: str) -> tuple[int, int]:
    """``"640x480"`` -> ``(640, 480)`` (argparse type)."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 640x480, got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return width, height


def add_read_arguments(parser: argparse.ArgumentParser, *, default_policy: str = "default") -> None:
    """Add the options every data-reading command shares: the shape policy and where media
    sizes come from (read back with :func:`policy_from_args` and :func:`read_options`)."""
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=default_policy,
        help="shape policy: 'tiny' (bundled tiny model) or 'default' (LLaVA-OneVision-like); "
        f"default {default_policy!r}; --model-name-or-path overrides it",
    )
    parser.add_argument(
        "--model-name-or-path",
        "--model_name_or_path",
        dest="model_name_or_path",
        default=None,
        metavar="DIR",
        help="a HuggingFace LLaVA save_pretrained directory: the shape policy "
        "(tokens per image, chat template token counts) of its processor",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="with --model-name-or-path: longest sequence (default: the tokenizer's model_max_length)",
    )
    parser.add_argument(
        "--image-folder",
        "--image_folder",
        dest="image_folder",
        default=None,
        metavar="DIR",
        help="folder the records' image paths are relative to; sizes the records lack are "
        "read from the image headers (cached beside the data file)",
    )
    parser.add_argument(
        "--video-folder",
        "--video_folder",
        dest="video_folder",
        default=None,
        metavar="DIR",
        help="folder the records' video paths are relative to (each video must exist)",
    )
    parser.add_argument(
        "--image-sizes", default=None, metavar="TABLE", help="JSON side table: image path -> [width, height]"
    )
    parser.add_argument(
        "--video-frames", default=None, metavar="TABLE", help="JSON side table: video path -> frame count"
    )
    parser.add_argument(
        "--fallback-size",
        type=parse_size,
        default=None,
        metavar="WxH",
        help="size of images found nowhere else, without --image-folder only (default: none, such a record is bad)",
    )
    parser.add_argument(
        "--fallback-frames",
        type=int,
        default=None,
        metavar="N",
        help="frame count of videos found nowhere else (default: none, such a record is bad)",
    )


def policy_from_args(args: argparse.Namespace) -> ShapePolicy:
    """The shape policy the flags of :func:`add_read_arguments` ask for."""
    if getattr(args, "model_name_or_path", None):
        return hf_policy(args.model_name_or_path, max_length=args.max_length)
    return POLICIES[args.policy]


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    """The media keyword arguments of :func:`~dflop_ds.data.read_dataset` the flags ask for."""
    return {item.name: getattr(args, item.name) for item in fields(MediaOptions)}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``validate`` sub-command."""
    parser = subparsers.add_parser(
        "validate",
        help="check a shape manifest or LLaVA file; exit 1 if it has problems",
        description="Read the whole dataset file and print every problem found (exit code 1), "
        "or a summary of its samples (exit code 0).",
    )
    parser.add_argument("data", metavar="DATA", help="shape manifest (JSONL) or LLaVA JSON/JSONL file")
    add_read_arguments(parser)
    parser.add_argument(
        "--max-llm-tokens",
        type=int,
        default=None,
        metavar="N",
        help="report samples whose LLM sequence is longer than N tokens",
    )
    parser.add_argument(
        "--max-encoder-tiles",
        type=int,
        default=None,
        metavar="N",
        help="report samples with more than N encoder tiles (tiles + frames)",
    )
    parser.set_defaults(func=run_validate)


def run_validate(args: argparse.Namespace) -> int:
    """Validate ``args.data``; print the problems (exit 1) or a summary (exit 0)."""
    policy = policy_from_args(args)
    problems, shapes = check_dataset(
        args.data,
        policy,
        max_llm_tokens=args.max_llm_tokens,
        max_encoder_tiles=args.max_encoder_tiles,
        **read_options(args),
    )
    if problems:
        print(format_problems(problems))
        return 1
    kinds = Counter(shape.modality for shape in shapes or [])
    longest = max((shape.llm_tokens for shape in shapes or []), default=0)
    print(
        f"{args.data}: {len(shapes or [])} samples, no problems "
        f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; longest LLM sequence {longest} tokens "
        f"under the {policy.name!r} policy)"
    )
    return 0
