"""`kvtune dashboards build | push`: regenerate dashboards/ from the Python source, or upload the dashboards
to a Grafana. Each action imports only what it needs (push needs grafana-client, build does not)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# helm reads only files inside the chart's folder, so the chart's ConfigMaps read their own copy.
CHART_COPY_DIR = Path("charts/kvtune/files/dashboards")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    actions.required = True
    build = actions.add_parser("build", help="write dashboards/*.json from the Python source")
    build.add_argument("--out", type=Path, default=Path("dashboards"), help="folder to write (dashboards/)")
    build.add_argument(
        "--chart-out",
        type=Path,
        default=CHART_COPY_DIR,
        help="the Helm chart's copy, which its ConfigMaps read (charts/kvtune/files/dashboards/)",
    )
    push = actions.add_parser("push", help="create or update the dashboards in a Grafana, by uid")
    push.add_argument("--grafana-url", required=True, help="the Grafana's base URL, e.g. http://grafana:3000")
    push.add_argument(
        "--token-file", type=Path, required=True, help="file holding a service-account token (Bearer)"
    )
    push.add_argument("--folder", default="kvtune", help="folder to put them in (created if missing)")


def run(args: argparse.Namespace) -> int:
    if args.action == "build":
        from kvtune.dashboards.build import write

        for folder in (args.out, args.chart_out):
            for path in write(folder):
                print(f"wrote {path}")
        return 0
    from kvtune.dashboards.push import push, read_token

    token = read_token(args.token_file)
    for answer in push(args.grafana_url, token, args.folder):
        print(f"{answer.get('status', 'success')}: {answer.get('uid')} -> {answer.get('url')}")
    sys.stdout.flush()
    return 0
