"""Train the tiny MLLM on a 2-stage MLLMPipelineModule with variable-shape microbatches.

Launched by tests/test_pipe_deepspeed.py as ``deepspeed --num_gpus 2 tiny_pipe_train.py ...``.
Step 1 uses the token-normalized loss with scheduled denominators and is compared with a
single-process reference that runs the same global batch as one batch (token mean) and takes
the same SGD step: the parameters must match. Later steps cycle over a few global batches so
the test can check the loss goes down. Each rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import random

import pipe_checks as check

from dflop_ds.models import TinyMLLMDataset, build_reference, collate_microbatch, label_tokens_in, tiny_mllm_layers
from dflop_ds.pipe import token_normalized_loss
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.shapes import TINY_POLICY, SampleShape

# image sizes giving 1, 3 and 5 tiles under TINY_POLICY
IMAGE_CHOICES = [(), ((336, 336),), ((672, 336),), ((672, 672),)]


def make_shapes(n: int, seed: int) -> list[SampleShape]:
    """Random small shapes: text-only, images of 1..5 tiles, short videos; varied text lengths."""
    rng = random.Random(seed)
    shapes = []
    for i in range(n):
        kind = rng.randrange(5)
        images = IMAGE_CHOICES[kind] if kind < 4 else ()
        frames = 2 if kind == 4 else 0
        text = rng.randint(6, 40)
        labels = rng.choice([text, rng.randint(1, text)])
        shapes.append(
            TINY_POLICY.shape(f"s{i}", image_sizes=images, video_frames=frames, text_tokens=text, label_tokens=labels)
        )
    return shapes


def make_batches(n_batches: int, sizes: list[int]) -> list[list[list[int]]]:
    """Global batches as lists of microbatches (sample indices) of the given sizes."""
    per_batch = sum(sizes)
    batches = []
    for b in range(n_batches):
        start, mbs = b * per_batch, []
        for size in sizes:
            mbs.append(list(range(start, start + size)))
            start += size
        batches.append(mbs)
    return batches


def scheduled(dataset: TinyMLLMDataset, batch: list[list[int]], gas: int, dp: int, batch_id: int, packed: bool = False):
    """Collated (padded or packed) microbatches of one global batch with the global-batch loss denominator."""
    global_tokens = label_tokens_in([dataset[i] for mb in batch for i in mb])
    denominator = global_tokens / (gas * dp)
    return [
        collate_microbatch([dataset[ScheduledIndex(i, denominator, batch_id)] for i in mb], packed=packed)
        for mb in batch
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    check.add_pipeline_options(parser, steps=20)
    parser.add_argument("--packed", action="store_true", help="packed microbatches (the reference stays padded)")
    parser.add_argument("--ckpt", type=int, default=0, help="activation_checkpoint_interval")
    runs = check.variants(parser)
    rank, device = check.start_distributed()
    for args, last in runs:
        run(args, rank, device, last)


def run(args, rank: int, device, last: bool) -> None:
    """One training of the variant ``args``: its report in ``args.out``."""
    # microbatches of 1, 3 and 2 samples: tensor shapes change every microbatch
    sizes = [1, 3, 2]
    gas, dp, n_batches = len(sizes), 1, 4
    shapes = make_shapes(sum(sizes) * n_batches, seed=7)
    shapes[0] = TINY_POLICY.shape("text_only_alone", text_tokens=12, label_tokens=12)  # a zero-tile microbatch
    dataset = TinyMLLMDataset(shapes, seed=3)
    batches = make_batches(n_batches, sizes)

    encoder, projector, llm = tiny_mllm_layers(seed=11)
    trainer = check.pipeline_trainer(encoder, projector, llm, args, gas, dp, activation_checkpoint_interval=args.ckpt)
    engine, model = trainer.engine, trainer.module

    # single-process reference of step 1: the whole global batch as one batch, token-mean loss
    reference = build_reference(seed=11).to(device)
    if args.freeze:
        for i in range(len(encoder)):
            reference[i].requires_grad_(False)
    ref_opt = check.sgd([p for p in reference.parameters() if p.requires_grad], args.lr)
    first = [i for mb in batches[0] for i in mb]
    inputs, labels = collate_microbatch([dataset[i] for i in first])
    inputs = tuple(t.to(device) for t in inputs)
    ref_loss = token_normalized_loss(reference(inputs), tuple(t.to(device) for t in labels))
    ref_opt.zero_grad()
    ref_loss.backward()
    ref_opt.step()

    losses = []
    max_diff = max_change = 0.0
    ref_state = reference.state_dict()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(args.steps):
        b = step % n_batches
        losses.append(trainer.train_step(iter(scheduled(dataset, batches[b], gas, dp, step, args.packed))))
        if step == 0:
            max_diff, max_change = check.step_gaps(model, ref_state, before)
    result = {
        "rank": rank,
        "stage": engine.stage_id,
        "parts": list(model.parts),
        "losses": losses,
        "ref_loss": float(ref_loss.detach()),
        "step1_max_param_diff": max_diff,
        "step1_max_param_change": max_change,
        **check.parameter_counts(model, before),
        "tiles_per_microbatch": [[sum(shapes[i].encoder_tiles for i in mb) for mb in batch] for batch in batches],
    }
    check.write_report(args.out, rank, result, last=last)


if __name__ == "__main__":
    main()
