// Paged decode attention on a CPU: one query token per sequence, keys and values read where
// they lie in the block-paged cache, with no gathered copy.
//
// The op `tierserve_cpu::paged_decode_attention` takes
//   q [B, H, D] float32, k_cache and v_cache [num_blocks, block_size, KV, D] (float32,
//   bfloat16 or float16), block_tables [B, W] int64, context_lens [B] int64, scale
// and returns [B, H, D] float32. Sequences run in parallel on torch's threads.
//
// Per sequence, keys are read a cache block at a time, each head's dot products over the
// block's rows (a block comes from memory for the first head, from the L1 cache for the
// others), into fp32 scores; then the softmax's exponentials per head, the weighted sum of
// the values read the same way, and the division by the exponentials' sum (SDPA's order of
// operations). Sequences whose block tables share leading blocks (the n samples of one
// prompt) run one after another on a thread, so the shared blocks come from the cache the
// first one warmed: reading them once for the group instead measured no faster.
//
// The arithmetic is simd.h's vectors, compiled for the capability PyTorch picks on this machine
// (`kernels/cpu_extension.py` defines CPU_CAPABILITY): a dot product sums its vector's lanes
// by halves, and the exponentials are vectorized too. The compiler's own vectorization of the
// plain loops ran this op 1.6x slower (it summed lanes one after another and left the
// exponentials scalar). The head dimension is a template constant for the common
// sizes, so a query and a head's weighted sum stay in registers across a block's rows.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "tensors.h"

namespace tierserve::attention {

// The vectors a head takes when its dimension is known at compile time and fills whole
// vectors, 0 otherwise: a query or a weighted sum then lives in registers.
template <int64_t kHeadDim>
constexpr int64_t kRegisterVecs =
    kHeadDim > 0 && kHeadDim % kLanes == 0 ? kHeadDim / kLanes : 0;

template <int64_t N>
inline void load(Vec (&v)[N], const float* p) {
  for (int64_t i = 0; i < N; ++i) v[i] = loadu(p + i * kLanes);
}

// out[j] = scale * q . k_j for n rows k_j = k + j * stride. With the head dimension known at
// compile time q stays in registers; each dot product sums D / lanes vectors, then its lanes.
template <int64_t kHeadDim, typename cache_t>
inline void dot_rows(float* out, const float* q, const cache_t* k, int64_t stride, int64_t n,
                     int64_t D, float scale) {
  if constexpr (constexpr int64_t N = kRegisterVecs<kHeadDim>; N > 0) {
    Vec qv[N];
    load(qv, q);
    for (int64_t j = 0; j < n; ++j, k += stride) {
      Vec acc{};
      for (int64_t i = 0; i < N; ++i) acc = fmadd(qv[i], widen(k + i * kLanes), acc);
      out[j] = lane_sum(acc) * scale;
    }
  } else {
    for (int64_t j = 0; j < n; ++j, k += stride) {
      Vec acc{};
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) acc = fmadd(loadu(q + d), widen(k + d), acc);
      float sum = lane_sum(acc);
      for (; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
      out[j] = sum * scale;
    }
  }
}

// a += sum_j p[j] * v_j for n rows v_j = v + j * stride, in row order. With the head dimension
// known at compile time the sum stays in registers across the rows.
template <int64_t kHeadDim, typename cache_t>
inline void add_weighted_rows(float* a, const float* p, const cache_t* v, int64_t stride,
                              int64_t n, int64_t D) {
  if constexpr (constexpr int64_t N = kRegisterVecs<kHeadDim>; N > 0) {
    Vec acc[N];
    load(acc, a);
    for (int64_t j = 0; j < n; ++j, v += stride) {
      const Vec pj = broadcast(p[j]);
      for (int64_t i = 0; i < N; ++i) acc[i] = fmadd(pj, widen(v + i * kLanes), acc[i]);
    }
    for (int64_t i = 0; i < N; ++i) storeu(a + i * kLanes, acc[i]);
  } else {
    for (int64_t j = 0; j < n; ++j, v += stride) {
      const Vec pj = broadcast(p[j]);
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) storeu(a + d, fmadd(pj, widen(v + d), loadu(a + d)));
      for (; d < D; ++d) a[d] += p[j] * static_cast<float>(v[d]);
    }
  }
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
// the run starts at token t, `rows` its n tokens' cached values, `row_size` a token (every kv
// head), walked block by block through the sequence's block table.
//
// While f reads a block, the next one is fetched into the L2 cache. The blocks lie anywhere
// in the cache, and hardware prefetchers stop at 4 KiB page boundaries, so without this a long
// context's read waits on memory every few rows: at 380 keys (the rollouts' 64 sequences)
// the op ran 1.4x faster with it. Into L1 instead (prefetcht0) it measured no faster: the
// fetches then compete with the rows being read.
template <typename cache_t, typename F>
inline void for_each_block(const cache_t* cache, const int64_t* table, int64_t len,
                           int64_t block_size, int64_t row_size, F&& f) {
  const int64_t block_bytes = block_size * row_size * sizeof(cache_t);
  for (int64_t start = 0, i = 0; start < len; start += block_size, ++i) {
    if (start + block_size < len) {
      const auto* next =
          reinterpret_cast<const char*>(cache + table[i + 1] * block_size * row_size);
      for (int64_t b = 0; b < block_bytes; b += 64) __builtin_prefetch(next + b, 0, 2);  // L2
    }
    f(start, cache + table[i] * block_size * row_size, std::min(block_size, len - start));
  }
}

// kHeadDim > 0 fixes the head dimension at compile time; 0 reads it at run time.
template <typename cache_t, int64_t kHeadDim>
void decode_attention(const float* q, const cache_t* k_cache, const cache_t* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens, float* out,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t table_width, float scale) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * D;  // one token's keys (or values), every kv head
  torch::stable::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inverse_totals(heads);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = context_lens[b];
      const int64_t* table = block_tables + b * table_width;
      const float* qb = q + b * heads * D;
      float* o = out + b * heads * D;
      scores.resize(heads * len);
      // A block's rows come from memory for its first head, from the L1 cache for the others.
      for_each_block(k_cache, table, len, block_size, row, [&](int64_t t, auto keys, int64_t n) {
        for (int64_t h = 0; h < heads; ++h)
          dot_rows<kHeadDim>(scores.data() + h * len + t, qb + h * D, keys + (h / group) * D, row,
                             n, D, scale);
      });
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * len;
        const float top = *std::max_element(s, s + len);
        inverse_totals[h] = 1.0f / exponentials(s, len, top);
        // The weights in the cache's dtype, as SDPA's flash kernel rounds them for its
        // half-precision product: a bf16 engine then rounds as transformers does in bf16.
        if constexpr (!std::is_same_v<cache_t, float>) {
          for (int64_t t = 0; t < len; ++t) s[t] = static_cast<float>(static_cast<cache_t>(s[t]));
        }
      }
      std::fill_n(o, heads * D, 0.0f);
      for_each_block(v_cache, table, len, block_size, row, [&](int64_t t, auto values, int64_t n) {
        for (int64_t h = 0; h < heads; ++h)
          add_weighted_rows<kHeadDim>(o + h * D, scores.data() + h * len + t,
                                      values + (h / group) * D, row, n, D);
      });
      // The division by the exponentials' sum comes last, as SDPA's does.
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inverse_totals[h];
    }
  });
}

template <typename cache_t>
void dispatch_head_dim(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& context_lens,
                       Tensor& out, double scale) {
  const int64_t D = q.size(2);
  auto run = [&](auto kernel) {
    kernel(q.const_data_ptr<float>(), static_cast<const cache_t*>(k_cache.const_data_ptr()),
           static_cast<const cache_t*>(v_cache.const_data_ptr()),
           block_tables.const_data_ptr<int64_t>(), context_lens.const_data_ptr<int64_t>(),
           out.mutable_data_ptr<float>(), q.size(0), q.size(1), k_cache.size(2), D, k_cache.size(1),
           block_tables.size(1), static_cast<float>(scale));
  };
  switch (D) {
    case 64: return run(decode_attention<cache_t, 64>);
    case 128: return run(decode_attention<cache_t, 128>);
    default: return run(decode_attention<cache_t, 0>);
  }
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
      dispatch_head_dim<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case ScalarType::BFloat16:
      dispatch_head_dim<BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out,
                                      scale);
      break;
    case ScalarType::Half:
      dispatch_head_dim<Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
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
