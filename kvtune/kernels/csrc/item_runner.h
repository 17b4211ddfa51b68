// The item runner, for whatever the vector runners do not take (a head_dim other than 32, 64 or 128, a
// decode group other than 1, 2, 4 or 8, prefill on a CPU with neither AVX-512 nor AVX2). An item is
// (sequence, KV head, tile of query tokens, key split); it scores one (row, key) dot product at a time and
// keeps the online (flash) softmax over chunks of kKeyChunk keys, so its scratch stays in L1/L2 however long
// the context is.

#pragma once

#include "cpu_primitives.h"

namespace {

constexpr int kKeyChunk = 128;

// A thread's scratch, reused from item to item.
struct Scratch {
    std::vector<float> q, acc, scores, row_max, row_sum, row_k;
    std::vector<int> limit;
};

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

}  // namespace
