"""`kvtune <verb>`: the public command-line contract, the verbs and flags the README documents.

Each verb lives in its own module and registers its flags through `add_arguments(parser)` and runs through
`run(args) -> int`; this file only wires them up and turns errors into one clear line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvtune.errors import KvtuneError

# verb -> (module, help). A verb's module is imported only when that verb runs (see build_parser).
VERBS: dict[str, tuple[str, str]] = {
    "sim": ("kvtune.sim.command", "trace-driven KV-cache simulation (no model)"),
    "demo": ("kvtune.demo.command", "the main job on the embedded default, with a report"),
    "tiny-model": (
        "kvtune.engine.model.tiny_model",
        "write a seeded random-weight Llama checkpoint (HF format)",
    ),
    "serve": (
        "kvtune.engine.command",
        "the engine server (OpenAI-compatible API, /metrics, admin API)",
    ),
    "proxy": (
        "kvtune.proxy.command",
        "OpenAI-compatible proxy in front of vLLM/SGLang: max_tokens cap, prefix watch",
    ),
    "doctor": (
        "kvtune.operator.doctor.command",
        "one-shot KV-cache diagnosis and the remedies in ladder order",
    ),
    "operator": (
        "kvtune.operator.command",
        "the tuning operator (--local: against one engine, no Kubernetes)",
    ),
    "rules": ("kvtune.observability.command", "render the Prometheus recording and alert rules"),
    "dashboards": (
        "kvtune.dashboards.command",
        "build dashboards/*.json from Python, or push them to a Grafana",
    ),
    "report": ("kvtune.dashboards.report", "the dashboards' panels from a Prometheus as PNG + index.html"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "kernels": ("kvtune.bench.kernels", "paged-attention kernels against the machine's memory bandwidth"),
    "sim": ("kvtune.bench.sim", "simulator steps per second for each allocation policy"),
    "serve": ("kvtune.bench.serve", "load generator for any OpenAI-compatible server"),
    "engine": ("kvtune.bench.engine", "kvtune serve against vLLM's CPU build, alternating"),
    "doctor-vllm": (
        "kvtune.bench.doctor_vllm",
        "kvtune doctor against vLLM's CPU build: diagnose, restart with the recommendation, replay",
    ),
    "tuner": ("kvtune.bench.tuner", "max_num_seqs tuner against a static sweep on a live engine"),
    "whatif": (
        "kvtune.bench.whatif",
        "what-if predictions against static settings measured on a live engine",
    ),
    "proxy": ("kvtune.bench.proxy", "kvtune proxy in front of an engine against the engine direct"),
    "prefix-defeats": ("kvtune.bench.prefix_defeats", "prefix-defeat detector: precision, recall, cost"),
    "soak": ("kvtune.bench.soak", "engine memory under a long mixed load with hang-ups: does it level off"),
    "autoscale": (
        "kvtune.bench.autoscale",
        "kvtune's replica signal against the waiting queue and KV usage, through KEDA on the local control plane",
    ),
    "fleet": (
        "kvtune.bench.fleet",
        "the operator over hundreds of policies and thousands of replayed pods on the local control plane",
    ),
    "connections": (
        "kvtune.bench.connections",
        "/health with 1,000 idle connections open; slowloris cut-off",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2 (argparse prints usage too by default)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"kvtune: error: {message}\n")
        raise SystemExit(2)


def _chosen(argv: Sequence[str], names: dict[str, tuple[str, str]]) -> str | None:
    """The first word of `argv` that names an entry of `names` (flags before it are skipped), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in names else None
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for `argv`: every verb is listed, but only the verb `argv` names has its module imported
    to add its flags, so `kvtune operator` or `kvtune doctor` never loads torch, fastapi or uvicorn."""
    parser = _Parser(prog="kvtune", description="Watch and tune the KV cache of LLM inference servers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True
    chosen = _chosen(argv, {**VERBS, "bench": ("", "")})
    for verb, (module, help_text) in VERBS.items():
        sub = verbs.add_parser(verb, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        if verb == chosen:
            _register(sub, module)
    bench = verbs.add_parser("bench", help="benchmarks that print a table and record it in BENCHMARKS.md")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=_Parser)
    benches.required = True
    chosen_bench = _chosen(argv[list(argv).index("bench") + 1 :], BENCHES) if chosen == "bench" else None
    for name, (module, help_text) in BENCHES.items():
        sub = benches.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        if name == chosen_bench:
            _register(sub, module)
    return parser


def _register(sub: argparse.ArgumentParser, module: str) -> None:
    """Adds a verb's arguments from its module. A verb whose module, or a package that module needs, is not
    installed stays listed and says so when used, so the other verbs keep working: a GPU image without the
    server's packages can still run `kvtune bench kernels`."""
    try:
        importlib.import_module(module).add_arguments(sub)
    except ModuleNotFoundError as missing:
        if missing.name and module.startswith(missing.name):
            reason = f"{module} is not installed in this build"
        else:
            reason = f"`{sub.prog}` needs the Python package {missing.name!r}, which is not installed here"
        sub.set_defaults(_missing=reason)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words)
    args, unparsed = parser.parse_known_args(words)
    try:
        if getattr(args, "_missing", None):  # its arguments were never added, so none of them parsed
            raise KvtuneError(args._missing)
        if unparsed:
            parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
        code: int = importlib.import_module(args._module).run(args)
        return code
    except KvtuneError as err:
        if args.debug:
            raise
        sys.stderr.write(f"kvtune: error: {err}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
