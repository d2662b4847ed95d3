"""ZeRO-3's blocking parameter gathers on CPU ranks, for DeepSpeed releases that read them too early.

Before DeepSpeed 0.19.8 (its pull request #8539), ``Init._allgather_params_coalesced`` (what a
``GatheredParameters`` block of several parameters runs, ``from_pretrained``'s ZeRO-3 loading
among them: one block per module, weight and bias) starts one asynchronous all-gather per
parameter into ``torch.empty`` buffers and waits only for the last. With NCCL the gathers run in
order on one stream and the accelerator's synchronize waits for them all; with gloo (CPU ranks)
each runs on its own thread and the CPU synchronize is skipped, so the earlier gathers can land
after the block has written the checkpoint's values: parts of the weights are left as whatever
memory the buffer held (values like 1e36, NaN losses from the first step, intermittently, more
often on larger layers and a busy machine). Seen with LLaMA-Factory 0.9.5's DeepSpeed 0.18.4
(docs/frameworks.md).

:func:`wait_every_gather` replaces that method, on such releases and where the accelerator
skips the synchronize, by the release's own blocking gather (:func:`install_waited_gather`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from packaging.version import Version

logger = logging.getLogger(__name__)

#: the first DeepSpeed release checked to wait for every gather (pull request #8539); 0.19.6's
#: sources still wait for the last one only
FIXED_IN = Version("0.19.8")


def gathers_read_early(deepspeed_version: str, synchronize_skipped: bool) -> bool:
    """Whether a DeepSpeed release's coalesced ZeRO-3 gather can be read before it lands: a release
    before :data:`FIXED_IN` on an accelerator whose ``resolves_data_dependency()`` is True (the CPU,
    where its synchronize after the gathers is skipped)."""
    return synchronize_skipped and Version(deepspeed_version).release < FIXED_IN.release


def wait_every_gather() -> bool:
    """On a DeepSpeed release and accelerator where :func:`gathers_read_early`, make ZeRO-3's
    coalesced blocking gather wait for every parameter (:func:`install_waited_gather`); returns
    whether it did. Call before the model loads (``zero.Init`` in ``from_pretrained``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if not gathers_read_early(deepspeed.__version__, get_accelerator().resolves_data_dependency()):
        return False
    install_waited_gather()
    logger.info(
        "DeepSpeed %s on %s: ZeRO-3's coalesced gathers now wait for every parameter (DeepSpeed #8539, fixed in %s)",
        deepspeed.__version__,
        get_accelerator().device_name(),
        FIXED_IN,
    )
    return True


def start_ranks_before_loading() -> None:
    """Under a multi-process launch (``WORLD_SIZE`` > 1), start DeepSpeed's communication and make
    ZeRO-3's gathers wait for every parameter (:func:`wait_every_gather`), before the model loads:
    ``from_pretrained``'s ZeRO-3 ``zero.Init`` runs before a Trainer starts the communication and
    would otherwise count one process (the CPU launchers' quirk, docs/hf_trainer.md). What the
    frameworks' plugins call as they start; nothing in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import deepspeed

    deepspeed.init_distributed()
    wait_every_gather()


def install_waited_gather() -> None:
    """Replace ``Init._allgather_params_coalesced`` (idempotent) by the release's own blocking gather
    of the same parameters: ``_allgather_params_sequential`` (one waited gather per parameter, from
    0.19 on, DeepSpeed #7661) or before it ``_allgather_params`` (one waited gather of them all);
    quantized gathers keep the original."""
    from deepspeed.runtime.zero.partition_parameters import Init

    coalesced = Init._allgather_params_coalesced
    if getattr(coalesced, "waits_every_gather", False):
        return
    blocking = getattr(Init, "_allgather_params_sequential", None) or Init._allgather_params

    def gather_waited(self: Any, param_list: list[Any], hierarchy: int = 0, quantize: bool = False) -> None:
        if quantize or not param_list:
            return coalesced(self, param_list, hierarchy, quantize=quantize)
        return blocking(self, param_list, hierarchy=hierarchy)

    gather_waited.waits_every_gather = True  # type: ignore[attr-defined]
    Init._allgather_params_coalesced = gather_waited


__all__ = ["FIXED_IN", "gathers_read_early", "install_waited_gather", "start_ranks_before_loading", "wait_every_gather"]
