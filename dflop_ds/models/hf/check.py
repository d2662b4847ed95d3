"""``dflop-ds check-model``: do the pipeline layer lists compute what the HF model computes?

Loads a ``save_pretrained`` directory (model + processor), takes its family's :class:`CheckParts`
by ``config.model_type`` (:func:`~dflop_ds.models.hf.registry.family_of`), splits the layer lists
into stages with :func:`dflop_ds.pipe.stage_bounds.plan_stage_bounds` (what ``MLLMPipelineModule`` uses), and runs a
few synthetic microbatches (an image inside the prompt, several images, text-only rows and a
microbatch without any image, rows of different lengths) stage by stage, checking every
boundary as the pipeline engine would (floats before ints, every float received is used). The
loss and logits are compared with the HF model's own forward with labels; when they differ, the
first stage boundary whose activations differ from HF's hidden states is named. Every microbatch
is also run packed (its samples in one row, :mod:`dflop_ds.models.packing`) through the same
stages: its loss must equal the padded microbatch's, and its logits the padded ones at the real
tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflop_ds.models.hf.base.folder import check_model_folder
from dflop_ds.models.hf.base.layers import check_boundary
from dflop_ds.models.hf.base.synthetic import hf_labels
from dflop_ds.models.hf.check_parts import CheckParts
from dflop_ds.models.hf.registry import family_of
from dflop_ds.pipe.loss import token_normalized_loss
from dflop_ds.pipe.stage_bounds import plan_stage_bounds

WORDS = (
    "what",
    "is",
    "shown",
    "in",
    "the",
    "picture",
    "a",
    "red",
    "car",
    "on",
    "road",
    "near",
    "sea",
    "compare",
    "two",
    "images",
    "describe",
    "it",
    "hello",
    "hi",
    "there",
    "thanks",
)


def random_image(rng: random.Random) -> Any:
    """A random RGB image of random size (the processor resizes it)."""
    from PIL import Image

    width, height = rng.randint(12, 90), rng.randint(12, 90)
    return Image.frombytes("RGB", (width, height), bytes(rng.getrandbits(8) for _ in range(width * height * 3)))


def random_frames(rng: random.Random, count: int) -> list:
    """``count`` random RGB frames of one random size: a video's sampled frames."""
    from PIL import Image

    width, height = rng.randint(12, 60), rng.randint(12, 60)
    return [
        Image.frombytes("RGB", (width, height), bytes(rng.getrandbits(8) for _ in range(width * height * 3)))
        for _ in range(count)
    ]


def tower_hidden_states(model: Any, inputs: tuple) -> Any:
    """The HF vision tower's hidden states of a microbatch's pixels (``inputs[0]``), for families
    whose tower takes the pixels as they are; ``None`` for a microbatch without images."""
    pixel_values = inputs[0]
    if not pixel_values.shape[0]:
        return None
    return model.model.vision_tower(pixel_values, output_hidden_states=True).hidden_states


def video_image_text_batches(
    image_mark: str, video_mark: str, frames: int = 3, model_types: tuple[str, ...] | None = None
) -> Callable[[int, Any], list[tuple[str, list]]]:
    """``extra_batches`` for a family that reads videos: one microbatch of a video row (``frames``
    frames), an image row and a text-only row, written with the family's image and video marks;
    none for a config whose ``model_type`` is not in ``model_types`` (None: any)."""

    def batches(seed: int, config: Any) -> list[tuple[str, list]]:
        if model_types is not None and config.model_type not in model_types:
            return []
        rng = random.Random(seed + 1)
        rows = [
            (f"USER: {video_mark} what happens? ASSISTANT:", "a car drives", [], random_frames(rng, frames)),
            (f"USER: {image_mark} and this? ASSISTANT:", "a tree", [random_image(rng)]),
            ("USER: hello ASSISTANT:", "hi there", []),
        ]
        return [("video + image row + text-only row", rows)]

    return batches


def synthetic_batches(seed: int, image_mark: str = "<image>") -> list[tuple[str, list]]:
    """``(description, samples)`` of the microbatches check-model runs; ``image_mark`` is what a
    prompt of the model family writes where an image goes."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def sample(images: int, words: int) -> tuple[str, str, list]:
        pieces = [text(rng.randint(1, 4)) for _ in range(images + 1)]
        prompt = "USER: " + f" {image_mark} ".join(pieces) + " " + text(words) + " ASSISTANT:"
        return prompt, text(rng.randint(2, 6)), [random_image(rng) for _ in range(images)]

    return [
        ("image inside the prompt + text-only row", [sample(1, 3), sample(0, 9)]),
        ("text-only microbatch", [sample(0, 2), sample(0, 7), sample(0, 4)]),
        ("two images in one row + one image", [sample(2, 1), sample(1, 6)]),
        ("one row, one image", [sample(1, 0)]),
    ]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run_stages(layers: list, bounds: list[int], inputs: tuple) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run the flat layer list stage by stage as separate pipeline stages would.

    Every stage's received float tensors are fresh leaves that require grad (as the engine hands
    them over); each boundary is checked (floats before ints, and, with grad mode on, every float
    received used).
    Returns the last stage's output and every stage's output by the index of its last layer.
    """
    from dflop_ds.pipe.module import unused_float_inputs

    x: Any = inputs
    outputs: dict[int, torch.Tensor] = {}
    for stage, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        if stage > 0:
            x = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in x)
        received = x
        for layer in layers[start:stop]:
            x = layer(x)
        where = f"stage {stage} (layers {start}..{stop - 1})"
        check_boundary(x, where)
        if stage > 0 and torch.is_grad_enabled():
            unused = unused_float_inputs(received, x)
            if unused:
                raise ValueError(f"{where} ignores the float input(s) at position(s) {unused} of the previous stage")
        outputs[stop - 1] = x[0] if isinstance(x, tuple) else x
    return x, outputs


def hf_boundaries(model: Any, family: CheckParts, inputs: tuple, n_vision: int) -> dict[int, torch.Tensor]:
    """HF's activations after flat layer ``j``: vision ``hidden_states[j]`` for the encoder entries,
    the language model's ``hidden_states[i]`` after the projector (i = 0) and decoder layer i - 1
    (the last decoder layer is left out: HF normalizes it in place)."""
    reference: dict[int, torch.Tensor] = {}
    vision = family.vision_states(model, inputs)
    if vision is not None:
        reference.update({j: vision[j] for j in range(n_vision)})
    text = model.model(**family.hf_kwargs(model, inputs), output_hidden_states=True).hidden_states
    reference.update({n_vision + i: text[i] for i in range(len(text) - 1)})
    return reference


@dataclass
class CheckReport:
    """What check-model found: the split, the largest relative error against HF and, per batch,
    what differed; the same for packed microbatches against the padded ones."""

    model_dir: str
    bounds: list[int]
    layer_names: list[str]
    tolerance: float
    max_rel_err: float = 0.0
    problems: list[str] = field(default_factory=list)
    packed_max_rel_err: float = 0.0
    packed_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when loss and logits agree with HF, and packed with padded, within the tolerance on every batch."""
        return not self.problems and not self.packed_problems

    def line(self) -> str:
        """The one summary line (``packed_rel_err=P``, then it ends in ``max_rel_err=X``)."""
        stages = len(self.bounds) - 1
        verdict = "match HF" if not self.problems else "DIFFER from HF: " + "; ".join(self.problems)
        packed = (
            "match padded" if not self.packed_problems else "DIFFER from padded: " + "; ".join(self.packed_problems)
        )
        return (
            f"check-model {self.model_dir}: {stages} stage(s), bounds {self.bounds}: loss and logits {verdict}, "
            f"packed microbatches {packed}, tolerance {self.tolerance:g}, "
            f"packed_rel_err={self.packed_max_rel_err:.3e} max_rel_err={self.max_rel_err:.3e}"
        )


def first_differing_stage(
    bounds: list[int],
    ours: dict[int, torch.Tensor],
    reference: dict[int, torch.Tensor],
    tolerance: float,
    names: list[str],
) -> str:
    """The first stage whose output differs from HF's activation at the same layer, named."""
    for stage, stop in enumerate(bounds[1:]):
        index = stop - 1
        if index in reference and index in ours and _relative(ours[index], reference[index]) > tolerance:
            return f"stage {stage} output (layer {index} {names[index]}) already differs"
    return f"stage {len(bounds) - 2} (the head) differs"


def packed_errors(
    layers: list, bounds: list[int], packed: tuple, padded_logits: torch.Tensor, padded_loss: torch.Tensor
) -> dict[str, float]:
    """Relative errors of a packed microbatch (``(inputs, labels)``, run stage by stage) against the
    same samples padded: its loss, and its logits against the padded logits of the real tokens."""
    inputs, labels = packed
    logits, _ = run_stages(layers, bounds, inputs)
    seq_lens = inputs[2].tolist()
    real = torch.cat([padded_logits[row, :length] for row, length in enumerate(seq_lens)])
    return {
        "loss": _relative(token_normalized_loss(logits, labels), padded_loss),
        "logits": _relative(logits[0], real),
    }


def check_model(model_dir: str | Path, *, stages: int = 1, tolerance: float = 1e-4, seed: int = 0) -> CheckReport:
    """Compare the layer lists split into ``stages`` with the HF model on synthetic microbatches."""
    from dflop_ds.pipe.module import layer_name

    path = Path(model_dir)
    family = family_of(path).check_parts()  # an unsupported model type is named first
    check_model_folder(path)
    torch.manual_seed(seed)
    model = family.load(path).eval()  # eval: no dropout, so both paths are deterministic
    microbatch = family.microbatches(path, model.config)
    encoder, projector, llm = family.layers(model)
    layers = [*encoder, projector, *llm]
    names = [layer_name(layer) for layer in layers]
    bounds = plan_stage_bounds(len(layers), len(encoder) + 1, stages).to_list()
    report = CheckReport(str(path), bounds, names, tolerance)
    batches = synthetic_batches(seed, family.image_mark) + family.extra_batches(seed, model.config)
    for number, (what, samples) in enumerate(batches):
        inputs, labels = microbatch(samples)
        logits, ours = run_stages(layers, bounds, inputs)
        loss = token_normalized_loss(logits, labels)
        with torch.no_grad():
            reference = model(**family.hf_kwargs(model, inputs), labels=hf_labels(labels[0]))
        errors = {"loss": _relative(loss, reference.loss), "logits": _relative(logits, reference.logits)}
        report.max_rel_err = max(report.max_rel_err, *errors.values())
        bad = [f"{kind} rel err {err:.2e}" for kind, err in errors.items() if not err <= tolerance]
        if bad:
            with torch.no_grad():
                hf_acts = hf_boundaries(model, family, inputs, len(encoder))
            where = first_differing_stage(bounds, ours, hf_acts, tolerance, names)
            report.problems.append(f"batch {number} ({what}): {', '.join(bad)}; {where}")
        packed = packed_errors(layers, bounds, microbatch(samples, packed=True), logits, loss)
        report.packed_max_rel_err = max(report.packed_max_rel_err, *packed.values())
        bad = [f"packed {kind} rel err {err:.2e}" for kind, err in packed.items() if not err <= tolerance]
        if bad:
            report.packed_problems.append(f"batch {number} ({what}): {', '.join(bad)}")
    return report


__all__ = [
    "CheckReport",
    "check_model",
    "hf_boundaries",
    "packed_errors",
    "random_frames",
    "random_image",
    "run_stages",
    "synthetic_batches",
    "tower_hidden_states",
    "video_image_text_batches",
]
