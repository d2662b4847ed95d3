"""A `make bench-frameworks` plugin for every ``swift sft`` launch (``--external_plugins THIS``),
with DFLOP's plugin or without, for CPU ranks only:

* under a multi-process launch it starts DeepSpeed's communication now, before
  ``from_pretrained``'s ZeRO-3 ``zero.Init`` (which would otherwise count one process and stop at
  DeepSpeed's batch assertion; DFLOP's plugin does the same, so both runs start alike);
* it lifts ms-swift's rule that ``--packing`` and ``--padding_free`` need a flash-attention
  implementation, which this CPU machine has none of, so that both run with sdpa. For timing
  only: not for training runs."""

import os

from swift.arguments import sft_args

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    import deepspeed

    deepspeed.init_distributed()


def _padding_free_without_flash(self):
    self.padding_free = bool(self.padding_free or self.packing)


sft_args.SftArguments._check_padding_free = _padding_free_without_flash
