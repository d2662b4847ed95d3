"""Synthetic data for the tiny MLLM: one item per :class:`SampleShape`, and the microbatch collate.

Content is deterministic in ``(seed, index)`` and learnable, so a few optimizer steps visibly
lower the loss: each sample has a class ``c``; its tiles are noise around a class colour, its
text starts at a class-dependent token and then follows a fixed token permutation (a bigram
rule), with a few random tokens mixed in. Only the last ``label_tokens`` text tokens are
supervised, like the answer of a conversation.

Label alignment. ``targets[t]`` is the token predicted at merged position ``t`` (already
shifted). Text token ``j`` (0-based) of a sample with ``v`` visual tokens sits at ``v + j`` and is
predicted at ``v + j - 1``. Supervising the last ``label_tokens`` text tokens therefore gives
exactly ``label_tokens`` targets, the first text token being predicted from the last visual
position when ``label_tokens == text_tokens``. The one case that cannot be honoured is a
text-only sample with ``label_tokens == text_tokens``: its first token has no position to be
predicted from, so it gets ``label_tokens - 1`` targets (clamped; see :func:`supervised_count`).

The loss denominator follows the contract: an item fetched with a
:class:`~dflop_ds.schedule.index.ScheduledIndex` records its ``loss_denominator`` (global-batch
label tokens / (GAS * dp)); items fetched with plain ints leave it to the collate, which then
uses the microbatch's own label-token count (the stock per-microbatch mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.data import Dataset

from dflop_ds.models.packing import join_rows
from dflop_ds.models.tiny import DEFAULT_CONFIG, TinyMLLMConfig
from dflop_ds.shapes import SampleShape

IGNORE_INDEX = -100
N_CLASSES = 8
#: text tokens live in [FIRST_TOKEN, FIRST_TOKEN + ACTIVE_TOKENS)
FIRST_TOKEN = 4
ACTIVE_TOKENS = 96
NOISE_RATE = 0.1


class SupervisedItem(Protocol):
    """What the loss accounting reads of a sample item (:class:`TinyItem`, the HF families' items)."""

    sample_id: str
    targets: torch.Tensor
    loss_denominator: float | None


@dataclass
class TinyItem:
    """One synthetic sample: ``pixels [tiles, C, P, P]``, ``input_ids [text]``, ``targets [v + text]``."""

    sample_id: str
    pixels: torch.Tensor
    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_denominator: float | None = None

    @property
    def tiles(self) -> int:
        """Encoder tiles of the sample."""
        return int(self.pixels.shape[0])


def supervised_count(shape: SampleShape) -> int:
    """Targets a sample of ``shape`` gets: ``label_tokens``, minus one for a text-only sample
    whose every text token is a label (its first token cannot be predicted)."""
    if shape.label_tokens == shape.text_tokens and shape.encoder_tiles == 0 and shape.label_tokens > 0:
        return shape.label_tokens - 1
    return shape.label_tokens


def _token_rule(vocab_size: int) -> list[int]:
    """The fixed bigram rule: ``next = rule[current]`` over the active tokens."""
    if FIRST_TOKEN + ACTIVE_TOKENS > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for {FIRST_TOKEN + ACTIVE_TOKENS} synthetic tokens")
    g = torch.Generator().manual_seed(1234)
    rule = torch.arange(vocab_size)
    rule[FIRST_TOKEN : FIRST_TOKEN + ACTIVE_TOKENS] = FIRST_TOKEN + torch.randperm(ACTIVE_TOKENS, generator=g)
    return rule.tolist()


class TinyMLLMDataset(Dataset):
    """Synthetic samples whose tensor shapes are exactly those of ``shapes``.

    Item ``i`` has ``shapes[i].encoder_tiles`` tiles (each ``tokens_per_tile`` LLM tokens),
    ``text_tokens`` text tokens and ``supervised_count(shapes[i])`` targets.
    """

    def __init__(self, shapes: Sequence[SampleShape], config: TinyMLLMConfig = DEFAULT_CONFIG, seed: int = 0) -> None:
        self.shapes = list(shapes)
        self.config = config
        self.seed = int(seed)
        self._rule = _token_rule(config.vocab_size)
        colour_gen = torch.Generator().manual_seed(4321)
        self._colours = torch.rand(N_CLASSES, config.channels, generator=colour_gen) * 2 - 1
        for shape in self.shapes:
            if shape.text_tokens + shape.encoder_tiles == 0:
                raise ValueError(f"sample {shape.sample_id!r} has neither text nor tiles")
            if not 0 <= shape.label_tokens <= shape.text_tokens:
                raise ValueError(
                    f"sample {shape.sample_id!r}: label_tokens {shape.label_tokens} not in [0, {shape.text_tokens}]"
                )

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, idx: int) -> TinyItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        i = int(idx)
        if not 0 <= i < len(self.shapes):
            raise IndexError(f"TinyMLLMDataset index {i} out of range [0, {len(self.shapes)})")
        shape = self.shapes[i]
        c = self.config
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        cls = int(torch.randint(N_CLASSES, (1,), generator=g))
        noise = 0.5 * torch.randn(shape.encoder_tiles, c.channels, c.image_size, c.image_size, generator=g)
        pixels = noise + self._colours[cls][None, :, None, None]
        noisy = (torch.rand(shape.text_tokens, generator=g) < NOISE_RATE).tolist()
        random_tokens = (FIRST_TOKEN + torch.randint(ACTIVE_TOKENS, (shape.text_tokens,), generator=g)).tolist()
        tokens = [FIRST_TOKEN + cls * (ACTIVE_TOKENS // N_CLASSES)]  # the class shows in the first token
        for j in range(1, shape.text_tokens):
            tokens.append(random_tokens[j] if noisy[j] else self._rule[tokens[-1]])
        ids = torch.tensor(tokens[: shape.text_tokens], dtype=torch.long)
        visual = shape.encoder_tiles * c.tokens_per_tile
        targets = torch.full((visual + shape.text_tokens,), IGNORE_INDEX, dtype=torch.long)
        for j in range(shape.text_tokens - shape.label_tokens, shape.text_tokens):
            if visual + j - 1 >= 0:
                targets[visual + j - 1] = ids[j]
        denominator = getattr(idx, "loss_denominator", None)
        return TinyItem(shape.sample_id, pixels, ids, targets, None if denominator is None else float(denominator))


def label_tokens_in(items: Sequence[SupervisedItem]) -> int:
    """Supervised targets (entries other than -100) of ``items``."""
    return int(sum(int((item.targets != IGNORE_INDEX).sum()) for item in items))


def microbatch_denominator(items: Sequence[SupervisedItem]) -> float:
    """The loss denominator of a microbatch: the scheduled one, or its own label-token count.

    Raises ``ValueError`` if only some items carry a scheduled denominator, or if they disagree
    (items of different global batches mixed in one microbatch).
    """
    denominators = {item.loss_denominator for item in items}
    if denominators == {None}:
        return float(max(label_tokens_in(items), 1))
    scheduled = {d for d in denominators if d is not None}
    if None in denominators or len(scheduled) > 1:
        named = ", ".join(f"{item.sample_id}={item.loss_denominator}" for item in items)
        raise ValueError(f"microbatch mixes loss denominators: {named}")
    return float(scheduled.pop())


def collate_microbatch(
    items: Sequence[TinyItem], packed: bool = False
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """Collate one microbatch into DeepSpeed's ``(inputs, labels)`` (see docs/architecture.md).

    ``inputs = (pixels [T,C,P,P], input_ids [B,S_text], text_lens [B], tiles_per_sample [B])``,
    ``labels = (targets [B,S], loss_denominator [])``, right-padded; with ``packed`` the samples
    are concatenated into one row: ``input_ids [1, sum(text_lens)]`` and ``targets [1, sum(S_i)]``
    (the model then packs its LLM sequence the same way, :mod:`dflop_ds.models.packing`).
    """
    if not items:
        raise ValueError("collate_microbatch: empty microbatch")
    pixels = torch.cat([item.pixels for item in items], dim=0)
    text_lens = torch.tensor([item.input_ids.numel() for item in items], dtype=torch.long)
    tiles = torch.tensor([item.tiles for item in items], dtype=torch.long)
    input_ids = join_rows([item.input_ids for item in items], 0, packed)
    targets = join_rows([item.targets for item in items], IGNORE_INDEX, packed)
    # float64 keeps ratios like 83 / 6 exact enough; the loss casts it to its own dtype
    denominator = torch.tensor(microbatch_denominator(items), dtype=torch.float64)
    return (pixels, input_ids, text_lens, tiles), (targets, denominator)


def collate_packed_microbatch(
    items: Sequence[TinyItem],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`collate_microbatch` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_microbatch(items, packed=True)
