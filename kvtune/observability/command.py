"""`kvtune rules build [--out DIR]`: writes the rendered rules, the plain rules file and the PrometheusRule,
from kvtune/observability/rules.py (their one source). The files under deploy/prometheus/ are committed; a
test fails when they drift from the source. The Helm chart's PrometheusRule reads its own copy of the rules
file (charts/kvtune/files/: helm cannot read outside the chart's folder), written by the same command and
drift-tested the same way."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtune.errors import KvtuneError
from kvtune.observability.rules import render_prometheus_rule, render_rules_file

DEFAULT_OUT = Path("deploy/prometheus")
CHART_COPY_DIR = Path("charts/kvtune/files")
RULES_FILE = "kvtune-rules.yaml"
PROMETHEUS_RULE_FILE = "kvtune-prometheusrule.yaml"
# kube-prometheus-stack selects rules by `release: <its release name>`; this is its usual name.
PROMETHEUS_RULE_LABELS = {"app.kubernetes.io/name": "kvtune", "release": "kube-prometheus-stack"}


def rendered_files() -> dict[str, str]:
    """File name -> content, as `kvtune rules build` writes them."""
    return {
        RULES_FILE: render_rules_file(),
        PROMETHEUS_RULE_FILE: render_prometheus_rule("kvtune", "monitoring", PROMETHEUS_RULE_LABELS),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="rules_action", metavar="ACTION", parser_class=type(parser))
    actions.required = True
    build = actions.add_parser("build", help="write the rules file and the PrometheusRule")
    build.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory (default {DEFAULT_OUT})")
    build.add_argument(
        "--chart-out",
        type=Path,
        default=CHART_COPY_DIR,
        help=f"where the Helm chart's copy of {RULES_FILE} goes (default {CHART_COPY_DIR})",
    )


def run(args: argparse.Namespace) -> int:
    files = rendered_files()
    targets = [("--out", args.out, files), ("--chart-out", args.chart_out, {RULES_FILE: files[RULES_FILE]})]
    for flag, out, _ in targets:
        if out.exists() and not out.is_dir():
            raise KvtuneError(f"{flag} {out} is not a directory")
    for _, out, chosen in targets:
        try:
            out.mkdir(parents=True, exist_ok=True)
            for name, content in chosen.items():
                (out / name).write_text(content)
                print(out / name)
        except OSError as err:
            raise KvtuneError(f"cannot write the rules under {out}: {err.strerror}") from err
    return 0
