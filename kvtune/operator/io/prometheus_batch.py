"""Many policies' instant queries to one Prometheus, sent as one. Each evaluation asks Prometheus for its
engines' series by its own selector; at 500 policies that is a query every 30 ms. Evaluations that ask
within `GATHER_S` of each other (the operator starts them on the same intervals) share one query, the union
(`or`) of theirs, sent as a form POST, and each takes back the series its own matchers select, matched here
as Prometheus matches them (anchored regular expressions)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtune.operator.io.http import shared_client

GATHER_S = 0.05  # how long the first asker waits for others: small beside a scrape, large beside a tick
MAX_BATCH = 32  # selectors in one query: one answer stays a few MB at most
Answer = dict[str, Any]  # the `data` of a successful API answer, or {"error": why}

# name, operator, double-quoted value (PromQL's string escapes)
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


@dataclass(frozen=True)
class Matcher:
    name: str
    op: str
    value: str

    def matches(self, labels: dict[str, str]) -> bool:
        found = labels.get(self.name, "")  # a missing label is the empty string, as in Prometheus
        if self.op == "=":
            return found == self.value
        if self.op == "!=":
            return found != self.value
        hit = re.fullmatch(self.value, found) is not None
        return hit if self.op == "=~" else not hit


def parse_matchers(text: str) -> list[Matcher]:
    """`a="x",b=~"y.*"` (the inside of a selector's braces) as matchers; ValueError when it is not that."""
    matchers: list[Matcher] = []
    position = 0
    inner = text.strip()
    while position < len(inner):
        found = MATCHER.match(inner, position)
        if found is None:
            raise ValueError(f"not a label matcher at {inner[position : position + 40]!r}")
        value = re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), found.group(3))
        matchers.append(Matcher(found.group(1), found.group(2), value))
        position = found.end()
    return matchers


def selected(result: list[dict[str, Any]], matchers: list[Matcher]) -> list[dict[str, Any]]:
    """The series of a union's answer that one member's matchers select."""
    return [item for item in result if all(m.matches(item.get("metric") or {}) for m in matchers)]


NAME = "__name__"


def split(result: list[dict[str, Any]], members: list[list[Matcher]]) -> list[list[dict[str, Any]]]:
    """Each member's share of the union's answer, as `selected` gives it, in one pass. `result` is what
    Prometheus answered to the `or` of the members' selectors, so every series in it already satisfies
    the matchers all members share (a router's copies left out, the same names asked for): only the
    others are tried, once per distinct combination of the labels they read (a pod's hundreds of series
    share one), and a metric name once per matcher, so a batch costs about two lookups a series."""
    shares: list[list[dict[str, Any]]] = [[] for _ in members]
    shared = set(members[0]).intersection(*members[1:]) if members else set()
    own = [[m for m in matchers if m not in shared and m.name != NAME] for matchers in members]
    by_name = [[m for m in matchers if m not in shared and m.name == NAME] for matchers in members]
    labels_read = sorted({m.name for matchers in own for m in matchers})
    takers: dict[tuple[str, ...], list[int]] = {}
    names_taken: dict[tuple[Matcher, str], bool] = {}
    for item in result:
        labels = item.get("metric") or {}
        key = tuple(labels.get(label, "") for label in labels_read)
        found = takers.get(key)
        if found is None:
            values = dict(zip(labels_read, key, strict=True))
            found = takers[key] = [
                i for i, matchers in enumerate(own) if all(m.matches(values) for m in matchers)
            ]
        name = labels.get(NAME, "")
        for index in found:
            if all(_takes_name(m, name, names_taken) for m in by_name[index]):
                shares[index].append(item)
    return shares


def _takes_name(matcher: Matcher, name: str, known: dict[tuple[Matcher, str], bool]) -> bool:
    """`matcher` on a metric name, remembered: a batch asks a few hundred names of thousands of series."""
    taken = known.get((matcher, name))
    if taken is None:
        taken = known[(matcher, name)] = matcher.matches({NAME: name})
    return taken


@dataclass
class _Ask:
    query: str
    matchers: list[Matcher]
    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None


class InstantBatcher:
    """One Prometheus' instant queries, gathered. Thread-safe: the first asker of a batch sends it, the
    others wait for their share."""

    def __init__(self, url: str, timeout: float = 10.0, gather_s: float = GATHER_S,
                 send: Callable[[str, str, float], Answer] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.gather_s = gather_s
        self.send = send or self._post
        self.sleep = sleep
        self._lock = threading.Lock()
        self._waiting: list[_Ask] = []
        self.queries = 0  # sent, all told
        self.asked = 0  # selectors answered, all told

    def waiting(self) -> int:
        """Askers waiting for the batch now being gathered."""
        with self._lock:
            return len(self._waiting)

    def instant(self, query: str, matchers_text: str) -> Answer:
        """The `data` of `query`'s answer (only the series `matchers_text` selects), or {"error": why}."""
        try:
            ask = _Ask(query, parse_matchers(matchers_text))
        except ValueError:
            return self.send(self.url, query, self.timeout)  # a selector this cannot read: asked alone
        with self._lock:
            self._waiting.append(ask)
            leader = len(self._waiting) == 1
        if leader:
            self.sleep(self.gather_s)
            with self._lock:
                batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
                if self._waiting:  # the rest go as the next batch, led by its first
                    threading.Thread(target=self._lead_rest, daemon=True).start()
            self._answer(batch)
        ask.done.wait()
        assert ask.answer is not None
        return ask.answer

    def _lead_rest(self) -> None:
        with self._lock:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            if self._waiting:
                threading.Thread(target=self._lead_rest, daemon=True).start()
        if batch:
            self._answer(batch)

    def _answer(self, batch: list[_Ask]) -> None:
        union = " or ".join(dict.fromkeys(ask.query for ask in batch))  # the same query once
        try:
            answer = self.send(self.url, union, self.timeout)
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}"}
        with self._lock:
            self.queries += 1
            self.asked += len(batch)
        result = answer.get("result")
        if "error" in answer or not isinstance(result, list):
            shares: list[Any] = [None] * len(batch)
        else:
            shares = split(result, [ask.matchers for ask in batch])
        for ask, share in zip(batch, shares, strict=True):
            ask.answer = answer if share is None else {**answer, "result": share}
            ask.done.set()

    @staticmethod
    def _post(url: str, query: str, timeout: float) -> Answer:
        try:
            response = shared_client().post(f"{url}/api/v1/query", data={"query": query}, timeout=timeout)
            body = response.json()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
            return {"error": f"unreachable: {type(err).__name__}: {err}"}
        if not isinstance(body, dict):
            return {"error": f"HTTP {response.status_code}: not a Prometheus API answer"}
        if response.status_code != 200 or body.get("status") != "success":
            return {"error": f"HTTP {response.status_code}: {body.get('error', 'query failed')}"}
        data = body.get("data")
        return data if isinstance(data, dict) else {"error": "unexpected answer: no data"}


class Batchers:
    """The process's batchers, one per Prometheus URL."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_url: dict[str, InstantBatcher] = {}

    def for_url(self, url: str, timeout: float = 10.0) -> InstantBatcher:
        with self._lock:
            return self._by_url.setdefault(url.rstrip("/"), InstantBatcher(url, timeout))


BATCHERS = Batchers()
