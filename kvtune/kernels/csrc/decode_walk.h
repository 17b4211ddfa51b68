// The walk of one decode item, which both decode runners take (DecodeRunner, decode_runner.h; DecodeRunner8
// for AVX2, decode_runner_avx2.h): the item's share of the keys (its split), their rows looked up once, the
// prefetch stream ahead of the reads, then chunk by chunk (kDecodeChunk keys, whose K and V rows stay in
// L1/L2) and head by head: scores, online softmax, values; then the output. The runner brings the
// arithmetic and its own layouts: begin (its token's queries in place, empty accumulators and softmax
// state), scores, softmax, values and store.
//
// A free function rather than a base class of the two runners: with the walk and begin() in a base (tried,
// with the runners' members in the same order), GCC 12 inlined differently and the kernel's machine code
// changed (its outputs did not); as a function, the code is what it was when the walk lived in the .cpp.

#pragma once

#include "cpu_primitives.h"

namespace {

template <int kDim, typename T, typename Runner>
void run_decode_item(const KvtParams& p, const Item& item, std::vector<const T*>& rows, Runner& runner) {
    const int token = p.query_start_loc[item.seq];
    const int seq_len = p.seq_lens[item.seq];
    const int per_split = (seq_len + p.num_splits - 1) / p.num_splits;
    const int lo = item.split * per_split;
    const int hi = std::min(seq_len, lo + per_split);
    runner.begin(token);
    if (lo < hi) {  // a split past a short sequence's end holds no keys (and no table entry to look up)
        key_rows(p, p.block_tables + item.seq * p.block_table_stride, lo, hi, rows);
        Prefetchers<T, kDecodeChunk, kDim> ahead(p, rows.data(), hi - lo);
        for (int chunk = lo; chunk < hi; chunk += kDecodeChunk) {
            const int n = std::min(kDecodeChunk, hi - chunk);
            const T* const* keys = rows.data() + (chunk - lo);
            for (int h = 0; h < p.num_kv_heads; ++h) {
                runner.scores(h, keys, n, ahead);
                runner.softmax(h, n);
                runner.values(h, keys, n, ahead);
            }
        }
    }
    runner.store(item, token);
}

}  // namespace
