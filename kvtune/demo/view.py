"""The live view: a `rich` panel redrawn every second on a terminal; plain progress lines otherwise (one
every few seconds, and one per action)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from kvtune.demo.timeline import Action, Point

PLAIN_EVERY_S = 5.0
BAR_WIDTH = 30


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def usage_bar(usage: float | None) -> str:
    if usage is None:
        return "n/a"
    filled = round(max(0.0, min(1.0, usage)) * BAR_WIDTH)
    return "█" * filled + "░" * (BAR_WIDTH - filled) + f" {usage:.0%}"


def action_line(action: Action) -> str:
    change = f"{action.knob}: {action.before} -> {action.after}; " if action.knob else ""
    return f"[{action.t:5.1f} s] {action.rung} {action.kind}: {change}{action.evidence}"


def point_line(point: Point) -> str:
    cap = "none" if point.max_tokens_cap is None else str(point.max_tokens_cap)
    return (
        f"[{point.t:5.1f} s] {point.phase}: KV {_num(point.kv_usage, '.0%')}, "
        f"preemptions {_num(point.preemptions_per_s, '.2f')}/s, {_num(point.throughput, '.0f')} tokens/s, "
        f"hit rate {_num(point.hit_rate, '.0%')}, max_num_seqs {point.max_num_seqs}, cap {cap}, "
        f"running {_num(point.running, '.0f')}, waiting {_num(point.waiting, '.0f')}"
    )


def _table(point: Point | None, action: Action | None) -> Table:
    table = Table(
        title="kvtune demo: a tiny engine in trouble, the operator walking the ladder", show_header=False
    )
    table.add_column(style="bold")
    table.add_column()
    if point is None:
        table.add_row("phase", "starting the engine")
        return table
    cap = "none" if point.max_tokens_cap is None else str(point.max_tokens_cap)
    table.add_row("phase", point.phase)
    table.add_row("KV usage", usage_bar(point.kv_usage))
    table.add_row("preemptions/s", _num(point.preemptions_per_s, ".2f"))
    table.add_row("throughput", f"{_num(point.throughput, '.0f')} tokens/s")
    table.add_row("prefix hit rate", _num(point.hit_rate, ".0%"))
    table.add_row("max_num_seqs / cap", f"{point.max_num_seqs} / {cap}")
    table.add_row("running / waiting", f"{_num(point.running, '.0f')} / {_num(point.waiting, '.0f')}")
    table.add_row("last action", "none yet" if action is None else action_line(action))
    return table


class LiveView:
    """`update(point, actions)` once a second; `close()` at the end."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.tty = out.isatty()
        self.live: Live | None = None
        self._printed_actions = 0
        self._last_plain = 0.0
        if self.tty:
            self.live = Live(_table(None, None), console=Console(file=out), refresh_per_second=2)
            self.live.start()

    def message(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text)
        else:
            print(text, file=self.out, flush=True)

    def update(self, point: Point | None, actions: list[Action]) -> None:
        new = actions[self._printed_actions :]
        self._printed_actions = len(actions)
        if self.live is not None:
            for action in new:
                self.live.console.print(action_line(action))
            self.live.update(_table(point, actions[-1] if actions else None))
            return
        lines = [(action.t, action_line(action)) for action in new]
        if point is not None and time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = time.monotonic()
            lines.append((point.t, point_line(point)))
        for _, line in sorted(
            lines, key=lambda timed: timed[0]
        ):  # in time order (a point waits out a restart)
            self.message(line)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
