"""Record docs/examples/kvtune-engine-preempting.prom and kvtune-engine-quiet.prom: kvtune's own engine on
its tiny model, its /metrics scraped several times under a closed-loop load (each scrape after a
`# scraped_at` line, as record_vllm_metrics.py records vLLM). Preempting: a 512-token pool under six
clients, scraped once it has preempted; quiet: a 4,096-token pool under one client, scraped once requests
have finished. `kvtune bench fleet` replays them as its pods.

Run from the repository root, with the engine extra installed and nothing else busy:
    .venv/bin/python docs/examples/record_kvtune_metrics.py
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtune import __version__
from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.scrape import metric_totals, preemptions

HERE = Path(__file__).parent
SCRAPES, GAP_S, WAIT_S = 6, 2.0, 300.0


@dataclass(frozen=True)
class Setting:
    name: str
    kv_cache_tokens: int
    shape: LoadShape
    preempting: bool  # scrape once it has preempted (else once a few requests have finished)


SETTINGS = (
    Setting(
        "kvtune-engine-preempting", 512, LoadShape(clients=6, prompt_len=(40, 60), output_len=(60, 100)), True
    ),
    Setting(
        "kvtune-engine-quiet", 4096, LoadShape(clients=1, prompt_len=(40, 60), output_len=(60, 100)), False
    ),
)


def started(url: str, setting: Setting) -> bool:
    """The engine is where the recording should begin: preempting, or with finished requests."""
    totals = metric_totals(httpx.get(f"{url}/metrics", timeout=10).text)
    if setting.preempting:
        return (preemptions(totals) or 0) > 0
    return totals.get("vllm:request_success_total", 0) >= 3


def record(setting: Setting, model: Path, folder: Path) -> None:
    token = folder / "token"
    token.write_text("record-token")
    engine = start_engine(model, token, folder / f"{setting.name}.log", "--kv-cache-tokens",
                          str(setting.kv_cache_tokens), "--max-num-seqs", "32")  # fmt: skip
    with engine:
        load = BackgroundLoad(engine.url, setting.shape).start()
        try:
            deadline = time.monotonic() + WAIT_S
            while not started(engine.url, setting):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{setting.name}: the engine did not get there in {WAIT_S:.0f} s")
                time.sleep(0.5)
            parts: list[str] = []
            for i in range(SCRAPES):
                if i:
                    time.sleep(GAP_S)  # the recording's spacing, as a scraper's interval
                at = time.time()
                parts.append(f"# scraped_at {at:.3f}\n{httpx.get(f'{engine.url}/metrics', timeout=10).text}")
        finally:
            tally = load.stop()
    header = (
        f"# Recorded by docs/examples/record_kvtune_metrics.py from kvtune {__version__} `kvtune serve` on its tiny "
        f"model: --kv-cache-tokens {setting.kv_cache_tokens} --max-num-seqs 32, 1 torch thread;\n# a closed loop of "
        f"{setting.shape.clients} clients (prompts {setting.shape.prompt_len[0]}-{setting.shape.prompt_len[1]}, "
        f"outputs {setting.shape.output_len[0]}-{setting.shape.output_len[1]} tokens); {SCRAPES} scrapes "
        f"{GAP_S:g} s apart once it {'had preempted' if setting.preempting else 'had finished 3 requests'}.\n"
    )
    (HERE / f"{setting.name}.prom").write_text(header + "".join(parts))
    print(f"{setting.name}: {tally.completed} completed, {len(tally.failures)} failed")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtune-record-") as tmp:
        folder = Path(tmp)
        model = write_tiny_model_in_subprocess(folder / "tiny")
        for setting in SETTINGS:
            record(setting, model, folder)


if __name__ == "__main__":
    main()
