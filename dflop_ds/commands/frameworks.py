"""The training frameworks' commands (docs/frameworks.md).

* ``dflop-ds plugin-path swift``: the file ms-swift loads, printed alone for the shell:
  ``swift sft ... --external_plugins "$(dflop-ds plugin-path swift)" --callbacks dflop``;
* ``dflop-ds llamafactory train config.yaml``: LLaMA-Factory's own training on the config, with
  DFLOP's sampler (:mod:`dflop_ds.integrations.llamafactory`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import dflop_ds.integrations.plugin_files as plugin_files

#: framework -> the plugin file it imports by path
PLUGIN_FILES = {"swift": "dflop_swift.py"}


def plugin_path(framework: str) -> Path:
    """The plugin file of ``framework`` (ValueError naming the frameworks that have one)."""
    if framework not in PLUGIN_FILES:
        raise ValueError(f"no plugin file for {framework!r}: one of {sorted(PLUGIN_FILES)}")
    return Path(plugin_files.__file__).resolve().parent / PLUGIN_FILES[framework]


def run_plugin_path(args: argparse.Namespace) -> int:
    """Print the plugin file's absolute path."""
    print(plugin_path(args.framework))
    return 0


def run_llamafactory(args: argparse.Namespace) -> int:
    """LLaMA-Factory's training of ``args.config`` with DFLOP's sampler."""
    from dflop_ds.integrations.llamafactory import launch

    return launch(args.config)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plugin-path`` and ``llamafactory`` sub-commands."""
    parser = subparsers.add_parser(
        "plugin-path",
        help="print the plugin file a training framework loads (swift: --external_plugins)",
        description="Print the absolute path of the file that makes FRAMEWORK train with DFLOP's balanced "
        'microbatches: swift sft ... --external_plugins "$(dflop-ds plugin-path swift)" --callbacks dflop',
    )
    parser.add_argument("framework", choices=sorted(PLUGIN_FILES), help="the training framework")
    parser.set_defaults(func=run_plugin_path)
    llamafactory = subparsers.add_parser(
        "llamafactory",
        help="run LLaMA-Factory's training with DFLOP's balanced microbatches",
        description="dflop-ds llamafactory train config.yaml: LLaMA-Factory's run_exp on the config (stage: sft),"
        " its trainer using DFLOP's sampler; settings from the \"dflop\" block of the config's deepspeed: file."
        " NPROC_PER_NODE > 1 or FORCE_TORCHRUN=1 starts torchrun, as llamafactory-cli does.",
    )
    llamafactory.add_argument("action", choices=["train"], help="what to run (train)")
    llamafactory.add_argument("config", help="the LLaMA-Factory training config (YAML)")
    llamafactory.set_defaults(func=run_llamafactory)
