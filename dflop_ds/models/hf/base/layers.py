"""Pipeline layers shared by the HF model families: decoder layers, the head, and their masks.

Each layer wraps the HF submodule itself (weights are shared with the HF model, so writing the
model back with ``save_pretrained`` saves what was trained) and maps a tuple to a tuple,
floating-point tensors first, as the pipeline contract asks (``docs/architecture.md``). Only
``(hidden, seq_lens)`` crosses a stage boundary: attention masks and rotary tables are built in
every layer from ``seq_lens``, with the same transformers functions the HF model calls, so they
have the dtype and format the configured attention implementation expects. A packed microbatch
(one row ``[1, sum(seq_lens), D]``, :mod:`dflop_ds.models.packing`) gets positions restarting at
every sample and attention within each sample (:mod:`dflop_ds.models.hf.base.packed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dflop_ds.models.hf.base.folder import check_model_folder
from dflop_ds.models.hf.base.packed import packed_attention, packed_kwargs
from dflop_ds.models.packing import is_packed, token_positions

#: text models whose decoder layers :func:`decoder_layers` runs as the HF model does
TEXT_TYPES = ("llama", "qwen2", "mistral")
#: key under which a tied embedding / lm_head weight is kept equal across pipeline stages
TIED_EMBEDDING_KEY = "word_embeddings"
#: how a decoder layer's attention is masked: HF ``layer_types`` values
FULL, SLIDING = "full_attention", "sliding_attention"


def layer_mask_kinds(text_config: Any) -> list[str]:
    """The attention kind of every decoder layer, as the HF model masks it.

    ``config.layer_types`` when the family has it (Qwen2), else sliding for every layer when the
    config sets a ``sliding_window`` (Mistral), else full attention (Llama). Other kinds
    (chunked attention, ...) are refused by name.
    """
    n = int(text_config.num_hidden_layers)
    kinds = getattr(text_config, "layer_types", None)
    if kinds is None:
        kind = SLIDING if getattr(text_config, "sliding_window", None) is not None else FULL
        kinds = [kind] * n
    kinds = list(kinds)[:n]
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if unknown:
        raise ValueError(
            f"{text_config.model_type}: attention layer types {unknown} are not supported "
            f"(supported: {FULL}, {SLIDING})"
        )
    return kinds


def padding_mask(seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]`` 0/1 (long) attention mask of right-padded rows holding ``seq_lens`` real tokens."""
    positions = torch.arange(length, device=seq_lens.device)
    return (positions[None, :] < seq_lens[:, None]).long()


def attention_mask_for(
    kind: str, text_config: Any, hidden: torch.Tensor, seq_lens: torch.Tensor, position_ids: torch.Tensor | None
) -> Any:
    """The mask an HF decoder layer of ``kind`` gets for right-padded ``hidden [B, S, D]``:
    causal (or sliding-window causal) with key padding, in the format of the config's
    attention implementation (``None`` when the implementation needs none)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if kind == SLIDING else create_causal_mask
    return make(
        config=text_config,
        inputs_embeds=hidden,
        attention_mask=padding_mask(seq_lens, hidden.shape[1]),
        past_key_values=None,
        position_ids=position_ids,
    )


class DecoderLayer(nn.Module):
    """One HF decoder layer: ``(hidden [B, S, D], seq_lens [B]) -> (hidden, seq_lens)``.

    Rotary tables come from the HF model's rotary module (no parameters) at positions
    ``0..len-1`` of every sample (:func:`~dflop_ds.models.packing.token_positions`); padded rows
    are masked by :func:`attention_mask_for`, a packed row attends within each sample.
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, text_config: Any, kind: str) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.text_config = text_config
        self.kind = kind

    def attend(
        self,
        hidden: torch.Tensor,
        seq_lens: torch.Tensor,
        rope_positions: torch.Tensor,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run the HF layer on ``hidden`` with rotary tables at ``rope_positions``: causal with key
        padding on right-padded rows, causal within each sample on a packed row."""
        position_embeddings = self.rotary_emb(hidden, rope_positions)
        if is_packed(hidden.shape[0], seq_lens):
            with packed_attention(self.text_config):
                out = self.layer(
                    hidden,
                    attention_mask=None,
                    position_ids=position_ids,
                    position_embeddings=position_embeddings,
                    **packed_kwargs(seq_lens),
                )
        else:
            mask = attention_mask_for(self.kind, self.text_config, hidden, seq_lens, position_ids)
            out = self.layer(
                hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings
            )
        return out[0] if isinstance(out, tuple) else out

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the layer to a padded or packed microbatch."""
        hidden, seq_lens = inputs
        position_ids = token_positions(seq_lens, hidden.shape[0], hidden.shape[1])
        return self.attend(hidden, seq_lens, position_ids, position_ids), seq_lens


class LMHead(nn.Module):
    """Final norm and vocabulary projection: ``(hidden, seq_lens) -> logits [B, S, V]``.

    With tied word embeddings, :attr:`tied_weights` names the shared weight so that a pipeline
    keeps it equal to the embedding on another stage (see ``MLLMPipelineModule``).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Module, tied_key: str | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.tied_weights = {} if tied_key is None else {tied_key: "lm_head.weight"}

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Logits at every position (padding included; the loss ignores it). Integer tensors after
        ``hidden`` (``seq_lens``, a family's position ids) are not needed here."""
        return self.lm_head(self.norm(inputs[0]))


def tied_embedding_key(lm_head: nn.Module, language_model: Any) -> str | None:
    """:data:`TIED_EMBEDDING_KEY` when ``lm_head`` shares the weight of ``language_model.embed_tokens``
    (tied word embeddings: the projector and the head declare it), else None."""
    return TIED_EMBEDDING_KEY if lm_head.weight is language_model.embed_tokens.weight else None


def decoder_layers(language_model: Any) -> list[DecoderLayer]:
    """Every decoder layer of an HF causal-LM body (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)."""
    config = language_model.config
    kinds = layer_mask_kinds(config)
    layers = list(language_model.layers)[: int(config.num_hidden_layers)]
    return [DecoderLayer(layer, language_model.rotary_emb, config, kind) for layer, kind in zip(layers, kinds)]


def check_boundary(outputs: Any, where: str) -> None:
    """Refuse a layer output that breaks the pipeline's tuple rule: floating-point tensors first,
    integer ones after (the engine shares p2p buffers by position)."""
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    seen_int = False
    for i, item in enumerate(items):
        if not torch.is_tensor(item):
            raise ValueError(f"{where}: output {i} is a {type(item).__name__}, not a tensor")
        if item.is_floating_point() and seen_int:
            raise ValueError(f"{where}: floating-point output {i} comes after an integer tensor")
        seen_int = seen_int or not item.is_floating_point()


def load_checked(
    model_dir: Any, check: Callable[[Any, str], None], model_class: Callable[[Any], Any], dtype: Any = None
) -> Any:
    """Load a ``save_pretrained`` directory offline: a missing config or weights file is named
    first (:func:`~dflop_ds.models.hf.base.folder.check_model_folder`), then its config is checked (``check(config,
    where)`` names an unsupported model before any weight is read), then ``model_class(config)``
    (the ``...ForConditionalGeneration`` class to use) loads the weights."""
    from pathlib import Path

    from transformers import AutoConfig

    path = Path(model_dir)
    check_model_folder(path, tokenizer=False)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check(config, str(path))
    kwargs = {} if dtype is None else {"dtype": dtype}
    return model_class(config).from_pretrained(path, local_files_only=True, **kwargs)


def run_layers(layers: Sequence[Callable], inputs: Any) -> Any:
    """Apply ``layers`` in order (a single-process run of a flat layer list)."""
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


__all__ = [
    "DecoderLayer",
    "FULL",
    "LMHead",
    "SLIDING",
    "TEXT_TYPES",
    "TIED_EMBEDDING_KEY",
    "attention_mask_for",
    "check_boundary",
    "decoder_layers",
    "layer_mask_kinds",
    "tied_embedding_key",
    "padding_mask",
    "run_layers",
]
