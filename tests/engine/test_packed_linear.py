"""bfloat16 linear layers over prepacked oneDNN weights on CPUs with native bfloat16: bitwise the layer they
replace (same GEMM, same accumulation), chosen only there, and the engine's greedy output unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_loop_driver import generate, make_engine
from greedy_workload import SMALL_POOL_TOKENS, WORKLOAD, workload_params
from torch import nn

from kvtune.engine.model import model_runner
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.model_runner import ModelRunner
from kvtune.engine.model.packed_linear import PackedLinear, pack_bf16_linears, packing_pays
from kvtune.engine.model.serving_dtype import cpu_flags

NATIVE = packing_pays("cpu", torch.bfloat16, cpu_flags())
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE, reason="not run: this CPU lacks native bfloat16 (AVX512-BF16 or AMX) or torch lacks oneDNN"
)


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 26, 64, 300])
@pytest.mark.parametrize("shape", [(256, 384), (512, 256), (1024, 2816)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_the_linear_it_replaces_bitwise(rows: int, shape: tuple[int, int], bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, shape[0], generator=generator).to(torch.bfloat16)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        got, expected = packed(x), F.linear(x, linear.weight, linear.bias)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_only_bf16_on_a_cpu_with_native_bf16_is_packed() -> None:
    native = frozenset({"avx2", "avx512_bf16"})
    if torch.backends.mkldnn.is_available():
        assert packing_pays("cpu", torch.bfloat16, native)
        assert packing_pays("cpu", torch.bfloat16, frozenset({"amx_bf16"}))
    assert not packing_pays("cpu", torch.bfloat16, frozenset({"avx2"}))
    assert not packing_pays("cpu", torch.float32, native)
    assert not packing_pays("cuda", torch.bfloat16, native)


@needs_native_bf16
def test_every_bf16_linear_is_replaced_and_nothing_else() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()), nn.Embedding(5, 8))
    model.to(torch.bfloat16)
    assert pack_bf16_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert pack_bf16_linears(nn.Sequential(nn.Linear(8, 8))) == 0  # float32: left alone


def test_the_engine_packs_only_where_the_cpu_has_native_bf16(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model=str(tiny_dir), dtype="bfloat16", kv_cache_tokens=1024)
    monkeypatch.setattr(model_runner, "cpu_flags", lambda: frozenset({"avx2"}))
    assert ModelRunner(config).packed_linears == 0
    if torch.backends.mkldnn.is_available():
        monkeypatch.setattr(model_runner, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
        runner = ModelRunner(config)
        assert runner.packed_linears == 4 * 4 + 1 and runner.widened_linears == 0


@needs_native_bf16
def test_bf16_greedy_through_packed_layers_under_preemption_equals_a_roomy_pool(tiny_dir: Path) -> None:
    roomy = make_engine(tiny_dir, dtype="bfloat16")
    assert roomy.runner.packed_linears == 17
    expected = generate(roomy, WORKLOAD, workload_params)
    tight = make_engine(tiny_dir, dtype="bfloat16", kv_cache_tokens=SMALL_POOL_TOKENS)
    done = generate(tight, WORKLOAD, workload_params)
    assert tight.counters.num_preemptions > 0
    assert {rid: done.tokens(rid) for rid in WORKLOAD} == {rid: expected.tokens(rid) for rid in WORKLOAD}
