// Paged attention for the CPU: K/V are read in place, block by block, through the block table (no gather
// copy). This file holds the dispatch and the C ABI; the runners, each in a header that compiles alone, are:
// - DecodeRunner (decode_runner.h; one query token per sequence, head_dim 32/64/128, group 1/2/4/8): an item
//   is a (sequence, key split) with all KV heads; keys are scored four at a time against four query rows,
//   the rows the item will read are prefetched a fixed number of bytes ahead of its reads, and the work is
//   written with explicit 16-lane vectors (GCC vector extensions; AVX512-BF16 dot products for bf16 and
//   fp8 caches where the CPU has them). On CPUs with AVX2 but not AVX-512, DecodeRunner8
//   (decode_runner_avx2.h) does the same walk (decode_walk.h) in 8-lane registers instead.
// - PrefillRunner (prefill_runner.h; query chunks of more than one token, head_dim 32/64/128, on AVX-512 or
//   AVX2): an item is (sequence, KV head, tile of query tokens) whose rows (tokens x the G query heads of
//   the KV head) sit in the vector lanes; scores and values are register-blocked small matrix products.
// - ItemRunner (item_runner.h; any other shape, or a CPU with neither): the same item, one (row, key) dot
//   product at a time.
// What they share (element types, fp8 table, exp helpers, Item, prefetch, ISA detection) is in
// cpu_primitives.h. All use the online (flash) softmax over chunks of keys, so scratch stays in L1/L2
// however long the context is. Output is float32 partials [splits, tokens, q_heads, head_dim] plus their
// log-sum-exp; Python merges the splits (kvtune.kernels.merge) and casts. The headers are included here into
// one translation unit, so the compiler sees every runner with the dispatch.

#include <omp.h>

#include "cpu_primitives.h"
#include "decode_runner.h"
#include "decode_runner_avx2.h"
#include "item_runner.h"
#include "prefill_runner.h"

namespace {

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
    // Longest first: threads take items dynamically, so the step ends with short items, not with one
    // thread finishing a long sequence while the others wait.
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return p.seq_lens[a.seq] > p.seq_lens[b.seq]; });
#pragma omp parallel num_threads(p.num_threads)
    {
#ifdef KVT_DECODE_AVX2
        DecodeRunner8<kDim, kGroup, T> runner(p);
        run_with(items, runner);
#else
        if (p.query_bf16) {
            DecodeRunner<kDim, kGroup, T, true> runner(p);
            run_with(items, runner);
        } else {
            DecodeRunner<kDim, kGroup, T, false> runner(p);
            run_with(items, runner);
        }
#endif
    }
    return true;
}

// Prefill (query_tile > 1) by the tiled PrefillRunner where it applies: items of PrefillRunner::tile_for
// query tokens per (sequence, KV head), the ones that read the most keys first.
template <int kDim, typename T>
bool try_prefill(const KvtParams& p) {
#ifdef KVT_PREFILL_LANES
    if (p.query_tile == 1 || !PrefillRunner<kDim, T>::fits(p)) return false;
    const int tile = PrefillRunner<kDim, T>::tile_for(p);
    std::vector<Item> items;
    std::vector<int> keys;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
        const int query_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
        const int context = p.seq_lens[seq] - query_len;
        for (int first = 0; first < query_len; first += tile) {
            const int count = std::min(tile, query_len - first);
            for (int head = 0; head < p.num_kv_heads; ++head) {
                items.push_back({seq, head, first, count, 0});
                keys.push_back(context + first + count);
            }
        }
    }
    std::vector<size_t> order(items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] > keys[b]; });
    std::vector<Item> sorted;
    sorted.reserve(items.size());
    for (size_t i : order) sorted.push_back(items[i]);
#pragma omp parallel num_threads(p.num_threads)
    {
        if (p.query_bf16) {
            PrefillRunner<kDim, T, true> runner(p);
            run_with(sorted, runner);
        } else {
            PrefillRunner<kDim, T, false> runner(p);
            run_with(sorted, runner);
        }
    }
    return true;
#else
    (void)p;
    return false;
#endif
}

template <int kDim, typename T>
void run_items(const KvtParams& p, const std::vector<Item>& items) {
    if constexpr (kDim != 0) {
        if (p.query_tile == 1 && (try_decode<kDim, 1, T>(p) || try_decode<kDim, 2, T>(p) ||
                                  try_decode<kDim, 4, T>(p) || try_decode<kDim, 8, T>(p))) {
            return;
        }
        if (try_prefill<kDim, T>(p)) return;
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
