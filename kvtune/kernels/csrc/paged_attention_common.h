// What the paged-attention kernel (paged_attention_cpu.cpp) shares with the benchmark's probes
// (kvtune/bench/csrc/kernel_probes.cpp): the argument block, the cache element types, the 16-lane vector
// types, and the walk over a sequence's K/V rows with the decode runner's prefetching. The probes read the
// cache exactly as the kernel does, so they include this rather than keep a copy that could drift.
// Everything but the extern "C" argument block has internal linkage: each library compiles its own.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// The vector helpers must inline: an out-of-line call spills every live vector register around it.
#define ALWAYS_INLINE inline __attribute__((always_inline))

// How far ahead of its reads the decode runner prefetches, in bytes of K/V (see PrefetchStream), into L2 and
// (float32 caches) into L1. Measured on the 2-core EPYC with 2 MiB pages: to L2, 8-32 KiB within 5% of each
// other, 4 KiB and 64 KiB 10-20% slower; a second stream 2 KiB ahead into L1 made fp32 18% faster (1.37 ->
// 1.11 ms per layer) and bf16 7% slower, so it is used for float32 caches only.
#ifndef KVT_PREFETCH_BYTES
#define KVT_PREFETCH_BYTES 16384
#endif
#ifndef KVT_PREFETCH_L1_BYTES
#define KVT_PREFETCH_L1_BYTES 2048
#endif

namespace {

struct Bf16 { uint16_t bits; };
struct F16 { _Float16 value; };
struct Fp8 { uint8_t bits; };

}  // namespace

extern "C" {

// Mirrored by kvtune.kernels.cpu_backend._Params (ctypes); keep the field order identical.
struct KvtParams {
    const float* q;            // [tokens, q_heads, head_dim], contiguous float32
    const void* cache;         // [num_blocks, 2, block_size, kv_heads, head_dim]
    int64_t stride_block, stride_kv, stride_token, stride_head;  // cache strides, in elements
    const int32_t* block_tables;
    int64_t block_table_stride;
    const int32_t* query_start_loc;  // [num_seqs + 1]
    const int32_t* seq_lens;         // [num_seqs], context + new tokens
    float* out;                // [num_splits, tokens, q_heads, head_dim]
    float* lse;                // [num_splits, tokens, q_heads]
    int32_t num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size;
    int32_t num_splits, query_tile, cache_type, num_threads;
    float scale, k_scale, v_scale;
    int32_t query_bf16;  // the caller's queries were bf16, so rounding them to bf16 loses nothing
};

}  // extern "C"

namespace {

using v16 = float __attribute__((vector_size(64)));
using v16i = int32_t __attribute__((vector_size(64)));
using v16u = float __attribute__((vector_size(64), aligned(4)));

// Unaligned vector loads by memcpy: GCC turns it into one vector load, where dereferencing an
// under-aligned vector type can become one scalar load per element.
template <typename V, typename E>
ALWAYS_INLINE V load_vector(const E* src) {
    V value;
    std::memcpy(&value, src, sizeof(V));
    return value;
}

// The K-row address (head 0; V is stride_kv further on) of each key in [lo, hi) of one sequence: one table
// lookup per block, then the passes below index keys directly and can look any distance ahead. The list is
// padded to whole groups of four keys with the last row, so a group's loads need no bounds checks.
template <typename T>
void key_rows(const KvtParams& p, const int32_t* table, int lo, int hi, std::vector<const T*>& rows) {
    rows.resize(static_cast<size_t>(hi - lo));
    if (lo >= hi) return;
    const T* cache = static_cast<const T*>(p.cache);
    size_t i = 0;
    for (int t = lo; t < hi;) {
        const int offset = t % p.block_size;
        const int run = std::min(p.block_size - offset, hi - t);
        const T* row = cache + table[t / p.block_size] * p.stride_block + offset * p.stride_token;
        for (int j = 0; j < run; ++j, row += p.stride_token) rows[i++] = row;
        t += run;
    }
    rows.resize(static_cast<size_t>(hi - lo + 3) / 4 * 4, rows.back());  // padding keys: a real row, masked
}

// Prefetches, a fixed distance ahead, exactly what a decode item will read. Its reads come in steps of
// kStepKeys keys' rows of one KV head, K or V: chunk by chunk, then head by head, K before V; each step()
// issues the lines of the step that lies `bytes_ahead` further on, into L2 (kLevel 2) or L1 (kLevel 3).
// Blocks sit at random places in the pool, so the hardware prefetcher cannot run ahead across a block
// boundary; asking for lines at the rate they are consumed keeps the core's miss buffers busy without
// overflowing them (a whole block at a time did: measured, the same time for bf16 as for fp32, i.e.
// latency-bound; and prefetching a key's rows for every head at once ran in bursts, 20% slower).
template <typename T, int kChunk, int kLevel = 2, int kDim = 0>
class PrefetchStream {
    // Lines per row of one head when head_dim is known at compile time (the inner loop then unrolls).
    static constexpr int64_t kLines = (static_cast<int64_t>(kDim) * static_cast<int64_t>(sizeof(T)) + 63) / 64;

  public:
    static constexpr int kStepKeys = 16;  // a step per 4 keys cost 15% of the bf16 arithmetic in bookkeeping

    // `keys` as from key_rows: `count` keys, padded to whole groups of four.
    PrefetchStream(const KvtParams& p, const T* const* keys, int count, int64_t bytes_ahead)
        : keys_(keys), count_(count), heads_(p.num_kv_heads), stride_kv_(p.stride_kv), stride_head_(p.stride_head),
          lines_(kDim != 0 ? kLines : (static_cast<int64_t>(p.head_dim) * static_cast<int64_t>(sizeof(T)) + 63) / 64) {
        const int64_t distance = bytes_ahead / (kStepKeys * 64 * lines_);
        for (int64_t i = 0; i < std::max<int64_t>(bytes_ahead > 0, distance); ++i) step();
    }

    void step() {
        if (chunk_ >= count_) return;
        const int64_t offset = kv_ * stride_kv_ + head_ * stride_head_;
        const int end = std::min(key_ + kStepKeys, std::min(kChunk, count_ - chunk_));
        // A row's lines from its start: a row that does not start on a line loses at most its last partial
        // line to the demand load.
        for (int key = key_; key < end; ++key) {
            const char* row = reinterpret_cast<const char*>(keys_[chunk_ + key] + offset);
            for (int64_t line = 0; line < (kDim != 0 ? kLines : lines_); ++line) __builtin_prefetch(row + 64 * line, 0, kLevel);
        }
        if ((key_ = end) < std::min(kChunk, count_ - chunk_)) return;
        key_ = 0;
        if (++kv_ < 2) return;
        kv_ = 0;
        if (++head_ < heads_) return;
        head_ = 0;
        chunk_ += kChunk;
    }

  private:
    const T* const* keys_;
    const int count_, heads_;
    const int64_t stride_kv_, stride_head_, lines_;
    int chunk_ = 0, head_ = 0, kv_ = 0, key_ = 0;
};

// The decode runner's two prefetch streams: far into L2, and for float32 caches near into L1 (see
// KVT_PREFETCH_L1_BYTES). step() is called once per PrefetchStream::kStepKeys keys read.
template <typename T, int kChunk, int kDim = 0>
class Prefetchers {
  public:
    static constexpr int kStepKeys = PrefetchStream<T, kChunk, 2, kDim>::kStepKeys;
    static constexpr bool kToL1 = sizeof(T) == 4;

    Prefetchers(const KvtParams& p, const T* const* keys, int count)
        : to_l2_(p, keys, count, KVT_PREFETCH_BYTES), to_l1_(p, keys, count, kToL1 ? KVT_PREFETCH_L1_BYTES : 0) {}

    ALWAYS_INLINE void step() {
        to_l2_.step();
        if constexpr (kToL1) to_l1_.step();
    }

  private:
    PrefetchStream<T, kChunk, 2, kDim> to_l2_;
    PrefetchStream<T, kChunk, 3, kDim> to_l1_;
};

// Keys per online-softmax step of the decode runner: a chunk's K and V rows stay in L1/L2. read_blocks
// walks the same chunks, so the read-only bound reads in the kernel's order.
constexpr int kDecodeChunk = 64;

}  // namespace
