"""`kvtune rules build [--out DIR]`: writes the rendered rules, the plain rules file and the PrometheusRule,
from kvtune/observability/rules.py (their one source). The files under deploy/prometheus/ are committed; a
test fails when they drift from the source."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtune.errors import KvtuneError
from kvtune.observability.rules import render_prometheus_rule, render_rules_file

DEFAULT_OUT = Path("deploy/prometheus")
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


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise KvtuneError(f"--out {out} is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, content in rendered_files().items():
            (out / name).write_text(content)
            print(out / name)
    except OSError as err:
        raise KvtuneError(f"cannot write the rules under {out}: {err.strerror}") from err
    return 0
