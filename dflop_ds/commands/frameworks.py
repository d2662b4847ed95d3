"""``dflop-ds plugin-path FRAMEWORK``: the file a framework loads to train with DFLOP.

``swift sft ... --external_plugins "$(dflop-ds plugin-path swift)" --callbacks dflop``
(docs/frameworks.md). The path is printed alone, for the shell to substitute.
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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plugin-path`` sub-command."""
    parser = subparsers.add_parser(
        "plugin-path",
        help="print the plugin file a training framework loads (swift: --external_plugins)",
        description="Print the absolute path of the file that makes FRAMEWORK train with DFLOP's balanced "
        'microbatches: swift sft ... --external_plugins "$(dflop-ds plugin-path swift)" --callbacks dflop',
    )
    parser.add_argument("framework", choices=sorted(PLUGIN_FILES), help="the training framework")
    parser.set_defaults(func=run_plugin_path)
