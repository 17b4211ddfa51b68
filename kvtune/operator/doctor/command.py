"""`kvtune doctor --metrics-url URL | --metrics-file FILE | --prometheus URL --selector S [--since D]
[--json]`: one-shot diagnosis and the remedies in ladder order, with concrete numbers a person can act on.
Reading a server directly, it also reads the server's prefix report (kvtune serve, kvtune proxy) to say
where each prefix-cache defeat lies; reading Prometheus, the defeat series alone name the reasons.

vLLM's metrics do not carry max_num_seqs, which the what-if table needs: the doctor reads it from vLLM's
startup log (`--vllm-log`) or the pod's spec (`--pod`) where it is given them, and otherwise says which
flag to pass. It rounds max_num_seqs as the operator does for the same engine and device.

People run the doctor after the incident, so it looks back: through Prometheus, `--since` diagnoses a
past span from range queries; on an engine that is quiet now but preempted since it started, it
diagnoses from the counters and histograms since boot, and says so."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtune.contract import metrics as m
from kvtune.contract.prefix_report import report_url
from kvtune.core.predict import NO_PREEMPTION, OBJECTIVES
from kvtune.errors import KvtuneError
from kvtune.operator.decide.diagnosis import Diagnosis, Finding, diagnose, no_data
from kvtune.operator.decide.ladder import Advice, plan
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.ports import MetricSource
from kvtune.operator.decide.prediction import objective_of
from kvtune.operator.decide.sample import EngineView, NoData, Sample, engine_view_from_sample
from kvtune.operator.decide.window import Window, since_boot
from kvtune.operator.doctor.admission import admission_advice
from kvtune.operator.doctor.engine_config import (
    EngineConfig,
    config_from_pod,
    config_from_vllm_log,
    engine_of,
    round_to_for,
    unknown_limit,
)
from kvtune.operator.doctor.metrics_file import MARKER, read_metrics_files, snapshot_note
from kvtune.operator.doctor.pod_spec import read_pod
from kvtune.operator.doctor.whatif import what_if_section, what_if_text
from kvtune.operator.io.prefix_report import defeat_entries, entry_line, fetch_report
from kvtune.operator.io.sources import (
    EngineWithProxy,
    MetricsEndpoint,
    PrometheusSource,
    url_problem,
)

WINDOW, RANGE, SINCE_BOOT = "window", "range", "since_boot"  # what the diagnosis covers
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

KNOB_LABELS = {
    "cap_max_tokens": "max_tokens cap",
    "lower_max_num_seqs": "max_num_seqs",
    "flag_prefix_defeat": "prefix hit rate",
    "recommend_fp8_kv": "kv_cache_dtype",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics-url", help="an engine's /metrics (or its base URL)")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server's base URL")
    source.add_argument(
        "--metrics-file",
        metavar="FILE",
        action="append",
        help="a saved /metrics (repeatable, oldest first; no engine needed). One scrape (curl -s URL/metrics "
        "> FILE) gives counters since the engine started and gauges at one instant: figures since boot, not "
        f"a window, and no what-if table. Several scrapes, each after a line `{MARKER} UNIX_SECONDS`, are a "
        f'window, like the samples --metrics-url takes: for i in 1 2 3 4 5 6; do echo "{MARKER} $(date +%%s)"; curl -s '
        "URL/metrics; sleep 2; done > FILE. A scrape without that line is timed by the file's mtime",
    )
    parser.add_argument("--selector", help='label selector for --prometheus, e.g. job="vllm"')
    parser.add_argument(
        "--proxy",
        metavar="URL",
        help="the kvtune proxy in front of the engine (its /metrics merged with --metrics-url's, its prefix report)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--since",
        metavar="DURATION",
        help="with --prometheus: diagnose the last DURATION (e.g. 1h, 30m, 1h30m) from range queries",
    )
    parser.add_argument("--window-seconds", type=float, default=10.0, help="span the samples cover")
    parser.add_argument("--samples", type=int, default=6,
                        help="samples taken across the window (>= 2; the what-if fit needs 3 over 5 s)")  # fmt: skip
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="the engine's max_num_seqs (vLLM's metrics lack it; see --vllm-log, --pod)",
    )
    parser.add_argument(
        "--vllm-log",
        metavar="FILE",
        help="vLLM's log from its start (kubectl logs POD > FILE): its max_num_seqs, device and version",
    )
    parser.add_argument(
        "--pod",
        metavar="NAMESPACE/NAME",
        help="read vLLM's flags from this pod's spec (kubeconfig or in-cluster credentials; needs get pods)",
    )
    parser.add_argument("--container", help="with --pod: the container that runs vLLM (default: found)")
    parser.add_argument(
        "--max-model-len", type=int, help="the engine's max_model_len, when its metrics lack it"
    )
    parser.add_argument("--cap-floor", type=int, default=TuningPolicy.cap_floor)
    parser.add_argument("--min-max-num-seqs", type=int, default=TuningPolicy.min_max_num_seqs)
    parser.add_argument("--shared-prefix-tokens", type=int, default=0, help="the workload's shared prefix")
    parser.add_argument("--objective", choices=OBJECTIVES, default=NO_PREEMPTION,
                        help="the what-if table's recommendation: NoPreemption, or Goodput under --p95-wait-bound")  # fmt: skip
    parser.add_argument("--p95-wait-bound", type=float, metavar="SECONDS",
                        help="Goodput's bound on the predicted p95 queue wait")  # fmt: skip
    parser.add_argument("--round-to", type=int,
                        help="max_num_seqs in multiples of this (default: as the operator rounds for the engine and "
                        "device: 8 for vLLM on CUDA, its CUDA graphs, and for a vLLM whose device is unknown; 1 "
                        "elsewhere)")  # fmt: skip
    parser.add_argument("--no-what-if", action="store_true", help="skip the what-if table")
    parser.add_argument(
        "--replicas",
        action="store_true",
        help="also size the replicas this load needs (a what-if search of its own: seconds to a minute)",
    )


def parse_duration(text: str) -> float:
    """`1h`, `30m`, `1h30m`, `45s`, `2d` (Prometheus' spelling) or plain seconds -> seconds, > 0."""
    spelled = text.strip()
    try:
        seconds = float(spelled)
    except ValueError:
        if not re.fullmatch(r"(?:\d+(?:\.\d+)?[smhdw])+", spelled):
            raise KvtuneError(f"--since: {text!r} is not a duration (e.g. 1h, 30m, 1h30m, 90s)") from None
        seconds = sum(
            float(n) * DURATION_UNITS[unit] for n, unit in re.findall(r"(\d+(?:\.\d+)?)([smhdw])", spelled)
        )
    if not seconds > 0 or seconds == float("inf"):
        raise KvtuneError(f"--since: {text!r} must be a positive duration")
    return seconds


def span_text(seconds: float) -> str:
    """A span as a person says it: `32 minutes`, or `4.5 minutes` when short."""
    minutes = seconds / 60
    return f"{minutes:.0f} minutes" if minutes >= 10 else f"{minutes:.1f} minutes"


@dataclass(frozen=True)
class Examined:
    """A diagnosis, the engine it is about, and what span it covers (WINDOW, RANGE or SINCE_BOOT)."""

    diagnosis: Diagnosis
    engine: EngineView
    basis: str = WINDOW
    since_boot_seconds: float | None = None


def looking_back(idle: Diagnosis, latest: Sample, engine: EngineView) -> Examined:
    """An engine quiet in the sampled window whose counters show preemptions since boot: diagnose the span
    from process start to now instead (`process_start_time_seconds` gives it), so a doctor run after the
    incident still gives the ladder with numbers. No preemption since boot: idle, nothing to do. One scrape
    (a saved file, or --samples 1) is no window: it is read since boot the same way, and said so."""
    one_scrape = idle.samples <= 1
    preempted = latest.counters.get(m.PREEMPTIONS) or 0.0
    if preempted <= 0:
        return Examined(idle, engine)
    started = latest.gauges.get(m.PROCESS_START)
    if started is None or started >= latest.timestamp:
        unknown = Finding(
            "QuietSinceBootUnknownSpan",
            "warning",
            f"{'one scrape' if one_scrape else 'the engine is quiet now'}, but its counters show "
            f"{preempted:,.0f} preemptions since boot; "
            "without process_start_time_seconds their span is unknown, so nothing is sized from them",
            "run the doctor during the load, or through --prometheus with --since",
        )
        return Examined(replace(idle, findings=(*idle.findings, unknown)), engine)
    span = latest.timestamp - started
    d = diagnose(since_boot(latest, started), engine)
    distributions = {
        name: replace(value, since="since engine start")
        for name in ("prompt_len", "generation_len", "declared_max_tokens")
        if (value := getattr(d, name)) is not None
    }
    said = Finding(
        "QuietSinceBoot",
        "info",
        f"{'one scrape, no window' if one_scrape else 'the engine is quiet now'}; diagnosing from its "
        f"counters since boot ({span_text(span)})",
        f"num_preemptions {preempted:,.0f} since the process started (process_start_time_seconds, "
        f"{span:,.0f} s before the scrape)"
        + (
            ""
            if one_scrape
            else f"; nothing moved in the {idle.window_seconds:.1f} s sampled ({idle.samples} samples)"
        ),
    )
    looked = replace(d, **distributions, findings=(said, *d.findings))
    return Examined(looked, engine, SINCE_BOOT, span)


def examine(
    samples: list[Sample],
    failure: NoData | None,
    known: EngineView,
    *,
    quiet_looks_back: bool,
    basis: str = WINDOW,
) -> Examined:
    """Diagnose the samples taken; on a quiet engine read directly (`quiet_looks_back`), look back to
    boot, unless the samples came from more than one process. The one path `kvtune doctor` and the
    doctor-vllm benchmark share."""
    engine = engine_view_from_sample(samples[-1] if samples else None, known)
    if not samples:
        return Examined(no_data(failure.reason if failure else "no sample"), engine, basis)
    d = diagnose(Window.of(samples), engine)
    alternating = any(
        f.code == "AlternatingSource" for f in d.findings
    )  # its counters since boot are not one process's
    if quiet_looks_back and d.status == "idle" and not alternating:
        return looking_back(d, samples[-1], engine)
    return Examined(d, engine, basis)


def collect(source: MetricSource, samples: int, window_seconds: float) -> tuple[list[Sample], NoData | None]:
    """`samples` readings evenly spread over `window_seconds`; the last failure, if any."""
    taken: list[Sample] = []
    failure = None
    gap = window_seconds / max(samples - 1, 1)
    for i in range(samples):
        if i:
            time.sleep(gap)
        result = source.read()
        if isinstance(result, NoData):
            failure = result
        else:
            taken.append(result)
    return taken, failure


def prefix_report_section(d: Diagnosis, metrics_url: str) -> dict[str, Any] | None:
    """The front's prefix report (kvtune serve, kvtune proxy), read after the samples; None where there is
    none (vLLM, SGLang). Each reason is marked `in_window` when its counter moved in the sampled window: the
    report counts since the server started, the window is what the diagnosis is about."""
    url = report_url(metrics_url)
    found = fetch_report(url)
    if found is None:
        return None
    moved = {reason for reason, _ in d.prefix_defeats}
    entries = [{**entry, "in_window": entry["reason"] in moved} for entry in defeat_entries(found)]
    return {"url": url, "block_size": found.get("block_size"), "observed": found.get("observed"),
            "defeats": entries}  # fmt: skip


def report(
    d: Diagnosis,
    engine: EngineView,
    remedies: list[Advice],
    source: str,
    prefix_report: dict[str, Any] | None = None,
    basis: str = WINDOW,
    since_boot_seconds: float | None = None,
    admission_flag: dict[str, Any] | None = None,
    what_if: dict[str, Any] | None = None,
) -> dict[str, Any]:
    gen = d.generation_len
    return {
        "source": source,
        "status": d.status,
        "basis": basis,
        "since_boot_seconds": since_boot_seconds,
        # vLLM read directly: the flag that sets max_num_seqs' admission limit ({flag, why, vllm_version})
        "admission_flag": admission_flag,
        "findings": {
            "preemption_rate": d.preemption_rate,
            "preemptions": d.preemptions,
            # newer vLLMs only (None / {} on others): why, and how the preemptions spread over requests
            "preemptions_by_reason": dict(d.preemptions_by_reason),
            "other_preemptions": d.other_preemptions,
            "preempted_requests": None if d.preempted_requests is None else asdict(d.preempted_requests),
            "kv_usage": d.kv_usage_mean,
            "kv_usage_max": d.kv_usage_max,
            "prefix_hit_rate": d.prefix_hit_rate,
            "prefix_hit_rate_source": d.prefix_hit_rate_source,
            "requests_running": d.running_mean,
            "requests_waiting": d.waiting_mean,
            "goodput_tokens_per_s": d.goodput,
            "generation_p99": gen.p99 if gen else None,
            "footprint_p95": d.footprint_p95,
            "footprint_mean": d.footprint_mean,
            "mean_footprint_concurrency": d.mean_footprint_concurrency,
            "pooled_p95_concurrency": d.pooled_p95_concurrency,
            "real_concurrency_ceiling": d.real_concurrency_ceiling,
            "boot_line_concurrency": d.boot_line_concurrency,
            "kv_pool_tokens": engine.pool_tokens,
            "max_num_seqs": engine.max_num_seqs,
            "window_seconds": d.window_seconds,
            "samples": d.samples,
            "notes": [
                {"code": f.code, "severity": f.severity, "message": f.message, "evidence": f.evidence}
                for f in d.findings
            ],
        },
        "remedies": [advice.as_json() for advice in remedies],
        "prefix_report": prefix_report,
        "what_if": what_if,
    }


def _number(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def flag_text(admission_flag: dict[str, Any] | None, remedy: dict[str, Any]) -> str:
    """On vLLM, the flag a person sets for max_num_seqs advice, and why that one."""
    if admission_flag is None or KNOB_LABELS[remedy["remedy"]] != "max_num_seqs" or not remedy["applicable"]:
        return ""
    return f" (set {admission_flag['flag']} {_number(remedy['recommended'])}: {admission_flag['why']})"


def config_lines(config: dict[str, Any] | None) -> list[str]:
    """The engine's max_num_seqs and where it was read (or the one line that says which flag gives it)."""
    if not config:
        return []
    device = f" on {config['device']} ({config['device_from']})" if config.get("device") else ""
    version = f" {config['vllm_version']}" if config.get("vllm_version") else ""
    if config.get("max_num_seqs_from"):
        limit = f"max_num_seqs {config['max_num_seqs']} ({config['max_num_seqs_from']})"
    else:
        limit = f"max_num_seqs unknown: {config['missing']}"
    return [f"Engine: {config['engine']}{version}{device}; {limit}"]


def format_text(data: dict[str, Any]) -> str:
    findings = data["findings"]
    span = f"{findings['samples']} samples over {findings['window_seconds']:.0f} s"
    if data.get("basis") == RANGE:
        span += ", from range queries"
    elif data.get("basis") == SINCE_BOOT:
        now = "one scrape" if data.get("scrapes") == 1 else "quiet now"
        span = f"{now}; its counters since boot, {span_text(data['since_boot_seconds'])}"
    lines = [f"kvtune doctor: {data['source']} ({span})", *config_lines(data.get("engine_config"))]
    lines.append("Findings")
    for note in findings["notes"] or [{"severity": "info", "message": "nothing to report", "evidence": ""}]:
        lines.append(f"  [{note['severity']}] {note['message']}")
        if note["evidence"]:
            lines.append(f"      {note['evidence']}")
    ceiling = findings["real_concurrency_ceiling"]
    if ceiling is not None:
        boot = findings["boot_line_concurrency"]
        boot_text = "n/a" if boot is None else f"{boot:.2f}x"
        lines.append(f"Real concurrency ceiling: {ceiling} (boot line: {boot_text})")
    prefix = data.get("prefix_report") or {}
    entries = prefix.get("defeats", [])
    # The doctor is often run after the incident, when traffic has stopped: what the report holds from
    # before the window is still said, apart from what moved in it.
    for in_window, heading in ((True, "in the window"), (False, "before the window, none in it")):
        chosen = [entry for entry in entries if entry["in_window"] is in_window]
        if chosen:
            lines.append(f"Prefix-cache defeats {heading} ({prefix['url']}; counts since the server started)")
            lines.extend(f"  {entry_line(entry)}" for entry in chosen)
    lines.append("Remedies, in ladder order")
    for i, remedy in enumerate(data["remedies"], 1):
        label = KNOB_LABELS[remedy["remedy"]]
        if remedy["applicable"]:
            current = "unset" if remedy["current"] is None else _number(remedy["current"])
            what = f"{label}: {current} → {_number(remedy['recommended'])}"
            what += flag_text(data.get("admission_flag"), remedy)
        else:
            what = "not applicable"
        lines.append(f"  {i}. {remedy['remedy']}: {what}")
        lines.append(f"      {remedy['evidence']}")
    lines.extend(what_if_text(data.get("what_if")))
    return "\n".join(lines)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """What --vllm-log and --pod say of the engine (the pod wins where both set the limit)."""
    found = EngineConfig()
    if args.vllm_log is not None:
        try:
            with open(args.vllm_log, encoding="utf-8", errors="replace") as file:
                found = config_from_vllm_log(file.read())
        except OSError as err:
            raise KvtuneError(f"--vllm-log {args.vllm_log}: {err.strerror or err}") from None
        except ValueError as err:
            raise KvtuneError(f"--vllm-log: {err}") from None
    if args.pod is not None:
        try:
            from_pod = config_from_pod(read_pod(args.pod), args.container)
        except ValueError as err:
            raise KvtuneError(f"--pod {args.pod}: {err}") from None
        limit = from_pod if from_pod.max_num_seqs is not None or found.max_num_seqs is None else found
        found = EngineConfig(
            max_num_seqs=limit.max_num_seqs,
            max_num_seqs_from=limit.max_num_seqs_from,
            device=from_pod.device or found.device,
            device_from=from_pod.device_from or found.device_from,
            vllm_version=from_pod.vllm_version or found.vllm_version,
            version_from=from_pod.version_from if from_pod.vllm_version else found.version_from,
            max_model_len=from_pod.max_model_len or found.max_model_len,
            missing=limit.missing,
        )
    elif args.container is not None:
        raise KvtuneError("--container needs --pod")
    return found


def limit_source(
    args: argparse.Namespace, config: EngineConfig, engine: EngineView, kind: str
) -> dict[str, Any]:
    """Where max_num_seqs came from (or the one line that says which flag gives it), the device, and the
    rounding: the report's `engine_config`."""
    if args.max_num_seqs is not None:
        where: str | None = "--max-num-seqs"
    elif config.max_num_seqs is not None:
        where = config.max_num_seqs_from
    elif engine.max_num_seqs is not None:
        where = "the engine's kvtune:max_num_seqs gauge"
    else:
        where = None
    looked = [name for name, given in (("--vllm-log", args.vllm_log), ("--pod", args.pod)) if given]
    return {
        "engine": kind,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_seqs_from": where,
        "missing": None if where else (config.missing or unknown_limit(kind, looked)),
        "device": config.device,
        "device_from": config.device_from,
        "vllm_version": config.vllm_version,
    }


def run(args: argparse.Namespace) -> int:
    if args.samples < 1 or args.window_seconds < 0:
        raise KvtuneError("--samples must be >= 1 and --window-seconds >= 0")
    source: MetricSource | None = None
    for flag, url in (
        ("--metrics-url", args.metrics_url),
        ("--prometheus", args.prometheus),
        ("--proxy", args.proxy),
    ):
        problem = url_problem(url) if url is not None else None
        if problem is not None:
            raise KvtuneError(f"{flag}: {problem}")
    since = parse_duration(args.since) if args.since is not None else None
    if since is not None and not args.prometheus:
        raise KvtuneError(
            "--since needs --prometheus (an engine's /metrics holds no history; on an engine that is quiet "
            "now, the doctor reads its counters since boot by itself)"
        )
    if args.proxy and not args.metrics_url:
        raise KvtuneError("--proxy needs --metrics-url (the engine's); through Prometheus, select both jobs")
    if args.metrics_file:
        where = " + ".join(args.metrics_file)
    elif args.metrics_url and args.proxy:
        source = EngineWithProxy(MetricsEndpoint(args.metrics_url), MetricsEndpoint(args.proxy))
        where = f"{args.metrics_url} + {args.proxy}"
    elif args.metrics_url:
        source, where = MetricsEndpoint(args.metrics_url), args.metrics_url
    else:
        if not args.selector:
            raise KvtuneError("--prometheus needs --selector")
        source, where = PrometheusSource(args.prometheus, args.selector), f"{args.prometheus} {args.selector}"
    config = engine_config(args)
    samples: list[Sample]
    failure: NoData | None = None
    if source is None:
        samples = read_metrics_files(args.metrics_file)
    elif since is not None and isinstance(source, PrometheusSource):
        found = source.read_range(since)
        samples, failure = ([], found) if isinstance(found, NoData) else (found, None)
        where += f" (last {args.since})"
    else:
        samples, failure = collect(source, args.samples, args.window_seconds)
    if isinstance(source, EngineWithProxy) and source.proxy_problem:
        print(
            f"kvtune doctor: the proxy's /metrics could not be read: {source.proxy_problem}", file=sys.stderr
        )
    latest = samples[-1] if samples else None
    kind = engine_of(latest)
    round_to, round_why = (
        (args.round_to, "--round-to") if args.round_to is not None else round_to_for(kind, config.device)
    )
    try:
        policy = TuningPolicy(
            cap_floor=args.cap_floor,
            min_max_num_seqs=args.min_max_num_seqs,
            shared_prefix_tokens=args.shared_prefix_tokens,
            objective=args.objective,
            p95_wait_bound_s=args.p95_wait_bound,
            round_to=round_to,
        )
        objective = objective_of(policy)  # the operator's own: the same margin, rounding and objective
    except ValueError as err:
        raise KvtuneError(str(err)) from None
    known = EngineView(
        max_num_seqs=args.max_num_seqs or config.max_num_seqs,
        max_model_len=args.max_model_len or config.max_model_len,
    )
    found_out = examine(
        samples,
        failure,
        known,
        quiet_looks_back=bool(args.metrics_url or args.metrics_file),
        basis=RANGE if since else WINDOW,
    )
    d, engine = found_out.diagnosis, found_out.engine
    # The prefix report lives on the front that tokenizes: the proxy when there is one, else the engine.
    front = args.proxy or args.metrics_url
    prefix = prefix_report_section(d, front) if front and samples else None
    remedies = plan(d, engine, policy)
    admission = admission_advice(args.metrics_url, latest, config.vllm_version, config.version_from)
    configured = limit_source(args, config, engine, kind)
    what_if = None
    note = snapshot_note(samples) if args.metrics_file and not args.no_what_if else None
    if note is not None:
        what_if = {"insufficient": note}
    elif not args.no_what_if and samples and found_out.basis != SINCE_BOOT:
        what_if = what_if_section(
            samples,
            engine,
            objective,
            bounds=(policy.min_max_num_seqs, policy.max_max_num_seqs),
            round_why=round_why,
            unknown=configured["missing"] or "",
            replicas=args.replicas,
        )
    data = report(
        d, engine, remedies, where, prefix, found_out.basis, found_out.since_boot_seconds, admission, what_if
    )
    data["engine_config"] = configured
    data["scrapes"] = len(samples)
    print(json.dumps(data, indent=2) if args.json else format_text(data))
    return 1 if d.status == "no_data" else 0
