"""A `make bench-frameworks` plugin for every ``swift sft`` launch (``--external_plugins THIS``),
with DFLOP's plugin or without, for CPU ranks only:

* under a multi-process launch it starts DeepSpeed's communication now, before
  ``from_pretrained``'s ZeRO-3 ``zero.Init`` (which would otherwise count one process and stop at
  DeepSpeed's batch assertion), through the function DFLOP's plugin calls, so both runs start
  alike;
* it lifts ms-swift's rule that ``--packing`` and ``--padding_free`` need a flash-attention
  implementation, which this CPU machine has none of, so that both run with sdpa. For timing
  only: not for training runs."""

from swift.arguments import sft_args

from dflop_ds.zero_gather import start_ranks_before_loading

start_ranks_before_loading()


def _padding_free_without_flash(self):
    self.padding_free = bool(self.padding_free or self.packing)


sft_args.SftArguments._check_padding_free = _padding_free_without_flash
