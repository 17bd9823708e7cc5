// Products of a few activation rows (a decode step's 1-32 tokens) with weight matrices read
// once for all rows, shared by the FP4 ops (fp4_gemm.cpp) and the dense ones (dense_gemm.cpp).
//
// A step of a few rows is bound by reading the weights, not by arithmetic: a product that
// streams the weights once per row (what a fused reduction over each row does) costs nearly
// rows times one row's. Here each vector of a weight row, once loaded (and decoded, for FP4),
// goes into the sums of every activation row of a tile before the next is read, so the
// weights come from memory once a step whatever the rows, and only the activations (a few
// KB, in L1) are read again.
//
// What a weight is, is a `Matrix` type: a [groups, N, K] array (one group for a linear
// layer, one per expert) whose `row(g, n)` is a reader of one weight row with
//   Vec load(k): the weights k .. k + kLanes as fp32 (k a multiple of kLanes),
//   float at(k): weight k, for the tail of a row that is not whole vectors,
//   void prefetch(k, ahead): asks for the weights at k of the row `ahead` rows further,
//   float row_scale: a factor of the row's sums (NVFP4's tensor scale, else 1),
//   static bool kDecodes: whether `load` decodes (FP4): it keeps a block's table as state,
//     and decoding, not reading, bounds the product,
//   static bool kReadsPairs, and where it is true and the CPU multiplies bf16 pairs
//     (simd.h's TIERSERVE_BF16_PAIRS), Pairs load_pairs(k): the weights k .. k + kPairLanes
//     as bf16, exactly (k a multiple of kPairLanes),
// and the products, the experts' grouping and their element-wise steps are written once.
//
// Activations are fp32 or bf16 (`X`). bf16 activations meet rows that read pairs as bf16
// pairs (`Step<BFloat16>`), twice the weights an instruction, nothing widened; elsewhere they
// are widened to fp32 first (`with_activations`).

#pragma once

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "tensors.h"

namespace tierserve {

// Activation rows that share one load of a weight vector.
constexpr int64_t kMaxTile = 6;
// Weight rows a work item takes: enough work to be worth a thread's turn.
constexpr int64_t kRowGroup = 4;

// How a tile keeps its fused multiply-adds from waiting on one another: each activation
// vector, once loaded, goes into the sums of W weight rows, and each sum is kChains<W> chains
// (over alternate vectors of the row). A decoding row on AVX-512 (32 registers): four rows
// side by side, one chain each (with kMaxTile rows, 24 sums), which shares each activation
// vector's load among more of the decoding's work; every other row: one weight row, two
// chains (four weight rows of dense rows ran the engine a third slower at 4 and 16 streams,
// `loadtests/bench_engine.py`, though each op alone ran no slower).
template <class Row>
constexpr int64_t kWeightTile = kLanes == 16 && Row::kDecodes ? 4 : 1;
template <int64_t W>
constexpr int64_t kChains = W == 1 ? 2 : 1;

// How a tile steps through a row for activations of type X: the weights a step takes, the
// activation and weight vectors of a step, and how they go into a sum.
template <class X>
struct Step;

template <>
struct Step<float> {
  static constexpr int64_t kWidth = kLanes;
  static Vec x(const float* p) { return loadu(p); }
  template <class Row>
  static Vec w(Row& row, int64_t k) {
    return row.load(k);
  }
  static Vec madd(Vec sum, Vec x, Vec w) { return fmadd(x, w, sum); }
};

#if TIERSERVE_BF16_PAIRS
template <>
struct Step<BFloat16> {
  static constexpr int64_t kWidth = kPairLanes;
  static Pairs x(const BFloat16* p) { return load_pairs(p); }
  template <class Row>
  static Pairs w(Row& row, int64_t k) {
    return row.load_pairs(k);
  }
  static Vec madd(Vec sum, Pairs x, Pairs w) { return dot_pairs(sum, x, w); }
};
#endif

// Whether bf16 activations meet a matrix's rows as bf16 pairs.
template <class Matrix>
constexpr bool kPairs = TIERSERVE_BF16_PAIRS && Matrix::Row::kReadsPairs;

// The N vectors of each weight row from k into chains 0 .. N - 1 of every sum: all N
// loaded first, then each activation vector into its sums. N a constant, so the sums stay
// in registers.
template <int64_t N, int64_t R, int64_t W, class X, class Row>
[[gnu::always_inline]] inline void chain_step(const X* x, int64_t ldx, Row* w, int64_t k,
                                              Vec (&sums)[R][W][kChains<W>]) {
  using S = Step<X>;
  decltype(S::w(w[0], k)) v[N][W];
  for (int64_t c = 0; c < N; ++c)
    for (int64_t j = 0; j < W; ++j) {
      w[j].prefetch(k + c * S::kWidth, kRowGroup);  // the rows the next work item reads
      v[c][j] = S::w(w[j], k + c * S::kWidth);
    }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < N; ++c) {
      const auto xv = S::x(x + r * ldx + k + c * S::kWidth);
      for (int64_t j = 0; j < W; ++j) sums[r][j][c] = S::madd(sums[r][j][c], xv, v[c][j]);
    }
}

// y[r * ldy + j] = row_scale_j * x_r . w_j for R activation rows x_r = x + r * ldx and W
// weight rows w_j. Each row is read front to back, as memory lies (rows read side by side, a
// few KB each, are streams too short for the hardware to prefetch, and ran at about half the
// bandwidth), and each weight vector goes into every activation row's sums. Every sum is
// summed in one order (its chains over the row's vectors, the chains added, their lanes,
// then the tail) in every tile, so a row's result does not depend on the rows beside it (a
// batch gives each sequence what it gets alone).
template <int64_t R, int64_t W, class X, class Row>
[[gnu::always_inline]] inline void dot_tile_of(const X* x, int64_t ldx, Row* w, int64_t K,
                                               float* y, int64_t ldy) {
  constexpr int64_t C = kChains<W>, width = Step<X>::kWidth;
  Vec sums[R][W][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < W; ++j)
      for (int64_t c = 0; c < C; ++c) sums[r][j][c] = Vec{};
  const int64_t whole = K - K % width;
  int64_t k = 0;
  for (; k + C * width <= whole; k += C * width) chain_step<C>(x, ldx, w, k, sums);
  if constexpr (C == 2)
    if (k < whole) chain_step<1>(x, ldx, w, k, sums);  // one vector left over
  // The tail of a row that is not whole vectors, lane by lane.
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < W; ++j) {
      Vec total = sums[r][j][0];
      for (int64_t c = 1; c < C; ++c) total = total + sums[r][j][c];
      float sum = lane_sum(total);
      for (int64_t i = whole; i < K; ++i) sum += static_cast<float>(x[r * ldx + i]) * w[j].at(i);
      y[r * ldy + j] = sum * w[j].row_scale;
    }
}

// A decoding reader (an FP4 row, its block table as state) is copied into the tile, where
// its state stays in registers; a dense one is read where it lies (copies of the dense rows
// measured slower). The tile's steps are inlined by force: left to itself, GCC called them,
// and an FP4 row's table went to memory at every block.
template <int64_t R, int64_t W, class X, class Row>
inline void dot_tile(const X* x, int64_t ldx, const Row* rows, int64_t K, float* y,
                     int64_t ldy) {
  if constexpr (Row::kDecodes) {
    Row copies[W];
    for (int64_t j = 0; j < W; ++j) copies[j] = rows[j];
    dot_tile_of<R, W>(x, ldx, copies, K, y, ldy);
  } else {
    dot_tile_of<R, W>(x, ldx, const_cast<Row*>(rows), K, y, ldy);
  }
}

// The tiles of R activation rows against W weight rows: up to kMaxTile rows a tile.
template <int64_t W, class X, class Row>
void dot_weight_tile(const X* x, int64_t ldx, int64_t rows, const Row* w, int64_t K, float* y,
                     int64_t ldy) {
  int64_t r = 0;
  for (; r + kMaxTile <= rows; r += kMaxTile)
    dot_tile<kMaxTile, W>(x + r * ldx, ldx, w, K, y + r * ldy, ldy);
  const X* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: dot_tile<1, W>(xr, ldx, w, K, yr, ldy); break;
    case 2: dot_tile<2, W>(xr, ldx, w, K, yr, ldy); break;
    case 3: dot_tile<3, W>(xr, ldx, w, K, yr, ldy); break;
    case 4: dot_tile<4, W>(xr, ldx, w, K, yr, ldy); break;
    case 5: dot_tile<5, W>(xr, ldx, w, K, yr, ldy); break;
    default: break;
  }
}

// y[r * ldy + j] for `rows` rows of x (stride ldx) against n weight rows w_j, kWeightTile
// weight rows at a time (the last few one by one), in tiles of up to kMaxTile activation
// rows: the weight rows are read from memory once and from L1 by the following tiles.
template <class X, class Row>
void dot_rows(const X* x, int64_t ldx, int64_t rows, const Row* w, int64_t n, int64_t K,
              float* y, int64_t ldy) {
  int64_t j = 0;
  constexpr int64_t W = kWeightTile<Row>;
  for (; j + W <= n; j += W) dot_weight_tile<W>(x, ldx, rows, w + j, K, y + j, ldy);
  for (; j < n; ++j) dot_weight_tile<1>(x, ldx, rows, w + j, K, y + j, ldy);
}

// A group's rows of activations: rows [begin, begin + count) of x against matrix group g.
struct Segment {
  int64_t group, begin, count;
};

// out[s.begin + r, n] = x[s.begin + r] . W[s.group, n] for every segment, the segments' groups
// of kRowGroup output rows split over the threads.
template <class Matrix, class X>
void segmented_product(const X* x, const Matrix& m, const std::vector<Segment>& segments,
                       float* out) {
  const int64_t groups = (m.N + kRowGroup - 1) / kRowGroup;
  const int64_t total = static_cast<int64_t>(segments.size()) * groups;
  torch::stable::parallel_for(0, total, 4, [&](int64_t begin, int64_t end) {
    typename Matrix::Row w[kRowGroup];
    for (int64_t i = begin; i < end; ++i) {
      const Segment& s = segments[i / groups];
      const int64_t n0 = (i % groups) * kRowGroup, n = std::min(kRowGroup, m.N - n0);
      for (int64_t j = 0; j < n; ++j) w[j] = m.row(s.group, n0 + j);
      dot_rows(x + s.begin * m.K, m.K, s.count, w, n, m.K, out + s.begin * m.N + n0, m.N);
    }
  });
}

inline void check_activations(const Tensor& x, int64_t K) {
  STD_TORCH_CHECK(x.dim() == 2 &&
                      (x.scalar_type() == ScalarType::Float ||
                       x.scalar_type() == ScalarType::BFloat16) &&
                      x.is_contiguous(),
                  "x must be contiguous float32 or bfloat16 [rows, K]");
  STD_TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

// f(the activations as the products read them): fp32 as they are; bf16 as they are where they
// meet Matrix's rows as pairs, else widened to fp32 (exactly).
template <class Matrix, class F>
auto with_activations(const Tensor& x, F&& f) {
  if (x.scalar_type() == ScalarType::Float) return f(x.const_data_ptr<float>());
  const BFloat16* b = static_cast<const BFloat16*>(x.const_data_ptr());
  if constexpr (kPairs<Matrix>) {
    return f(b);
  } else {
    std::vector<float> wide(b, b + x.numel());
    return f(static_cast<const float*>(wide.data()));
  }
}

// x [M, K] @ W.t() for a one-group matrix W [N, K].
template <class Matrix>
Tensor linear_product(const Tensor& x, const Matrix& m) {
  check_activations(x, m.K);
  Tensor out = empty_float({x.size(0), m.N});
  if (x.size(0) > 0)
    with_activations<Matrix>(x, [&](const auto* xp) {
      segmented_product(xp, m, {{0, 0, x.size(0)}}, out.mutable_data_ptr<float>());
    });
  return out;
}

// The grain of the element-wise steps: rows that run on one thread. A decode step's 1-64 slots
// then take no parallel region for them, only the products do.
constexpr int64_t kRowGrain = 64;

inline void store(float* p, Vec v) { storeu(p, v); }
#if TIERSERVE_BF16_PAIRS
inline void store(BFloat16* p, Vec v) { store_rounded(p, v); }
#endif

// silu(gate) * up of h [S, 2I] (gate columns first) into a [S, I], as torch's silu: g / (1 + e^-g).
// In the activations' type: bf16 activations' products give bf16 (as a bf16 model's do).
template <class X>
void silu_and_mul(const float* h, X* a, int64_t S, int64_t I) {
  torch::stable::parallel_for(0, S, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float* g = h + s * 2 * I;
      const float* u = g + I;
      X* o = a + s * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec gv = loadu(g + i);
        store(o + i, gv / (1.0f + exp(-gv)) * loadu(u + i));
      }
      for (; i < I; ++i) o[i] = static_cast<X>(g[i] / (1.0f + std::exp(-g[i])) * u[i]);
    }
  });
}

// sum_k topk_weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, k], for
// x [T, H] and experts gate_up [E, 2I, H], down [E, H, I]. Token slots are sorted by expert,
// each used expert's slots run as one tile loop over its weight rows (its weights read once
// a step), and the output rows of all used experts are split over torch's threads
// (`torch::stable::parallel_for`), gate/up first, then down.
template <class Matrix>
Tensor expert_product(const Tensor& x, const Tensor& topk_weights,
                          const Tensor& topk_ids, const Matrix& gate_up, const Matrix& down,
                          int64_t E) {
  const int64_t H = gate_up.K, I = down.K;
  STD_TORCH_CHECK(gate_up.N == 2 * I && down.N == H, "gate_up [", E, ", ", gate_up.N, ", ", H,
                  "] and down [", E, ", ", down.N, ", ", I, "] are not the experts of one layer");
  check_activations(x, H);
  const int64_t T = x.size(0);
  STD_TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                      topk_ids.scalar_type() == ScalarType::Long && topk_ids.is_contiguous(),
                  "topk_ids must be contiguous int64 [T, k]");
  STD_TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() &&
                      topk_weights.scalar_type() == ScalarType::Float &&
                      topk_weights.is_contiguous(),
                  "topk_weights must be contiguous float32 shaped like topk_ids");
  const int64_t top_k = topk_ids.size(1), S = T * top_k;
  const int64_t* ids = topk_ids.const_data_ptr<int64_t>();
  // Slots sorted by expert (a counting sort, stable): sorted[p] is the slot at position p.
  std::vector<int64_t> starts(E + 1, 0), sorted(S), position(S);
  for (int64_t s = 0; s < S; ++s) {
    STD_TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "expert ", ids[s], " is not in the layer's ", E);
    ++starts[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  std::vector<Segment> segments;
  for (int64_t e = 0; e < E; ++e)
    if (starts[e + 1] > starts[e]) segments.push_back({e, starts[e], starts[e + 1] - starts[e]});
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t s = 0; s < S; ++s) {
      position[s] = next[ids[s]]++;
      sorted[position[s]] = s;
    }
  }
  std::vector<float> h(S * 2 * I), y(S * H);
  with_activations<Matrix>(x, [&](const auto* xp) {
    using X = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
    std::vector<X> xs(S * H), a(S * I);
    torch::stable::parallel_for(0, S, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        std::memcpy(&xs[p * H], xp + (sorted[p] / top_k) * H, H * sizeof(X));
    });
    segmented_product(xs.data(), gate_up, segments, h.data());
    silu_and_mul(h.data(), a.data(), S, I);
    segmented_product(static_cast<const X*>(a.data()), down, segments, y.data());
  });
  Tensor out = empty_float({T, H});
  float* o = out.mutable_data_ptr<float>();
  const float* w = topk_weights.const_data_ptr<float>();
  torch::stable::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* ot = o + t * H;
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t s = t * top_k + j;
        const float* ys = &y[position[s] * H];
        const Vec wv = broadcast(w[s]);
        int64_t i = 0;
        if (j == 0) {
          for (; i + kLanes <= H; i += kLanes) storeu(ot + i, loadu(ys + i) * wv);
          for (; i < H; ++i) ot[i] = ys[i] * w[s];
        } else {
          for (; i + kLanes <= H; i += kLanes)
            storeu(ot + i, fmadd(loadu(ys + i), wv, loadu(ot + i)));
          for (; i < H; ++i) ot[i] += ys[i] * w[s];
        }
      }
    }
  });
  return out;
}

}  // namespace tierserve
