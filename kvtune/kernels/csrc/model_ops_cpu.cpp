// A decoder layer's small ops fused for the CPU, one pass over the rows each, split by rows over `threads`
// OpenMP threads (the caller passes 1 for a decode step's few rows, where waking a thread costs more than the
// pass; a prefill chunk's thousands of rows take every thread). Rows are independent, so the split changes no
// value:
// - kvt_rms_norm / kvt_add_rms_norm: (residual + delta, then) RMSNorm, as the model's torch code computes it:
//   the add rounded to the model dtype, the norm in float32, rounded to the model dtype, times the weight,
//   rounded again;
// - kvt_rope_write: rotary embedding of the fused qkv projection's q and k (Llama's half-split pairs), the
//   rotated q written out and the rotated k and the v written into their cache slots: the split, the rotation
//   (each product and the sum rounded to the model dtype, as torch rounds each op) and the cache write in one;
// - kvt_silu_mul: silu(gate) * up of the fused gate/up projection, each op rounded to the model dtype.
// The rotation, the adds and the products are exactly torch's (IEEE float32 operations on the widened values,
// rounded to nearest even); this file is built with -ffp-contract=off so that no multiply-add is fused. The
// norm's sum of squares runs in another order than torch's reduction and silu's exp is not torch's, so those
// two differ from torch by float32 rounding (tests/kernels/test_model_ops.py states and checks the bound).
// Model dtypes: 0 float32, 2 bfloat16 (kvtune.kernels.model_ops falls back to torch for anything else).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

inline float widen(const uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float out;
    std::memcpy(&out, &wide, sizeof(out));
    return out;
}

// float32 to bfloat16, rounding to nearest even (NaN kept quiet), as torch's conversion does.
// Branch-free (a select for NaN), so the loops around it vectorise.
inline uint16_t narrow(const float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded >> 16);
}

// One element of the model dtype: read as float32, and a float32 result rounded back to it.
template <typename T>
inline float load(const T* base, int64_t i);
template <>
inline float load<float>(const float* base, int64_t i) { return base[i]; }
template <>
inline float load<uint16_t>(const uint16_t* base, int64_t i) { return widen(base[i]); }

template <typename T>
inline T round_to(float value);
template <>
inline float round_to<float>(float value) { return value; }
template <>
inline uint16_t round_to<uint16_t>(float value) { return narrow(value); }

template <typename T>
inline float rounded(float value) {
    if constexpr (sizeof(T) == 4) {
        return value;
    } else {
        return widen(narrow(value));
    }
}

// Sum of squares over a row in 16 interleaved partial sums (a fixed order, so any vector width gives the same
// float32 result), then the partials pairwise.
template <typename T>
inline float sum_of_squares(const T* row, int cols) {
    float partial[16] = {};
    int c = 0;
    for (; c + 16 <= cols; c += 16) {
        for (int i = 0; i < 16; ++i) {
            const float x = load(row, c + i);
            partial[i] += x * x;
        }
    }
    for (int i = 0; c < cols; ++c, ++i) {
        const float x = load(row, c);
        partial[i] += x * x;
    }
    for (int width = 8; width >= 1; width /= 2) {
        for (int i = 0; i < width; ++i) partial[i] += partial[i + width];
    }
    return partial[0];
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)) for one row of x (x already in the model dtype).
template <typename T>
inline void norm_row(const T* row, const T* weight, T* dst, int cols, float eps) {
    const float mean = sum_of_squares(row, cols) / static_cast<float>(cols);
    const float inverse = 1.0f / std::sqrt(mean + eps);
    for (int c = 0; c < cols; ++c) {
        const float normed = rounded<T>(load(row, c) * inverse);
        dst[c] = round_to<T>(load(weight, c) * normed);
    }
}

// Each row: sum = x + delta (when delta is given), then out = RMSNorm(sum, or x).
template <typename T>
void add_norm_rows(const T* x, const T* delta, const T* weight, T* sum, T* out, int64_t rows, int cols, float eps,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = r * cols;
        const T* normed_input = x + at;
        if (delta) {
            for (int c = 0; c < cols; ++c) sum[at + c] = round_to<T>(load(x, at + c) + load(delta, at + c));
            normed_input = sum + at;
        }
        norm_row(normed_input, weight, out + at, cols, eps);
    }
}

// Rotates the head at `src` by one token's cos/sin row (half-split pairs), writing it to `dst`:
// dst[i] = round(round(x[i] cos[i]) + round(rot[i] sin[i])), rot = (-x[h:], x[:h]) as torch.cat builds it.
// Two loops, one per half, so each vectorises.
template <typename T>
inline void rotate(const T* src, const T* cos, const T* sin, T* dst, int dim) {
    const int half = dim / 2;
    for (int i = 0; i < half; ++i) {
        const float first = rounded<T>(load(src, i) * load(cos, i));
        const float second = rounded<T>(-load(src, i + half) * load(sin, i));
        dst[i] = round_to<T>(first + second);
    }
    for (int i = half; i < dim; ++i) {
        const float first = rounded<T>(load(src, i) * load(cos, i));
        const float second = rounded<T>(load(src, i - half) * load(sin, i));
        dst[i] = round_to<T>(first + second);
    }
}

// exp(x) by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (within 2 float32 units in the last
// place): branch-free, so the silu loop vectorises, where a libm call per element kept it scalar (5x slower
// than torch's vectorised silu at 2,048 x 512). Like libm's, it overflows to inf (above ln(FLT_MAX)) and
// underflows to 0, so silu's extremes come out as torch's: x / (1 + inf) = -0, x / (1 + 0) = x.
inline float exp_approx(float x) {
    const float clamped = x < -87.0f ? -87.0f : (x > 88.7228f ? 88.7228f : x);
    const float magic = 12582912.0f;  // 1.5 x 2^23: adding and subtracting it rounds to the nearest integer
    const float n = (clamped * 1.44269504088896341f + magic) - magic;
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const float y = (poly * r) * r + r + 1.0f;
    // 2^n in two factors, each a normal float32 for every n in [-126, 128] (2^128 alone would be inf).
    const int32_t whole = static_cast<int32_t>(n), low = whole >> 1;
    const int32_t bits_low = (low + 127) << 23, bits_high = (whole - low + 127) << 23;
    float scale_low, scale_high;
    std::memcpy(&scale_low, &bits_low, sizeof(scale_low));
    std::memcpy(&scale_high, &bits_high, sizeof(scale_high));
    const float value = (y * scale_low) * scale_high;
    return x < -87.0f ? 0.0f : (x > 88.7228f ? std::numeric_limits<float>::infinity() : value);
}

template <typename T>
void rope_write(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* cache, T* q_out, int64_t tokens,
                int num_heads, int num_kv_heads, int dim, int64_t stride_block, int64_t stride_kv,
                int64_t stride_token, int block_size, int threads) {
    const int64_t row_width = static_cast<int64_t>(num_heads + 2 * num_kv_heads) * dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const T* row = qkv + t * row_width;
        const T* c = cos + t * dim;
        const T* s = sin + t * dim;
        for (int h = 0; h < num_heads; ++h) rotate(row + h * dim, c, s, q_out + (t * num_heads + h) * dim, dim);
        const int64_t slot = slots[t];
        if (slot < 0) continue;  // a token whose KV is not kept
        T* k_dst = cache + (slot / block_size) * stride_block + (slot % block_size) * stride_token;
        T* v_dst = k_dst + stride_kv;
        const T* k = row + static_cast<int64_t>(num_heads) * dim;
        const T* v = k + static_cast<int64_t>(num_kv_heads) * dim;
        for (int h = 0; h < num_kv_heads; ++h) rotate(k + h * dim, c, s, k_dst + h * dim, dim);
        std::memcpy(v_dst, v, sizeof(T) * static_cast<size_t>(num_kv_heads) * dim);
    }
}

// out[t] = round(round(silu(gate[t])) * up[t]) with silu(x) = x / (1 + exp(-x)).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t tokens, int width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const T* gate = gate_up + t * 2 * width;
        const T* up = gate + width;
        T* dst = out + t * width;
        for (int i = 0; i < width; ++i) {
            const float x = load(gate, i);
            const float silu = rounded<T>(x / (1.0f + exp_approx(-x)));
            dst[i] = round_to<T>(silu * load(up, i));
        }
    }
}

}  // namespace

extern "C" {

// sum = x + delta (when delta is not null; else x itself is normed), then out = RMSNorm(sum): rows x cols,
// contiguous, in the model dtype.
int kvt_add_rms_norm(const void* x, const void* delta, const void* weight, void* sum, void* out, int64_t rows,
                     int cols, float eps, int dtype, int threads) {
    if (dtype == 0) {
        add_norm_rows(static_cast<const float*>(x), static_cast<const float*>(delta), static_cast<const float*>(weight),
                      static_cast<float*>(sum), static_cast<float*>(out), rows, cols, eps, threads);
        return 0;
    }
    if (dtype == 2) {
        add_norm_rows(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(delta),
                      static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(sum), static_cast<uint16_t*>(out),
                      rows, cols, eps, threads);
        return 0;
    }
    return 1;
}

int kvt_rope_write(const void* qkv, const void* cos, const void* sin, const int64_t* slots, void* cache, void* q_out,
                   int64_t tokens, int num_heads, int num_kv_heads, int dim, int64_t stride_block, int64_t stride_kv,
                   int64_t stride_token, int block_size, int dtype, int threads) {
    if (dtype == 0) {
        rope_write(static_cast<const float*>(qkv), static_cast<const float*>(cos), static_cast<const float*>(sin),
                   slots, static_cast<float*>(cache), static_cast<float*>(q_out), tokens, num_heads, num_kv_heads, dim,
                   stride_block, stride_kv, stride_token, block_size, threads);
        return 0;
    }
    if (dtype == 2) {
        rope_write(static_cast<const uint16_t*>(qkv), static_cast<const uint16_t*>(cos),
                   static_cast<const uint16_t*>(sin), slots, static_cast<uint16_t*>(cache),
                   static_cast<uint16_t*>(q_out), tokens, num_heads, num_kv_heads, dim, stride_block, stride_kv,
                   stride_token, block_size, threads);
        return 0;
    }
    return 1;
}

int kvt_silu_mul(const void* gate_up, void* out, int64_t tokens, int width, int dtype, int threads) {
    if (dtype == 0) {
        silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), tokens, width, threads);
        return 0;
    }
    if (dtype == 2) {
        silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), tokens, width, threads);
        return 0;
    }
    return 1;
}

}  // extern "C"
