// The paged-attention kernel's primitives, what every runner header builds on: the cache element types (from
// paged_attention_common.h, with the argument block, the 16-lane vector type, the key-row walk and the decode
// prefetch streams), the ISA detection (KVT_DOT_BF16), to_float and the fp8 table, the exp helpers (scalar,
// portable vectors, 16 lanes), the work Item and the item runner's row prefetch. Every runner header
// includes this one and compiles alone; paged_attention_cpu.cpp includes them all into one translation unit.
// Everything has internal linkage: the kernel library compiles its own copy.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVT_DOT_BF16 1  // vdpbf16ps: bf16 pair dot products into float32 lanes (Zen 4, Sapphire Rapids)
#endif

#include "paged_attention_common.h"

namespace {

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

// A unit of work, taken by one thread: a sequence, a KV head, a tile of its query tokens, a key split (each
// runner reads the fields its items vary in).
struct Item {
    int seq, head, first_query, num_queries, split;
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

ALWAYS_INLINE v16 load16(const float* src) { return *reinterpret_cast<const v16u*>(src); }

ALWAYS_INLINE void store16(float* dst, v16 value) { *reinterpret_cast<v16u*>(dst) = value; }

using v8 = float __attribute__((vector_size(32)));  // the AVX2 runners' 8 lanes

// One value in every lane. (`v16{} + value` compiles to a scalar add of zero and then the broadcast.)
ALWAYS_INLINE v16 splat(float value) {
#ifdef __AVX512F__
    return (v16)_mm512_set1_ps(value);
#else
    return v16{} + value;
#endif
}

// exp on 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by the polynomial of fast_exp, then 2^n.
// With AVX-512, vrndscaleps rounds and vscalefps applies 2^n, underflowing to 0 below about -104 (so -inf
// gives 0) with no clamps or integer conversion: about half the operations of the portable version, which
// rounds by the 1.5 * 2^23 trick and builds 2^n from the exponent bits.
template <typename V>
ALWAYS_INLINE V exp_polynomial(V r) {
    V poly = V{} + 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    return poly * r * r + r + 1.0f;
}

// The same without AVX-512, for any float vector V and its int32 vector VI: rounds by the 1.5 * 2^23 trick and
// builds 2^n from the exponent bits.
template <typename V, typename VI>
ALWAYS_INLINE V fast_exp_portable(V x) {
    const V low = V{} - 87.0f, high = V{} + 88.0f;
    V clamped = x < low ? low : x;
    clamped = clamped > high ? high : clamped;
    const V magic = V{} + 12582912.0f;
    const V n = (clamped * 1.44269504088896341f + magic) - magic;
    const V r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
    const V result = exp_polynomial(r) * (V)bits;
    return x < low ? V{} : result;
}

ALWAYS_INLINE v16 fast_exp16(v16 x) {
#ifdef __AVX512F__
    const v16 low = splat(-110.0f);
    const v16 clamped = x < low ? low : x;  // also turns -inf into a finite input (and then 0)
    const v16 n = (v16)_mm512_roundscale_ps((__m512)(clamped * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const v16 r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    return (v16)_mm512_scalef_ps((__m512)exp_polynomial(r), (__m512)n);
#else
    return fast_exp_portable<v16, v16i>(x);
#endif
}

}  // namespace
