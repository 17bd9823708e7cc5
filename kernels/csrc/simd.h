// The float vector of the capability the ops are built for (CPU_CAPABILITY: AVX512, AVX2,
// else DEFAULT, what `kernels/cpu_extension.py` defines), and the few operations the ops take
// of it, shared by every op.
//
// A vector is the capability's own register type (GCC's vector extension under the
// intrinsics' types), so `+ - * /` and comparisons are the compiler's, and only the rest is
// written per capability: loads, fused multiply-adds, lane sums, widening loads.
// DEFAULT is the same extension at eight lanes (ATen's portable width), its lane operations
// left to the compiler. These few lines replace ATen's vector headers, whose compilation took
// most of the ops' build time.

#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tierserve {

using BFloat16 = torch::headeronly::BFloat16;
using Half = torch::headeronly::Half;

#if defined(CPU_CAPABILITY_AVX512)
using Vec = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using Vec = __m256;
#else
using Vec = float __attribute__((vector_size(32)));
#endif
using Ints = int32_t __attribute__((vector_size(sizeof(Vec))));
constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);

#if defined(CPU_CAPABILITY_AVX512)
// The intrinsic, which a scalar in memory turns into one broadcast load; `Vec{} + s` added it
// to zero first, an extra instruction in the innermost loops.
inline Vec broadcast(float s) { return _mm512_set1_ps(s); }
inline Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#elif defined(CPU_CAPABILITY_AVX2)
inline Vec broadcast(float s) { return _mm256_set1_ps(s); }
inline Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void storeu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#else
inline Vec broadcast(float s) { return Vec{} + s; }
inline Vec loadu(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storeu(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
#endif

// a * b + c, rounded once.
inline Vec fmadd(Vec a, Vec b, Vec c) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_fmadd_ps(a, b, c);
#else
  Vec out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return out;
#endif
}

// The sum of a vector's lanes, by halves: (v0 + v4) + (v2 + v6) + ... on eight lanes.
inline float lane_sum(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#elif defined(CPU_CAPABILITY_AVX2)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float lanes[kLanes];
  storeu(lanes, v);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
#endif
}

// e^x lane by lane, within one unit in the last place: x = n ln2 + r with n the nearest
// integer (adding 1.5 * 2^23 rounds away the fraction) and |r| <= ln2 / 2 (ln2 in two parts,
// so r is exact), e^r by a minimax polynomial of degree 6, times 2^n built in the exponent
// bits. Inputs are clamped to [-87.3, 88.3], where 2^n is a normal float: beyond, e^x is
// about 1e-38 or 2e38 (SiLU's g / (1 + e^-g) then still goes to 0 for a very negative g).
inline Vec exp(Vec x) {
  x = x < -87.3f ? broadcast(-87.3f) : x;
  x = x > 88.3f ? broadcast(88.3f) : x;
  const Vec round = broadcast(12582912.0f);
  const Vec n = (x * 1.44269504f + round) - round;
  const Vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = broadcast(1.9875691500e-4f);
  p = fmadd(p, r, broadcast(1.3981999507e-3f));
  p = fmadd(p, r, broadcast(8.3334519073e-3f));
  p = fmadd(p, r, broadcast(4.1665795894e-2f));
  p = fmadd(p, r, broadcast(1.6666665459e-1f));
  p = fmadd(p, r, broadcast(5.0000001201e-1f));
  const Vec e = fmadd(p, r * r, r) + 1.0f;
  const Ints scale = (__builtin_convertvector(n, Ints) + 127) << 23;
  return e * __builtin_bit_cast(Vec, scale);
}

// kLanes weights of bf16 or fp16 widened to fp32, exactly. A bf16 is an fp32's high half.
inline Vec widen(const BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  Vec out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

inline Vec widen(const Half* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  Vec out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

inline Vec widen(const float* p) { return loadu(p); }

// Pairs of bf16 multiplied into fp32 sums, where the CPU has the instruction (`vdpbf16ps`,
// AVX512_BF16, which `-march=native` names): each lane of the sum takes the exact products
// of its two bf16 pairs, 2 * kLanes products an instruction and nothing widened, where an fp32
// product of bf16 values widens them first and multiplies kLanes at a time. Input and output
// denormals are flushed to zero (as oneDNN's bf16 products do); no value a model holds is one.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define TIERSERVE_BF16_PAIRS 1
using Pairs = __m512bh;
constexpr int64_t kPairLanes = 32;
inline Pairs load_pairs(const BFloat16* p) {
  return reinterpret_cast<Pairs>(_mm512_loadu_si512(p));
}
inline Vec dot_pairs(Vec sum, Pairs x, Pairs w) { return _mm512_dpbf16_ps(sum, x, w); }
// kLanes sums rounded to bf16 (to nearest, ties to even, as torch rounds).
inline void store_rounded(BFloat16* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#else
#define TIERSERVE_BF16_PAIRS 0
#endif

}  // namespace tierserve
