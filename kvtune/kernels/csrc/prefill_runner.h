// The prefill runner: a tile of query tokens against the key blocks, as small matrix products in vector
// registers. paged_attention_cpu.cpp uses it for prefill and recompute chunks with head_dim 32, 64 or 128 on
// CPUs with AVX-512 (16 lanes) or AVX2 (8 lanes), where this header defines KVT_PREFILL_LANES; anything else
// keeps the scalar ItemRunner (item_runner.h).
//
// An item is (sequence, KV head, tile of query tokens): the tile's tokens times the G query heads that share
// the KV head make kRows = 64 rows (a tile of 64 / G tokens; padding rows past the last token compute and
// are dropped). Everything is laid out with the rows in the vector lanes, so every step is vertical:
// - the queries, transposed once per item: Qt[d][row], pre-scaled;
// - a chunk of kChunk keys (and values) widened to float32 once: Kc[key][d], Vc[key][d];
// - scores St[key][row] = sum_d Kc[key][d] * Qt[d][row]: blocks of keys x row vectors held in registers, one
//   broadcast key element against a row vector per multiply-add;
// - the online softmax: each row's running max and sum are vectors too (max over keys is a vertical max), and
//   the causal mask is one compare of a key index against the rows' limits, only in chunks that reach it;
// - values Ot[d][row] += sum_key Vc[key][d] * Pt[key][row], the same register blocking;
// - at the end, each row's output is divided by its sum and written out (one transpose per item).
// The scalar ItemRunner scored one (row, key) pair at a time with a horizontal sum; this does the same
// arithmetic (float32 products, float32 sums, the same exp) in another order, so outputs differ from it by
// float32 rounding only (tests/kernels check both against a float64 reference).
// With AVX512-BF16, a bf16 cache and bf16 queries (kDot), scores and values use vdpbf16ps instead, as the
// decode runner does: queries and K are bf16 already (exact), the softmax stays float32, and the weights are
// rounded to bf16 for the values (a relative error of at most 2^-9 per weight, below the bf16 rounding of
// the output itself; tests/kernels check bf16 outputs within vLLM's bf16 tolerance). Single-thread CPU time
// at the tiny model's geometry: 4 x 512-token prompts 11.5 -> 8.5 ms, a 1,500-token recompute 24.5 -> 14.3 ms;
// the small model's 4 x 512: 44 -> 34 ms.

#pragma once

#include "cpu_primitives.h"

#if defined(__AVX512F__)
#define KVT_PREFILL_LANES 16
#elif defined(__AVX2__)
#define KVT_PREFILL_LANES 8
#endif

#ifdef KVT_PREFILL_LANES

namespace {

constexpr int kPrefillLanes = KVT_PREFILL_LANES;
constexpr int kPrefillRows = 64;

using vp = float __attribute__((vector_size(4 * kPrefillLanes)));
using vpi = int32_t __attribute__((vector_size(4 * kPrefillLanes)));
using vpu = float __attribute__((vector_size(4 * kPrefillLanes), aligned(4)));

ALWAYS_INLINE vp load_p(const float* src) { return *reinterpret_cast<const vpu*>(src); }
ALWAYS_INLINE void store_p(float* dst, vp value) { *reinterpret_cast<vpu*>(dst) = value; }

ALWAYS_INLINE vp splat_p(float value) {
#if KVT_PREFILL_LANES == 16
    return (vp)_mm512_set1_ps(value);
#else
    return (vp)_mm256_set1_ps(value);
#endif
}

ALWAYS_INLINE vp exp_p(vp x) {
#if KVT_PREFILL_LANES == 16
    return fast_exp16(x);
#else
    return fast_exp_portable<vp, vpi>(x);
#endif
}

// kLanes elements of a cache row widened to float32.
ALWAYS_INLINE vp widen_p(const float* src) { return load_p(src); }
ALWAYS_INLINE vp widen_p(const F16* src) {
    using half = _Float16 __attribute__((vector_size(2 * kPrefillLanes)));
    return __builtin_convertvector(load_vector<half>(src), vp);
}
ALWAYS_INLINE vp widen_p(const Bf16* src) {
    using words = uint16_t __attribute__((vector_size(2 * kPrefillLanes)));
    return (vp)(__builtin_convertvector(load_vector<words>(src), vpi) << 16);
}
ALWAYS_INLINE vp widen_p(const Fp8* src) {
    alignas(64) float wide[kPrefillLanes];
    for (int i = 0; i < kPrefillLanes; ++i) wide[i] = fp8_table[src[i].bits];
    return load_p(wide);
}

template <int kDim, typename T, bool kDot = false>
class PrefillRunner {
#ifdef KVT_DOT_BF16
    // bf16 dot products (vdpbf16ps): bf16 caches with bf16 queries (rounding them to bf16 loses nothing).
    static constexpr bool kDotBf16 = kDot && std::is_same_v<T, Bf16> && kPrefillLanes == 16;
#else
    static constexpr bool kDotBf16 = false;
#endif
    static constexpr int kLanes = kPrefillLanes;
    static constexpr int kRows = kPrefillRows;
    static constexpr int kRowVecs = kRows / kLanes;
    static constexpr int kChunk = 64;  // keys per online-softmax step
    // Register blocks: scores hold kKeyBlock keys x kRowBlock row vectors, values kDimBlock dims x kRowBlock
    // row vectors; 16 accumulators with AVX-512's 32 registers, 8 with AVX2's 16.
    static constexpr int kRowBlock = kLanes == 16 ? 4 : 2;
    static constexpr int kKeyBlock = 4;
    static constexpr int kDimBlock = 4;
    static_assert(kRowVecs % kRowBlock == 0 && kChunk % kKeyBlock == 0 && kDim % kDimBlock == 0);
    static_assert(kDim % kLanes == 0);

  public:
    explicit PrefillRunner(const KvtParams& p)
        : p_(p), group_(p.num_q_heads / p.num_kv_heads),
          qt_(static_cast<size_t>(kDim) * kRows), ot_(static_cast<size_t>(kDim) * kRows),
          kc_(static_cast<size_t>(kChunk) * kDim), vc_(static_cast<size_t>(kChunk) * kDim),
          st_(static_cast<size_t>(kChunk) * kRows), max_(kRows), sum_(kRows), limit_(kRows),
          qp_(kDotBf16 ? static_cast<size_t>(kDim / 2) * kRows : 0),
          pp_(kDotBf16 ? static_cast<size_t>(kChunk / 2) * kRows : 0),
          vp_(kDotBf16 ? static_cast<size_t>(kChunk / 2) * kDim : 0), k_rows_(kChunk) {}

    // Whether this runner takes the call: a whole number of query heads per KV head, all in one item's rows.
    static bool fits(const KvtParams& p) {
        const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
        return group >= 1 && group <= kRows && group * p.num_kv_heads == p.num_q_heads && p.num_splits == 1;
    }

    // Query tokens per item: as many as fill the rows.
    static int tile_for(const KvtParams& p) { return kRows / (p.num_q_heads / p.num_kv_heads); }

    void run(const Item& item) {
        const int query_begin = p_.query_start_loc[item.seq];
        const int query_len = p_.query_start_loc[item.seq + 1] - query_begin;
        const int seq_len = p_.seq_lens[item.seq];
        const int context = seq_len - query_len;
        const int key_end = std::min(seq_len, context + item.first_query + item.num_queries);
        prepare(item, query_begin, context);
        const int32_t* table = p_.block_tables + item.seq * p_.block_table_stride;
        const T* k_base = static_cast<const T*>(p_.cache) + item.head * p_.stride_head;
        // The first row's limit: keys below it are visible to every row, so chunks before it need no mask.
        const int unmasked_end = context + item.first_query + 1;
        for (int chunk = 0; chunk < key_end; chunk += kChunk) {
            const int n = std::min(kChunk, key_end - chunk);
            if constexpr (kDotBf16) {
                chunk_rows(table, k_base, chunk, n);
                scores_bf16(n);
                softmax(chunk, n, chunk + n > unmasked_end);
                values_bf16(n);
            } else {
                widen_chunk(table, k_base, chunk, n);
                scores(n);
                softmax(chunk, n, chunk + n > unmasked_end);
                values(n);
            }
        }
        store(item, query_begin);
    }

  private:
    const KvtParams& p_;
    const int group_;
    std::vector<float> qt_, ot_, kc_, vc_, st_, max_, sum_, limit_;
    // The bf16 path: queries as bf16 pairs of dims [d / 2][row]; the chunk's weights as bf16 pairs of keys
    // [key / 2][row]; its V rows interleaved in pairs of keys [key / 2][position] (see values_bf16); the K
    // rows' addresses (K is read from the cache as it is).
    std::vector<uint32_t> qp_, pp_, vp_;
    std::vector<const T*> k_rows_;
    alignas(64) float rescale_[kRows];

    void prepare(const Item& item, int query_begin, int context) {
        const float q_scale = p_.scale * p_.k_scale;
        std::fill(qt_.begin(), qt_.end(), 0.0f);
        const int rows = item.num_queries * group_;
        for (int row = 0; row < kRows; ++row) {
            // Padding rows repeat the last real row's limit, so they stay finite; their output is dropped.
            const int real = std::min(row, rows - 1);
            const int query = real / group_;
            limit_[row] = static_cast<float>(context + item.first_query + query + 1);
            if (row >= rows) continue;
            const int token = query_begin + item.first_query + query;
            const float* src = p_.q + (static_cast<int64_t>(token) * p_.num_q_heads + item.head * group_ + row % group_) * kDim;
            if constexpr (kDotBf16) {
                for (int i = 0; i < kDim / 2; ++i) qp_[static_cast<size_t>(i) * kRows + row] = bf16_pair(src[2 * i], src[2 * i + 1]);
            } else {
                for (int d = 0; d < kDim; ++d) qt_[static_cast<size_t>(d) * kRows + row] = src[d] * q_scale;
            }
        }
        if constexpr (kDotBf16) {
            for (int row = rows; row < kRows; ++row) {
                for (int i = 0; i < kDim / 2; ++i) qp_[static_cast<size_t>(i) * kRows + row] = 0;
            }
        }
        std::fill(ot_.begin(), ot_.end(), 0.0f);
        std::fill(max_.begin(), max_.end(), -std::numeric_limits<float>::infinity());
        std::fill(sum_.begin(), sum_.end(), 0.0f);
    }

    // The chunk's K and V rows of this head, widened to float32 (padding keys of the last chunk are zero).
    void widen_chunk(const int32_t* table, const T* k_base, int chunk, int n) {
        for (int key = 0; key < n; ++key) {
            const int t = chunk + key;
            const T* k_row = k_base + static_cast<int64_t>(table[t / p_.block_size]) * p_.stride_block +
                             static_cast<int64_t>(t % p_.block_size) * p_.stride_token;
            const T* v_row = k_row + p_.stride_kv;
            float* k_dst = kc_.data() + static_cast<size_t>(key) * kDim;
            float* v_dst = vc_.data() + static_cast<size_t>(key) * kDim;
            for (int d = 0; d < kDim; d += kLanes) {
                store_p(k_dst + d, widen_p(k_row + d));
                store_p(v_dst + d, widen_p(v_row + d));
            }
        }
        const int padded = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        std::fill(kc_.begin() + static_cast<size_t>(n) * kDim, kc_.begin() + static_cast<size_t>(padded) * kDim, 0.0f);
        std::fill(vc_.begin() + static_cast<size_t>(n) * kDim, vc_.begin() + static_cast<size_t>(padded) * kDim, 0.0f);
    }

    void scores(int n) {
        const float* qt = qt_.data();
        for (int key = 0; key < n; key += kKeyBlock) {
            const float* k = kc_.data() + static_cast<size_t>(key) * kDim;
            for (int rv = 0; rv < kRowVecs; rv += kRowBlock) {
                vp acc[kKeyBlock][kRowBlock] = {};
                for (int d = 0; d < kDim; ++d) {
                    vp q[kRowBlock];
                    for (int j = 0; j < kRowBlock; ++j) q[j] = load_p(qt + static_cast<size_t>(d) * kRows + (rv + j) * kLanes);
                    for (int i = 0; i < kKeyBlock; ++i) {
                        const vp kd = splat_p(k[i * kDim + d]);
                        for (int j = 0; j < kRowBlock; ++j) acc[i][j] += kd * q[j];
                    }
                }
                for (int i = 0; i < kKeyBlock; ++i) {
                    for (int j = 0; j < kRowBlock; ++j) store_p(score(key + i, rv + j), acc[i][j]);
                }
            }
        }
    }

    float* score(int key, int rv) { return st_.data() + static_cast<size_t>(key) * kRows + rv * kLanes; }

    // Online softmax over the chunk's n keys, row vector by row vector. `masked`: some key of the chunk lies at
    // or past some row's limit (the causal diagonal), so scores there become -inf first.
    void softmax(int chunk, int n, bool masked) {
        const vp minus_infinity = splat_p(-std::numeric_limits<float>::infinity());
        for (int rv = 0; rv < kRowVecs; ++rv) {
            const vp limit = load_p(limit_.data() + rv * kLanes);
            vp top = minus_infinity;
            for (int key = 0; key < n; ++key) {
                vp s = load_p(score(key, rv));
                if (masked) {
                    s = splat_p(static_cast<float>(chunk + key)) < limit ? s : minus_infinity;
                    store_p(score(key, rv), s);
                }
                top = s > top ? s : top;
            }
            const vp old = load_p(max_.data() + rv * kLanes);
            const vp updated = old > top ? old : top;  // finite: key 0 is visible to every row
            const vp rescale = exp_p(old - updated);   // an empty history (-inf) rescales to 0
            vp total{};
            for (int key = 0; key < n; ++key) {
                const vp e = exp_p(load_p(score(key, rv)) - updated);
                store_p(score(key, rv), e);
                total += e;
            }
            store_p(max_.data() + rv * kLanes, updated);
            store_p(sum_.data() + rv * kLanes, load_p(sum_.data() + rv * kLanes) * rescale + total);
            store_p(rescale_ + rv * kLanes, rescale);
        }
        // Padding keys of the last block of four carry weight 0 into values().
        const int padded = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        for (int key = n; key < padded; ++key) {
            for (int rv = 0; rv < kRowVecs; ++rv) store_p(score(key, rv), vp{});
        }
    }

    void values(int n) {
        const int padded = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        for (int d = 0; d < kDim; d += kDimBlock) {
            for (int rv = 0; rv < kRowVecs; rv += kRowBlock) {
                vp acc[kDimBlock][kRowBlock];
                for (int j = 0; j < kRowBlock; ++j) {
                    const vp rescale = load_p(rescale_ + (rv + j) * kLanes);
                    for (int i = 0; i < kDimBlock; ++i) acc[i][j] = load_p(out(d + i, rv + j)) * rescale;
                }
                for (int key = 0; key < padded; ++key) {
                    vp weight[kRowBlock];
                    for (int j = 0; j < kRowBlock; ++j) weight[j] = load_p(score(key, rv + j));
                    const float* v = vc_.data() + static_cast<size_t>(key) * kDim + d;
                    for (int i = 0; i < kDimBlock; ++i) {
                        const vp vd = splat_p(v[i]);
                        for (int j = 0; j < kRowBlock; ++j) acc[i][j] += vd * weight[j];
                    }
                }
                for (int i = 0; i < kDimBlock; ++i) {
                    for (int j = 0; j < kRowBlock; ++j) store_p(out(d + i, rv + j), acc[i][j]);
                }
            }
        }
    }

#ifdef KVT_DOT_BF16
    // Two float32 values (bf16-exact: queries the caller had in bf16) as one bf16 pair, low word first.
    static uint32_t bf16_pair(float low, float high) {
        uint32_t a, b;
        std::memcpy(&a, &low, sizeof(a));
        std::memcpy(&b, &high, sizeof(b));
        return (a >> 16) | (b & 0xFFFF0000u);
    }

    const T* k_row(const int32_t* table, const T* k_base, int t) const {
        return k_base + static_cast<int64_t>(table[t / p_.block_size]) * p_.stride_block +
               static_cast<int64_t>(t % p_.block_size) * p_.stride_token;
    }

    // The chunk's K row addresses, and its V rows interleaved two keys at a time: of each 32-dim piece w, one
    // unpack pair puts key 2m's and key 2m + 1's values of a dim side by side (a bf16 pair), lane by lane, so
    // position 32 w + 16 h + 4 l + m' holds dim 32 w + 8 l + 4 h + m' (the order values_bf16 reads back). An
    // odd last key pairs with a zero row (its weight is zero too).
    void chunk_rows(const int32_t* table, const T* k_base, int chunk, int n) {
        for (int key = 0; key < n; ++key) k_rows_[key] = k_row(table, k_base, chunk + key);
        for (int key = 0; key < n; key += 2) {
            const T* first = k_rows_[key] + p_.stride_kv;
            const bool pair = key + 1 < n;
            const T* second = pair ? k_rows_[key + 1] + p_.stride_kv : nullptr;
            uint32_t* dst = vp_.data() + static_cast<size_t>(key / 2) * kDim;
            for (int w = 0; w < kDim / 32; ++w) {
                const __m512i a = _mm512_loadu_si512(first + 32 * w);
                const __m512i b = pair ? _mm512_loadu_si512(second + 32 * w) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 32 * w, _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512(dst + 32 * w + 16, _mm512_unpackhi_epi16(a, b));
            }
        }
    }

    // Scores by vdpbf16ps: each K row's pair of dims (2i, 2i + 1) broadcast from the cache against the rows'
    // query pairs; then scaled (the queries stay unscaled, so they stay exact in bf16).
    void scores_bf16(int n) {
        const __m512 q_scale = _mm512_set1_ps(p_.scale * p_.k_scale);
        for (int key = 0; key < n; key += kKeyBlock) {
            const uint32_t* k[kKeyBlock];
            for (int i = 0; i < kKeyBlock; ++i) {
                k[i] = reinterpret_cast<const uint32_t*>(k_rows_[std::min(key + i, n - 1)]);
            }
            __m512 acc[kKeyBlock][kRowVecs];
            for (int i = 0; i < kKeyBlock; ++i) {
                for (int j = 0; j < kRowVecs; ++j) acc[i][j] = _mm512_setzero_ps();
            }
            for (int pair = 0; pair < kDim / 2; ++pair) {
                __m512bh q[kRowVecs];
                for (int j = 0; j < kRowVecs; ++j) {
                    q[j] = (__m512bh)_mm512_loadu_si512(qp_.data() + static_cast<size_t>(pair) * kRows + j * kLanes);
                }
                for (int i = 0; i < kKeyBlock; ++i) {
                    const __m512bh kd = (__m512bh)_mm512_set1_epi32(static_cast<int>(k[i][pair]));
                    for (int j = 0; j < kRowVecs; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], q[j], kd);
                }
            }
            for (int i = 0; i < kKeyBlock; ++i) {
                for (int j = 0; j < kRowVecs; ++j) store_p(score(key + i, j), (vp)_mm512_mul_ps(acc[i][j], q_scale));
            }
        }
    }

    // Values by vdpbf16ps: the chunk's weights rounded to bf16 in pairs of keys (rows in lanes), against each
    // dim's pair of V values broadcast; accumulators over four positions (four consecutive dims) at a time.
    void values_bf16(int n) {
        const int pairs = (n + 1) / 2;
        for (int m = 0; m < pairs; ++m) {
            for (int j = 0; j < kRowVecs; ++j) {
                const __m512i first = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)load_p(score(2 * m, j))));
                const __m512i second = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)load_p(score(2 * m + 1, j))));
                _mm512_storeu_si512(pp_.data() + static_cast<size_t>(m) * kRows + j * kLanes,
                                    _mm512_or_si512(first, _mm512_slli_epi32(second, 16)));
            }
        }
        for (int position = 0; position < kDim; position += kDimBlock) {
            const int w = position / 32, h = (position % 32) / 16, l = (position % 16) / 4;
            const int d = 32 * w + 8 * l + 4 * h;  // positions [position, position + 4) hold dims [d, d + 4)
            __m512 acc[kDimBlock][kRowVecs];
            for (int j = 0; j < kRowVecs; ++j) {
                const __m512 rescale = (__m512)load_p(rescale_ + j * kLanes);
                for (int i = 0; i < kDimBlock; ++i) acc[i][j] = _mm512_mul_ps((__m512)load_p(out(d + i, j)), rescale);
            }
            for (int m = 0; m < pairs; ++m) {
                __m512bh weight[kRowVecs];
                for (int j = 0; j < kRowVecs; ++j) {
                    weight[j] = (__m512bh)_mm512_loadu_si512(pp_.data() + static_cast<size_t>(m) * kRows + j * kLanes);
                }
                const uint32_t* v = vp_.data() + static_cast<size_t>(m) * kDim + position;
                for (int i = 0; i < kDimBlock; ++i) {
                    const __m512bh vd = (__m512bh)_mm512_set1_epi32(static_cast<int>(v[i]));
                    for (int j = 0; j < kRowVecs; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], weight[j], vd);
                }
            }
            for (int i = 0; i < kDimBlock; ++i) {
                for (int j = 0; j < kRowVecs; ++j) store_p(out(d + i, j), (vp)acc[i][j]);
            }
        }
    }
#else
    void chunk_rows(const int32_t*, const T*, int, int) {}
    void scores_bf16(int) {}
    void values_bf16(int) {}
    static uint32_t bf16_pair(float, float) { return 0; }
#endif

    float* out(int d, int rv) { return ot_.data() + static_cast<size_t>(d) * kRows + rv * kLanes; }

    void store(const Item& item, int query_begin) {
        const int rows = item.num_queries * group_;
        for (int row = 0; row < rows; ++row) {
            const int token = query_begin + item.first_query + row / group_;
            const int q_head = item.head * group_ + row % group_;
            const int64_t slot = static_cast<int64_t>(token) * p_.num_q_heads + q_head;
            const float total = sum_[row];
            const float factor = total > 0.0f ? p_.v_scale / total : 0.0f;
            float* dst = p_.out + slot * kDim;
            for (int d = 0; d < kDim; ++d) dst[d] = ot_[static_cast<size_t>(d) * kRows + row] * factor;
            p_.lse[slot] = total > 0.0f ? max_[row] + std::log(total) : -std::numeric_limits<float>::infinity();
        }
    }
};

}  // namespace

#endif  // KVT_PREFILL_LANES
