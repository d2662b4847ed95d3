"""The ``dflop-ds`` command: one sub-command family per module (profile, plan, data, ...)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dflop_ds import __version__
from dflop_ds.commands import check_launch, check_model, data, frameworks, plan, profile, project, report

#: the modules that add sub-commands through ``register(subparsers)``, in help order
COMMAND_MODULES = (data, profile, plan, report, check_model, check_launch, project, frameworks)


def build_parser() -> argparse.ArgumentParser:
    """The full ``dflop-ds`` argument parser."""
    parser = argparse.ArgumentParser(prog="dflop-ds", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dflop-ds {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
