// Probes for `kvtune bench kernels`, kept out of the production kernel: a streaming read of a whole tensor
// (the machine's sequential read bandwidth) and a read of every K/V byte a decode step reads, in the decode
// runner's order and with its prefetching (what the cache layout allows a paged decode at best). Each
// returns an xor checksum of what it loaded, so a test can check it read exactly those bytes.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "paged_attention_common.h"

namespace {

using v8i = int32_t __attribute__((vector_size(32)));
using v4i = int32_t __attribute__((vector_size(16)));

#ifdef __AVX512F__
constexpr bool kLoads64 = true;
#else
// Without AVX-512 a 64-byte vector is two registers, and GCC 12 keeps such accumulators in memory: the xor
// chain then ran through the stack and held both probes at about 10 GB/s on an AVX2 EPYC whose torch sum read
// 26-36 GB/s (and below the kernel itself, which made "read-only" no bound). 32-byte loads there.
constexpr bool kLoads64 = false;
#endif

// Folds a cache row's 32-bit words into `folded` by xor, with loads of V (16 to 64 bytes, the widest that tile
// the row): 16-byte loads through one xor chain held the read-only pass 5-10% below what fp32 rows allow.
template <typename V>
ALWAYS_INLINE V fold_row(V folded, const char* bytes, int64_t row_bytes) {
    constexpr int64_t kWidth = sizeof(V);
    for (int64_t b = 0; b + kWidth <= row_bytes; b += kWidth) folded ^= load_vector<V>(bytes + b);
    return folded;
}

// The xor of a vector's 32-bit lanes: a thread's share of a read checksum.
template <typename V>
uint32_t xor_lanes(V v) {
    uint32_t total = 0;
    for (size_t lane = 0; lane < sizeof(V) / 4; ++lane) total ^= static_cast<uint32_t>(v[lane]);
    return total;
}

// Reads every K and V byte a decode step over this batch would read, in the same order (chunk by chunk, a
// head's K rows then its V rows), with the same prefetching and threads, and no arithmetic but an xor: what
// the cache layout and the memory system allow a paged decode kernel at best. `kvtune bench kernels` sets
// the kernel beside it.
template <typename T>
uint64_t read_blocks(const KvtParams& p) {
    constexpr int kChunk = kDecodeChunk;
    std::vector<int> order(p.num_seqs);
    for (int seq = 0; seq < p.num_seqs; ++seq) order[seq] = seq;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p.seq_lens[a] > p.seq_lens[b]; });
    const int64_t head_bytes = static_cast<int64_t>(p.head_dim) * sizeof(T);
    uint64_t checksum = 0;
#pragma omp parallel num_threads(p.num_threads) reduction(^ : checksum)
    {
        v16i wide{};  // one accumulator per load width: folding them into one would cost lane moves per row
        v8i half{};
        v4i quarter{};
        std::vector<const T*> rows;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < p.num_seqs; ++i) {
            const int seq = order[i], len = p.seq_lens[seq];
            if (len == 0) continue;
            key_rows(p, p.block_tables + seq * p.block_table_stride, 0, len, rows);
            Prefetchers<T, kChunk> ahead(p, rows.data(), len);
            for (int chunk = 0; chunk < len; chunk += kChunk) {
                const int n = std::min(kChunk, len - chunk);
                for (int h = 0; h < p.num_kv_heads; ++h) {
                    for (int64_t kv = 0; kv < 2; ++kv) {
                        for (int t = chunk; t < chunk + n; ++t) {
                            if ((t - chunk) % Prefetchers<T, kChunk>::kStepKeys == 0) ahead.step();
                            const char* bytes = reinterpret_cast<const char*>(rows[t] + kv * p.stride_kv + h * p.stride_head);
                            if (kLoads64 && head_bytes % 64 == 0) {
                                wide = fold_row(wide, bytes, head_bytes);
                            } else if (head_bytes % 32 == 0) {
                                half = fold_row(half, bytes, head_bytes);
                            } else {
                                quarter = fold_row(quarter, bytes, head_bytes);
                            }
                        }
                    }
                }
            }
        }
        checksum ^= xor_lanes(wide) ^ xor_lanes(half) ^ xor_lanes(quarter);
    }
    return checksum;
}

}  // namespace

// A streaming read of `bytes` bytes (a multiple of 64) with full-width vector loads on `threads` threads:
// the machine's sequential read bandwidth, which torch's float sum does not always reach.
extern "C" uint64_t kvt_stream_read(const void* data, int64_t bytes, int32_t threads) {
    const char* base = static_cast<const char*>(data);
    uint64_t checksum = 0;
#pragma omp parallel num_threads(threads) reduction(^ : checksum)
    {
        v16i folded{};
        v8i low{}, high{};  // two chains, so the xors do not wait on each other
#pragma omp for schedule(static)
        for (int64_t line = 0; line < bytes / 64; ++line) {
            if constexpr (kLoads64) {
                folded ^= load_vector<v16i>(base + line * 64);
            } else {
                low ^= load_vector<v8i>(base + line * 64);
                high ^= load_vector<v8i>(base + line * 64 + 32);
            }
        }
        checksum ^= xor_lanes(folded) ^ xor_lanes(low) ^ xor_lanes(high);
    }
    return checksum;
}

extern "C" uint64_t kvt_read_blocks(const KvtParams* params) {
    switch (params->cache_type) {
        case 0: return read_blocks<float>(*params);
        case 1: return read_blocks<F16>(*params);
        case 2: return read_blocks<Bf16>(*params);
        default: return read_blocks<Fp8>(*params);
    }
}
