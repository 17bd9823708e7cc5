// FP4 weights (MXFP4, NVFP4) times fp32 activations on a CPU, the weights read as they are
// stored: packed E2M1 codes, two a byte (element 2j in the low nibble), and one scale byte a
// block (MXFP4: an E8M0 exponent per 32; NVFP4: an FP8 E4M3 scale per 16, with an fp32 scale
// per output row). Nothing is widened in memory: each block's codes are decoded in registers
// inside the dot product, as ggml's quantized dot products do.
//
// The ops, in the library `tierserve_fp4`:
//   linear(x [M, K] f32, format, packed [N, K/2] u8, scales [N, K/block] u8, row_scale [N]?)
//     -> [M, N] f32: x @ W.t();
//   moe(x [T, H] f32, topk_weights [T, k] f32, topk_ids [T, k] i64, format,
//       gate_up packed/scales/row_scale [E, 2I, ...], down packed/scales/row_scale [E, H, ...])
//     -> [T, H] f32: sum_k topk_weights[t, k] * down_e(silu(gate_e x) * up_e x), e = topk_ids[t, k].
//
// A block's decoding: its scale byte becomes an fp32 value through a 256-entry table, the
// 16 E2M1 values times that scale become the block's lookup table in one register, and each
// vector of codes indexes that register (`vpermps`). An E2M1 value times an E8M0 or E4M3
// scale is exact in fp32, so the decoded weights are the dequantized weights exactly, and
// the products differ from `kernels/reference.py`'s fp32 products of dequantized weights only
// in the order of the sums. The decoded vector is multiplied into every activation row of a
// tile (up to 8 rows) before the next one is decoded.
//
// - AVX-512: 16 codes a vector, the 16-entry signed table in one zmm (`vpermps` reads 4 bits);
// - AVX2: 8 codes a vector, the 8 magnitudes in one ymm (`vpermps` reads 3 bits) and the
//   sign bit moved into place by the same xor that undoes the table's index bits;
// - elsewhere (ATen's DEFAULT capability): a scalar lookup into a 16-float table per vector.
// Sums and fused multiply-adds are ATen's vector types, as in paged_attention.cpp.
//
// The experts: token slots are sorted by expert, each used expert's rows (its tokens) run as
// one tile loop over its weight rows, and the output rows of all used experts are split over
// torch's OpenMP threads (`at::parallel_for`), gate/up first, then down.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
static_assert(16 % kLanes == 0, "a block of 16 must hold whole vectors");
// Activation rows that share one decoding of a weight vector.
constexpr int64_t kMaxTile = 8;

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

const Format& format_of(const std::string& name) {
  static const Format mxfp4 = make_mxfp4(), nvfp4 = make_nvfp4();
  TORCH_CHECK(name == "mxfp4" || name == "nvfp4", "format must be mxfp4 or nvfp4, not ", name);
  return name == "mxfp4" ? mxfp4 : nvfp4;
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
    alignas(64) float w[kLanes];
    for (int64_t i = 0; i < kLanes / 2; ++i) {
      w[2 * i] = table[p[i] & 15];
      w[2 * i + 1] = table[p[i] >> 4];
    }
    return Vec::loadu(w);
  }
};
#endif

inline float lane_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// A weight row's codes and scale bytes, K its length (a whole number of blocks).
struct WeightRow {
  const uint8_t* codes;
  const uint8_t* scales;
  float row_scale;
};

// y[r * ldy + j] = row_scale_j * x_r . w_j for R activation rows x_r = x + r * ldx and NR
// weight rows w_j. Each decoded vector of w_j goes into every activation row, and each loaded
// activation vector into every weight row; the R * NR sums are independent, so the fused
// multiply-adds do not wait on one another, and a tile's setup and final lane sums are shared.
template <int64_t R, int64_t NR, int64_t kBlock>
inline void dot_tile(const float* x, int64_t ldx, const WeightRow* w, const Format& f, int64_t K,
                     float* y, int64_t ldy) {
  Vec acc[R][NR];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NR; ++j) acc[r][j] = Vec(0.0f);
  Decoder dec[NR];
  for (int64_t k = 0; k < K; k += kLanes) {
    if (k % kBlock == 0)
      for (int64_t j = 0; j < NR; ++j) dec[j].set_scale(f.scale_of[w[j].scales[k / kBlock]]);
    Vec xv[R];
    for (int64_t r = 0; r < R; ++r) xv[r] = Vec::loadu(x + r * ldx + k);
    for (int64_t j = 0; j < NR; ++j) {
      const Vec v = dec[j](w[j].codes + k / 2);
      for (int64_t r = 0; r < R; ++r) acc[r][j] = at::vec::fmadd(xv[r], v, acc[r][j]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NR; ++j) y[r * ldy + j] = lane_sum(acc[r][j]) * w[j].row_scale;
}

// Weight rows a work item takes at once: what the tiles of one or two activation rows use.
constexpr int64_t kRowGroup = 4;

// y[r * ldy + j] for `rows` rows of x (stride ldx) against n weight rows w_j (n <= kRowGroup):
// one or two activation rows run against 4 or 2 weight rows at a time (their sums in
// registers); more run in tiles of up to kMaxTile rows, one weight row at a time.
template <int64_t kBlock>
void dot_rows(const float* x, int64_t ldx, int64_t rows, const WeightRow* w, int64_t n,
              const Format& f, int64_t K, float* y, int64_t ldy) {
  if (rows <= 2) {
    int64_t j = 0;
    for (; rows == 1 && j + 4 <= n; j += 4) dot_tile<1, 4, kBlock>(x, ldx, w + j, f, K, y + j, ldy);
    for (; rows == 2 && j + 2 <= n; j += 2) dot_tile<2, 2, kBlock>(x, ldx, w + j, f, K, y + j, ldy);
    for (; j < n; ++j) {
      if (rows == 1) dot_tile<1, 1, kBlock>(x, ldx, w + j, f, K, y + j, ldy);
      else dot_tile<2, 1, kBlock>(x, ldx, w + j, f, K, y + j, ldy);
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    int64_t r = 0;
    for (; r + kMaxTile <= rows; r += kMaxTile)
      dot_tile<kMaxTile, 1, kBlock>(x + r * ldx, ldx, w + j, f, K, y + r * ldy + j, ldy);
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy + j;
    switch (rows - r) {
      case 1: dot_tile<1, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      case 2: dot_tile<2, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      case 3: dot_tile<3, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      case 4: dot_tile<4, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      case 5: dot_tile<5, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      case 6: dot_tile<6, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      case 7: dot_tile<7, 1, kBlock>(xr, ldx, w + j, f, K, yr, ldy); break;
      default: break;
    }
  }
}

// An FP4 matrix [groups, N, K] (one group for a linear layer, one per expert for the experts).
struct Matrix {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* row_scale;  // [groups, N], or null (MXFP4)
  int64_t N, K;
  const Format* f;

  WeightRow row(int64_t g, int64_t n) const {
    const int64_t i = g * N + n;
    return {codes + i * (K / 2), scales + i * (K / f->block), row_scale ? row_scale[i] : 1.0f};
  }
};

// A group's rows of activations: rows [begin, begin + count) of x against matrix group g.
struct Segment {
  int64_t group, begin, count;
};

// out[s.begin + r, n] = x[s.begin + r] . W[s.group, n] for every segment, the segments' groups
// of kRowGroup output rows split over the threads.
void segmented_product(const float* x, const Matrix& m, const std::vector<Segment>& segments,
                       float* out) {
  const int64_t groups = (m.N + kRowGroup - 1) / kRowGroup;
  const int64_t total = static_cast<int64_t>(segments.size()) * groups;
  at::parallel_for(0, total, 4, [&](int64_t begin, int64_t end) {
    WeightRow w[kRowGroup];
    for (int64_t i = begin; i < end; ++i) {
      const Segment& s = segments[i / groups];
      const int64_t n0 = (i % groups) * kRowGroup, n = std::min(kRowGroup, m.N - n0);
      for (int64_t j = 0; j < n; ++j) w[j] = m.row(s.group, n0 + j);
      const float* xs = x + s.begin * m.K;
      float* ys = out + s.begin * m.N + n0;
      if (m.f->block == 32)
        dot_rows<32>(xs, m.K, s.count, w, n, *m.f, m.K, ys, m.N);
      else
        dot_rows<16>(xs, m.K, s.count, w, n, *m.f, m.K, ys, m.N);
    }
  });
}

// Checks an FP4 weight's arrays against [groups, N, K] and returns it as a Matrix.
Matrix matrix(const Format& f, const at::Tensor& packed, const at::Tensor& scales,
              const std::optional<at::Tensor>& row_scale, int64_t groups, const char* name) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, name,
              ": packed codes and scales must be uint8");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), name, ": must be contiguous");
  TORCH_CHECK(packed.numel() > 0 && packed.size(-1) * 2 % f.block == 0, name,
              ": rows of ", packed.size(-1) * 2, " codes are not whole blocks of ", f.block);
  const int64_t N = packed.size(-2), K = packed.size(-1) * 2;
  TORCH_CHECK(packed.numel() == groups * N * K / 2, name, ": packed codes ", packed.sizes(),
              " are not ", groups, " matrices");
  TORCH_CHECK(scales.dim() == packed.dim() && scales.numel() == groups * N * (K / f.block) &&
                  scales.size(-1) == K / f.block,
              name, ": scales ", scales.sizes(), " do not match packed codes ", packed.sizes(),
              " in blocks of ", f.block);
  const float* rs = nullptr;
  if (row_scale.has_value()) {
    TORCH_CHECK(row_scale->scalar_type() == at::kFloat && row_scale->is_contiguous() &&
                    row_scale->numel() == groups * N,
                name, ": row scales must be ", groups * N, " contiguous float32");
    rs = row_scale->data_ptr<float>();
  }
  return {packed.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), rs, N, K, &f};
}

void check_activations(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [rows, K]");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

at::Tensor linear(const at::Tensor& x, const std::string& format, const at::Tensor& packed,
                  const at::Tensor& scales, const std::optional<at::Tensor>& row_scale) {
  const Format& f = format_of(format);
  TORCH_CHECK(packed.dim() == 2, "packed codes must be [N, K/2]");
  const Matrix m = matrix(f, packed, scales, row_scale, 1, "weight");
  check_activations(x, m.K);
  at::Tensor out = at::empty({x.size(0), m.N}, x.options());
  if (x.size(0) > 0)
    segmented_product(x.data_ptr<float>(), m, {{0, 0, x.size(0)}}, out.data_ptr<float>());
  return out;
}

// The grain of the element-wise steps: rows that run on one thread. A decode step's 1-64 slots
// then take no parallel region for them, only the products do.
constexpr int64_t kRowGrain = 64;

// silu(gate) * up of h [S, 2I] (gate columns first) into a [S, I], as torch's silu: g / (1 + e^-g).
void silu_and_mul(const float* h, float* a, int64_t S, int64_t I) {
  at::parallel_for(0, S, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float* g = h + s * 2 * I;
      const float* u = g + I;
      float* o = a + s * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec gv = Vec::loadu(g + i);
        (gv / (Vec(1.0f) + gv.neg().exp()) * Vec::loadu(u + i)).store(o + i);
      }
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

at::Tensor moe(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
               const std::string& format, const at::Tensor& gate_up_packed,
               const at::Tensor& gate_up_scales, const std::optional<at::Tensor>& gate_up_row_scale,
               const at::Tensor& down_packed, const at::Tensor& down_scales,
               const std::optional<at::Tensor>& down_row_scale) {
  const Format& f = format_of(format);
  TORCH_CHECK(gate_up_packed.dim() == 3 && down_packed.dim() == 3,
              "expert codes must be [E, N, K/2]");
  const int64_t E = gate_up_packed.size(0);
  const Matrix gate_up = matrix(f, gate_up_packed, gate_up_scales, gate_up_row_scale, E, "gate_up");
  const Matrix down = matrix(f, down_packed, down_scales, down_row_scale, E, "down");
  const int64_t H = gate_up.K, I = down.K;
  TORCH_CHECK(down_packed.size(0) == E && gate_up.N == 2 * I && down.N == H, "gate_up [", E, ", ",
              gate_up.N, ", ", H, "] and down [", down_packed.size(0), ", ", down.N, ", ", I,
              "] are not the experts of one layer");
  check_activations(x, H);
  const int64_t T = x.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(),
              "topk_ids must be contiguous int64 [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous(),
              "topk_weights must be contiguous float32 shaped like topk_ids");
  const int64_t top_k = topk_ids.size(1), S = T * top_k;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  // Slots sorted by expert (a counting sort, stable): sorted[p] is the slot at position p.
  std::vector<int64_t> starts(E + 1, 0), sorted(S), position(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "expert ", ids[s], " is not in the layer's ", E);
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
  const float* xp = x.data_ptr<float>();
  std::vector<float> xs(S * H), h(S * 2 * I), a(S * I), y(S * H);
  at::parallel_for(0, S, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      std::memcpy(&xs[p * H], xp + (sorted[p] / top_k) * H, H * sizeof(float));
  });
  segmented_product(xs.data(), gate_up, segments, h.data());
  silu_and_mul(h.data(), a.data(), S, I);
  segmented_product(a.data(), down, segments, y.data());
  at::Tensor out = at::empty({T, H}, x.options());
  float* o = out.data_ptr<float>();
  const float* w = topk_weights.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* ot = o + t * H;
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t s = t * top_k + j;
        const float* ys = &y[position[s] * H];
        const Vec wv(w[s]);
        int64_t i = 0;
        if (j == 0) {
          for (; i + kLanes <= H; i += kLanes) (Vec::loadu(ys + i) * wv).store(ot + i);
          for (; i < H; ++i) ot[i] = ys[i] * w[s];
        } else {
          for (; i + kLanes <= H; i += kLanes)
            at::vec::fmadd(Vec::loadu(ys + i), wv, Vec::loadu(ot + i)).store(ot + i);
          for (; i < H; ++i) ot[i] += ys[i] * w[s];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tierserve_fp4, m) {
  m.def(
      "linear(Tensor x, str format, Tensor packed, Tensor scales, Tensor? row_scale) -> Tensor");
  m.def(
      "moe(Tensor x, Tensor topk_weights, Tensor topk_ids, str format, Tensor gate_up_packed, "
      "Tensor gate_up_scales, Tensor? gate_up_row_scale, Tensor down_packed, Tensor down_scales, "
      "Tensor? down_row_scale) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear);
  m.impl("moe", c10::DispatchKey::CPU, &moe);
}
