"""argparse types for the CLI's numbers: a value outside its range is argparse's one-line error (exit 2) before
anything starts, naming the option, the value and the rule."""
from __future__ import annotations

import argparse
import math


def number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False):
    """A `kind` (int or float) within [low, high] (`above`: strictly more than `low`); NaN and infinities refused."""
    rule = " and ".join(r for r in (
        None if low is None else f"{'>' if above else '>='} {low:g}",
        None if high is None else f"<= {high:g}") if r)

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if not math.isfinite(v) or (low is not None and (v <= low if above else v < low)) or \
                (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"{text}: must be {rule}")
        return v
    parse.__name__ = kind.__name__       # argparse names the type in its "invalid ... value" fallback
    return parse


POSITIVE_INT = number(int, 1)
NON_NEGATIVE_INT = number(int, 0)
POSITIVE_S = number(float, 0, above=True)
NON_NEGATIVE_S = number(float, 0)
PORT = number(int, 0, 65535)
