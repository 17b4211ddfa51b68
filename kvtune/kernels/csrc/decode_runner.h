// The decode runner in 16-lane vectors (GCC vector extensions, which compile to AVX-512 where the CPU has
// it), with AVX512-BF16 dot products for bf16 and fp8 caches where the CPU has those (KVT_DOT_BF16). On CPUs
// with AVX2 but not AVX-512, DecodeRunner8 (decode_runner_avx2.h) runs decode instead.

#pragma once

#include "decode_walk.h"

namespace {

using v16u8 = uint8_t __attribute__((vector_size(16)));
using v16u16 = uint16_t __attribute__((vector_size(32)));
using v16u32 = uint32_t __attribute__((vector_size(64)));
using v16f16 = _Float16 __attribute__((vector_size(32)));

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

// Four consecutive floats repeated in each 128-bit quarter of a vector (one vbroadcastf32x4 on AVX-512;
// GCC's generic shuffles would round-trip through the stack).
ALWAYS_INLINE v16 broadcast4(const float* src) {
#ifdef __AVX512F__
    return (v16)_mm512_broadcast_f32x4(_mm_loadu_ps(src));
#else
    return v16{src[0], src[1], src[2], src[3], src[0], src[1], src[2], src[3],
               src[0], src[1], src[2], src[3], src[0], src[1], src[2], src[3]};
#endif
}

#ifdef KVT_DOT_BF16
// The bf16 bit pattern of the e4m3fn value with magnitude bits `m` (sign 0): a normal moves exponent and
// mantissa into place and rebiases (7 -> 127); a subnormal (m x 2^-9) is normalised; S.1111.111 is NaN.
constexpr uint16_t e4m3_magnitude_as_bf16(int m) {
    if (m == 0x7F) return 0x7FC0;
    const int exponent = m >> 3, mantissa = m & 7;
    if (exponent != 0) return static_cast<uint16_t>(((exponent + 120) << 7) | (mantissa << 4));
    if (mantissa == 0) return 0;
    const int top = mantissa >= 4 ? 2 : mantissa >= 2 ? 1 : 0;  // mantissa x 2^-9 = 2^(top - 9) x 1.f
    return static_cast<uint16_t>(((top - 9 + 127) << 7) | ((mantissa - (1 << top)) << (7 - top)));
}

#ifdef __AVX512VBMI__
// Byte tables over the 128 magnitudes for the two-source byte permute: the low byte of the bf16 pattern, and
// its high byte xor the magnitude itself (see fp8_bytes_to_bf16).
struct Fp8Bf16Tables {
    alignas(64) uint8_t low[128];
    alignas(64) uint8_t high_xor_magnitude[128];
};
constexpr Fp8Bf16Tables make_fp8_bf16_tables() {
    Fp8Bf16Tables t{};
    for (int m = 0; m < 128; ++m) {
        t.low[m] = static_cast<uint8_t>(e4m3_magnitude_as_bf16(m) & 0xFF);
        t.high_xor_magnitude[m] = static_cast<uint8_t>((e4m3_magnitude_as_bf16(m) >> 8) ^ m);
    }
    return t;
}
inline constexpr Fp8Bf16Tables fp8_bf16_tables = make_fp8_bf16_tables();

// e4m3fn to bf16 in 16-bit lanes (`word` = 0x00XX) by two 128-entry byte lookups, five operations per 32
// values where bit arithmetic took twelve. The byte permute reads only an index's low seven bits, so:
// - looking up `word` gives the low byte in place (its zero high byte looks up magnitude 0, whose pattern is 0);
// - looking up `word << 8` gives the high byte in place, xor the magnitude; xor with `word << 8` itself then
//   cancels the magnitude and leaves the sign in bit 15.
ALWAYS_INLINE __m512i fp8_bytes_to_bf16(__m512i word) {
    const __m512i* low = reinterpret_cast<const __m512i*>(fp8_bf16_tables.low);
    const __m512i* high = reinterpret_cast<const __m512i*>(fp8_bf16_tables.high_xor_magnitude);
    const __m512i shifted = _mm512_slli_epi16(word, 8);
    const __m512i low_bytes = _mm512_permutex2var_epi8(_mm512_load_si512(low), word, _mm512_load_si512(low + 1));
    const __m512i high_bytes = _mm512_permutex2var_epi8(_mm512_load_si512(high), shifted, _mm512_load_si512(high + 1));
    constexpr int kA = 0xF0, kB = 0xCC, kC = 0xAA;  // vpternlog's operand truth tables: a | (b ^ c)
    return _mm512_ternarylogic_epi32(low_bytes, high_bytes, shifted, kA | (kB ^ kC));
}
#else
// e4m3fn to bf16 in 16-bit lanes (`word` = 0x00XX) by bit arithmetic, for CPUs without byte permutes (AVX512-VBMI).
ALWAYS_INLINE __m512i fp8_bytes_to_bf16(__m512i word) {
    const __m512i magnitude = _mm512_and_si512(word, _mm512_set1_epi16(0x7F));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(word, _mm512_set1_epi16(0x80)), 8);
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
    const __m512i subnormals = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, e4m3_magnitude_as_bf16(7),
        e4m3_magnitude_as_bf16(6), e4m3_magnitude_as_bf16(5), e4m3_magnitude_as_bf16(4), e4m3_magnitude_as_bf16(3),
        e4m3_magnitude_as_bf16(2), e4m3_magnitude_as_bf16(1), 0);
    __m512i value = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)), normal,
                                            _mm512_permutexvar_epi16(magnitude, subnormals));
    value = _mm512_mask_mov_epi16(value, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F)),
                                  _mm512_set1_epi16(0x7FC0));
    return _mm512_or_si512(value, sign);
}
#endif

// 32 fp8 values as 32 bf16 words.
ALWAYS_INLINE __m512i fp8_to_bf16(const Fp8* src) {
    return fp8_bytes_to_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}

// 128-bit lane `lane` of v in all four lanes.
ALWAYS_INLINE __m512i broadcast_lane(__m512i v, int lane) {
    switch (lane) {
        case 0: return _mm512_shuffle_i32x4(v, v, 0x00);
        case 1: return _mm512_shuffle_i32x4(v, v, 0x55);
        case 2: return _mm512_shuffle_i32x4(v, v, 0xAA);
        default: return _mm512_shuffle_i32x4(v, v, 0xFF);
    }
}
#endif

// a..d hold, for four keys, the partial dot products of four query rows: lane 4r + i is row r's sum over
// dims i, i + 4, i + 8, ... Returns the finished dot products with lane 4r + key (keys a, b, c, d = 0..3):
// six in-lane shuffles and adds for sixteen dot products.
ALWAYS_INLINE v16 reduce_quads(v16 a, v16 b, v16 c, v16 d) {
    const v16i low = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
    const v16i high = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
    const v16 ab = __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
    const v16 cd = __builtin_shuffle(c, d, low) + __builtin_shuffle(c, d, high);
    const v16i first = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i second = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    return __builtin_shuffle(ab, cd, first) + __builtin_shuffle(ab, cd, second);
}

// Within-row maximum for the [row][key] layout below: lanes 4r..4r+3 (one 128-bit lane) all get their max.
ALWAYS_INLINE v16 max_within_quads(v16 x) {
    const v16i swap_pairs = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    const v16i swap_halves = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const v16 a = __builtin_shuffle(x, swap_pairs);
    x = a > x ? a : x;
    const v16 b = __builtin_shuffle(x, swap_halves);
    return b > x ? b : x;
}

// Decode (one query token per sequence) with the group size and head_dim known at compile time. An item is
// a (sequence, key split) with all its KV heads; its keys are taken in chunks of 64 (a chunk's K and V rows
// stay in L1/L2), and within a chunk head by head: scores, online softmax, values (the walk is
// run_decode_item's, decode_walk.h).
// - Scores, four keys at a time against a KV head's G query rows in sets of four (G = 1 and 2 are padded to
//   four rows). G >= 4: each key is cut into quarters of four dims, each quarter broadcast to the four
//   128-bit lanes and multiplied into a vector holding the same quarter of four query rows; reduce_quads
//   finishes the sixteen dot products of four rows x four keys with six in-lane operations. G < 4: each
//   key's row dot products are summed across lanes by reduce4 (the broadcast form would spend three
//   quarters of its multiplies on padding rows).
// - Scores are kept as [key group][row set][row][key within group]: the softmax works on whole vectors and
//   keeps each row's running max and sum as vectors (a row is one 128-bit lane), so nothing is reduced to
//   a scalar before the item ends.
// - Values: four keys per step with each row's weight broadcast into its dims; the accumulators of a tile
//   of dims stay in registers for the whole chunk (a tile is as wide as 16 registers allow).
// kDot allows the bf16 dot-product path (bf16 and fp8 caches): scores by vdpbf16ps on bf16 pairs of dims,
// values by vdpbf16ps on pairs of keys (two V rows interleaved by one unpack, so the accumulators hold the
// dims in a permuted order that store() undoes). It rounds queries and weights to bf16, so it is taken
// only when the caller's queries were bf16 already.
template <int kDim, int kGroup, typename T, bool kDot>
class DecodeRunner {
    static constexpr int kVecs = kDim / 16;
    static constexpr int kQuads = kDim / 4;
    static constexpr int kRows = kGroup < 4 ? 4 : kGroup;
    static constexpr int kRowSets = kRows / 4;
    static constexpr int kChunk = kDecodeChunk;
    static constexpr int kKeyGroups = kChunk / 4;
    static constexpr int kTileVecs = kGroup * kVecs <= 16 ? kVecs : (16 / kGroup > 0 ? 16 / kGroup : 1);
#ifdef KVT_DOT_BF16
    static constexpr bool kDotBf16 = kDot && (std::is_same_v<T, Bf16> || std::is_same_v<T, Fp8>) && kGroup >= 4;
#else
    static constexpr bool kDotBf16 = false;
#endif
    static constexpr int kWords = kDim / 32;  // bf16 path: 32-dim pieces of a V row, two accumulators each
    static constexpr int kTileWords = kWords * kGroup * 2 <= 16 ? kWords : (8 / kGroup > 0 ? 8 / kGroup : 1);

  public:
    explicit DecodeRunner(const KvtParams& p)
        : p_(p),
          heads_(p.num_kv_heads),
          q_(static_cast<size_t>(heads_) * kRowSets * kQuads * 16),
          q_rows_(kGroup < 4 ? static_cast<size_t>(heads_) * 4 * kDim : 0),
          acc_(static_cast<size_t>(heads_) * kGroup * kDim),
          scores_(static_cast<size_t>(heads_) * kKeyGroups * kRowSets * 16),
          widened_(static_cast<size_t>(4) * kDim),
          max_(static_cast<size_t>(heads_) * kRowSets * 16),
          sum_(max_.size()),
          rescale_(max_.size()),
          q16_(kDotBf16 ? static_cast<size_t>(heads_) * kRowSets * kDim * 4 : 0),
          p16_(kDotBf16 ? scores_.size() : 0) {}

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
    std::vector<float> q_, q_rows_, acc_, scores_, widened_, max_, sum_, rescale_;
    std::vector<uint16_t> q16_, p16_;

    // Query row set s of head h, quarter j: lane 4r + i holds dim 4j + i of row 4s + r (zero for padding).
    float* query(int h, int s, int j) { return q_.data() + ((static_cast<size_t>(h) * kRowSets + s) * kQuads + j) * 16; }
    // G < 4: head h's four (padded) query rows, row-major.
    float* query_rows(int h) { return q_rows_.data() + static_cast<size_t>(h) * 4 * kDim; }
    // The same rows for the bf16 path, in bf16: lane 8r + i of quarter j holds dim 8j + i of row 4s + r.
    uint16_t* query_bf16(int h, int s, int j) {
        return q16_.data() + ((static_cast<size_t>(h) * kRowSets + s) * (kDim / 8) + j) * 32;
    }
    float* accumulator(int h, int g) { return acc_.data() + (static_cast<size_t>(h) * kGroup + g) * kDim; }
    float* score(int h, int key_group, int s) {
        return scores_.data() + ((static_cast<size_t>(h) * kKeyGroups + key_group) * kRowSets + s) * 16;
    }
    // Per-row running state of head h's row set s, one row per 128-bit lane (all four lanes equal for max).
    float* state(std::vector<float>& of, int h, int s) { return of.data() + (static_cast<size_t>(h) * kRowSets + s) * 16; }

    // Rearranges the token's query rows into the quarter layouts (16-byte copies: this runs once per item,
    // and an element-wise loop here cost more than the keys of a short sequence).
    void load_queries(int token) {
        const float q_scale = p_.scale * p_.k_scale;
        alignas(64) float scaled[kDim];
        for (int h = 0; h < heads_; ++h) {
            for (int row = 0; row < kRows; ++row) {
                const float* src = p_.q + (static_cast<int64_t>(token) * p_.num_q_heads + h * kGroup + row) * kDim;
                for (int v = 0; v < kVecs; ++v) store16(scaled + 16 * v, row < kGroup ? load16(src + 16 * v) * q_scale : v16{});
                for (int j = 0; j < kQuads; ++j) std::memcpy(query(h, row / 4, j) + (row % 4) * 4, scaled + 4 * j, 4 * sizeof(float));
                if constexpr (kGroup < 4) std::memcpy(query_rows(h) + row * kDim, scaled, sizeof(scaled));
                if constexpr (kDotBf16) load_query_bf16(h, row, row < kGroup ? src : nullptr);
            }
        }
    }

    // Key rows as float32: in place for a float cache, else widened into a small scratch that stays in L1.
    const float* as_float(const T* row, int slot) {
        if constexpr (std::is_same_v<T, float>) {
            return row;
        } else {
            float* dst = widened_.data() + slot * kDim;
            for (int v = 0; v < kVecs; ++v) store16(dst + 16 * v, load16(row + 16 * v));
            return dst;
        }
    }

    // Scores of head h's rows against the chunk's n keys.
    void scores(int h, const T* const* keys, int n, Prefetchers<T, kChunk, kDim>& ahead) {
        const int64_t head = h * p_.stride_head;
        const v16 key_in_group = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
        const v16 minus_infinity = splat(-std::numeric_limits<float>::infinity());
        const v16 bf16_scale = splat(p_.scale * p_.k_scale);  // the bf16 path's queries are not pre-scaled
        // The query quarters, read once (in the loop they would be re-read after every score store: both
        // are floats, so the compiler must assume the stores may change them).
        v16 quarters[kGroup >= 4 ? kRowSets : 1][kDotBf16 ? kDim / 8 : kQuads];
        if constexpr (kGroup >= 4) {
            for (int s = 0; s < kRowSets; ++s) {
                for (int j = 0; j < (kDotBf16 ? kDim / 8 : kQuads); ++j) {
                    quarters[s][j] = kDotBf16 ? load_vector<v16>(query_bf16(h, s, j)) : load16(query(h, s, j));
                }
            }
        }
        for (int group = 0; group * 4 < n; ++group) {
            if (group % (Prefetchers<T, kChunk, kDim>::kStepKeys / 4) == 0) ahead.step();
            const int count = std::min(4, n - group * 4);
            const T* raw[4];
            for (int i = 0; i < 4; ++i) raw[i] = keys[4 * group + i] + head;  // padding keys are masked below
            v16 sets[kRowSets];
            if constexpr (kDotBf16) {
                for (int s = 0; s < kRowSets; ++s) sets[s] = bf16_quad_scores(quarters[s], raw) * bf16_scale;
            } else {
                const float* k[4];
                for (int i = 0; i < 4; ++i) k[i] = as_float(raw[i], i);
                for (int s = 0; s < kRowSets; ++s) sets[s] = kGroup >= 4 ? quad_scores(quarters[s], k) : lane_scores(h, k);
            }
            // Lanes of padding keys get -inf by one select (writing single lanes went through the stack).
            const v16 valid = splat(static_cast<float>(count));
            for (int s = 0; s < kRowSets; ++s) {
                store16(score(h, group, s), key_in_group < valid ? sets[s] : minus_infinity);
            }
        }
    }

#ifdef KVT_DOT_BF16
    // 32 dims of a cache row as 32 bf16 words: loaded for a bf16 cache, widened for fp8.
    ALWAYS_INLINE __m512i bf16_words(const T* row) {
        if constexpr (std::is_same_v<T, Fp8>) {
            return fp8_to_bf16(row);
        } else {
            return _mm512_loadu_si512(row);
        }
    }

    // bf16 keys: eight dims (four bf16 pairs) broadcast to each 128-bit lane, and vdpbf16ps sums each pair's
    // products into the lane, so lane 4r + i ends up holding row r's sum over dims 2i and 2i + 1 (mod 8), the
    // layout reduce_quads finishes. Half the multiply instructions of the float path.
    ALWAYS_INLINE v16 bf16_quad_scores(const v16* q, const T* const* k) {
        __m512 dot[4];
        for (int i = 0; i < 4; ++i) dot[i] = _mm512_setzero_ps();
        if constexpr (std::is_same_v<T, Fp8>) {
            // fp8 keys are widened to bf16 32 dims at a time, then each 8-dim lane broadcast in registers
            for (int c = 0; c < kDim / 32; ++c) {
                __m512i words[4];
                for (int i = 0; i < 4; ++i) words[i] = fp8_to_bf16(k[i] + 32 * c);
                for (int lane = 0; lane < 4; ++lane) {
                    const __m512bh quarter = (__m512bh)q[4 * c + lane];
                    for (int i = 0; i < 4; ++i) dot[i] = _mm512_dpbf16_ps(dot[i], quarter, (__m512bh)broadcast_lane(words[i], lane));
                }
            }
        } else {
            for (int j = 0; j < kDim / 8; ++j) {
                const __m512bh quarter = (__m512bh)q[j];
                for (int i = 0; i < 4; ++i) {
                    const __m512i keys = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k[i] + 8 * j)));
                    dot[i] = _mm512_dpbf16_ps(dot[i], quarter, (__m512bh)keys);
                }
            }
        }
        return reduce_quads((v16)dot[0], (v16)dot[1], (v16)dot[2], (v16)dot[3]);
    }
#else
    v16 bf16_quad_scores(const v16*, const T* const*) { return v16{}; }
#endif

    ALWAYS_INLINE v16 quad_scores(const v16* q, const float* const* k) {
        v16 dot[4];
        for (int i = 0; i < 4; ++i) dot[i] = q[0] * broadcast4(k[i]);
        for (int j = 1; j < kQuads; ++j) {
            for (int i = 0; i < 4; ++i) dot[i] += q[j] * broadcast4(k[i] + 4 * j);
        }
        return reduce_quads(dot[0], dot[1], dot[2], dot[3]);
    }

    // G < 4 (one row set): each key's four row dot products are summed across lanes together.
    ALWAYS_INLINE v16 lane_scores(int h, const float* const* k) {
        const float* rows = query_rows(h);
        v16 out{};
        for (int i = 0; i < 4; ++i) {
            v16 dot[4];
            for (int r = 0; r < 4; ++r) {
                dot[r] = load16(rows + r * kDim) * load16(k[i]);
                for (int v = 1; v < kVecs; ++v) dot[r] += load16(rows + r * kDim + 16 * v) * load16(k[i] + 16 * v);
            }
            const v16 four = reduce4(dot[0], dot[1], dot[2], dot[3]);
            for (int r = 0; r < 4; ++r) out[4 * r + i] = four[r];
        }
        return out;
    }

    // Online softmax over the chunk: every row's lanes move to the new running max, the chunk's scores
    // become weights, and the factor that rescales the row's earlier sum and values is kept for values().
    void softmax(int h, int n) {
        const int groups = (n + 3) / 4;
        for (int s = 0; s < kRowSets; ++s) {
            v16 top = splat(-std::numeric_limits<float>::infinity());
            for (int group = 0; group < groups; ++group) {
                const v16 x = load16(score(h, group, s));
                top = x > top ? x : top;
            }
            const v16 old = load16(state(max_, h, s));
            v16 updated = max_within_quads(top);
            updated = old > updated ? old : updated;
            const v16 rescale = fast_exp16(old - updated);  // an empty history (-inf) rescales to 0
            store16(state(max_, h, s), updated);
            store16(state(rescale_, h, s), rescale);
            v16 total{};
            for (int group = 0; group < groups; ++group) {
                float* flat = score(h, group, s);
                const v16 e = fast_exp16(load16(flat) - updated);
                store16(flat, e);
                if constexpr (kDotBf16) store_bf16(h, group, s, e);
                total += e;
            }
            store16(state(sum_, h, s), load16(state(sum_, h, s)) * rescale + total);
        }
    }

    // Row g's factor from softmax(), broadcast.
    ALWAYS_INLINE v16 row_rescale(int h, int g) { return splat(state(rescale_, h, g / 4)[4 * (g % 4)]); }

    // The first tile's pass over the keys steps the prefetcher (once per PrefetchStream::kStepKeys keys, as the
    // reads go).
    void values(int h, const T* const* keys, int n, Prefetchers<T, kChunk, kDim>& ahead) {
        const int64_t offset = p_.stride_kv + h * p_.stride_head;
        if constexpr (kDotBf16) {
            for (int word = 0; word < kWords; word += kTileWords) bf16_values(h, keys, n, offset, word, ahead, word == 0);
        } else {
            for (int vec = 0; vec < kVecs; vec += kTileVecs) float_values(h, keys, n, offset, vec, ahead, vec == 0);
        }
    }

    // Dims [16 vec, 16 (vec + kTileVecs)) of every row; padding keys of the last group carry weight 0.
    ALWAYS_INLINE void float_values(int h, const T* const* keys, int n, int64_t offset, int vec,
                                    Prefetchers<T, kChunk, kDim>& ahead, bool stepping) {
        v16 acc[kGroup][kTileVecs];
        for (int g = 0; g < kGroup; ++g) {
            const v16 rescale = row_rescale(h, g);
            for (int j = 0; j < kTileVecs; ++j) acc[g][j] = load16(accumulator(h, g) + 16 * (vec + j)) * rescale;
        }
        for (int group = 0; group * 4 < n; ++group) {
            if (stepping && group % (Prefetchers<T, kChunk, kDim>::kStepKeys / 4) == 0) ahead.step();
            const float* weights = score(h, group, 0);
            for (int i = 0; i < 4; ++i) {
                const T* row = keys[4 * group + i] + offset + 16 * vec;
                v16 value[kTileVecs];
                for (int j = 0; j < kTileVecs; ++j) value[j] = load16(row + 16 * j);
                for (int g = 0; g < kGroup; ++g) {
                    const v16 weight = splat(weights[(g / 4) * 16 + (g % 4) * 4 + i]);
                    for (int j = 0; j < kTileVecs; ++j) acc[g][j] += weight * value[j];
                }
            }
        }
        for (int g = 0; g < kGroup; ++g) {
            for (int j = 0; j < kTileVecs; ++j) store16(accumulator(h, g) + 16 * (vec + j), acc[g][j]);
        }
    }

#ifdef KVT_DOT_BF16
    // The weights of the chunk, rounded to bf16 alongside the float ones, in the same layout.
    uint16_t* weights_bf16(int h, int key_group, int s) {
        return p16_.data() + ((static_cast<size_t>(h) * kKeyGroups + key_group) * kRowSets + s) * 16;
    }

    void load_query_bf16(int h, int row, const float* src) {
        alignas(64) uint16_t rounded[kDim];
        for (int v = 0; v < kVecs; ++v) {
            const v16 values = src != nullptr ? load16(src + 16 * v) : v16{};
            _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + 16 * v), (__m256i)_mm512_cvtneps_pbh((__m512)values));
        }
        for (int j = 0; j < kDim / 8; ++j) std::memcpy(query_bf16(h, row / 4, j) + (row % 4) * 8, rounded + 8 * j, 16);
    }

    void store_bf16(int h, int key_group, int s, v16 weights) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights_bf16(h, key_group, s)),
                            (__m256i)_mm512_cvtneps_pbh((__m512)weights));
    }

    // Two keys at a time: one unpack pair interleaves their V rows into (key t, key t + 1) bf16 pairs, and
    // each row's two weights make one bf16 pair, so one vdpbf16ps adds both keys' contributions to 16 dims.
    // Unpacking works within 128-bit lanes, so of 32 dims [32w, 32w + 32) the low accumulator holds dims
    // 8l + m and the high one 8l + 4 + m in lane 4l + m; store() puts them back in order.
    ALWAYS_INLINE void bf16_values(int h, const T* const* keys, int n, int64_t offset, int word,
                                   Prefetchers<T, kChunk, kDim>& ahead, bool stepping) {
        v16 acc[kGroup][2 * kTileWords];
        for (int g = 0; g < kGroup; ++g) {
            const v16 rescale = row_rescale(h, g);
            for (int j = 0; j < 2 * kTileWords; ++j) acc[g][j] = load16(accumulator(h, g) + 32 * word + 16 * j) * rescale;
        }
        for (int index = 0; index < n; index += 2) {
            if (stepping && index % Prefetchers<T, kChunk, kDim>::kStepKeys == 0) ahead.step();
            const T* first = keys[index] + offset + 32 * word;
            const T* second = keys[index + 1] + offset + 32 * word;  // past an odd tail: padding, weight 0
            __m512bh low[kTileWords], high[kTileWords];
            for (int j = 0; j < kTileWords; ++j) {
                const __m512i a = bf16_words(first + 32 * j), b = bf16_words(second + 32 * j);
                low[j] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                high[j] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            const uint16_t* weights = weights_bf16(h, index / 4, 0) + index % 4;
            for (int g = 0; g < kGroup; ++g) {
                uint32_t pair;
                std::memcpy(&pair, weights + (g / 4) * 16 + (g % 4) * 4, sizeof(pair));
                const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
                for (int j = 0; j < kTileWords; ++j) {
                    acc[g][2 * j] = (v16)_mm512_dpbf16_ps((__m512)acc[g][2 * j], low[j], weight);
                    acc[g][2 * j + 1] = (v16)_mm512_dpbf16_ps((__m512)acc[g][2 * j + 1], high[j], weight);
                }
            }
        }
        for (int g = 0; g < kGroup; ++g) {
            for (int j = 0; j < 2 * kTileWords; ++j) store16(accumulator(h, g) + 32 * word + 16 * j, acc[g][j]);
        }
    }
#else
    void load_query_bf16(int, int, const float*) {}
    void store_bf16(int, int, int, v16) {}
    void bf16_values(int, const T* const*, int, int64_t, int, Prefetchers<T, kChunk, kDim>&, bool) {}
#endif

    // Dim d of a row's accumulator: in order, except on the bf16 path (see bf16_values).
    static int accumulated_at(int d) {
        if constexpr (!kDotBf16) return d;
        const int piece = d / 32, within = d % 32;
        const int lane = within / 8, half = (within % 8) / 4, m = within % 4;
        return 32 * piece + 16 * half + 4 * lane + m;
    }

    void store(const Item& item, int token) {
        for (int h = 0; h < heads_; ++h) {
            for (int g = 0; g < kGroup; ++g) {
                const int q_head = h * kGroup + g;
                const int64_t slot = (static_cast<int64_t>(item.split) * p_.num_tokens + token) * p_.num_q_heads + q_head;
                const float* sums = state(sum_, h, g / 4) + 4 * (g % 4);
                const float total = (sums[0] + sums[1]) + (sums[2] + sums[3]);
                const float factor = total > 0.0f ? p_.v_scale / total : 0.0f;
                const float* acc = accumulator(h, g);
                for (int d = 0; d < kDim; ++d) p_.out[slot * kDim + d] = acc[accumulated_at(d)] * factor;
                p_.lse[slot] = total > 0.0f ? state(max_, h, g / 4)[4 * (g % 4)] + std::log(total)
                                            : -std::numeric_limits<float>::infinity();
            }
        }
    }
};

}  // namespace
