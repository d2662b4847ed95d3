"""Several runs of examples/train.py in one launch, then the rank's end.

    deepspeed --num_gpus 2 tests/ds_scripts/train_runs.py --run "ARGS" --run "ARGS" ...

Each ``--run`` holds one train.py command line, shell-quoted; the runs train in turn
(:func:`dflop_ds.train.loop.run_training`), and :func:`~dflop_ds.rank_lifecycle.finish_rank` ends
the rank after the last. The ranks start once (importing torch, DeepSpeed and transformers takes
most of a tiny model's run), not once per run. The runs must share one engine kind (pipeline
stages, ZeRO stage, AutoTP size): DeepSpeed keeps a pipeline's topology and AutoTP's groups in
module state (``deepspeed.utils.groups``) that a later run of another kind would inherit. Used by
the tests through :func:`ds_runs.run_train_batch`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from dflop_ds.compose import launch_settings
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.rank_lifecycle import finish_rank
from dflop_ds.train.loop import run_training


def engine_kind(argv: list[str]) -> tuple[int, int, int]:
    """``(pipeline stages, ZeRO stage, AutoTP size)`` of the run ``argv``."""
    settings = launch_settings(argv)
    keys = deepspeed_keys(settings.ds_config)
    return settings.config.plan.pipeline_stages, keys.stage, keys.autotp_size


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--run", action="append", required=True, help="one train.py command line, shell-quoted")
    runs = [shlex.split(run) for run in parser.parse_args().run]
    kinds = {engine_kind(argv) for argv in runs}
    if len(kinds) > 1:
        raise SystemExit(f"train_runs.py: runs of one engine kind only, got (stages, ZeRO, AutoTP) {sorted(kinds)}")
    for index, argv in enumerate(runs):
        print(f"[train_runs] run {index + 1} of {len(runs)}: {shlex.join(argv)}", flush=True)
        try:
            run_training(argv)
        except BaseException:
            print(f"[train_runs] run {index + 1} of {len(runs)} failed; the runs after it did not start", flush=True)
            raise
    finish_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
