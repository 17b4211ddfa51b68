"""bfloat16 linear layers widened to float32 GEMMs on CPUs without bfloat16 arithmetic: the same layer (bf16
in and out, the same weight values, float32 accumulation as a bf16 GEMM defines it), chosen only where it
pays, and the engine serving bfloat16 through it stays close to float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_loop_driver import generate, make_engine
from engine_runner import PagedRunner, PagedSequence
from greedy_workload import SMALL_POOL_TOKENS, WORKLOAD, workload_params
from torch import nn

from kvtune.engine.model import model_runner
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model import load_model
from kvtune.engine.model.model_runner import ModelRunner
from kvtune.engine.model.serving_dtype import cpu_flags
from kvtune.engine.model.widened_linear import WidenedLinear, widen_bf16_linears, widening_pays

TOKENS = list(range(32, 112))


def _logits(folder: Path, backend: str, dtype: torch.dtype, widen: bool = False) -> torch.Tensor:
    model = load_model(folder, dtype=dtype, attention_backend=backend)
    if widen:
        widen_bf16_linears(model)
    runner = PagedRunner(model)
    runner.cache = KVCache.for_model(model.config, 16, num_tokens=1024, model_dtype=dtype)
    sequence = PagedSequence()
    first = runner.step([(sequence, TOKENS[:50])], all_logits=True)
    rest = [runner.step([(sequence, [token])]) for token in TOKENS[50:]]
    return torch.cat([first, *rest]).float()


def test_widened_equals_the_bf16_products_accumulated_in_float32() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(7, 256).to(torch.bfloat16)
    widened = WidenedLinear(linear)
    out = widened(x)
    assert out.dtype == torch.bfloat16 and out.shape == (7, 96)
    assert torch.equal(widened.weight.to(torch.bfloat16), linear.weight)  # the same values, widened exactly
    exact = (x.double() @ linear.weight.double().T + linear.bias.double()).to(torch.bfloat16)
    native = F.linear(x, linear.weight, linear.bias)
    # both round a float32 accumulation of the same products: at most one bf16 step apart from the exact sum
    step = exact.float().abs().clamp(min=1e-3) * 2**-7
    assert ((out.float() - exact.float()).abs() <= step).all()
    assert ((native.float() - exact.float()).abs() <= step).all()


def test_only_bf16_on_a_cpu_without_native_bf16_is_widened() -> None:
    avx2 = frozenset({"avx2", "fma"})
    assert widening_pays("cpu", torch.bfloat16, avx2)
    assert not widening_pays("cpu", torch.bfloat16, avx2 | {"avx512_bf16"})
    assert not widening_pays("cpu", torch.bfloat16, avx2 | {"amx_bf16"})
    assert not widening_pays("cpu", torch.float32, avx2)
    assert not widening_pays("cuda", torch.bfloat16, avx2)


def test_every_bf16_linear_is_replaced_and_nothing_else() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()), nn.Embedding(5, 8))
    model.to(torch.bfloat16)
    assert widen_bf16_linears(model) == 2
    assert isinstance(model[0], WidenedLinear) and isinstance(model[1][0], WidenedLinear)
    assert isinstance(model[2], nn.Embedding) and model[2].weight.dtype == torch.bfloat16
    assert widen_bf16_linears(nn.Sequential(nn.Linear(8, 8))) == 0  # float32: left alone


def test_a_widened_bf16_model_is_as_close_to_float32_as_the_native_one(tiny_dir: Path) -> None:
    exact = _logits(tiny_dir, "reference", torch.float32)
    native = _logits(tiny_dir, "reference", torch.bfloat16)
    widened = _logits(tiny_dir, "reference", torch.bfloat16, widen=True)
    torch.testing.assert_close(widened, exact, atol=0.03, rtol=0)
    torch.testing.assert_close(widened, native, atol=0.03, rtol=0)
    assert (widened.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_the_engine_widens_only_where_the_cpu_lacks_bf16(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model=str(tiny_dir), dtype="bfloat16", kv_cache_tokens=1024)
    monkeypatch.setattr(model_runner, "cpu_flags", lambda: frozenset({"avx2"}))
    widened = ModelRunner(config)
    assert widened.widened_linears == 4 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    monkeypatch.setattr(model_runner, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert ModelRunner(config).widened_linears == 0


def test_bf16_greedy_under_preemption_equals_a_roomy_pool(tiny_dir: Path) -> None:
    """Issue 17: greedy output is identical under preemption, in bfloat16 through the widened layers too."""
    roomy = make_engine(tiny_dir, dtype="bfloat16")
    assert roomy.runner.widened_linears == 17 or not widening_pays("cpu", torch.bfloat16, cpu_flags())
    expected = generate(roomy, WORKLOAD, workload_params)
    assert roomy.counters.num_preemptions == 0
    tight = make_engine(tiny_dir, dtype="bfloat16", kv_cache_tokens=SMALL_POOL_TOKENS)
    done = generate(tight, WORKLOAD, workload_params)
    assert tight.counters.num_preemptions > 0
    assert {rid: done.tokens(rid) for rid in WORKLOAD} == {rid: expected.tokens(rid) for rid in WORKLOAD}
