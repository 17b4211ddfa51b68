// The decode runner for CPUs with AVX2 but not AVX-512, in 8-lane registers: paged_attention_cpu.cpp uses it
// in place of the 16-lane DecodeRunner (decode_runner.h) where KVT_DECODE_AVX2 is defined. It compiles
// wherever AVX2 and FMA are on (an AVX-512 build compiles it too, and leaves it unused).
//
// Why a second runner: GCC 12 keeps the 16-lane runner's vectors, two 256-bit halves each, in memory on
// AVX2. Its G = 4 path holds 8 query quarters (16 ymm) and 8 accumulators at once where AVX2 has 16
// registers: a perf profile of the decode kernel on a 2-core EPYC showed 55% of its cycles in vector moves
// to and from the stack and 15% in FMAs. This runner does the same walk with the same arithmetic, sized to
// 16 registers:
// - an item is a (sequence, key split) with all KV heads; keys in chunks of kDecodeChunk (the chunk's K/V
//   rows stay in L1/L2), head by head: scores, online softmax, values; the same prefetch stream runs ahead
//   (the walk is run_decode_item's, decode_walk.h);
// - scores: a ymm holds two query rows, lane 4r + i being row r's partial sum over dims i, i + 4, ... of one
//   key; four keys make four such vectors, and reduce_quads8 finishes them into lane 4r + key. Pairs of rows
//   are scored two at a time (8 accumulators, the query pair's two vectors, one broadcast key quad);
// - values: each row's accumulator over a tile of dims that fits the registers beside one V row's tile.

#pragma once

#include "decode_walk.h"

#if defined(__AVX2__) && defined(__FMA__)

#ifndef __AVX512F__
#define KVT_DECODE_AVX2 1  // decode runs here: the 16-lane runner was about 10x slower per key on AVX2
#endif

namespace {

using v8i = int32_t __attribute__((vector_size(32)));
using v8u32 = uint32_t __attribute__((vector_size(32)));
using v8f16 = _Float16 __attribute__((vector_size(16)));

// Eight cache elements widened to float32 in registers, one overload per cache type.
ALWAYS_INLINE __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
ALWAYS_INLINE __m256 load8(const F16* src) { return (__m256)__builtin_convertvector(load_vector<v8f16>(src), v8); }
ALWAYS_INLINE __m256 load8(const Bf16* src) {
    const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}
// e4m3fn by bit arithmetic, as load16 does it for 16 lanes.
ALWAYS_INLINE __m256 load8(const Fp8* src) {
    const v8i byte = (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    const v8i magnitude = byte & 0x7F;
    const v8i sign = (v8i)((v8u32)(byte & 0x80) << 24);  // unsigned: no signed-shift overflow
    const v8 normal = (v8)(((magnitude << 20) + (120 << 23)) | sign);
    const v8 tiny = __builtin_convertvector(magnitude, v8) * 0.001953125f;
    const v8 subnormal = (v8)((v8i)tiny | sign);
    const v8 value = (magnitude >> 3) == 0 ? subnormal : normal;
    return (__m256)(magnitude == 0x7F ? v8{} + std::numeric_limits<float>::quiet_NaN() : value);
}

// a..d hold, for four keys, two query rows' partial dot products (lane 4r + i: row r's sum over dims i, i + 4,
// ...). Returns the finished dot products in lane 4r + key: in-lane unpacks and shuffles only.
ALWAYS_INLINE __m256 reduce_quads8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
}

// Every lane of each 128-bit lane (one row) gets that lane's maximum.
ALWAYS_INLINE __m256 max_within_quads8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_permute_ps(x, 0xB1));     // swap pairs
    return _mm256_max_ps(x, _mm256_permute_ps(x, 0x4E));  // swap the halves of each 128-bit lane
}

ALWAYS_INLINE __m256 fast_exp8(__m256 x) { return (__m256)fast_exp_portable<v8, v8i>((v8)x); }

template <int kDim, int kGroup, typename T>
class DecodeRunner8 {
    static constexpr int kVecs = kDim / 8;   // ymm per row
    static constexpr int kQuads = kDim / 4;  // four-dim pieces per row
    static constexpr int kRows = kGroup < 2 ? 2 : kGroup;
    static constexpr int kPairs = kRows / 2;
    static constexpr int kPairTile = kPairs < 2 ? kPairs : 2;  // pairs scored together
    static constexpr int kChunk = kDecodeChunk;
    static constexpr int kKeyGroups = kChunk / 4;
    // Accumulators of the values pass: at most 8 ymm, so one V tile and a weight fit beside them.
    static constexpr int kTileVecs = kGroup * kVecs <= 8 ? kVecs : (8 / kGroup > 0 ? 8 / kGroup : 1);
    static_assert(kVecs % kTileVecs == 0 && kPairs % kPairTile == 0);

  public:
    explicit DecodeRunner8(const KvtParams& p)
        : p_(p),
          heads_(p.num_kv_heads),
          q_(static_cast<size_t>(heads_) * kPairs * kQuads * 8),
          acc_(static_cast<size_t>(heads_) * kGroup * kDim),
          scores_(static_cast<size_t>(heads_) * kKeyGroups * kPairs * 8),
          widened_(static_cast<size_t>(4) * kDim),
          max_(static_cast<size_t>(heads_) * kPairs * 8),
          sum_(max_.size()),
          rescale_(max_.size()) {}

    void run(const Item& item) { run_decode_item<kDim>(p_, item, rows_, *this); }

  private:
    template <int kD, typename U, typename R>
    friend void run_decode_item(const KvtParams&, const Item&, std::vector<const U*>&, R&);

    // A new item: its token's queries in place, and empty accumulators and softmax state.
    void begin(int token) {
        load_queries(token);
        std::fill(acc_.begin(), acc_.end(), 0.0f);
        std::fill(max_.begin(), max_.end(), -std::numeric_limits<float>::infinity());
        std::fill(sum_.begin(), sum_.end(), 0.0f);
    }

    const KvtParams& p_;
    const int heads_;
    std::vector<const T*> rows_;
    std::vector<float> q_, acc_, scores_, widened_, max_, sum_, rescale_;

    // Head h's row pair p, quarter j: lane 4r + i holds dim 4j + i of row 2p + r (zero for a padding row).
    float* query(int h, int p, int j) { return q_.data() + ((static_cast<size_t>(h) * kPairs + p) * kQuads + j) * 8; }
    float* accumulator(int h, int g) { return acc_.data() + (static_cast<size_t>(h) * kGroup + g) * kDim; }
    // Keys 4 key_group .. + 3 against pair p: lane 4r + i is row 2p + r's score (then weight) of key i.
    float* score(int h, int key_group, int p) {
        return scores_.data() + ((static_cast<size_t>(h) * kKeyGroups + key_group) * kPairs + p) * 8;
    }
    // Running state of head h's pair p: row r in lanes 4r .. 4r + 3 (the max equal in all four).
    float* state(std::vector<float>& of, int h, int p) { return of.data() + (static_cast<size_t>(h) * kPairs + p) * 8; }

    void load_queries(int token) {
        const float q_scale = p_.scale * p_.k_scale;
        for (int h = 0; h < heads_; ++h) {
            for (int row = 0; row < kRows; ++row) {
                const float* src = p_.q + (static_cast<int64_t>(token) * p_.num_q_heads + h * kGroup + row) * kDim;
                for (int j = 0; j < kQuads; ++j) {
                    float* dst = query(h, row / 2, j) + (row % 2) * 4;
                    for (int i = 0; i < 4; ++i) dst[i] = row < kGroup ? src[4 * j + i] * q_scale : 0.0f;
                }
            }
        }
    }

    // A key row as float32: in place for a float cache, else widened into a scratch row that stays in L1.
    const float* as_float(const T* row, int slot) {
        if constexpr (std::is_same_v<T, float>) {
            return row;
        } else {
            float* dst = widened_.data() + slot * kDim;
            for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(dst + 8 * v, load8(row + 8 * v));
            return dst;
        }
    }

    void scores(int h, const T* const* keys, int n, Prefetchers<T, kChunk, kDim>& ahead) {
        const int64_t head = h * p_.stride_head;
        const __m256 key_in_group = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
        const __m256 minus_infinity = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        for (int group = 0; group * 4 < n; ++group) {
            if (group % (Prefetchers<T, kChunk, kDim>::kStepKeys / 4) == 0) ahead.step();
            const float* k[4];
            for (int i = 0; i < 4; ++i) k[i] = as_float(keys[4 * group + i] + head, i);  // padding keys: masked
            // Lanes of padding keys get -inf by one blend.
            const __m256 valid = _mm256_cmp_ps(key_in_group, _mm256_set1_ps(static_cast<float>(std::min(4, n - group * 4))), _CMP_LT_OQ);
            for (int p0 = 0; p0 < kPairs; p0 += kPairTile) {
                __m256 dot[kPairTile][4];
                for (int t = 0; t < kPairTile; ++t) {
                    for (int i = 0; i < 4; ++i) dot[t][i] = _mm256_setzero_ps();
                }
                for (int j = 0; j < kQuads; ++j) {
                    __m256 pair[kPairTile];
                    for (int t = 0; t < kPairTile; ++t) pair[t] = _mm256_loadu_ps(query(h, p0 + t, j));
                    for (int i = 0; i < 4; ++i) {
                        const __m256 quad = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(k[i] + 4 * j));
                        for (int t = 0; t < kPairTile; ++t) dot[t][i] = _mm256_fmadd_ps(pair[t], quad, dot[t][i]);
                    }
                }
                for (int t = 0; t < kPairTile; ++t) {
                    const __m256 finished = reduce_quads8(dot[t][0], dot[t][1], dot[t][2], dot[t][3]);
                    _mm256_storeu_ps(score(h, group, p0 + t), _mm256_blendv_ps(minus_infinity, finished, valid));
                }
            }
        }
    }

    // Online softmax over the chunk: each row moves to its new running max, the chunk's scores become
    // weights, and the factor that rescales the row's earlier sum and values is kept for values().
    void softmax(int h, int n) {
        const int groups = (n + 3) / 4;
        for (int p = 0; p < kPairs; ++p) {
            __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
            for (int group = 0; group < groups; ++group) top = _mm256_max_ps(top, _mm256_loadu_ps(score(h, group, p)));
            const __m256 old = _mm256_loadu_ps(state(max_, h, p));
            const __m256 updated = _mm256_max_ps(old, max_within_quads8(top));
            const __m256 rescale = fast_exp8(_mm256_sub_ps(old, updated));  // an empty history (-inf) gives 0
            _mm256_storeu_ps(state(max_, h, p), updated);
            _mm256_storeu_ps(state(rescale_, h, p), rescale);
            __m256 total = _mm256_setzero_ps();
            for (int group = 0; group < groups; ++group) {
                float* flat = score(h, group, p);
                const __m256 weights = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(flat), updated));
                _mm256_storeu_ps(flat, weights);
                total = _mm256_add_ps(total, weights);
            }
            _mm256_storeu_ps(state(sum_, h, p), _mm256_fmadd_ps(_mm256_loadu_ps(state(sum_, h, p)), rescale, total));
        }
    }

    // Row g's weight for key t of the chunk, and its rescale factor.
    const float* weight(int h, int t, int g) { return score(h, t / 4, g / 2) + 4 * (g % 2) + t % 4; }
    const float* row_rescale(int h, int g) { return state(rescale_, h, g / 2) + 4 * (g % 2); }

    // The first tile's pass over the keys steps the prefetcher (once per kStepKeys keys, as the reads go).
    void values(int h, const T* const* keys, int n, Prefetchers<T, kChunk, kDim>& ahead) {
        const int64_t offset = p_.stride_kv + h * p_.stride_head;
        for (int vec = 0; vec < kVecs; vec += kTileVecs) {
            __m256 acc[kGroup][kTileVecs];
            for (int g = 0; g < kGroup; ++g) {
                const __m256 rescale = _mm256_broadcast_ss(row_rescale(h, g));
                for (int j = 0; j < kTileVecs; ++j) acc[g][j] = _mm256_mul_ps(_mm256_loadu_ps(accumulator(h, g) + 8 * (vec + j)), rescale);
            }
            for (int t = 0; t < n; ++t) {
                if (vec == 0 && t % Prefetchers<T, kChunk, kDim>::kStepKeys == 0) ahead.step();
                const T* row = keys[t] + offset + 8 * vec;
                __m256 value[kTileVecs];
                for (int j = 0; j < kTileVecs; ++j) value[j] = load8(row + 8 * j);
                for (int g = 0; g < kGroup; ++g) {
                    const __m256 w = _mm256_broadcast_ss(weight(h, t, g));
                    for (int j = 0; j < kTileVecs; ++j) acc[g][j] = _mm256_fmadd_ps(w, value[j], acc[g][j]);
                }
            }
            for (int g = 0; g < kGroup; ++g) {
                for (int j = 0; j < kTileVecs; ++j) _mm256_storeu_ps(accumulator(h, g) + 8 * (vec + j), acc[g][j]);
            }
        }
    }

    void store(const Item& item, int token) {
        for (int h = 0; h < heads_; ++h) {
            for (int g = 0; g < kGroup; ++g) {
                const int q_head = h * kGroup + g;
                const int64_t slot = (static_cast<int64_t>(item.split) * p_.num_tokens + token) * p_.num_q_heads + q_head;
                const float* sums = state(sum_, h, g / 2) + 4 * (g % 2);
                const float total = (sums[0] + sums[1]) + (sums[2] + sums[3]);
                const float factor = total > 0.0f ? p_.v_scale / total : 0.0f;
                const float* acc = accumulator(h, g);
                for (int d = 0; d < kDim; ++d) p_.out[slot * kDim + d] = acc[d] * factor;
                p_.lse[slot] = total > 0.0f ? state(max_, h, g / 2)[4 * (g % 2)] + std::log(total)
                                            : -std::numeric_limits<float>::infinity();
            }
        }
    }
};

}  // namespace

#endif  // __AVX2__ && __FMA__
