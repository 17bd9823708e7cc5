// Dense weights (fp32, or bf16 held narrower and widened in registers) times fp32 activations
// on a CPU, for the projections and experts of compiled decode steps: each weight is read
// once a step for all its rows (row_products.h), where a fused reduction per row reads it once
// a row. A bf16 weight is widened exactly (its 16 bits are an fp32's high half), so results
// differ from an fp32 product of the widened weight only in the order of the sums.
//
// The ops, in the library `tierserve_dense`:
//   linear(x [M, K] f32, weight [N, K] f32 or bf16) -> [M, N] f32: x @ W.t();
//   moe(x [T, H] f32, topk_weights [T, k] f32, topk_ids [T, k] i64, gate_up [E, 2I, H],
//       down [E, H, I], both f32 or both bf16)
//     -> [T, H] f32: sum_k topk_weights[t, k] * down_e(silu(gate_e x) * up_e x),
//        e = topk_ids[t, k].
//
// - AVX-512 / AVX2: a bf16 vector is widened by zero-extending its 16-bit lanes and shifting
//   them into the high half;
// - elsewhere (ATen's DEFAULT capability): the same, lane by lane through a buffer.

#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "row_products.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using tierserve::kLanes;
using tierserve::Vec;

// One weight row of fp32.
struct FloatRow {
  const float* w;
  int64_t K;
  float row_scale;

  Vec load(int64_t k) const { return Vec::loadu(w + k); }
  float at(int64_t k) const { return w[k]; }
  void prefetch(int64_t k, int64_t ahead) const {
    if (k % 16 == 0) __builtin_prefetch(w + ahead * K + k);
  }
};

// bf16 bits to the fp32 value they are the high half of.
inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &word, sizeof v);
  return v;
}

// One weight row of bf16, widened a vector at a time.
struct BFloat16Row {
  const uint16_t* w;
  int64_t K;
  float row_scale;

  void prefetch(int64_t k, int64_t ahead) const {
    if (k % 32 == 0) __builtin_prefetch(w + ahead * K + k);
  }

  Vec load(int64_t k) const {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
    alignas(64) float v[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) v[i] = at(k + i);
    return Vec::loadu(v);
#endif
  }
  float at(int64_t k) const { return widen(w[k]); }
};

// A dense matrix [groups, N, K], row-major, of fp32 (T = float) or bf16 bits (T = uint16_t).
template <class T, class R, c10::ScalarType kType>
struct DenseMatrix {
  using Row = R;
  static constexpr c10::ScalarType type = kType;
  const T* w;
  int64_t N, K;

  Row row(int64_t g, int64_t n) const { return {w + (g * N + n) * K, K, 1.0f}; }
};

using FloatMatrix = DenseMatrix<float, FloatRow, at::kFloat>;
using BFloat16Matrix = DenseMatrix<uint16_t, BFloat16Row, at::kBFloat16>;

// Checks a weight against [groups, N, K] of Matrix's dtype and returns it as a Matrix.
template <class Matrix>
Matrix matrix(const at::Tensor& w, int64_t groups, const char* name) {
  TORCH_CHECK(w.scalar_type() == Matrix::type, name, " must be ", Matrix::type, " like the ",
              "other weight, not ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous() && w.dim() >= 2 && w.numel() > 0, name,
              " must be a contiguous, non-empty [..., N, K]");
  const int64_t N = w.size(-2), K = w.size(-1);
  TORCH_CHECK(w.numel() == groups * N * K, name, " ", w.sizes(), " is not ", groups,
              " matrices");
  return {static_cast<const decltype(Matrix::w)>(w.data_ptr()), N, K};
}

void check_dtype(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, not ", w.scalar_type());
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  check_dtype(weight, "weight");
  if (weight.scalar_type() == at::kFloat)
    return tierserve::linear_product(x, matrix<FloatMatrix>(weight, 1, "weight"));
  return tierserve::linear_product(x, matrix<BFloat16Matrix>(weight, 1, "weight"));
}

at::Tensor moe(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
               const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "experts must be [E, N, K]");
  check_dtype(gate_up, "gate_up");
  const int64_t E = gate_up.size(0);
  if (gate_up.scalar_type() == at::kFloat)
    return tierserve::expert_product(x, topk_weights, topk_ids,
                                     matrix<FloatMatrix>(gate_up, E, "gate_up"),
                                     matrix<FloatMatrix>(down, E, "down"), E);
  return tierserve::expert_product(x, topk_weights, topk_ids,
                                   matrix<BFloat16Matrix>(gate_up, E, "gate_up"),
                                   matrix<BFloat16Matrix>(down, E, "down"), E);
}

}  // namespace

TORCH_LIBRARY(tierserve_dense, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def(
      "moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor gate_up, Tensor down) -> "
      "Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear);
  m.impl("moe", c10::DispatchKey::CPU, &moe);
}
