// Paged decode attention on a CPU: one query token per sequence, keys and values read where
// they lie in the block-paged cache, with no gathered copy.
//
// The op `tierserve_cpu::paged_decode_attention` takes
//   q [B, H, D] float32, k_cache and v_cache [num_blocks, block_size, KV, D] (float32,
//   bfloat16 or float16), block_tables [B, W] int64, context_lens [B] int64, scale
// and returns [B, H, D] float32. Sequences, and a sequence's kv heads, run in parallel on
// torch's threads.
//
// Per sequence and kv head, keys are read a cache block at a time, each key vector loaded once
// for the dot products of a tile of the query heads that share the kv head, into fp32 scores
// (a group of more than four heads reads the block again from L1 for its next tile); then the
// softmax's exponentials per head, the weighted sum of the values read the same way, and the
// division by the exponentials' sum (SDPA's order of operations). Sequences whose block tables share leading blocks (the n samples of one
// prompt) run one after another on a thread, so the shared blocks come from the cache the
// first one warmed: reading them once for the group instead measured no faster.
//
// The arithmetic is simd.h's vectors, compiled for the capability PyTorch picks on this machine
// (`kernels/cpu_extension.py` defines CPU_CAPABILITY): a dot product sums its vector's lanes
// by halves, and the exponentials are vectorized too. The compiler's own vectorization of the
// plain loops ran this op 1.6x slower (it summed lanes one after another and left the
// exponentials scalar).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"
#include "tensors.h"

namespace tierserve::attention {

// A tile of G query heads that share a kv head, U vectors of each head's dimension at a time:
// G * U independent sums, so the fused multiply-adds do not wait on each other (one sum of a
// head's products, one after another, ran at a fraction of the CPU's rate), and each key or
// value vector loaded serves every head of the tile. G * U is 8, what the 16 registers of
// AVX2 hold beside the operands.
template <int G>
constexpr int kUnroll = G >= 8 ? 1 : 8 / G;

// f(i) for i = 0 .. N - 1, each i a compile-time constant: arrays of vectors indexed by them
// stay in registers (indexed by a loop's counter, GCC kept them in memory, storing every sum
// on every step).
template <int N, typename F>
inline void repeat(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// scores[g * len + j] = scale * q_g . k_j for the tile's heads g and n rows k_j = k + j * stride.
// Each row's lines in the next block (`next`, null for none) are fetched as the row is read.
template <int G, typename cache_t>
inline void dot_rows(float* scores, int64_t len, const float* q, const cache_t* k,
                     int64_t stride, int64_t n, int64_t D, float scale, const cache_t* next) {
  constexpr int U = kUnroll<G>;
  for (int64_t j = 0; j < n; ++j, k += stride) {
    if (next)
      for (int64_t d = 0; d < D; d += 64 / sizeof(cache_t))
        __builtin_prefetch(next + j * stride + d, 0, 2);
    Vec acc[G][U];
    repeat<G>([&](auto g) { repeat<U>([&](auto u) { acc[g][u] = broadcast(0.0f); }); });
    int64_t d = 0;
    for (; d + U * kLanes <= D; d += U * kLanes)
      repeat<U>([&](auto u) {
        const Vec kv = widen(k + d + u * kLanes);
        repeat<G>([&](auto g) {
          acc[g][u] = fmadd(loadu(q + g * D + d + u * kLanes), kv, acc[g][u]);
        });
      });
    if constexpr (U > 1) {
      for (; d + kLanes <= D; d += kLanes) {
        const Vec kv = widen(k + d);
        repeat<G>([&](auto g) { acc[g][0] = fmadd(loadu(q + g * D + d), kv, acc[g][0]); });
      }
      repeat<G>([&](auto g) {
        repeat<U - 1>([&](auto u) { acc[g][0] = acc[g][0] + acc[g][u + 1]; });
      });
    }
    repeat<G>([&](auto g) {
      float sum = lane_sum(acc[g][0]);
      for (int64_t e = d; e < D; ++e) sum += q[g * D + e] * static_cast<float>(k[e]);
      scores[g * len + j] = sum * scale;
    });
  }
}

// o_g += sum_j p[g * len + j] * v_j for the tile's heads g and n rows v_j = v + j * stride, in
// row order. A pass over the rows reads U vectors of each; a pass that starts a cache line
// fetches that line of each row in the next block (`next`, null for none).
template <int G, typename cache_t>
inline void add_weighted_rows(float* o, const float* p, int64_t len, const cache_t* v,
                              int64_t stride, int64_t n, int64_t D, const cache_t* next) {
  constexpr int U = kUnroll<G>;
  int64_t d = 0;
  // U vectors of each head at a time, then the last few one at a time.
  auto columns = [&]<int W>(std::integral_constant<int, W>) {
    Vec acc[G][W];
    repeat<G>([&](auto g) {
      repeat<W>([&](auto u) { acc[g][u] = loadu(o + g * D + d + u * kLanes); });
    });
    const cache_t* row = v + d;
    const bool fetch = next && (d * sizeof(cache_t)) % 64 == 0;
    for (int64_t j = 0; j < n; ++j, row += stride) {
      if (fetch) __builtin_prefetch(next + j * stride + d, 0, 2);
      repeat<W>([&](auto u) {
        const Vec vv = widen(row + u * kLanes);
        repeat<G>([&](auto g) { acc[g][u] = fmadd(broadcast(p[g * len + j]), vv, acc[g][u]); });
      });
    }
    repeat<G>([&](auto g) {
      repeat<W>([&](auto u) { storeu(o + g * D + d + u * kLanes, acc[g][u]); });
    });
    d += W * kLanes;
  };
  while (d + U * kLanes <= D) columns(std::integral_constant<int, U>{});
  while (d + kLanes <= D) columns(std::integral_constant<int, 1>{});
  for (; d < D; ++d)
    for (int g = 0; g < G; ++g)
      for (int64_t j = 0; j < n; ++j)
        o[g * D + d] += p[g * len + j] * static_cast<float>(v[j * stride + d]);
}

// f(h, tile) over a group's heads in tiles of 4, 2 and 1, `tile` the tile's size as a
// compile-time constant. Tiles of 8 heads (U = 1) read half a cache line of each value row a
// pass and load 9 operands for 8 fused multiply-adds, against 6 for a tile of 4 (U = 2): with
// tiles of 4, a group of 8 heads at 32k keys (Qwen3-Next's shape) ran faster, the
// second tile reading the block from the L1 cache.
template <typename F>
inline void for_each_head_tile(int64_t group, F&& f) {
  int64_t h = 0;
  for (; h + 4 <= group; h += 4) f(h, std::integral_constant<int, 4>{});
  if (h + 2 <= group) {
    f(h, std::integral_constant<int, 2>{});
    h += 2;
  }
  if (h < group) f(h, std::integral_constant<int, 1>{});
}

// exp(s - top) in place; returns their sum.
inline float exponentials(float* s, int64_t len, float top) {
  Vec sums{};
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) {
    const Vec e = exp(loadu(s + t) - top);
    storeu(s + t, e);
    sums = sums + e;
  }
  float total = lane_sum(sums);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  return total;
}

// f(t, rows, n) for each run of a sequence's first `len` tokens that lies in one cache block:
// the run starts at token t, `rows` its n tokens' cached values of one kv head (`row_size`
// apart: a token holds every kv head's), walked block by block through the sequence's block
// table. `cache` starts at that kv head's values of a token. f gets the next block's rows too
// (`next`, null at the last block), to fetch them into the L2 cache while it reads these.
//
// The blocks lie anywhere in the cache, and hardware prefetchers stop at 4 KiB page boundaries,
// so without the fetches a long context's read waits on memory every few rows: at 380 keys
// (the rollouts' 64 sequences) the op ran 1.4x faster with them. Into L1 instead (prefetcht0)
// it measured no faster: the fetches then compete with the rows being read. Each line is
// fetched as the same line of the block being read is: all of a block's fetches at its start
// kept the CPU's queue of misses full, and those of a group of 8 heads at 32k keys ran slower.
template <typename cache_t, typename F>
inline void for_each_block(const cache_t* cache, const int64_t* table, int64_t len,
                           int64_t block_size, int64_t row_size, F&& f) {
  for (int64_t start = 0, i = 0; start < len; start += block_size, ++i) {
    const cache_t* next =
        start + block_size < len ? cache + table[i + 1] * block_size * row_size : nullptr;
    f(start, cache + table[i] * block_size * row_size, std::min(block_size, len - start), next);
  }
}

// The work is split into (sequence, kv head) pairs, each the query heads that share a kv
// head: one long sequence then keeps every thread reading its cache, where one thread per
// sequence had left the others idle (decode of one stream at long context). A pair reads only
// its kv head's values of each token.
template <typename cache_t>
void decode_attention(const float* q, const cache_t* k_cache, const cache_t* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens, float* out,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t table_width, float scale) {
  const int64_t D = head_dim;
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * D;  // one token's keys (or values), every kv head
  torch::stable::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inverse_totals(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kv = item % kv_heads;
      const int64_t len = context_lens[b];
      const int64_t* table = block_tables + b * table_width;
      const float* qb = q + (b * heads + kv * group) * D;
      float* o = out + (b * heads + kv * group) * D;
      scores.resize(group * len);
      // A block's rows come from memory for the group's first tile of heads, from the L1
      // cache for the others.
      for_each_block(k_cache + kv * D, table, len, block_size, row,
                     [&](int64_t t, auto keys, int64_t n, auto next) {
                       for_each_head_tile(group, [&](int64_t h, auto tile) {
                         dot_rows<decltype(tile)::value>(scores.data() + h * len + t, len,
                                                         qb + h * D, keys, row, n, D, scale,
                                                         h == 0 ? next : nullptr);
                       });
                     });
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * len;
        const float top = *std::max_element(s, s + len);
        inverse_totals[h] = 1.0f / exponentials(s, len, top);
        // The weights in the cache's dtype, as SDPA's flash kernel rounds them for its
        // half-precision product: a bf16 engine then rounds as transformers does in bf16.
        if constexpr (!std::is_same_v<cache_t, float>) {
          for (int64_t t = 0; t < len; ++t) s[t] = static_cast<float>(static_cast<cache_t>(s[t]));
        }
      }
      std::fill_n(o, group * D, 0.0f);
      for_each_block(v_cache + kv * D, table, len, block_size, row,
                     [&](int64_t t, auto values, int64_t n, auto next) {
                       for_each_head_tile(group, [&](int64_t h, auto tile) {
                         add_weighted_rows<decltype(tile)::value>(
                             o + h * D, scores.data() + h * len + t, len, values, row, n, D,
                             h == 0 ? next : nullptr);
                       });
                     });
      // The division by the exponentials' sum comes last, as SDPA's does.
      for (int64_t h = 0; h < group; ++h)
        for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inverse_totals[h];
    }
  });
}

template <typename cache_t>
void run(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
         const Tensor& block_tables, const Tensor& context_lens, Tensor& out, double scale) {
  decode_attention(q.const_data_ptr<float>(),
                   static_cast<const cache_t*>(k_cache.const_data_ptr()),
                   static_cast<const cache_t*>(v_cache.const_data_ptr()),
                   block_tables.const_data_ptr<int64_t>(), context_lens.const_data_ptr<int64_t>(),
                   out.mutable_data_ptr<float>(), q.size(0), q.size(1), k_cache.size(2),
                   q.size(2), k_cache.size(1), block_tables.size(1), static_cast<float>(scale));
}

Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& block_tables,
                                  const Tensor& context_lens, double scale) {
  STD_TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, H, D] and caches [N, bs, KV, D]");
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float, "q must be float32");
  STD_TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                      k_cache.sizes() == v_cache.sizes(),
                  "k_cache and v_cache must match in shape and dtype");
  STD_TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
                  "head dims differ, or query heads are not a multiple of kv heads");
  STD_TORCH_CHECK(block_tables.scalar_type() == ScalarType::Long &&
                      context_lens.scalar_type() == ScalarType::Long,
                  "block_tables and context_lens must be int64");
  STD_TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
                  "one block table and one context length per query");
  STD_TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                      block_tables.is_contiguous() && context_lens.is_contiguous(),
                  "inputs must be contiguous");
  // What the loops will read, checked first: a context within its block table, and blocks
  // within the cache.
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), width = block_tables.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {
    STD_TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block_size, "context length ", lens[b],
                    " of sequence ", b, " is not in [1, ", width * block_size,
                    "], what its block table holds");
    for (int64_t i = 0; i * block_size < lens[b]; ++i)
      STD_TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < k_cache.size(0),
                      "block ", tables[b * width + i], " of sequence ", b,
                      " is not in the cache's ", k_cache.size(0), " blocks");
  }
  Tensor out = empty_float({q.size(0), q.size(1), q.size(2)});
  switch (k_cache.scalar_type()) {
    case ScalarType::Float:
      run<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case ScalarType::BFloat16:
      run<BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out,
                                      scale);
      break;
    case ScalarType::Half:
      run<Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    default:
      STD_TORCH_CHECK(false, "the cache must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace tierserve::attention

STABLE_TORCH_LIBRARY(tierserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", TORCH_BOX(&tierserve::attention::paged_decode_attention));
}
