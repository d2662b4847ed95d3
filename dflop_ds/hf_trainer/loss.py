"""The step's token-mean loss for a model whose forward takes no ``num_items_in_batch``.

DFLOP's microbatches differ in size, so a microbatch's loss must be its summed token loss over the
label tokens of the whole step (over every rank), which the Trainer counts and hands the model as
``num_items_in_batch``. A model class that declares it takes no loss keyword arguments (e.g.
Qwen3-VL's, ``accepts_loss_kwargs = False``) would return a per-microbatch mean instead;
:func:`step_token_loss` is the ``compute_loss_func`` the Trainer then uses, unless the user passes
their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def step_token_loss(model: Any) -> Callable[..., Any]:
    """A ``compute_loss_func`` for ``model``: the causal-LM cross-entropy of its logits against the
    labels (shifted inside), summed and divided by ``num_items_in_batch`` (the step's label tokens)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    config = model.config
    vocab = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size

    def loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        return ForCausalLMLoss(outputs.logits, labels, vocab, num_items_in_batch=num_items_in_batch)

    return loss


__all__ = ["step_token_loss"]
