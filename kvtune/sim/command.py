"""`kvtune sim`: one simulation, or the seed's figures side by side with ours (`--table seed`)."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

from kvtune.core.allocators import POLICIES
from kvtune.core.geometry import GIB, ModelGeometry, check_block_size
from kvtune.errors import KvtuneError
from kvtune.sim.distributions import LengthDistribution
from kvtune.sim.scenarios import SCENARIOS, SEED_OUTPUT_MEAN, scenario_config
from kvtune.sim.seed_table import format_table, run_all, seed_figures
from kvtune.sim.simulator import SimConfig, SimResult

SUMMARY_FIELDS = (
    "resident_sequences",
    "tokens_per_step",
    "effective_utilization",
    "reserved_fraction",
    "internal_fraction",
    "external_fraction",
    "held_and_empty_mib",
    "preemptions",
    "discarded_tokens",
    "delivered_tokens",
    "shared_tokens_per_request",
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--table", choices=SCENARIOS, help="print every figure the scenario's source states, beside ours"
    )
    p.add_argument("--scenario", default="seed", help=f"base scenario ({', '.join(SCENARIOS)}; default seed)")
    p.add_argument("--policy", default="paged", help=f"allocation policy: {', '.join(POLICIES)}")
    p.add_argument("--max-tokens", type=_positive_int, help="declared max_tokens of every request")
    p.add_argument("--block-size", type=int, help="tokens per KV block")
    p.add_argument("--spread", type=float, help="output-length spread, %% around 256 tokens (0-100)")
    p.add_argument("--no-round", action="store_true", help="contiguous/oracle: do not round chunks up to 2^n")
    p.add_argument(
        "--shared-prefix", type=_non_negative_int, help="tokens of system prompt every request shares"
    )
    p.add_argument(
        "--steps", type=_positive_int, help="steps to simulate (the last 2/3, at most 2,000, measured)"
    )
    p.add_argument(
        "--prompt-dist", help="prompt lengths, e.g. uniform:1300:6800, fixed:4000, normal:4000:1200"
    )
    p.add_argument("--output-dist", help="true output lengths (overrides --spread), e.g. spread:256:100")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--pool-tokens", type=_positive_int, help="KV pool size in tokens")
    pool.add_argument("--pool-gib", type=float, help="KV pool size in GiB (with the model geometry below)")
    p.add_argument(
        "--layers", type=_positive_int, default=36, help="model geometry for --pool-gib (default Qwen3-8B)"
    )
    p.add_argument("--kv-heads", type=_positive_int, default=8)
    p.add_argument("--head-dim", type=_positive_int, default=128)
    p.add_argument("--dtype-bytes", type=_positive_int, default=2)
    p.add_argument("--seed", type=_non_negative_int, default=0, help="random seed of the first run")
    p.add_argument("--seeds", type=_positive_int, default=None, help="runs to average (default 1; table: 5)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE.png", help="draw the memory map over time for each policy")


def build_config(args: argparse.Namespace) -> SimConfig:
    """Turn flags into a SimConfig, with one clear error for anything that cannot run."""
    if args.policy not in POLICIES:
        raise KvtuneError(f"unknown policy {args.policy!r} (choose from {', '.join(POLICIES)})")
    if args.block_size is not None:
        check_block_size(args.block_size, error=KvtuneError)
    if args.spread is not None and not 0 <= args.spread <= 100:
        raise KvtuneError(f"spread is a percentage from 0 to 100, got {args.spread:g}")
    overrides: dict[str, object] = {"policy": args.policy, "seed": args.seed}
    if args.max_tokens is not None:
        overrides["max_tokens"] = args.max_tokens
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.spread is not None:
        overrides["spread"] = args.spread
    if args.no_round:
        overrides["round_pow2"] = False
    if args.shared_prefix is not None:
        overrides["shared_prefix"] = args.shared_prefix
    if args.steps is not None:
        if args.steps < 3:
            raise KvtuneError(f"--steps must be at least 3, got {args.steps}")
        overrides["steps"] = args.steps
    if args.prompt_dist:
        overrides["prompt"] = LengthDistribution.parse(args.prompt_dist)
    if args.output_dist:
        overrides["output"] = LengthDistribution.parse(args.output_dist)
    elif args.spread is not None:
        overrides["output"] = LengthDistribution("spread", SEED_OUTPUT_MEAN, args.spread)
    if args.pool_tokens is not None:
        overrides["pool_tokens"] = args.pool_tokens
    elif args.pool_gib is not None:
        if args.pool_gib <= 0:
            raise KvtuneError(f"--pool-gib must be positive, got {args.pool_gib:g}")
        geometry = ModelGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)
        overrides["pool_tokens"] = geometry.tokens_in(args.pool_gib * GIB)
    cfg = scenario_config(args.scenario, **overrides)
    if geometry_given(args):
        geometry = ModelGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)
        cfg = replace(cfg, bytes_per_token=geometry.bytes_per_token)
    _check_fits(cfg)
    return cfg


def geometry_given(args: argparse.Namespace) -> bool:
    return (args.layers, args.kv_heads, args.head_dim, args.dtype_bytes) != (36, 8, 128, 2)


def _check_fits(cfg: SimConfig) -> None:
    """A pool that cannot hold even one request would simulate an empty machine forever: refuse it."""
    if cfg.num_blocks < 1:
        raise KvtuneError(f"a pool of {cfg.pool_tokens} tokens holds no block of {cfg.block_size} tokens")
    w = cfg.workload
    prompt_max = w.prompt_len.maximum
    output_max = min(w.max_tokens, w.output_len.maximum)
    need = prompt_max + output_max - 1 if cfg.policy == "paged" else prompt_max + w.max_tokens
    if need > cfg.num_blocks * cfg.block_size:
        raise KvtuneError(
            f"the pool ({cfg.num_blocks * cfg.block_size:,} tokens) is smaller than one request "
            f"(up to {need:,.0f} tokens for the {cfg.policy} policy)"
        )


def _summary(results: list[SimResult]) -> dict[str, object]:
    out: dict[str, object] = {"policy": results[0].policy, "runs": len(results)}
    for name in SUMMARY_FIELDS:
        values = [float(getattr(r, name)) for r in results]
        mean = statistics.fmean(values)
        out[name] = round(mean) if name in ("preemptions", "discarded_tokens", "delivered_tokens") else mean
    out["steps"] = results[0].steps
    out["window_steps"] = results[0].window_steps
    out["steps_per_second"] = statistics.median(r.steps_per_second for r in results)
    out["head_blocked_steps"] = results[0].head_blocked_steps
    frag = results[0].first_fragmentation
    out["first_fragmentation"] = None if frag is None else frag.__dict__
    return out


def run(args: argparse.Namespace) -> int:
    if args.table:
        figures = seed_figures(seeds=args.seeds or 5)
        if args.json:
            print(json.dumps([f.to_dict() for f in figures], indent=1))
        else:
            print(format_table(figures))
        return 0
    cfg = build_config(args)
    results = run_all({"run": cfg}, args.seeds or 1, workers=1 if (args.seeds or 1) == 1 else None)["run"]
    summary = _summary(results)
    if args.plot:
        from kvtune.sim.plot import plot_memory_maps

        plot_memory_maps(cfg, args.plot)
        summary["plot"] = args.plot
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_summary(summary))
    return 0


def format_summary(s: dict[str, object]) -> str:
    lines = [f"policy {s['policy']}, {s['runs']} run(s), measured over the last {s['window_steps']} steps"]
    for name in SUMMARY_FIELDS:
        value = s[name]
        shown = f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"
        lines.append(f"  {name.replace('_', ' '):<28} {shown}")
    lines.append(f"  {'head blocked (steps)':<28} {s['head_blocked_steps']}")
    if s.get("first_fragmentation"):
        lines.append(f"  {'first fragmentation':<28} {s['first_fragmentation']}")
    lines.append(f"  {'simulator speed':<28} {s['steps_per_second']:,.0f} steps/s")
    return "\n".join(lines)
