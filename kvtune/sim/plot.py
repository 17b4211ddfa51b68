"""The memory map over time, one panel per policy: the picture the seed asks the reader to watch.

Each column is one moment; each row a stretch of the pool in address order. Blue holds tokens, orange is
held but empty (reserved for tokens not written yet, or never to be written), white is free. Under the
contiguous policy the orange dominates and white holes appear between reservations; under paging the pool
is blue with a thin fringe of partial blocks.
"""

from __future__ import annotations

from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

from kvtune.core.accounting import FREE, PARTIAL, RESERVED, TOKENS
from kvtune.core.allocators import POLICIES
from kvtune.sim.simulator import SimConfig, simulate

ROWS = 256
COLUMNS = 300
# Colour per state: FREE, TOKENS, PARTIAL, RESERVED.
_COLOURS = ["#ffffff", "#1f5fa8", "#7fb2e5", "#f28e2b"]


def _binned(states: list[int], rows: int) -> np.ndarray:
    """Reduce a per-block map to `rows` rows, each showing the state most of its blocks are in."""
    arr = np.asarray(states, dtype=np.int8)
    edges = np.linspace(0, len(arr), rows + 1).astype(int)
    out = np.empty(rows, dtype=np.int8)
    for i in range(rows):
        chunk = arr[edges[i] : max(edges[i + 1], edges[i] + 1)]
        out[i] = np.bincount(chunk, minlength=4).argmax()
    return out


def plot_memory_maps(base: SimConfig, path: str, policies: tuple[str, ...] = POLICIES) -> None:
    """Simulate `base` under each policy and draw the memory maps side by side into `path`."""
    every = max(1, base.steps // COLUMNS)
    fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 5), sharey=True, squeeze=False)
    cmap = ListedColormap(_COLOURS)
    for ax, policy in zip(axes[0], policies, strict=True):
        res = simulate(replace(base, policy=policy, map_every=every))
        image = np.stack([_binned(m, ROWS) for m in res.memory_maps], axis=1)
        ax.imshow(image, aspect="auto", cmap=cmap, vmin=0, vmax=3, interpolation="nearest",
                  extent=(0, base.steps, base.pool_tokens, 0))  # fmt: skip
        ax.set_title(
            f"{policy}: {res.tokens_per_step:.1f} tok/step, {100 * res.effective_utilization:.1f}% effective",
            fontsize=10,
        )
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("pool address (token slots)")
    handles = [
        Rectangle((0, 0), 1, 1, facecolor=_COLOURS[s], edgecolor="#888888")
        for s in (TOKENS, PARTIAL, RESERVED, FREE)
    ]
    fig.legend(
        handles, ["holding tokens", "partial block", "held, empty", "free"], loc="lower center", ncol=4
    )
    w = base.workload
    fig.suptitle(
        f"KV pool of {base.pool_tokens:,} tokens, block {base.block_size}, declared max_tokens {w.max_tokens:,}"
    )
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
