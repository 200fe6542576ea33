"""The argument parser and value types of the training scripts (train.py, train_mtp.py, train_dflash.py).

A bad value is refused while the arguments are parsed, before anything is loaded or trained: one line on
stderr that names the flag (`error: argument --clip: must be a finite number > 0, got 'nan'`), exit status 2.
"""
import argparse
import math
import os

import torch

from nano_spec.engine.threads import MAX_THREADS  # the engine's bound on --threads


class Parser(argparse.ArgumentParser):
    """argparse, but an error is the one line `error: <message>` without the usage text (exit status 2)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def number(lo: float = -math.inf, hi: float = math.inf, above: bool = False):
    """A finite float in [lo, hi], or in (lo, hi] when `above`: NaN and infinities never pass."""
    what = "a finite number" + (f" {'>' if above else '>='} {lo:g}" if lo > -math.inf else "") + \
        (f" and <= {hi:g}" if hi < math.inf else "")

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and (v > lo if above else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return v
    return parse


# --lr: far above any rate that learns, and below ~3.4e37, where AdamW's first step size lr / (1 - beta1) overflows
# fp32 and raises (a traceback); a huge --lr under the bound diverges and fails in one line (exit 1).
learning_rate = number(0, 1e30, above=True)


def integer(lo: int = 0, hi: int = 2**63 - 1):
    """An integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {text!r}")
        return v
    return parse


def threads(text: str):
    """auto, or an integer number of threads in [1, MAX_THREADS]."""
    return text if text == "auto" else integer(1, MAX_THREADS)(text)


def device(text: str) -> str:
    """cpu, cuda, cuda:N, or auto (cuda when there is one); a device the script can train on."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d = torch.device(text)
    except (RuntimeError, ValueError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of cpu, cuda, cuda:N, auto")
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} CUDA devices")
    return text


def existing_path(text: str) -> str:
    """A file or directory that exists (its content is checked where it is read)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def indices(text: str) -> list:
    """Distinct integers >= 0, comma-separated (`2,5`): layer indices, checked against the model where it is read."""
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        v = None
    if not v or min(v) < 0 or len(set(v)) != len(v):
        raise argparse.ArgumentTypeError(f"must be distinct integers >= 0 separated by commas, got {text!r}")
    return v
