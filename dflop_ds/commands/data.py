"""``dflop-ds validate``: check a dataset file and print every problem found."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import fields
from typing import Any

from dflop_ds.cost.reference_policies import INTERNVL2_5_POLICY, QWEN2_VL_POLICY
from dflop_ds.data.decode import SAMPLED_DECODES
from dflop_ds.data.media import MediaOptions, default_media_folders
from dflop_ds.data.validate import check_dataset, format_problems
from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.template import TRUNCATION
from dflop_ds.models.hf.preprocessor import hf_preprocessor
from dflop_ds.shapes import DEFAULT_POLICY, TINY_POLICY, ShapePolicy

#: the named shape policies: the bundled tiny model's, LLaVA-OneVision's, and the reference models'
#: (:mod:`dflop_ds.cost.reference_policies`) for planning with those cost models
POLICIES = {
    "tiny": TINY_POLICY,
    "default": DEFAULT_POLICY,
    "qwen2-vl-2b": QWEN2_VL_POLICY,
    "internvl2.5-26b": INTERNVL2_5_POLICY,
}


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
        default=None,
        help="shape policy: 'tiny' (bundled tiny model), 'default' (LLaVA-OneVision-like), or a reference"
        f" model's ('qwen2-vl-2b', 'internvl2.5-26b'); default {default_policy!r}; --model-name-or-path overrides it",
    )
    parser.set_defaults(default_policy=default_policy)
    parser.add_argument(
        "--model-name-or-path",
        "--model_name_or_path",
        dest="model_name_or_path",
        default=None,
        metavar="DIR",
        help="a HuggingFace save_pretrained directory of a registered family: the shape policy "
        "(tokens per image, chat template token counts) of its processor",
    )
    parser.add_argument(
        "--max-length",
        "--max_length",
        dest="max_length",
        type=int,
        default=None,
        metavar="N",
        help="with --model-name-or-path: longest sequence, visual tokens included (default: the "
        "tokenizer's model_max_length), as dflop.data.max_length",
    )
    parser.add_argument(
        "--truncation",
        choices=TRUNCATION,
        default=None,
        help="with --model-name-or-path: a longer sample is a bad record ('error', default) or is cut "
        "at --max-length ('truncate'), as dflop.data.truncation",
    )
    parser.add_argument(
        "--video-fps",
        "--video_fps",
        dest="video_fps",
        type=float,
        default=None,
        metavar="FPS",
        help=f"Qwen2-VL: video frames sampled per second (default {DEFAULT_VIDEO_FPS}), as dflop.data.video_fps",
    )
    parser.add_argument(
        "--video-max-frames",
        "--video_max_frames",
        dest="video_max_frames",
        type=int,
        default=None,
        metavar="N",
        help=f"Qwen2-VL: at most this many frames per video (default {DEFAULT_VIDEO_MAX_FRAMES}), "
        "as dflop.data.video_max_frames",
    )
    parser.add_argument(
        "--image-folder",
        "--image_folder",
        dest="image_folder",
        default=None,
        metavar="DIR",
        help="folder the records' image paths are relative to (default, as in training: the data file's "
        "folder, unless --image-sizes or --fallback-size give the sizes); sizes the records lack are "
        "read from the image headers (cached beside the data file)",
    )
    parser.add_argument(
        "--video-folder",
        "--video_folder",
        dest="video_folder",
        default=None,
        metavar="DIR",
        help="folder the records' video paths are relative to, each video must exist (default, as in "
        "training: the data file's folder, unless --video-frames or --fallback-frames give the counts)",
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


#: options of :func:`add_read_arguments` that only a HuggingFace model's tokenization uses
HF_ONLY_OPTIONS = ("max_length", "truncation", "video_fps", "video_max_frames")


def policy_from_args(args: argparse.Namespace) -> ShapePolicy:
    """The shape policy the flags of :func:`add_read_arguments` ask for: a HuggingFace model's
    (under the length and video rules training would use), else the named policy."""
    rule = {name: getattr(args, name) for name in HF_ONLY_OPTIONS if getattr(args, name, None) is not None}
    if getattr(args, "model_name_or_path", None):
        return hf_preprocessor(args.model_name_or_path, **rule).policy()
    if rule:
        flags = ", ".join("--" + name.replace("_", "-") for name in rule)
        raise ValueError(f"{flags}: these set a HuggingFace model's tokenization; give --model-name-or-path")
    return POLICIES[args.policy or args.default_policy]


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    """The media keyword arguments of :func:`~dflop_ds.data.read_dataset` the flags ask for; the
    image and video folders default to the data file's folder, as training's do
    (:func:`~dflop_ds.data.media.default_media_folders`)."""
    return default_media_folders(args.data, {item.name: getattr(args, item.name) for item in fields(MediaOptions)})


def apply_training_config(args: argparse.Namespace) -> None:
    """Fill the options not given on the command line from the ``dflop`` block of
    ``args.deepspeed_config`` (:class:`~dflop_ds.config.DFLOPConfig`: the data file, model, policy,
    media folders and length and video rules), so the data is read exactly as training reads it."""
    from dflop_ds.config import DFLOPConfig, get_setting  # the config module imports this package
    from dflop_ds.jsonio import read_json_object

    config = DFLOPConfig.from_deepspeed_config(args.deepspeed_config)
    if args.data is None:
        if get_setting(read_json_object(args.deepspeed_config).get("dflop") or {}, "data") is None:
            raise ValueError(
                f"{args.deepspeed_config}: its dflop block names no data file (dflop.data.path), so there is"
                " nothing of it to validate (a Trainer's config: the data is your script's train_dataset);"
                " give the data file: dflop-ds validate DATA"
            )
        args.data = config.data.path
    args.model_name_or_path = args.model_name_or_path or config.model.name_or_path
    args.policy = args.policy or config.data.policy
    for name in ("image_folder", "video_folder", *HF_ONLY_OPTIONS):
        if getattr(args, name) is None:
            setattr(args, name, getattr(config.data, name))
    if not args.model_name_or_path:  # the tiny model: training applies no length or video rule
        for name in HF_ONLY_OPTIONS:
            setattr(args, name, None)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``validate`` sub-command."""
    parser = subparsers.add_parser(
        "validate",
        help="check a shape manifest or LLaVA file; exit 1 if it has problems",
        description="Read the whole dataset file and print every problem found (exit code 1), "
        "or a summary of its samples (exit code 0).",
    )
    parser.add_argument(
        "data",
        metavar="DATA",
        nargs="?",
        default=None,
        help="shape manifest (JSONL) or LLaVA JSON/JSONL file (default: the --deepspeed-config's dflop.data.path)",
    )
    parser.add_argument(
        "--deepspeed-config",
        "--deepspeed_config",
        dest="deepspeed_config",
        default=None,
        metavar="FILE",
        help='a training config: read the data as its "dflop" block says (data path, model, policy, media '
        "folders, max_length, truncation, video rule); options given here win",
    )
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
    parser.add_argument(
        "--deep",
        action="store_true",
        help="decode every image and every video frame in full (with a progress bar), to find truncated or "
        "corrupt files their headers hide; without it a few media files spread over the data are decoded",
    )
    parser.set_defaults(func=run_validate)


def run_validate(args: argparse.Namespace) -> int:
    """Validate ``args.data``; print the problems (exit 1) or a summary (exit 0)."""
    if args.deepspeed_config is not None:
        apply_training_config(args)
    if args.data is None:
        raise ValueError("validate: give the data file (DATA) or a --deepspeed-config that names it")
    policy = policy_from_args(args)
    problems, shapes = check_dataset(
        args.data,
        policy,
        max_llm_tokens=args.max_llm_tokens,
        max_encoder_tiles=args.max_encoder_tiles,
        decode=None if args.deep else SAMPLED_DECODES,
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
