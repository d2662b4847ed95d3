"""dflop_ds.models: the tiny MLLM (ViT over tiles, projector + merge, decoder LM) and its synthetic data."""

from dflop_ds.models.tiny import (
    DecoderBlock,
    LMHead,
    PatchEmbed,
    Projector,
    TinyMLLMConfig,
    VisionBlock,
    build_reference,
    tiny_mllm_layers,
)
from dflop_ds.models.tiny_data import (
    IGNORE_INDEX,
    TinyItem,
    TinyMLLMDataset,
    collate_microbatch,
    collate_packed_microbatch,
    label_tokens_in,
    microbatch_denominator,
    supervised_count,
)

__all__ = [
    "IGNORE_INDEX",
    "TinyItem",
    "TinyMLLMDataset",
    "collate_microbatch",
    "collate_packed_microbatch",
    "label_tokens_in",
    "microbatch_denominator",
    "supervised_count",
    "DecoderBlock",
    "LMHead",
    "PatchEmbed",
    "Projector",
    "TinyMLLMConfig",
    "VisionBlock",
    "build_reference",
    "tiny_mllm_layers",
]
