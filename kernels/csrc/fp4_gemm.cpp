// FP4 weights (MXFP4, NVFP4) times fp32 or bf16 activations on a CPU, the weights read as they are
// stored: packed E2M1 codes, two a byte (element 2j in the low nibble), and one scale byte a
// block (MXFP4: an E8M0 exponent per 32; NVFP4: an FP8 E4M3 scale per 16, with an fp32 scale
// per output row). Nothing is widened in memory: each block's codes are decoded in registers
// inside the dot product, as ggml's quantized dot products do.
//
// The ops, in the library `tierserve_fp4`:
//   linear(x [M, K] f32 or bf16, format, packed [N, K/2] u8, scales [N, K/block] u8, row_scale [N]?)
//     -> [M, N] f32: x @ W.t();
//   moe(x [T, H] f32 or bf16, topk_weights [T, k] f32, topk_ids [T, k] i64, format,
//       gate_up packed/scales/row_scale [E, 2I, ...], down packed/scales/row_scale [E, H, ...])
//     -> [T, H] f32: sum_k topk_weights[t, k] * down_e(silu(gate_e x) * up_e x), e = topk_ids[t, k].
//
// A block's decoding: its scale byte becomes an fp32 value through a 256-entry table, the
// 16 E2M1 values times that scale become the block's lookup table in one register, and each
// vector of codes indexes that register (`vpermps`). An E2M1 value times an E8M0 or E4M3
// scale is exact in fp32, so the decoded weights are the dequantized weights exactly, and
// the products differ from `kernels/reference.py`'s fp32 products of dequantized weights only
// in the order of the sums. The decoded vector is multiplied into every activation row of a
// tile (up to 6 rows) before the next one is decoded.
//
// - AVX-512: 16 codes a vector, the 16-entry signed table in one zmm (`vpermps` reads 4 bits);
// - AVX2: 8 codes a vector, the 8 magnitudes in one ymm (`vpermps` reads 3 bits) and the
//   sign bit moved into place by the same xor that undoes the table's index bits;
// - elsewhere (the DEFAULT capability): a scalar lookup into a 16-float table per vector;
// - bf16 activations where the CPU multiplies bf16 pairs (simd.h): 32 codes a vector decoded
//   to bf16 (`decode_pairs`, exact too), the tables of one or two blocks in one zmm
//   (`vpermw` reads 5 bits), multiplied into the activations as pairs; the experts' inner
//   activations rounded to bf16, as a bf16 model rounds them.
// Sums and fused multiply-adds are simd.h's, as in paged_attention.cpp.
//
// The tile loops, the experts' grouping by expert and the threads are row_products.h's,
// shared with the dense ops (dense_gemm.cpp): here an FP4 row is one of its weight readers.

#include <torch/csrc/stable/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "row_products.h"

namespace tierserve::fp4 {

static_assert(16 % kLanes == 0, "a block of 16 must hold whole vectors");

alignas(64) constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// A format: its block and the fp32 value of each scale byte.
struct Format {
  int64_t block;
  std::array<float, 256> scale_of;
};

Format make_mxfp4() {
  Format f{32, {}};
  for (int b = 0; b < 256; ++b)  // E8M0: 2^(b - 127), 255 is NaN
    f.scale_of[b] = b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, b - 127);
  return f;
}

Format make_nvfp4() {
  Format f{16, {}};
  for (int b = 0; b < 256; ++b) {  // E4M3 (fn): bias 7, subnormals, S.1111.111 is NaN
    const int exponent = (b >> 3) & 15, mantissa = b & 7;
    float v = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                            : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    if ((b & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
    f.scale_of[b] = (b & 0x80) ? -v : v;
  }
  return f;
}

// The block names the format: 32 for MXFP4, 16 for NVFP4. An int, not the format's name, so
// the op's schema is one inductor's C++ wrapper calls through the stable ABI: a string argument
// makes it box the call through the dispatcher, and the wrapper of every graph with FP4
// weights then compiles ATen's dispatcher headers.
const Format& format_of(int64_t block) {
  static const Format mxfp4 = make_mxfp4(), nvfp4 = make_nvfp4();
  STD_TORCH_CHECK(block == 32 || block == 16,
                  "block must be 32 (MXFP4) or 16 (NVFP4), not ", block);
  return block == 32 ? mxfp4 : nvfp4;
}

// Decodes kLanes codes (kLanes / 2 bytes) into a vector of weights, through a block's table.
#if defined(CPU_CAPABILITY_AVX512)
struct Decoder {
  __m512 table;
  void set_scale(float s) { table = _mm512_mul_ps(_mm512_load_ps(kE2M1), _mm512_set1_ps(s)); }
  Vec operator()(const uint8_t* p) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    // Each byte twice, widened to 32 bits, the second copy shifted to its high nibble:
    // `vpermps` reads the low 4 bits of each lane.
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const __m512i codes =
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)), shifts);
    return _mm512_permutexvar_ps(codes, table);
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct Decoder {
  // The 8 magnitudes times the scale, entry i with its bits 28-30 flipped by i (see below).
  __m256 table;
  void set_scale(float s) {
    const __m256i index_bits = _mm256_slli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), 28);
    const __m256 scaled = _mm256_mul_ps(_mm256_load_ps(kE2M1), _mm256_set1_ps(s));
    table = _mm256_xor_ps(scaled, _mm256_castsi256_ps(index_bits));
  }
  Vec operator()(const uint8_t* p) const {
    int32_t word;
    std::memcpy(&word, p, 4);
    // Code i in the low bits of lane i: `vpermps` reads 3 of them, the magnitude's entry.
    // The code shifted left by 28 holds the sign in bit 31 and the entry's index in bits
    // 28-30, which the table flipped: one xor sets the sign and restores those bits.
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
    const __m256 entry = _mm256_permutevar8x32_ps(table, codes);
    return _mm256_xor_ps(entry, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
  }
};
#else
struct Decoder {
  float table[16];
  void set_scale(float s) {
    for (int i = 0; i < 16; ++i) table[i] = kE2M1[i] * s;
  }
  Vec operator()(const uint8_t* p) const {
    Vec w;
    for (int64_t i = 0; i < kLanes / 2; ++i) {
      w[2 * i] = table[p[i] & 15];
      w[2 * i + 1] = table[p[i] >> 4];
    }
    return w;
  }
};
#endif

#if TIERSERVE_BF16_PAIRS
// 32 codes (16 bytes) as bf16 weights, the first 16 in a block of scale s0, the last 16 in one
// of scale s1 (MXFP4: one block, s0 = s1). An E2M1 value times an E8M0 or E4M3 scale has at
// most 6 significant bits, so it is exact in bf16 too. The two blocks' tables share one
// register, 32 bf16 entries, which `vpermw` reads by 5 bits: the code, and the block.
inline Pairs decode_pairs(const uint8_t* p, float s0, float s1) {
  const __m512 values = _mm512_load_ps(kE2M1);
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
      _mm512_mul_ps(values, _mm512_set1_ps(s1)), _mm512_mul_ps(values, _mm512_set1_ps(s0))));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  // Each byte twice, widened to 16 bits, the second copy shifted down to its high nibble.
  const __m512i twice = _mm512_cvtepu8_epi16(
      _mm256_set_m128i(_mm_unpackhi_epi8(bytes, bytes), _mm_unpacklo_epi8(bytes, bytes)));
  const __m512i codes = _mm512_srlv_epi16(twice, _mm512_set1_epi32(4 << 16));
  // (code & 15) | 16 for the second block's words.
  const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  const __m512i index = _mm512_ternarylogic_epi32(codes, _mm512_set1_epi16(15), second, 0xEA);
  return reinterpret_cast<Pairs>(_mm512_permutexvar_epi16(index, table));
}
#endif

// A weight row's codes and scale bytes (a whole number of blocks), read a vector at a time.
template <int64_t kBlock>
struct Fp4Row {
  static constexpr bool kDecodes = true, kReadsPairs = true;
  const uint8_t* codes;
  const uint8_t* scales;
  const float* scale_of;
  float row_scale;
  Decoder dec;

  Vec load(int64_t k) {
    if (k % kBlock == 0) dec.set_scale(scale_of[scales[k / kBlock]]);
    return dec(codes + k / 2);
  }
#if TIERSERVE_BF16_PAIRS
  // Stateless: a pair step is one MXFP4 block or two NVFP4 blocks, each table built anew.
  Pairs load_pairs(int64_t k) const {
    const float s0 = scale_of[scales[k / kBlock]];
    return decode_pairs(codes + k / 2, s0, kBlock == 16 ? scale_of[scales[k / kBlock + 1]] : s0);
  }
#endif
  // The tail of a row of an odd number of NVFP4 blocks, read in pairs.
  float at(int64_t k) const {
    return kE2M1[(codes[k / 2] >> (k % 2 * 4)) & 15] * scale_of[scales[k / kBlock]];
  }
  // None: an FP4 row is an eighth of an fp32 row's bytes, and decoding it, not reading it,
  // bounds the product.
  void prefetch(int64_t, int64_t) const {}
};

// An FP4 matrix [groups, N, K] (one group for a linear layer, one per expert for the experts).
template <int64_t kBlock>
struct Fp4Matrix {
  using Row = Fp4Row<kBlock>;
  const uint8_t* codes;
  const uint8_t* scales;
  const float* row_scale;  // [groups, N], or null (MXFP4)
  int64_t N, K;
  const Format* f;

  Row row(int64_t g, int64_t n) const {
    const int64_t i = g * N + n;
    Row r;
    r.codes = codes + i * (K / 2);
    r.scales = scales + i * (K / kBlock);
    r.scale_of = f->scale_of.data();
    r.row_scale = row_scale ? row_scale[i] : 1.0f;
    return r;
  }
};

// An FP4 weight's arrays, checked (`matrix`), its block not yet a type.
struct Matrix {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* row_scale;
  int64_t N, K;
  const Format* f;
};

template <int64_t kBlock>
Fp4Matrix<kBlock> blocked(const Matrix& m) {
  return {m.codes, m.scales, m.row_scale, m.N, m.K, m.f};
}

// Checks an FP4 weight's arrays against [groups, N, K] and returns it as a Matrix.
Matrix matrix(const Format& f, const Tensor& packed, const Tensor& scales,
              const std::optional<Tensor>& row_scale, int64_t groups, const char* name) {
  STD_TORCH_CHECK(
      packed.scalar_type() == ScalarType::Byte && scales.scalar_type() == ScalarType::Byte, name,
      ": packed codes and scales must be uint8");
  STD_TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), name, ": must be contiguous");
  STD_TORCH_CHECK(packed.numel() > 0 && packed.size(-1) * 2 % f.block == 0, name,
                  ": rows of ", packed.size(-1) * 2, " codes are not whole blocks of ", f.block);
  const int64_t N = packed.size(-2), K = packed.size(-1) * 2;
  STD_TORCH_CHECK(packed.numel() == groups * N * K / 2, name, ": packed codes ", shape(packed),
                  " are not ", groups, " matrices");
  STD_TORCH_CHECK(scales.dim() == packed.dim() && scales.numel() == groups * N * (K / f.block) &&
                      scales.size(-1) == K / f.block,
                  name, ": scales ", shape(scales), " do not match packed codes ", shape(packed),
                  " in blocks of ", f.block);
  const float* rs = nullptr;
  if (row_scale.has_value()) {
    STD_TORCH_CHECK(row_scale->scalar_type() == ScalarType::Float && row_scale->is_contiguous() &&
                        row_scale->numel() == groups * N,
                    name, ": row scales must be ", groups * N, " contiguous float32");
    rs = row_scale->const_data_ptr<float>();
  }
  return {packed.const_data_ptr<uint8_t>(), scales.const_data_ptr<uint8_t>(), rs, N, K, &f};
}

Tensor linear(const Tensor& x, int64_t block, const Tensor& packed,
                  const Tensor& scales, const std::optional<Tensor>& row_scale) {
  const Format& f = format_of(block);
  STD_TORCH_CHECK(packed.dim() == 2, "packed codes must be [N, K/2]");
  const Matrix m = matrix(f, packed, scales, row_scale, 1, "weight");
  if (f.block == 32) return tierserve::linear_product(x, blocked<32>(m));
  return tierserve::linear_product(x, blocked<16>(m));
}

Tensor moe(const Tensor& x, const Tensor& topk_weights, const Tensor& topk_ids,
               int64_t block, const Tensor& gate_up_packed,
               const Tensor& gate_up_scales, const std::optional<Tensor>& gate_up_row_scale,
               const Tensor& down_packed, const Tensor& down_scales,
               const std::optional<Tensor>& down_row_scale) {
  const Format& f = format_of(block);
  STD_TORCH_CHECK(gate_up_packed.dim() == 3 && down_packed.dim() == 3,
                  "expert codes must be [E, N, K/2]");
  const int64_t E = gate_up_packed.size(0);
  const Matrix gate_up = matrix(f, gate_up_packed, gate_up_scales, gate_up_row_scale, E, "gate_up");
  const Matrix down = matrix(f, down_packed, down_scales, down_row_scale, E, "down");
  if (f.block == 32)
    return tierserve::expert_product(x, topk_weights, topk_ids, blocked<32>(gate_up),
                                     blocked<32>(down), E);
  return tierserve::expert_product(x, topk_weights, topk_ids, blocked<16>(gate_up),
                                   blocked<16>(down), E);
}

}  // namespace tierserve::fp4

STABLE_TORCH_LIBRARY(tierserve_fp4, m) {
  m.def(
      "linear(Tensor x, int block, Tensor packed, Tensor scales, Tensor? row_scale) -> Tensor");
  m.def(
      "moe(Tensor x, Tensor topk_weights, Tensor topk_ids, int block, Tensor gate_up_packed, "
      "Tensor gate_up_scales, Tensor? gate_up_row_scale, Tensor down_packed, Tensor down_scales, "
      "Tensor? down_row_scale) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(tierserve_fp4, CPU, m) {
  m.impl("linear", TORCH_BOX(&tierserve::fp4::linear));
  m.impl("moe", TORCH_BOX(&tierserve::fp4::moe));
}
