// Paged attention for the CPU: K/V are read in place, block by block, through the block table (no gather
// copy). Two runners share the file:
// - DecodeRunner (one query token per sequence, head_dim 32/64/128, group 1/2/4/8): an item is a
//   (sequence, key split) with all KV heads, so each block is streamed front to back, and the work is
//   written with explicit 16-lane vectors (GCC vector extensions).
// - ItemRunner (prefill, and any other shape): an item is (sequence, KV head, tile of query tokens, split),
//   holding the tile's rows for the G query heads that share the KV head.
// Both use the online (flash) softmax over chunks of keys, so scratch stays in L1/L2 however long the
// context is. Output is float32 partials [splits, tokens, q_heads, head_dim] plus their log-sum-exp;
// Python merges the splits (kvtune.kernels.merge) and casts.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

// The vector helpers must inline: an out-of-line call spills every live vector register around it.
#define ALWAYS_INLINE inline __attribute__((always_inline))

#ifndef KVT_PREFETCH
#define KVT_PREFETCH 4
#endif

namespace {

struct Bf16 { uint16_t bits; };
struct F16 { _Float16 value; };
struct Fp8 { uint8_t bits; };

float fp8_table[256];

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
struct Fp8TableInit {
    Fp8TableInit() {
        for (int i = 0; i < 256; ++i) {
            int exponent = (i >> 3) & 0xF, mantissa = i & 7;
            float magnitude;
            if (exponent == 15 && mantissa == 7) {
                magnitude = std::numeric_limits<float>::quiet_NaN();
            } else if (exponent == 0) {
                magnitude = std::ldexp(mantissa / 8.0f, -6);
            } else {
                magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
            }
            fp8_table[i] = (i & 0x80) ? -magnitude : magnitude;
        }
    }
} fp8_table_init;

inline float to_float(float x) { return x; }
inline float to_float(F16 x) { return static_cast<float>(x.value); }
inline float to_float(Fp8 x) { return fp8_table[x.bits]; }
inline float to_float(Bf16 x) {
    uint32_t widened = static_cast<uint32_t>(x.bits) << 16;
    float out;
    std::memcpy(&out, &widened, sizeof(out));
    return out;
}

// exp(x) by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (about 1 ulp); branch-free so the
// compiler vectorises the softmax loops, which a libm call would serialise.
inline float fast_exp(float x) {
    float clamped = std::min(std::max(x, -87.0f), 88.0f);
    float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    float y = poly * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return x < -87.0f ? 0.0f : y * scale;
}

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
};

}  // extern "C"

namespace {

constexpr int kKeyChunk = 128;
constexpr int kPrefetchBlocks = 2;  // how far ahead the decode runner prefetches K blocks

struct Item {
    int seq, head, first_query, num_queries, split;
};

struct Scratch {
    std::vector<float> q, acc, scores, row_max, row_sum, row_k;
    std::vector<int> limit;
};

inline int64_t row_offset(const KvtParams& p, const int32_t* table, int t) {
    const int64_t block = table[t / p.block_size];
    return block * p.stride_block + (t % p.block_size) * p.stride_token;
}

// Blocks sit at random places in the pool, so the hardware prefetcher cannot run ahead across a block
// boundary: touching the rows of the next block before they are needed hides most of the memory latency.
template <int kDim, typename T>
inline void prefetch_rows(const KvtParams& p, const T* base, const int32_t* table, int t, int count) {
    const int64_t row_bytes = static_cast<int64_t>(kDim ? kDim : p.head_dim) * sizeof(T);
    const char* row = reinterpret_cast<const char*>(base + row_offset(p, table, t));
    for (int j = 0; j < count; ++j, row += p.stride_token * sizeof(T)) {
        for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(row + line);
    }
}

template <int kDim, typename T>
class ItemRunner {
  public:
    ItemRunner(const KvtParams& p, Scratch& s) : p_(p), s_(s), dim_(kDim ? kDim : p.head_dim) {}

    void run(const Item& item) {
        const int group = p_.num_q_heads / p_.num_kv_heads;
        const int rows = item.num_queries * group;
        const int query_begin = p_.query_start_loc[item.seq];
        const int query_len = p_.query_start_loc[item.seq + 1] - query_begin;
        const int seq_len = p_.seq_lens[item.seq];
        const int context = seq_len - query_len;
        const int key_end = std::min(seq_len, context + item.first_query + item.num_queries);
        const int per_split = (seq_len + p_.num_splits - 1) / p_.num_splits;
        const int lo = item.split * per_split;
        const int hi = std::min(key_end, lo + per_split);
        prepare(item, rows, group, query_begin, context);
        const int32_t* table = p_.block_tables + item.seq * p_.block_table_stride;
        const T* k_base = static_cast<const T*>(p_.cache) + item.head * p_.stride_head;
        const T* v_base = k_base + p_.stride_kv;
        for (int chunk = lo; chunk < hi; chunk += kKeyChunk) {
            const int n = std::min(kKeyChunk, hi - chunk);
            scores_for_chunk(table, k_base, v_base, chunk, n, hi, rows);
            softmax_update(chunk, n, rows);
            accumulate_values(table, v_base, chunk, n, rows);
        }
        store(item, rows, group, query_begin);
    }

  private:
    const KvtParams& p_;
    Scratch& s_;
    const int dim_;

    void prepare(const Item& item, int rows, int group, int query_begin, int context) {
        const int dim = kDim ? kDim : dim_;
        s_.q.resize(static_cast<size_t>(rows) * dim);
        s_.acc.assign(static_cast<size_t>(rows) * dim, 0.0f);
        s_.scores.resize(static_cast<size_t>(rows) * kKeyChunk);
        s_.row_max.assign(rows, -std::numeric_limits<float>::infinity());
        s_.row_sum.assign(rows, 0.0f);
        s_.row_k.resize(dim);
        s_.limit.resize(rows);
        const float q_scale = p_.scale * p_.k_scale;
        for (int query = 0; query < item.num_queries; ++query) {
            const int token = query_begin + item.first_query + query;
            for (int g = 0; g < group; ++g) {
                const int row = query * group + g;
                const float* src = p_.q + (static_cast<int64_t>(token) * p_.num_q_heads + item.head * group + g) * dim;
                for (int d = 0; d < dim; ++d) s_.q[row * dim + d] = src[d] * q_scale;
                s_.limit[row] = context + item.first_query + query + 1;
            }
        }
    }

    // Calls visit(index, row) for keys [chunk, chunk + n) in order, one block-run at a time; visit_run(start,
    // run) is called first for every run, so callers can prefetch.
    template <typename Visit, typename VisitRun>
    void walk(const int32_t* table, const T* base, int chunk, int n, Visit visit, VisitRun visit_run) const {
        int index = 0;
        for (int t = chunk; t < chunk + n;) {
            const int offset = t % p_.block_size;
            const int run = std::min(p_.block_size - offset, chunk + n - t);
            visit_run(t, run);
            const T* row = base + row_offset(p_, table, t);
            for (int j = 0; j < run; ++j, ++index) visit(index, row + j * p_.stride_token);
            t += run;
        }
    }

    const float* as_float(const T* src) {
        if constexpr (std::is_same_v<T, float>) {
            return src;
        } else {
            float* dst = s_.row_k.data();
            const int dim = kDim ? kDim : dim_;
#pragma omp simd
            for (int d = 0; d < dim; ++d) dst[d] = to_float(src[d]);
            return dst;
        }
    }

    void scores_for_chunk(const int32_t* table, const T* k_base, const T* v_base, int chunk, int n, int hi, int rows) {
        const int dim = kDim ? kDim : dim_;
        const float* q = s_.q.data();
        float* scores = s_.scores.data();
        const auto prefetch = [&](int t, int run) {
            prefetch_rows<kDim>(p_, v_base, table, t, run);
            const int next = t + run;
            if (next < hi) prefetch_rows<kDim>(p_, k_base, table, next, std::min(p_.block_size, hi - next));
        };
        walk(table, k_base, chunk, n, [&](int index, const T* raw) {
            const float* k = as_float(raw);
            for (int r = 0; r < rows; ++r) {
                const float* qr = q + r * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; ++d) dot += qr[d] * k[d];
                scores[r * kKeyChunk + index] = dot;
            }
        }, prefetch);
    }

    void softmax_update(int chunk, int n, int rows) {
        const int dim = kDim ? kDim : dim_;
        for (int r = 0; r < rows; ++r) {
            float* row = s_.scores.data() + r * kKeyChunk;
            const int valid = std::max(0, std::min(n, s_.limit[r] - chunk));
            float top = -std::numeric_limits<float>::infinity();
            for (int t = 0; t < valid; ++t) top = std::max(top, row[t]);
            if (valid == 0) {
                std::fill(row, row + n, 0.0f);
                continue;
            }
            const float new_max = std::max(s_.row_max[r], top);
            const float rescale = fast_exp(s_.row_max[r] - new_max);
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int t = 0; t < valid; ++t) {
                row[t] = fast_exp(row[t] - new_max);
                total += row[t];
            }
            std::fill(row + valid, row + n, 0.0f);
            s_.row_sum[r] = s_.row_sum[r] * rescale + total;
            s_.row_max[r] = new_max;
            if (rescale != 1.0f) {
                float* acc = s_.acc.data() + r * dim;
#pragma omp simd
                for (int d = 0; d < dim; ++d) acc[d] *= rescale;
            }
        }
    }

    void accumulate_values(const int32_t* table, const T* v_base, int chunk, int n, int rows) {
        const int dim = kDim ? kDim : dim_;
        const float* probs = s_.scores.data();
        float* acc = s_.acc.data();
        walk(table, v_base, chunk, n, [&](int index, const T* raw) {
            const float* v = as_float(raw);
            for (int r = 0; r < rows; ++r) {
                const float weight = probs[r * kKeyChunk + index];
                if (weight == 0.0f) continue;
                float* ar = acc + r * dim;
#pragma omp simd
                for (int d = 0; d < dim; ++d) ar[d] += weight * v[d];
            }
        }, [](int, int) {});
    }

    void store(const Item& item, int rows, int group, int query_begin) {
        const int dim = kDim ? kDim : dim_;
        for (int r = 0; r < rows; ++r) {
            const int token = query_begin + item.first_query + r / group;
            const int q_head = item.head * group + r % group;
            const int64_t slot = (static_cast<int64_t>(item.split) * p_.num_tokens + token) * p_.num_q_heads + q_head;
            float* dst = p_.out + slot * dim;
            const float total = s_.row_sum[r];
            const float factor = total > 0.0f ? p_.v_scale / total : 0.0f;
            const float* acc = s_.acc.data() + r * dim;
            for (int d = 0; d < dim; ++d) dst[d] = acc[d] * factor;
            p_.lse[slot] = total > 0.0f ? s_.row_max[r] + std::log(total)
                                        : -std::numeric_limits<float>::infinity();
        }
    }
};

using v16 = float __attribute__((vector_size(64)));
using v16i = int32_t __attribute__((vector_size(64)));
using v16u = float __attribute__((vector_size(64), aligned(4)));

ALWAYS_INLINE v16 load16(const float* src) { return *reinterpret_cast<const v16u*>(src); }

ALWAYS_INLINE void store16(float* dst, v16 value) { *reinterpret_cast<v16u*>(dst) = value; }

ALWAYS_INLINE v16 splat(float value) { return v16{} + value; }

// fast_exp on 16 lanes with explicit vector operations (the scalar version's clamps and select compile to
// branches that keep the loop scalar): round-to-nearest by the 1.5 * 2^23 trick, then 2^n from the bits.
ALWAYS_INLINE v16 fast_exp16(v16 x) {
    const v16 low = splat(-87.0f), high = splat(88.0f);
    v16 clamped = x < low ? low : x;
    clamped = clamped > high ? high : clamped;
    const v16 magic = splat(12582912.0f);
    const v16 n = (clamped * 1.44269504088896341f + magic) - magic;
    const v16 r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    v16 poly = splat(1.9875691500e-4f);
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const v16 y = poly * r * r + r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    const v16 result = y * (v16)bits;
    return x < low ? v16{} : result;
}

using v16u8 = uint8_t __attribute__((vector_size(16)));
using v16u16 = uint16_t __attribute__((vector_size(32)));
using v16u32 = uint32_t __attribute__((vector_size(64)));
using v16f16 = _Float16 __attribute__((vector_size(32)));

// Unaligned vector loads by memcpy: GCC turns it into one vector load, where dereferencing an
// under-aligned vector type can become one scalar load per element.
template <typename V, typename E>
ALWAYS_INLINE V load_vector(const E* src) {
    V value;
    std::memcpy(&value, src, sizeof(V));
    return value;
}

// Sixteen cache elements widened to float32 in registers, one overload per cache type.
ALWAYS_INLINE v16 load16(const F16* src) {
    return __builtin_convertvector(load_vector<v16f16>(src), v16);
}
ALWAYS_INLINE v16 load16(const Bf16* src) {
    const v16i widened = __builtin_convertvector(load_vector<v16u16>(src), v16i);
    return (v16)(widened << 16);
}
// e4m3fn by bit arithmetic: normals move exponent and mantissa into place and rebias (7 -> 127);
// subnormals are mantissa * 2^-9; S.1111.111 is NaN.
ALWAYS_INLINE v16 load16(const Fp8* src) {
    // Widening through 16 bits: GCC 12 scalarises a direct 8-to-32-bit vector conversion.
    const v16i byte = __builtin_convertvector(__builtin_convertvector(load_vector<v16u8>(src), v16u16), v16i);
    const v16i magnitude = byte & 0x7F;
    const v16i sign = (v16i)((v16u32)(byte & 0x80) << 24);  // unsigned: no signed-shift overflow
    const v16 normal = (v16)(((magnitude << 20) + (120 << 23)) | sign);
    const v16 tiny = __builtin_convertvector(magnitude, v16) * 0.001953125f;
    const v16 subnormal = (v16)((v16i)tiny | sign);
    const v16 value = (magnitude >> 3) == 0 ? subnormal : normal;
    return magnitude == 0x7F ? splat(std::numeric_limits<float>::quiet_NaN()) : value;
}

// Sums each of a, b, c, d across its 16 lanes; the four totals land in lanes 0-3. A tree of two-source
// permutes costs about 4 operations per dot product where four separate horizontal sums cost about 10.
ALWAYS_INLINE v16 reduce4(v16 a, v16 b, v16 c, v16 d) {
    const v16i half_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i half_hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16 ab = __builtin_shuffle(a, b, half_lo) + __builtin_shuffle(a, b, half_hi);
    const v16 cd = __builtin_shuffle(c, d, half_lo) + __builtin_shuffle(c, d, half_hi);
    const v16i quarter_lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i quarter_hi = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16 abcd = __builtin_shuffle(ab, cd, quarter_lo) + __builtin_shuffle(ab, cd, quarter_hi);
    const v16i pair_lo = {0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13};
    const v16i pair_hi = {2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15};
    const v16 pairs = __builtin_shuffle(abcd, pair_lo) + __builtin_shuffle(abcd, pair_hi);
    const v16i even = {0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14};
    const v16i odd = {1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15};
    return __builtin_shuffle(pairs, even) + __builtin_shuffle(pairs, odd);
}

// Decode (one query token per sequence) with the group size and head_dim known at compile time. An item is
// a (sequence, key split) with all its KV heads, so each block is streamed front to back: a per-KV-head
// walk would read one head's rows out of every cache line pair and waste half the bandwidth when a row is
// shorter than 128 bytes (the tiny model's 2 KV heads x 32 dims). Within a block-run the heads are taken in
// turn, their G query rows and accumulators held in vector registers, and the G dot products of a key row
// are reduced together by reduce4.
template <int kDim, int kGroup, typename T>
class DecodeRunner {
    static constexpr int kVecs = kDim / 16;
    static constexpr int kRows = kGroup < 4 ? 4 : kGroup;  // padded to whole reduce4 groups
    static constexpr int kScoreRows = kKeyChunk + 4;         // 4 spare token rows pad the softmax to whole vectors

  public:
    explicit DecodeRunner(const KvtParams& p)
        : p_(p),
          heads_(p.num_kv_heads),
          q_(static_cast<size_t>(heads_) * kRows * kDim),
          acc_(static_cast<size_t>(heads_) * kGroup * kDim),
          scores_(static_cast<size_t>(heads_) * kScoreRows * kRows),
          max_(static_cast<size_t>(heads_) * kGroup),
          sum_(static_cast<size_t>(heads_) * kGroup) {}

    void run(const Item& item) {
        const int token = p_.query_start_loc[item.seq];
        const int seq_len = p_.seq_lens[item.seq];
        const int per_split = (seq_len + p_.num_splits - 1) / p_.num_splits;
        const int lo = item.split * per_split;
        const int hi = std::min(seq_len, lo + per_split);
        const float q_scale = p_.scale * p_.k_scale;
        for (int h = 0; h < heads_; ++h) {
            for (int r = 0; r < kRows; ++r) {
                float* dst = query(h, r);
                if (r >= kGroup) {
                    std::fill(dst, dst + kDim, 0.0f);
                    continue;
                }
                const float* src = p_.q + (static_cast<int64_t>(token) * p_.num_q_heads + h * kGroup + r) * kDim;
                for (int d = 0; d < kDim; ++d) dst[d] = src[d] * q_scale;
            }
        }
        std::fill(acc_.begin(), acc_.end(), 0.0f);
        std::fill(max_.begin(), max_.end(), -std::numeric_limits<float>::infinity());
        std::fill(sum_.begin(), sum_.end(), 0.0f);
        const int32_t* table = p_.block_tables + item.seq * p_.block_table_stride;
        const T* k_base = static_cast<const T*>(p_.cache);
        const T* v_base = k_base + p_.stride_kv;
        for (int chunk = lo; chunk < hi; chunk += kKeyChunk) {
            const int n = std::min(kKeyChunk, hi - chunk);
            scores(table, k_base, v_base, chunk, n, hi);
            for (int h = 0; h < heads_; ++h) softmax(h, n);
            values(table, v_base, chunk, n);
        }
        for (int h = 0; h < heads_; ++h) {
            for (int g = 0; g < kGroup; ++g) {
                const int q_head = h * kGroup + g;
                const int64_t slot = (static_cast<int64_t>(item.split) * p_.num_tokens + token) * p_.num_q_heads + q_head;
                const float total = sum_[h * kGroup + g];
                const float factor = total > 0.0f ? p_.v_scale / total : 0.0f;
                const float* acc = accumulator(h, g);
                for (int d = 0; d < kDim; ++d) p_.out[slot * kDim + d] = acc[d] * factor;
                p_.lse[slot] = total > 0.0f ? max_[h * kGroup + g] + std::log(total)
                                            : -std::numeric_limits<float>::infinity();
            }
        }
    }

  private:
    const KvtParams& p_;
    const int heads_;
    std::vector<float> q_, acc_, scores_, max_, sum_;

    float* query(int h, int r) { return q_.data() + (static_cast<size_t>(h) * kRows + r) * kDim; }
    float* accumulator(int h, int g) { return acc_.data() + (static_cast<size_t>(h) * kGroup + g) * kDim; }
    float* score_rows(int h) { return scores_.data() + static_cast<size_t>(h) * kScoreRows * kRows; }

    // A block-run's rows for all heads are contiguous: prefetch them as one byte range.
    void prefetch_run(const T* base, const int32_t* table, int t, int count) const {
        const char* start = reinterpret_cast<const char*>(base + row_offset(p_, table, t));
        const int64_t bytes = static_cast<int64_t>(count) * p_.stride_token * sizeof(T);
        for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(start + line);
    }

    void scores(const int32_t* table, const T* k_base, const T* v_base, int chunk, int n, int hi) {
        int index = 0;
        for (int t = chunk; t < chunk + n;) {
            const int run = std::min(p_.block_size - t % p_.block_size, chunk + n - t);
            prefetch_run(v_base, table, t, run);
            const int ahead = t + run + (kPrefetchBlocks - 1) * p_.block_size;
            if (ahead < hi) prefetch_run(k_base, table, ahead, std::min(p_.block_size, hi - ahead));
            const T* block_rows = k_base + row_offset(p_, table, t);
            for (int h = 0; h < heads_; ++h) {
                v16 q[kRows][kVecs];
                for (int r = 0; r < kRows; ++r) {
                    for (int j = 0; j < kVecs; ++j) q[r][j] = load16(query(h, r) + 16 * j);
                }
                float* out = score_rows(h) + static_cast<size_t>(index) * kRows;
                const T* row = block_rows + h * p_.stride_head;
                for (int j = 0; j < run; ++j, row += p_.stride_token, out += kRows) {
                    v16 key[kVecs];
                    for (int v = 0; v < kVecs; ++v) key[v] = load16(row + 16 * v);
                    for (int r = 0; r < kRows; r += 4) {
                        v16 dot[4];
                        for (int i = 0; i < 4; ++i) {
                            dot[i] = q[r + i][0] * key[0];
                            for (int v = 1; v < kVecs; ++v) dot[i] += q[r + i][v] * key[v];
                        }
                        const v16 four = reduce4(dot[0], dot[1], dot[2], dot[3]);
                        for (int i = 0; i < 4; ++i) out[r + i] = four[i];
                    }
                }
            }
            index += run;
            t += run;
        }
    }

    void softmax(int h, int n) {
        const int padded = (n + 3) / 4 * 4;
        float* flat = score_rows(h);
        std::fill(flat + n * kRows, flat + padded * kRows, -std::numeric_limits<float>::infinity());
        const int count = padded * kRows;  // a multiple of 16 since kRows is 4 or 8
        v16 top16 = splat(-std::numeric_limits<float>::infinity());
        for (int i = 0; i < count; i += 16) {
            const v16 x = load16(flat + i);
            top16 = x > top16 ? x : top16;
        }
        float rescale[kRows];
        alignas(64) float shift[16];
        for (int r = 0; r < kRows; ++r) {
            float best = -std::numeric_limits<float>::infinity();
            for (int l = r; l < 16; l += kRows) best = std::max(best, top16[l]);
            const float old = r < kGroup ? max_[h * kGroup + r] : best;
            const float updated = std::max(old, best);
            rescale[r] = fast_exp(old - updated);
            if (r < kGroup) max_[h * kGroup + r] = updated;
            for (int l = r; l < 16; l += kRows) shift[l] = updated;
        }
        const v16 shift16 = load16(shift);
        v16 total = v16{};
        for (int i = 0; i < count; i += 16) {
            const v16 e = fast_exp16(load16(flat + i) - shift16);
            store16(flat + i, e);
            total += e;
        }
        for (int g = 0; g < kGroup; ++g) {
            float added = 0.0f;
            for (int l = g; l < 16; l += kRows) added += total[l];
            sum_[h * kGroup + g] = sum_[h * kGroup + g] * rescale[g] + added;
            float* acc = accumulator(h, g);
            for (int d = 0; d < kDim; ++d) acc[d] *= rescale[g];
        }
    }

    void values(const int32_t* table, const T* v_base, int chunk, int n) {
        int index = 0;
        for (int t = chunk; t < chunk + n;) {
            const int run = std::min(p_.block_size - t % p_.block_size, chunk + n - t);
            const T* block_rows = v_base + row_offset(p_, table, t);
            for (int h = 0; h < heads_; ++h) {
                v16 acc[kGroup][kVecs];
                for (int g = 0; g < kGroup; ++g) {
                    for (int j = 0; j < kVecs; ++j) acc[g][j] = load16(accumulator(h, g) + 16 * j);
                }
                const float* weights = score_rows(h) + static_cast<size_t>(index) * kRows;
                const T* row = block_rows + h * p_.stride_head;
                for (int j = 0; j < run; ++j, row += p_.stride_token, weights += kRows) {
                    v16 value[kVecs];
                    for (int i = 0; i < kVecs; ++i) value[i] = load16(row + 16 * i);
                    for (int g = 0; g < kGroup; ++g) {
                        for (int i = 0; i < kVecs; ++i) acc[g][i] += weights[g] * value[i];
                    }
                }
                for (int g = 0; g < kGroup; ++g) {
                    for (int j = 0; j < kVecs; ++j) std::memcpy(accumulator(h, g) + 16 * j, &acc[g][j], sizeof(v16));
                }
            }
            index += run;
            t += run;
        }
    }
};

template <typename Runner>
void run_with(const std::vector<Item>& items, Runner& runner) {
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) runner.run(items[i]);
}

template <int kDim, int kGroup, typename T>
bool try_decode(const KvtParams& p) {
    if (p.num_q_heads != kGroup * p.num_kv_heads) return false;
    std::vector<Item> items;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
        for (int split = 0; split < p.num_splits; ++split) items.push_back({seq, 0, 0, 1, split});
    }
#pragma omp parallel num_threads(p.num_threads)
    {
        DecodeRunner<kDim, kGroup, T> runner(p);
        run_with(items, runner);
    }
    return true;
}

template <int kDim, typename T>
void run_items(const KvtParams& p, const std::vector<Item>& items) {
    if constexpr (kDim != 0) {
        if (p.query_tile == 1 && (try_decode<kDim, 1, T>(p) || try_decode<kDim, 2, T>(p) ||
                                  try_decode<kDim, 4, T>(p) || try_decode<kDim, 8, T>(p))) {
            return;
        }
    }
#pragma omp parallel num_threads(p.num_threads)
    {
        Scratch scratch;
        ItemRunner<kDim, T> runner(p, scratch);
        run_with(items, runner);
    }
}

template <typename T>
void dispatch_dim(const KvtParams& p, const std::vector<Item>& items) {
    switch (p.head_dim) {
        case 32: run_items<32, T>(p, items); break;
        case 64: run_items<64, T>(p, items); break;
        case 128: run_items<128, T>(p, items); break;
        default: run_items<0, T>(p, items); break;
    }
}

}  // namespace

extern "C" int kvt_paged_attention(const KvtParams* params) {
    const KvtParams& p = *params;
    std::vector<Item> items;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
        const int query_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
        for (int first = 0; first < query_len; first += p.query_tile) {
            const int count = std::min(p.query_tile, query_len - first);
            for (int head = 0; head < p.num_kv_heads; ++head) {
                for (int split = 0; split < p.num_splits; ++split) items.push_back({seq, head, first, count, split});
            }
        }
    }
    switch (p.cache_type) {
        case 0: dispatch_dim<float>(p, items); break;
        case 1: dispatch_dim<F16>(p, items); break;
        case 2: dispatch_dim<Bf16>(p, items); break;
        case 3: dispatch_dim<Fp8>(p, items); break;
        default: return 1;
    }
    return 0;
}
