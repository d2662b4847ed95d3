"""One rank of a `make bench-frameworks` LLaMA-Factory run without dflop-ds, under ``torchrun``
(``python -m torch.distributed.run --nproc_per_node 2 THIS config.yaml``): what
``llamafactory-cli train``'s ranks run (``run_exp()`` on the config named in ``sys.argv``), after
starting DeepSpeed's communication. On CPU ranks ZeRO-3's ``zero.Init`` in ``from_pretrained``
would otherwise count one process and stop at DeepSpeed's batch assertion. It also makes ZeRO-3's
gathers wait for every parameter on this DeepSpeed 0.18.4 (dflop_ds/zero_gather.py: without it
the checkpoint loads into partly unwritten memory and the loss is NaN from the first step).
``dflop-ds llamafactory train`` does both through the same function, so both runs start alike."""

from llamafactory.train.tuner import run_exp

from dflop_ds.zero_gather import start_ranks_before_loading

start_ranks_before_loading()
run_exp()
