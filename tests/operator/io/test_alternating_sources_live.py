"""The issue's set-ups, for real: `kvtune serve` engines (tiny model, a 1,024-token pool, max_num_seqs 64)
that preempted under load and then went quiet, and the local operator (Apply mode) reading them through a
/metrics relay.

- The relay halves every counter (histograms included) for 14 scrapes, then answers the true text again.
- The relay answers from two real engines in turn, three scrapes each.

Both are driven by the relay's scrape count, never by time. Neither may change max_num_seqs or the cap
(the engines' own preemption counters do not move: nothing preempts), and the alternation is reported.
On c504836 the first set-up lowered a value on the climb back, as the issue saw."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.contract.metrics import PREEMPTIONS
from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.server import ServerProcess
from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.decide.loop import Tick, hold_seconds, run_loop
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import Sample
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.sources import MetricsEndpoint

TOKEN = "alternating-token"
INTERVAL = 0.5
POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=2.0)
HALVED = range(6, 20)  # the relay's scrapes (0-based) that halve every counter: 14 of them
UNTOUCHED = {KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}
PATIENCE = 300.0  # seconds: only a hung loop or engine gets near it


def halved(text: str) -> str:
    """Every counter and histogram sample of an exposition at half its value (a sample belongs to the
    family of the TYPE line above it)."""
    kind, out = "", []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            kind = line.split(" ", 3)[3]
        elif line and not line.startswith("#") and kind in ("counter", "histogram"):
            head, value = line.rsplit(" ", 1)
            if not head.split("{", 1)[0].endswith("_created"):
                line = f"{head} {float(value) / 2}"
        out.append(line)
    return "\n".join(out) + "\n"


class Relay:
    """A /metrics endpoint in front of real engines: scrape n answers `choose(n)`'s engine, through
    `transform(n, text)`."""

    def __init__(self, choose: Callable[[int], str], transform: Callable[[int, str], str]) -> None:
        self.scrapes = 0
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                n = relay.scrapes
                relay.scrapes += 1
                text = relay.transform(n, httpx.get(f"{relay.choose(n)}/metrics", timeout=30).text)
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.choose, self.transform = choose, transform
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def preemptions(url: str) -> float:
    sample = MetricsEndpoint(url).read()
    assert isinstance(sample, Sample), sample
    return sample.counters[PREEMPTIONS]


def preempted_then_quiet(engine: ServerProcess) -> None:
    """Load until the engine has preempted, then stop the load and wait for it to drain."""
    load = BackgroundLoad(engine.url, LoadShape(clients=16)).start()
    try:
        deadline = time.monotonic() + PATIENCE
        while preemptions(engine.url) == 0:
            assert time.monotonic() < deadline, "16 clients on a 1,024-token pool did not preempt"
            time.sleep(0.2)
    finally:
        tally = load.stop()
    assert not tally.failures, tally.failures[:3]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    folder = tmp_path_factory.mktemp("alternating")
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    model = write_tiny_model_in_subprocess(folder / "tiny")
    flags = ("--kv-cache-tokens", "1024", "--max-num-seqs", "64")
    live = [start_engine(model, token, folder / f"engine-{i}.log", *flags) for i in range(2)]
    try:
        preempted_then_quiet(live[0])
        yield live
    finally:
        for engine in live:
            engine.stop()


def operate(relay: Relay, admin: str, scrapes: int) -> list[Tick]:
    """The local operator on the relay, acting through `admin`'s API, until the relay has answered
    `scrapes` scrapes."""
    ticks: list[Tick] = []
    stop = threading.Event()
    loop = threading.Thread(target=run_loop, args=(MetricsEndpoint(relay.url), KvtuneAdminActuator(admin, TOKEN),
                                                   POLICY, INTERVAL, stop, ticks.append))  # fmt: skip
    loop.start()
    try:
        deadline = time.monotonic() + PATIENCE
        while relay.scrapes < scrapes:
            assert loop.is_alive() and time.monotonic() < deadline, f"{relay.scrapes} scrapes"
            time.sleep(INTERVAL / 2)
    finally:
        stop.set()
        loop.join(30)
    return ticks


def journal(ticks: list[Tick]) -> str:
    return "\n".join(
        f"{t.at % 1000:.1f} restart={t.restart} alternation={getattr(t, 'alternation', None)} "
        f"{t.decision.note if t.decision else t.no_data} {[(c.knob, c.before, c.value) for c, _ in t.applied]}"
        for t in ticks
    )


def settled_scrapes() -> int:
    """Scrapes after the halving stops: the hold, then as long again with the operator free to act."""
    return HALVED.stop + 2 * round(hold_seconds(POLICY) / INTERVAL) + 8


def test_a_relay_that_halves_every_counter_for_14_scrapes_changes_nothing(
    engines: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    engine = engines[0]
    before = preemptions(engine.url)
    relay = Relay(lambda _: engine.url, lambda n, text: halved(text) if n in HALVED else text)
    caplog.set_level(logging.WARNING, logger="kvtune.operator")
    try:
        ticks = operate(relay, engine.url, settled_scrapes())
    finally:
        relay.close()
    assert preemptions(engine.url) == before, "the engine itself preempted: the set-up is not quiet"
    assert not [t for t in ticks if t.applied], journal(ticks)
    assert KvtuneAdminActuator(engine.url, TOKEN).current().values == UNTOUCHED
    said = [t for t in ticks if t.alternation]
    assert said, journal(ticks)
    assert any(ALTERNATING_HINT in r.getMessage() for r in caplog.records), "no log line says so"
    assert any(t.holding for t in ticks) and not ticks[-1].holding, journal(ticks)  # and it resumed


def test_a_relay_that_alternates_between_two_engines_changes_nothing(
    engines: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    urls = [engine.url for engine in engines]
    before = [preemptions(url) for url in urls]
    relay = Relay(lambda n: urls[(n // 3) % 2], lambda _, text: text)
    caplog.set_level(logging.WARNING, logger="kvtune.operator")
    try:
        ticks = operate(relay, urls[0], 40)
    finally:
        relay.close()
    assert [preemptions(url) for url in urls] == before
    assert not [t for t in ticks if t.applied], journal(ticks)
    for url in urls:
        assert KvtuneAdminActuator(url, TOKEN).current().values == UNTOUCHED
    assert sum(1 for t in ticks if t.alternation) >= 4, journal(ticks)
    assert all(t.holding for t in ticks[8:]), journal(ticks)
    assert any(ALTERNATING_HINT in r.getMessage() for r in caplog.records)
