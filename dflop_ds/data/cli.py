"""``dflop-ds validate``: check a dataset file and print every problem found."""

from __future__ import annotations

import argparse
from collections import Counter

from dflop_ds.data.validate import check_dataset, format_problems
from dflop_ds.shapes import TINY_POLICY, ShapePolicy

POLICIES = {"tiny": TINY_POLICY, "default": ShapePolicy()}


def parse_size(text: str) -> tuple[int, int]:
    """``"640x480"`` -> ``(640, 480)`` (argparse type)."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 640x480, got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return width, height


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``validate`` sub-command."""
    parser = subparsers.add_parser(
        "validate", help="check a shape manifest or LLaVA file; exit 1 if it has problems",
        description="Read the whole dataset file and print every problem found (exit code 1), "
                    "or a summary of its samples (exit code 0).")
    parser.add_argument("data", metavar="DATA", help="shape manifest (JSONL) or LLaVA JSON/JSONL file")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="default",
                        help="shape policy: 'tiny' (bundled tiny model) or 'default' (LLaVA-OneVision-like)")
    parser.add_argument("--max-llm-tokens", type=int, default=None, metavar="N",
                        help="report samples whose LLM sequence is longer than N tokens")
    parser.add_argument("--max-encoder-tiles", type=int, default=None, metavar="N",
                        help="report samples with more than N encoder tiles (tiles + frames)")
    parser.add_argument("--image-sizes", default=None, metavar="TABLE",
                        help="JSON side table: image path -> [width, height]")
    parser.add_argument("--video-frames", default=None, metavar="TABLE",
                        help="JSON side table: video path -> frame count")
    parser.add_argument("--fallback-size", type=parse_size, default=None, metavar="WxH",
                        help="size of images found nowhere else (default: report them)")
    parser.set_defaults(func=run_validate)


def run_validate(args: argparse.Namespace) -> int:
    """Validate ``args.data``; print the problems (exit 1) or a summary (exit 0)."""
    problems, shapes = check_dataset(
        args.data, POLICIES[args.policy], max_llm_tokens=args.max_llm_tokens,
        max_encoder_tiles=args.max_encoder_tiles, image_sizes=args.image_sizes,
        video_frames=args.video_frames, fallback_size=args.fallback_size)
    if problems:
        print(format_problems(problems))
        return 1
    kinds = Counter(shape.modality for shape in shapes or [])
    longest = max((shape.llm_tokens for shape in shapes or []), default=0)
    print(f"{args.data}: {len(shapes or [])} samples, no problems "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; longest LLM sequence {longest} tokens "
          f"under the {args.policy!r} policy)")
    return 0
