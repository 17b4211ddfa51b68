"""Everything `kvtune serve` is configured with, in one validated place."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.contract.knobs import CAP_MODES, CapMode
from kvtune.core.allocators import POLICIES
from kvtune.core.geometry import KERNEL_BLOCK_MULTIPLE, check_block_size
from kvtune.engine.model.model_config import MODEL_DTYPES
from kvtune.errors import KvtuneError

DEFAULT_CPU_KV_BYTES = 1 << 30  # vLLM's CPU build defaults to a fixed KV space too (VLLM_CPU_KVCACHE_SPACE)


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    allocator: str = "paged"
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    max_tokens_cap: int | None = None
    cap_mode: CapMode = "clamp"  # over the cap: clamp lowers max_tokens, reject refuses the request
    prefix_detector: bool = True  # watch prompts for prefix-cache defeats (off: the cost A/B)
    prefix_report_text: bool = False  # keep the varying spans' token ids, so the report can show text
    seed: int = 0  # seeds torch's global generator at boot: what requests without their own seed draw from

    def validate(self) -> None:
        """One clear error for a configuration that cannot serve."""
        if self.dtype != "auto" and self.dtype not in MODEL_DTYPES:
            raise KvtuneError(f"--dtype must be auto, {', '.join(MODEL_DTYPES)}; got {self.dtype!r}")
        check_block_size(
            self.block_size, multiple_of=KERNEL_BLOCK_MULTIPLE, name="--block-size", error=KvtuneError
        )
        if self.allocator not in POLICIES:
            raise KvtuneError(f"--allocator must be one of {', '.join(POLICIES)}, got {self.allocator!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_memory_bytes is not None:
            raise KvtuneError("give --kv-cache-tokens or --kv-cache-memory-bytes, not both")
        for name in ("kv_cache_tokens", "kv_cache_memory_bytes", "max_model_len", "max_tokens_cap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise KvtuneError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.cap_mode not in CAP_MODES:
            raise KvtuneError(f"--cap-mode must be one of {', '.join(CAP_MODES)}, got {self.cap_mode!r}")
        if self.max_num_seqs <= 0:
            raise KvtuneError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise KvtuneError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise KvtuneError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise KvtuneError(f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
