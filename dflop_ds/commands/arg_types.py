"""Argparse types that refuse a value outside its meaning when the command is parsed, naming it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive_float(text: str) -> float:
    """A finite number above 0 (``0``, ``nan``, ``inf`` and negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def int_in_range(low: int, high: int, why: str) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``; ``why`` says what the upper bound is."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}] ({why}), got {value}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low`` (e.g. 1 for a count, 0 for a seed)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer of at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: comma-separated integers, every one at least 1 (a size of 0 has no cost to fit)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


#: the largest cluster ``plan`` and ``project`` take: the size the planner's search time is measured at (bench-plan)
MAX_PLANNED_GPUS = 16384

__all__ = ["MAX_PLANNED_GPUS", "int_at_least", "int_in_range", "positive_float", "positive_int_list"]
