"""The KV-cache memory model: one implementation shared by the engine, the simulator and the operator.

Pure Python, no torch, no I/O. The engine runs it with a real model; the simulator with a counting stub.
"""

from kvtune.core.allocators import (
    AdmissionBlock,
    ContiguousAllocator,
    KVAllocator,
    PagedAllocator,
    make_allocator,
)
from kvtune.core.block_pool import BlockPool
from kvtune.core.geometry import ModelGeometry
from kvtune.core.prefix_hash import hash_block_tokens, prompt_block_hashes
from kvtune.core.request import FinishReason, Request, RequestStatus
from kvtune.core.scheduler import (
    PrefixCacheStats,
    Sampled,
    Scheduler,
    SchedulerConfig,
    SchedulerStep,
    samples_now,
)

__all__ = [
    "AdmissionBlock",
    "BlockPool",
    "ContiguousAllocator",
    "FinishReason",
    "KVAllocator",
    "ModelGeometry",
    "PagedAllocator",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "Sampled",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStep",
    "hash_block_tokens",
    "make_allocator",
    "prompt_block_hashes",
    "samples_now",
]
