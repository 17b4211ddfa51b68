"""`kvtune demo`: the main job on the embedded default. For now, the seed's figures side by side."""

from __future__ import annotations

import argparse

from kvtune.sim.seed_table import format_table, seed_figures


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=5, help="random seeds to average")


def run(args: argparse.Namespace) -> int:
    print("kvtune demo: the seed document's KV-memory figures, simulated on kvtune.core\n")
    print(format_table(seed_figures(seeds=args.seeds)))
    return 0
