"""HF models padded against packed: forward+backward of the tiny HF LLaVA and Qwen2-VL layer lists.

The same mixed microbatch (images and text-only samples of very different lengths) runs through
the layer lists of :func:`dflop_ds.models.hf.llava.model.llava_layers` (Llama and Qwen2 text models) and
:func:`dflop_ds.models.hf.qwen2_vl.model.qwen2_vl_layers`, collated padded and packed; both run in
interleaved rounds and the median is reported (``benchmarks/bench_packed_attention.py``'s timer).
What ``dflop.model.packing``'s default for HF models rests on (``docs/configuration.md``).
Run: ``python benchmarks/bench_hf_packing.py`` (about a minute; figures depend on load).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import AutoProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_packed_attention import median_ms  # noqa: E402
from dflop_ds.models.hf.base.synthetic import contract_microbatch  # noqa: E402
from dflop_ds.models.hf.check import random_image  # noqa: E402
from dflop_ds.models.hf.llava.model import llava_layers, load_llava  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.model import load_qwen2_vl, qwen2_vl_layers  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.synthetic import IMAGE_MARK, Qwen2VLInputs  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.testing.hf_tiny import build_tiny_llava  # noqa: E402
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl  # noqa: E402

#: words of each sample's answer (text lengths of a mixed microbatch); samples 0 and 3 carry an image
ANSWER_WORDS = [10, 20, 40, 75, 130, 30, 15, 55]
IMAGES = {0, 3}


def samples(image_mark: str, seed: int = 0) -> list[tuple]:
    """``(prompt, answer, images)`` of the mixed microbatch."""
    rng = random.Random(seed)
    words = ["red", "car", "road", "sea", "tree", "blue", "sky", "a", "the", "moves"]
    out = []
    for i, n in enumerate(ANSWER_WORDS):
        images = [random_image(rng)] if i in IMAGES else []
        prompt = f"USER: {image_mark if images else ''} describe it ASSISTANT:"
        out.append((prompt, " ".join(rng.choice(words) for _ in range(n)), images))
    return out


def steps(layers: tuple, build: Callable[..., tuple]) -> dict[str, Callable[[], None]]:
    """Forward+backward closures of the ``(encoder, projector, llm)`` layer lists on the microbatch
    ``build(packed)``, padded and packed."""
    encoder, projector, llm = layers
    model = torch.nn.Sequential(*encoder, projector, *llm)

    def step(packed: bool) -> Callable[[], None]:
        inputs, labels = build(packed=packed)
        return lambda: token_normalized_loss(model(inputs), labels).backward()

    return {"padded": step(False), "packed": step(True)}


def report(name: str, layers: tuple, build: Callable[..., tuple]) -> None:
    """Print the sample lengths of ``build``'s microbatch and the padded and packed medians."""
    lengths = build(packed=False)[0][2].tolist()
    times = median_ms(steps(layers, build))
    print(f"{name}: lengths {lengths}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()))


def main() -> int:
    torch.set_num_threads(1)  # two cores shared with other jobs: one thread times more steadily
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as folder:
        for text in ("llama", "qwen2"):
            model_dir = build_tiny_llava(Path(folder) / text, vision="clip", text=text)
            processor, mb = AutoProcessor.from_pretrained(model_dir), samples("<image>")
            report(
                f"llava-{text}",
                llava_layers(load_llava(model_dir)),
                partial(contract_microbatch, processor, mb),
            )
        model_dir = build_tiny_qwen2_vl(Path(folder) / "qwen2_vl")
        model = load_qwen2_vl(model_dir)
        inputs_of = Qwen2VLInputs.from_dir(model_dir, model.config)
        report("qwen2_vl", qwen2_vl_layers(model), partial(inputs_of.microbatch, samples(IMAGE_MARK)))
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
