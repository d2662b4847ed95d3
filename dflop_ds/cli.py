"""The ``dflop-ds`` command: one sub-command family per module (profile, plan, data, ...)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# Modules that add sub-commands through ``register(subparsers)``.
COMMAND_MODULES = ("dflop_ds.data.cli", "dflop_ds.profile.cli", "dflop_ds.plan.cli", "dflop_ds.telemetry.cli",
                   "dflop_ds.models.hf.cli")


def build_parser() -> argparse.ArgumentParser:
    """The full ``dflop-ds`` argument parser."""
    from dflop_ds import __version__

    parser = argparse.ArgumentParser(prog="dflop-ds", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dflop-ds {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``dflop-ds`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"dflop-ds {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
