"""What every benchmark shares: its flags (``--quick``, ``--out``), and the table and
JSON writers of ``superinfer_jax.sim.report``."""

from __future__ import annotations

import argparse
import os

from superinfer_jax.sim.report import print_table, write_json

__all__ = ["add_common_args", "print_table", "write_json"]


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--quick", action="store_true", help="small version, under a minute")
    parser.add_argument("--out", default=os.path.join("results", f"{name}.json"),
                        help="where to write the JSON results")


def parse_seeds(text: str) -> list[int]:
    """``--seeds`` as ranges and lists: ``0-3,7`` -> [0, 1, 2, 3, 7] (ValueError if not)."""
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        lo, sep, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
    return out
