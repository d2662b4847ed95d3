"""One rank of a `make bench-frameworks` LLaMA-Factory run without dflop-ds, under ``torchrun``
(``python -m torch.distributed.run --nproc_per_node 2 THIS config.yaml``): what
``llamafactory-cli train``'s ranks run (``run_exp()`` on the config named in ``sys.argv``), after
starting DeepSpeed's communication. On CPU ranks ZeRO-3's ``zero.Init`` in ``from_pretrained``
would otherwise count one process and stop at DeepSpeed's batch assertion; ``dflop-ds
llamafactory train`` starts it the same way, so both runs start alike."""

import deepspeed
from llamafactory.train.tuner import run_exp

deepspeed.init_distributed()
run_exp()
