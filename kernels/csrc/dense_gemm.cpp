// Dense weights (fp32, or bf16 held narrower) times fp32 or bf16 activations on a CPU, for
// the projections and experts of compiled decode steps: each weight is read once a step for
// all its rows (row_products.h), where a fused reduction per row reads it once a row. bf16
// weights meet bf16 activations as bf16 pairs where the CPU multiplies them (simd.h), and are
// otherwise widened exactly in registers (their 16 bits are an fp32's high half); either way
// the products are exact and results differ from an fp32 product of the widened values only
// in the order of the sums (and, for bf16 pairs, the experts' inner activations rounded to
// bf16, as a bf16 model rounds them).
//
// The ops, in the library `tierserve_dense`:
//   linear(x [M, K] f32 or bf16, weight [N, K] f32 or bf16) -> [M, N] f32: x @ W.t();
//   moe(x [T, H] f32 or bf16, topk_weights [T, k] f32, topk_ids [T, k] i64, gate_up [E, 2I, H],
//       down [E, H, I], both f32 or both bf16)
//     -> [T, H] f32: sum_k topk_weights[t, k] * down_e(silu(gate_e x) * up_e x),
//        e = topk_ids[t, k];
//   bf16_pairs() -> bool: whether bf16 activations meet bf16 weights as bf16 pairs here.

#include <torch/csrc/stable/library.h>

#include <cstdint>

#include "row_products.h"

namespace tierserve::dense {

// One weight row of fp32.
struct FloatRow {
  static constexpr bool kDecodes = false, kReadsPairs = false;
  const float* w;
  int64_t K;
  float row_scale;

  Vec load(int64_t k) const { return loadu(w + k); }
  float at(int64_t k) const { return w[k]; }
  void prefetch(int64_t k, int64_t ahead) const {
    if (k % 16 == 0) __builtin_prefetch(w + ahead * K + k);
  }
};

// One weight row of bf16, widened a vector at a time.
struct BFloat16Row {
  static constexpr bool kDecodes = false, kReadsPairs = true;
  const BFloat16* w;
  int64_t K;
  float row_scale;

  void prefetch(int64_t k, int64_t ahead) const {
    if (k % 32 == 0) __builtin_prefetch(w + ahead * K + k);
  }

  Vec load(int64_t k) const { return widen(w + k); }
#if TIERSERVE_BF16_PAIRS
  Pairs load_pairs(int64_t k) const { return tierserve::load_pairs(w + k); }
#endif
  float at(int64_t k) const { return static_cast<float>(w[k]); }
};

// A dense matrix [groups, N, K], row-major, of fp32 (T = float) or bf16 (T = BFloat16).
template <class T, class R, ScalarType kType>
struct DenseMatrix {
  using Row = R;
  static constexpr ScalarType type = kType;
  const T* w;
  int64_t N, K;

  Row row(int64_t g, int64_t n) const { return {w + (g * N + n) * K, K, 1.0f}; }
};

using FloatMatrix = DenseMatrix<float, FloatRow, ScalarType::Float>;
using BFloat16Matrix = DenseMatrix<BFloat16, BFloat16Row, ScalarType::BFloat16>;

// Checks a weight against [groups, N, K] of Matrix's dtype and returns it as a Matrix.
template <class Matrix>
Matrix matrix(const Tensor& w, int64_t groups, const char* name) {
  STD_TORCH_CHECK(w.scalar_type() == Matrix::type, name, " must be ", Matrix::type, " like the ",
                  "other weight, not ", w.scalar_type());
  STD_TORCH_CHECK(w.is_contiguous() && w.dim() >= 2 && w.numel() > 0, name,
                  " must be a contiguous, non-empty [..., N, K]");
  const int64_t N = w.size(-2), K = w.size(-1);
  STD_TORCH_CHECK(w.numel() == groups * N * K, name, " ", shape(w), " is not ", groups,
                  " matrices");
  return {static_cast<const decltype(Matrix::w)>(w.const_data_ptr()), N, K};
}

void check_dtype(const Tensor& w, const char* name) {
  STD_TORCH_CHECK(
      w.scalar_type() == ScalarType::Float || w.scalar_type() == ScalarType::BFloat16, name,
      " must be float32 or bfloat16, not ", w.scalar_type());
}

Tensor linear(const Tensor& x, const Tensor& weight) {
  STD_TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  check_dtype(weight, "weight");
  if (weight.scalar_type() == ScalarType::Float)
    return tierserve::linear_product(x, matrix<FloatMatrix>(weight, 1, "weight"));
  return tierserve::linear_product(x, matrix<BFloat16Matrix>(weight, 1, "weight"));
}

Tensor moe(const Tensor& x, const Tensor& topk_weights, const Tensor& topk_ids,
               const Tensor& gate_up, const Tensor& down) {
  STD_TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "experts must be [E, N, K]");
  check_dtype(gate_up, "gate_up");
  const int64_t E = gate_up.size(0);
  if (gate_up.scalar_type() == ScalarType::Float)
    return tierserve::expert_product(x, topk_weights, topk_ids,
                                     matrix<FloatMatrix>(gate_up, E, "gate_up"),
                                     matrix<FloatMatrix>(down, E, "down"), E);
  return tierserve::expert_product(x, topk_weights, topk_ids,
                                   matrix<BFloat16Matrix>(gate_up, E, "gate_up"),
                                   matrix<BFloat16Matrix>(down, E, "down"), E);
}

bool bf16_pairs() { return TIERSERVE_BF16_PAIRS; }

}  // namespace tierserve::dense

STABLE_TORCH_LIBRARY(tierserve_dense, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def(
      "moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor gate_up, Tensor down) -> "
      "Tensor");
  m.def("bf16_pairs() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(tierserve_dense, CPU, m) {
  m.impl("linear", TORCH_BOX(&tierserve::dense::linear));
  m.impl("moe", TORCH_BOX(&tierserve::dense::moe));
}

// No tensor to dispatch on: registered for every backend.
STABLE_TORCH_LIBRARY_IMPL(tierserve_dense, CompositeExplicitAutograd, m) {
  m.impl("bf16_pairs", TORCH_BOX(&tierserve::dense::bf16_pairs));
}
