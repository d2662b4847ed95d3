"""Train a tiny HF LLaVA for a few steps on a 2-stage MLLMPipelineModule (launched by tests/test_hf_llava.py).

``deepspeed --num_gpus 2 hf_pipe_check.py --model-dir DIR --out OUT [--freeze] [--bounds a,b,c]``, or
several such runs in one launch with ``--variant NAME=OPTIONS`` (see pipe_checks.variants).
One global batch of three microbatches (an image inside a prompt next to a text-only row, a
text-only microbatch, two images in one row) with the global-batch loss denominator. Every rank
also runs the same step in one process on the layer lists of its own copy of the model (an
``nn.Sequential``, whose parameter names are the pipeline's) and the HF model's own forward over
the whole global batch; step 1's loss and parameters must match. Each rank writes
``OUT/rank<r>.json`` and its copy of a tied embedding to ``OUT/tied<r>.pt``.
"""

from __future__ import annotations

import argparse
import os
import random

import pipe_checks as check
import torch

from dflop_ds.models.hf.base.synthetic import contract_microbatch, hf_forward
from dflop_ds.models.hf.llava.model import llava_layers, load_llava
from dflop_ds.pipe import token_loss_sum


def image(rng: random.Random, width: int, height: int):
    from PIL import Image

    return Image.frombytes("RGB", (width, height), bytes(rng.getrandbits(8) for _ in range(width * height * 3)))


def global_batch(rng: random.Random) -> list[list[tuple]]:
    """Three microbatches of (prompt, answer, images)."""
    return [
        [
            ("USER: look at <image> what is shown? ASSISTANT:", "a red car", [image(rng, 40, 30)]),
            ("USER: hello there ASSISTANT:", "hi, thanks!", []),
        ],
        [("USER: hi ASSISTANT:", "hello", []), ("USER: describe the sea ASSISTANT:", "a road near the sea", [])],
        [("USER: compare <image> and <image> ASSISTANT:", "two images", [image(rng, 64, 20), image(rng, 16, 50)])],
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    check.add_pipeline_options(parser, steps=4)
    runs = check.variants(parser)
    rank, device = check.start_distributed()
    for args, last in runs:
        run(args, rank, device, last)


def run(args, rank: int, device, last: bool) -> None:
    """One training of the variant ``args``: its report (and tied embedding) in ``args.out``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.model_dir)
    samples = global_batch(random.Random(5))
    gas, dp = len(samples), 1
    unscaled = [contract_microbatch(processor, mb) for mb in samples]
    total_targets = sum(float(labels[1]) for _, labels in unscaled)
    denominator = torch.tensor(total_targets / (gas * dp), dtype=torch.float64)
    microbatches = [(inputs, (labels[0], denominator)) for inputs, labels in unscaled]

    encoder, projector, llm = llava_layers(load_llava(args.model_dir))
    trainer = check.pipeline_trainer(encoder, projector, llm, args, gas, dp)
    engine, model = trainer.engine, trainer.module

    # single-process reference: the same layer lists of another copy, one SGD step on the global token mean
    hf_model = load_llava(args.model_dir).to(device)
    ref_encoder, ref_projector, ref_llm = llava_layers(hf_model)
    reference = torch.nn.Sequential(*ref_encoder, ref_projector, *ref_llm)
    if args.freeze:
        for layer in ref_encoder:
            layer.requires_grad_(False)
    with torch.no_grad():  # HF's own loss over the whole global batch as one padded batch
        inputs, labels = contract_microbatch(processor, [s for mb in samples for s in mb])
        hf_loss = float(hf_forward(hf_model, [t.to(device) for t in inputs], labels[0].to(device)).loss)
    ref_opt = check.sgd([p for p in reference.parameters() if p.requires_grad], args.lr)
    ref_loss = (
        sum(
            token_loss_sum(reference(tuple(t.to(device) for t in inputs)), labels[0].to(device))
            for inputs, labels in microbatches
        )
        / total_targets
    )
    ref_opt.zero_grad()
    ref_loss.backward()
    ref_opt.step()
    ref_state = dict(reference.named_parameters(remove_duplicate=False))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, max_diff, max_change = [], 0.0, 0.0
    for step in range(args.steps):
        batch = [
            (tuple(t.to(device) for t in inputs), tuple(t.to(device) for t in labels))
            for inputs, labels in microbatches
        ]
        losses.append(trainer.train_step(iter(batch)))
        if step == 0:
            max_diff, max_change = check.step_gaps(model, ref_state, before)
    tied = [getattr(comm["module"], comm["weight_attr"][0]) for comm in model.tied_comms.values()]
    os.makedirs(args.out, exist_ok=True)
    if tied:
        torch.save(tied[0].detach().cpu(), os.path.join(args.out, f"tied{rank}.pt"))
    result = {
        "rank": rank,
        "stage": engine.stage_id,
        "parts": list(model.parts),
        "losses": losses,
        "ref_loss": float(ref_loss.detach()),
        "hf_loss": hf_loss,
        "step1_max_param_diff": max_diff,
        "step1_max_param_change": max_change,
        "tied_keys": sorted(model.tied_comms),
        "images_per_microbatch": [int(i[0].shape[0]) for i, _ in microbatches],
        **check.parameter_counts(model, before),
    }
    check.write_report(args.out, rank, result, last=last)


if __name__ == "__main__":
    main()
