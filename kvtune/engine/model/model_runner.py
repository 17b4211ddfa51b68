"""The model side of the engine: the weights, the paged KV cache and the attention backend, on one device.

The engine decides what runs (requests, the scheduler's batch, stops, stats); the runner runs it: it flattens
the scheduled chunks into one batch, runs the forward pass, samples, and applies the scheduler's
copy-on-write block copies. It is built once at boot: the dtype is chosen, the attention backend resolved and
the cache sized here, and torch's global generator is seeded with `--seed` (as vLLM's `--seed`), so a
server restarted with the same seed and the same requests samples the same tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtune.engine.model.attention_metadata import BatchInputs, ScheduledChunk, build_batch
from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.engine.model.engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.logprobs import TokenLogprobs, sampled_logprobs
from kvtune.engine.model.model import load_model
from kvtune.engine.model.packed_linear import pack_bf16_linears, packing_pays
from kvtune.engine.model.sampling import Sampler, SamplingParams
from kvtune.engine.model.serving_dtype import choose_dtype, cpu_flags
from kvtune.engine.model.step_threads import StepThreads, Width
from kvtune.engine.model.widened_linear import widen_bf16_linears, widening_pays
from kvtune.errors import KvtuneError

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads the model and its KV cache once; then runs one forward pass and one sampling pass per step."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder = Path(config.model)
        self.model_config = open_checkpoint(folder).config
        self.device = torch.device(config.device)
        flags = cpu_flags()
        self.dtype_choice = choose_dtype(config.dtype, self.model_config.dtype, self.device.type, flags)
        self.model = load_model(
            folder,
            dtype=self.dtype_choice.dtype,
            device=self.device,
            attention_backend=config.attention_backend,
        )
        self.widened_linears = 0
        if widening_pays(self.device.type, self.dtype_choice.dtype, flags):
            self.widened_linears = widen_bf16_linears(self.model)
            logger.info(
                "bfloat16 linear layers (%d) run as float32 GEMMs over their exactly widened weights: this CPU "
                "lacks AVX512-BF16, where oneDNN's bfloat16 GEMM is several times slower",
                self.widened_linears,
            )
        self.packed_linears = 0
        if packing_pays(self.device.type, self.dtype_choice.dtype, flags):
            self.packed_linears = pack_bf16_linears(self.model)
            logger.info(
                "bfloat16 linear layers (%d) run oneDNN's GEMM over weights reordered once at load",
                self.packed_linears,
            )
        self.cache = self._allocate_cache(self.dtype_choice.dtype)
        if config.max_model_len and config.max_model_len > self.model_config.max_model_len:
            raise KvtuneError(
                f"--max-model-len {config.max_model_len} exceeds the model's {self.model_config.max_model_len}"
            )
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_model_len, self.cache.num_tokens
        )
        self.sampler = Sampler()
        self.step_threads: StepThreads | None = None  # None: every step on torch's threads as set
        torch.manual_seed(config.seed)

    def adapt_threads(self, narrow: Width, wide: Width) -> None:
        """From now on each forward pass runs on `narrow` or `wide`, whichever its batch size ran faster
        on (step_threads)."""
        self.step_threads = StepThreads(narrow, wide)

    def _allocate_cache(self, dtype: torch.dtype) -> KVCache:
        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            return KVCache.for_model(
                self.model_config, cfg.block_size, num_tokens=cfg.kv_cache_tokens,
                cache_dtype=cfg.kv_cache_dtype, model_dtype=dtype, device=self.device,
            )  # fmt: skip
        memory = cfg.kv_cache_memory_bytes
        if memory is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                memory = int(free - (1 - cfg.gpu_memory_utilization) * total)
                if memory <= 0:
                    raise KvtuneError(
                        "no GPU memory is left for the KV cache at this --gpu-memory-utilization"
                    )
            else:
                memory = DEFAULT_CPU_KV_BYTES
        return KVCache.for_model(
            self.model_config, cfg.block_size, memory_bytes=memory,
            cache_dtype=cfg.kv_cache_dtype, model_dtype=dtype, device=self.device,
        )  # fmt: skip

    # --- one step ------------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `src` into block `dst`, in every layer, before a sharer writes to it."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.cache.layers:
            layer[dst] = layer[src]

    def forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Next-token logits of every chunk, and the chunks (by index) whose forward pass raised.

        The batch runs as one pass; if that raises, each chunk runs alone so that only the chunks that
        fail on their own are reported (their rows of the returned logits are zeros, never read). Re-running
        a chunk rewrites the same cache slots with the same values, so the retry is safe. A lone chunk is
        not retried: that would only repeat the same pass.
        """
        try:
            return self._run_model(chunks), {}
        except Exception as err:
            if len(chunks) == 1:
                return torch.zeros(1, self.model_config.vocab_size, device=self.device), {0: err}
            logger.exception(
                "a batched forward pass failed; retrying each of its %d chunks alone", len(chunks)
            )
        rows: list[torch.Tensor] = []
        faults: dict[int, Exception] = {}
        for i, chunk in enumerate(chunks):
            try:
                rows.append(self._run_model([chunk])[0])
            except Exception as err:
                faults[i] = err
                rows.append(torch.zeros(self.model_config.vocab_size, device=self.device))
        return torch.stack(rows), faults

    def _run_model(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        batch = build_batch(chunks, self.cache.block_size, self.device, self.max_model_len)
        if self.step_threads is None:
            with torch.inference_mode():
                return self._forward(batch)
        tokens = batch.input_ids.numel()
        threads = self.step_threads.begin(tokens)
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self._forward(batch)
        self.step_threads.end(tokens, threads, time.perf_counter() - started)
        return logits

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        logits: torch.Tensor = self.model(batch.input_ids, batch.positions, batch.metadata, self.cache)
        return logits

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int | Exception], list[TokenLogprobs | None]]:
        """A token for each entry of `rows` (a row of `logits`; n > 1 choices repeat their parent's row),
        or the exception its sampling raised, and its logprobs where its request asked for them."""
        row_logits = logits[rows]
        tokens = self.sampler.sample(row_logits, params, generators)
        wanted = [
            None if isinstance(token, Exception) else p.logprobs
            for token, p in zip(tokens, params, strict=True)
        ]
        if all(count is None for count in wanted):  # the usual step: nobody asked, nothing to compute
            return tokens, [None] * len(tokens)
        sampled = [0 if isinstance(token, Exception) else token for token in tokens]
        return tokens, sampled_logprobs(row_logits, sampled, wanted)
