"""Train a tiny HF LLaVA for a few steps on a 2-stage MLLMPipelineModule (launched by tests/test_hf_llava.py).

``deepspeed --num_gpus 2 hf_pipe_check.py --model-dir DIR --out OUT [--freeze] [--bounds a,b,c]``.
One global batch of three microbatches (an image inside a prompt next to a text-only row, a
text-only microbatch, two images in one row) with the global-batch loss denominator. Every rank
also runs the same step in one process on the layer lists of its own copy of the model (an
``nn.Sequential``, whose parameter names are the pipeline's) and the HF model's own forward over
the whole global batch; step 1's loss and parameters must match. Each rank writes
``OUT/rank<r>.json`` and its copy of a tied embedding to ``OUT/tied<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from dflop_ds.models.hf.llava import llava_layers, load_llava
from dflop_ds.models.hf.synthetic import contract_microbatch, hf_forward
from dflop_ds.pipe import token_loss_sum
from dflop_ds.train import build_engine


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
    parser.add_argument("--out", required=True)
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument("--bounds", default="", help="comma-separated stage bounds; default encoder_stages=1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoProcessor

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    device = torch.device(get_accelerator().device_name())
    processor = AutoProcessor.from_pretrained(args.model_dir)
    samples = global_batch(random.Random(5))
    gas, dp = len(samples), 1
    unscaled = [contract_microbatch(processor, mb) for mb in samples]
    total_targets = sum(float(labels[1]) for _, labels in unscaled)
    denominator = torch.tensor(total_targets / (gas * dp), dtype=torch.float64)
    microbatches = [(inputs, (labels[0], denominator)) for inputs, labels in unscaled]

    encoder, projector, llm = llava_layers(load_llava(args.model_dir))
    # default split: the encoder and projector alone on stage 0
    bounds = (
        [int(b) for b in args.bounds.split(",")] if args.bounds else [0, len(encoder) + 1, len(encoder) + 1 + len(llm)]
    )
    config = {
        "train_batch_size": gas * dp,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }
    trainer = build_engine(
        encoder,
        projector,
        llm,
        config,
        pipeline_stages=2,
        stage_bounds=bounds,
        freeze_encoder=args.freeze,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
    )
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
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=args.lr, momentum=0.9)
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
            for name, p in model.named_parameters():
                max_diff = max(max_diff, float((p.detach() - ref_state[name].detach()).abs().max()))
                max_change = max(max_change, float((p.detach() - before[name]).abs().max()))
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
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "frozen_moved": any(
            not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if not p.requires_grad
        ),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
