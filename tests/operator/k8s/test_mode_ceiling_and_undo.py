"""The operator's ceiling on mode (`--max-mode`, the chart's maxMode) and undo (the kvtune.dev/undo
annotation), against kmock's Kubernetes API over real HTTP and real recorded metrics: a policy that asks for
Apply under a Recommend ceiling changes nothing and says so (condition, Event, status.mode); an undo puts
the Deployment's flag back as it was before the operator's first change (taking out a flag the workload
never set), records it, and holds the policy at Recommend until the annotation goes."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from pathlib import Path

import kopf
import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.policy import UNDO_ANNOTATION, Mode, effective_mode
from kvtune.operator.decide.tuner import HistoryEntry, JudgedFigures
from kvtune.operator.decide.undo import first_values
from kvtune.operator.k8s.reconcile import PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag, unset_flag
from tests.operator.kmock_world import (
    FIXTURES,
    OptimisticEmulator,
    add_deployment_and_policy,
    ask_for_undo,
    conditions,
    container_args,
    kopf_running,
    our_events,
    policy_spec,
    policy_status,
    reasons,
    ticks,
    undo_done,
)

NO_FIGURES = JudgedFigures(None, None, None, None)


def test_the_mode_is_the_lower_of_the_policys_and_the_ceiling() -> None:
    assert effective_mode(Mode.APPLY, Mode.RECOMMEND).mode is Mode.RECOMMEND
    assert effective_mode(Mode.APPLY, Mode.RECOMMEND).reason == "MaxMode"
    assert effective_mode(Mode.RECOMMEND, Mode.OBSERVE).mode is Mode.OBSERVE
    assert not effective_mode(Mode.OBSERVE, Mode.RECOMMEND).capped  # a ceiling never raises a mode
    assert effective_mode(Mode.APPLY, Mode.APPLY).reason == "AsRequested"
    held = effective_mode(Mode.APPLY, Mode.APPLY, undo_hold=True)
    assert (held.mode, held.reason) == (Mode.RECOMMEND, "UndoHold") and UNDO_ANNOTATION in held.message
    assert effective_mode(Mode.OBSERVE, Mode.APPLY, undo_hold=True).mode is Mode.OBSERVE


def entry(at: float, kind: str, knob: str, before: int | None, after: int | None) -> HistoryEntry:
    return HistoryEntry(at, kind, Remedy.LOWER_MAX_NUM_SEQS, knob, before, after, "", "", NO_FIGURES)


def test_first_values_are_the_before_of_the_first_change_since_the_last_undo() -> None:
    history = [
        entry(1, "recommended", "max_num_seqs", 256, 40),
        entry(2, "applied", "max_num_seqs", 256, 48),
        entry(3, "applied", "max_num_seqs", 48, 40),
    ]
    assert first_values({}, history) == {"max_num_seqs": 256}
    assert first_values({"max_num_seqs": None}, history) == {"max_num_seqs": None}  # the saved one wins
    after_undo = [
        *history,
        entry(4, "undone", "max_num_seqs", 40, 256),
        entry(5, "applied", "max_num_seqs", 300, 200),
    ]
    assert first_values({}, after_undo) == {"max_num_seqs": 300}  # a new baseline
    assert first_values({}, after_undo[:4]) == {}


def test_unset_flag_takes_out_either_form() -> None:
    assert unset_flag(["--model", "m", "--max-num-seqs", "8", "--x"], "--max-num-seqs") == [
        "--model",
        "m",
        "--x",
    ]
    assert unset_flag(["--max_num_seqs=8", "--model", "m"], "--max-num-seqs") == ["--model", "m"]
    assert unset_flag(["--model", "m"], "--max-num-seqs") == ["--model", "m"]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_apply_under_a_recommend_ceiling_recommends_and_says_why(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    spec = add_deployment_and_policy(kube, ["--max-num-seqs", "64"], policy_spec(metrics_url, "Apply"))
    await ticks(spec, PolicyMemory(), 3, max_mode=Mode.RECOMMEND)
    assert container_args(kube) == ["--max-num-seqs", "64"] and not kube.answered  # never patched
    found = policy_status(kube)
    assert found["mode"] == "Recommend"
    assert conditions(found)["ModeCapped"] == "True" and conditions(found)["Preempting"] == "True"
    (capped,) = [c for c in found["conditions"] if c["type"] == "ModeCapped"]
    assert capped["reason"] == "MaxMode" and "maxMode" in capped["message"]
    assert {h["kind"] for h in found["history"]} == {"recommended"}
    assert 2 <= found["recommended"]["maxNumSeqs"] < 64
    assert reasons(kube).count("ModeCapped") == 1  # on the transition, not every tick


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_under_an_apply_ceiling_the_mode_is_the_policys(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    spec = add_deployment_and_policy(kube, ["--max-num-seqs", "64"], policy_spec(metrics_url, "Apply"))
    await ticks(spec, PolicyMemory(), 3, max_mode=Mode.APPLY)
    found = policy_status(kube)
    assert found["mode"] == "Apply" and conditions(found)["ModeCapped"] == "False"
    assert read_flag(container_args(kube), "--max-num-seqs") != 64 and "ModeCapped" not in reasons(kube)


async def apply_then_undo(
    kube: OptimisticEmulator, metrics_url: str, args: list[str]
) -> tuple[PolicyMemory, int]:
    """Let the operator lower max_num_seqs in Apply mode, then ask for an undo; returns the memory and the
    value it had set."""
    spec = add_deployment_and_policy(kube, args, policy_spec(metrics_url, "Apply"))
    memory = PolicyMemory()
    await ticks(spec, memory, 3)
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and lowered < 64
    assert policy_status(kube)["original"] == {"maxNumSeqs": read_flag(args, "--max-num-seqs") or 0}
    await ticks(spec, memory, 3, undo="2026-12-02")
    return memory, lowered


@pytest.mark.asyncio
@pytest.mark.timeout(40)
async def test_undo_restores_the_before_and_holds_the_policy(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    memory, lowered = await apply_then_undo(kube, metrics_url, ["--model", "m", "--max-num-seqs", "64"])
    assert container_args(kube) == ["--model", "m", "--max-num-seqs", "64"]  # as it was
    found = policy_status(kube)
    undone = [h for h in found["history"] if h["kind"] == "undone"]
    assert [(h["knob"], h["before"], h["after"]) for h in undone] == [("max_num_seqs", lowered, 64)]
    assert found["undo"]["request"] == "2026-12-02" and found["undo"]["done"] is True
    assert "original" not in found and "desired" not in found  # nothing held, nothing to restore twice
    assert found["mode"] == "Recommend" and conditions(found)["ModeCapped"] == "True"
    (capped,) = [c for c in found["conditions"] if c["type"] == "ModeCapped"]
    assert capped["reason"] == "UndoHold"
    events = [e for e in our_events(kube) if e["reason"] == "TuningUndone"]
    assert len(events) == 1 and f"max_num_seqs: {lowered} -> 64" in events[0]["message"]
    # the annotation gone, the policy runs in Apply again (the recorded metrics no longer move: no new action)
    await ticks(policy_spec(metrics_url, "Apply"), memory, 2)
    assert policy_status(kube)["mode"] == "Apply" and conditions(policy_status(kube))["ModeCapped"] == "False"
    assert container_args(kube) == ["--model", "m", "--max-num-seqs", "64"]


@pytest.mark.asyncio
@pytest.mark.timeout(40)
async def test_undo_takes_out_a_flag_the_workload_never_set(
    kube: OptimisticEmulator, metrics_server: ThreadingHTTPServer, metrics_url: str, tmp_path: Path
) -> None:
    # vLLM exports no max_num_seqs gauge: the value in force before is unknown, the flag absent
    served = []
    for name in metrics_server.files:  # type: ignore[attr-defined]
        text = (FIXTURES / name).read_text()
        (tmp_path / name).write_text(
            "".join(line for line in text.splitlines(True) if "kvtune:max_num_seqs" not in line)
        )
        served.append(str(tmp_path / name))
    metrics_server.files = served  # type: ignore[attr-defined]
    spec = add_deployment_and_policy(kube, ["--model", "m"], policy_spec(metrics_url, "Apply"))
    memory = PolicyMemory()
    await ticks(spec, memory, 3)
    assert read_flag(container_args(kube), "--max-num-seqs") is not None  # the operator added it
    assert policy_status(kube)["original"] == {"maxNumSeqs": 0}  # 0: not set
    await ticks(spec, memory, 2, undo="now")
    assert container_args(kube) == ["--model", "m"]
    assert policy_status(kube)["undo"]["done"] is True


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_kopf_reads_the_ceiling_from_its_memo_and_the_undo_from_the_annotation(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    """The wiring: `kvtune operator --max-mode` puts the ceiling in kopf's memo; the annotation is read
    from the policy the daemon watches. A policy whose status says the operator lowered 64 to 20 is undone
    at the first tick, under a Recommend ceiling."""
    ask_for_undo(kube, metrics_url)
    async with kopf_running(kopf.Memo(max_mode=Mode.RECOMMEND)) as operator:
        await operator.until(lambda: undo_done(kube), 30, "the operator did not undo within 30 s")
    assert read_flag(container_args(kube), "--max-num-seqs") == 64
    found = policy_status(kube)
    assert found["undo"]["request"] == "please" and found["mode"] == "Recommend"


def test_first_values_round_trip_through_status() -> None:
    """Status cannot hold a meaningful null: a knob that was not set is 0 there, and comes back as None."""
    from kvtune.operator.k8s.crd import OriginalValues

    first = {"max_num_seqs": None, "max_tokens_cap": 512}
    saved = OriginalValues.of(first)
    assert saved is not None and saved.dump() == {"maxNumSeqs": 0, "maxTokensCap": 512}
    assert OriginalValues.model_validate(saved.dump()).values() == first
    assert OriginalValues.of({}) is None and OriginalValues.of({"kv_cache_dtype": None}) is None
