// int4 linear layers with AVX-512 VNNI, for weights w[n, k] = scale[n, g] q[n, k] + zero[n, g]
// (q in 0..15, groups g of 32, 64 or 128 input channels: GGUF's Q4_1 and its kin).
//
// Activations are split per row into two int8 levels as for int8 layers, x = s (x1 + x2 /
// 254), and each group's integer dot products A1 = sum q x1, A2 = sum q x2 come from
// vpdpbusd (the weights are the unsigned operand: no offset to correct). Per group:
//   acc += scale * (254 A1 + A2) + zero * (254 X1 + X2)      (X = sum of the codes)
// in that order, then y = acc * s / 254. The integer parts are exact; the float steps run in
// a fixed order per output, so a row's result does not depend on the rest of the batch.
//
// Packing, per panel of 64 output channels, in reading order:
//   weights [in / 4][2][64] bytes: byte i of half h holds channel-block 2h's (low nibble) and
//           2h+1's (high nibble) value for column i / 4, input channel 4 j + i % 4;
//   scales and zeros [groups][2][64] float16 (the precision of GGUF's own block scales).
//
// The AVX2 build (no VNNI) reads the same packing: vpmaddubsw multiplies the nibbles by the
// codes (two products per int16 lane, at most 2 x 15 x 127), vpmaddwd widens to int32. The
// same exact sums and float steps: the same bits as the VNNI build and int4_reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vnni.h"

namespace llmserve {

#if LLMSERVE_HAS_VNNI || LLMSERVE_HAS_INT_AVX2

namespace {

constexpr int kBlock = 16;       // output channels per block (one AVX-512 vector)
constexpr int kPanel = 4;        // channel blocks per panel: 64 channels
constexpr int kMaxTileRows = 2;  // activation rows per tile (4 integer rows)

using TileFn = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t,
                        const uint8_t*, const uint16_t*, float*, int64_t, int64_t, bool);

// Checks the arguments, splits each row of x into two int8 levels (codes: x1 then x2 per
// row, scales per row, sums of 254 x1 + x2 per group) and runs `tiles` over (panel, tile of
// up to kMaxTileRows rows) items, panel-major.
at::Tensor run_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero,
                    int64_t group, int64_t n, const TileFn (&tiles_of)[kMaxTileRows + 1]) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a float32 [rows, in] tensor with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(group % 32 == 0 && k % group == 0, "in (", k,
              ") must be a multiple of the group size (", group, "), itself one of 32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
              packed.size(1) * 4 == k && packed.size(2) == 128 && packed.is_contiguous() &&
              reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed must be 64-byte aligned uint8 [out_padded / 64, in / 4, 128] for in = ",
              k);
  const int64_t panels = packed.size(0), groups = k / group;
  TORCH_CHECK(panels * kPanel * kBlock >= n && n > (panels - 1) * kPanel * kBlock,
              "packed holds ", panels * kPanel * kBlock, " output channels, not ", n,
              " padded to a multiple of 64");
  TORCH_CHECK(scale_zero.scalar_type() == at::kHalf && scale_zero.is_contiguous() &&
              scale_zero.numel() == panels * groups * 2 * kPanel * kBlock,
              "scale_zero must be float16 [out_padded / 64, groups, 2, 64]");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;

  std::vector<int8_t> q(2 * m * k);
  std::vector<float> sums(m * groups), scales(m);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      auto* codes = reinterpret_cast<uint8_t*>(q.data() + 2 * r * k);  // x1, then x2
      scales[r] = split_row(xp + r * x.stride(0), k, 0, codes, codes + k, group,
                            sums.data() + r * groups);
    }
  });

  const int64_t tiles = (m + kMaxTileRows - 1) / kMaxTileRows;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t p = item / tiles, t0 = (item % tiles) * kMaxTileRows;
      const int64_t rows = std::min<int64_t>(kMaxTileRows, m - t0);
      const int64_t n0 = p * kPanel * kBlock;
      tiles_of[rows](q.data() + 2 * t0 * k, sums.data() + t0 * groups, scales.data() + t0, k,
                     group, wp + p * k * 32, szp + p * groups * 2 * kPanel * kBlock,
                     yp + t0 * n + n0, n, std::min<int64_t>(kPanel * kBlock, n - n0),
                     t0 == 0 || item == b);
    }
  });
  return y;
}

}  // namespace

#endif

#if LLMSERVE_HAS_VNNI

namespace {

constexpr int kPrefetch = 2048;

// One group of quads [j0, j0 + quads) for T rows: sums[t][c] = 254 A1 + A2 (exact int32).
// Its own function, not inlined, with the prefetch choice a template argument: inside
// tile()'s group loop, or with the loop unswitched on a runtime flag, GCC copied half of
// the accumulators through other registers around every vpdpbusd.
template <int T, bool prefetch>
__attribute__((noinline)) void group_dots(const int8_t* q, int64_t k, int64_t j0,
                                          int64_t quads, const uint8_t* weights,
                                          __m512i* sums) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i acc[2 * T][kPanel];
#pragma GCC unroll 4
  for (int r = 0; r < 2 * T; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t j = j0; j < j0 + quads; ++j) {
    const uint8_t* wj = weights + j * 128;
    if constexpr (prefetch) {  // a panel's first pass, from memory; later ones find it cached
      _mm_prefetch(reinterpret_cast<const char*>(wj) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wj) + kPrefetch + 64, _MM_HINT_T0);
    }
    const __m512i v0 = _mm512_load_si512(wj), v1 = _mm512_load_si512(wj + 64);
    const __m512i w[kPanel] = {
        _mm512_and_si512(v0, low), _mm512_and_si512(_mm512_srli_epi16(v0, 4), low),
        _mm512_and_si512(v1, low), _mm512_and_si512(_mm512_srli_epi16(v1, 4), low)};
    rows_times_weights<2 * T, kPanel, true>(acc, reinterpret_cast<const uint8_t*>(q), k, j, w);
  }
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) {
      const __m512i a1 = acc[2 * t][c];
      sums[t * kPanel + c] = _mm512_add_epi32(
          _mm512_sub_epi32(_mm512_slli_epi32(a1, 8), _mm512_slli_epi32(a1, 1)),
          acc[2 * t + 1][c]);  // 254 A1 + A2, exact
    }
}

template <int T>
void tile(const int8_t* q, const float* group_sums, const float* scales, int64_t k,
          int64_t group, const uint8_t* weights, const uint16_t* scale_zero, float* y,
          int64_t y_stride, int64_t cols, bool prefetch) {
  const int64_t groups = k / group, quads_per_group = group / 4;
  alignas(64) float out[T][kPanel * kBlock] = {};
  alignas(64) __m512i sums[T * kPanel];
  for (int64_t g = 0; g < groups; ++g) {
    (prefetch ? group_dots<T, true> : group_dots<T, false>)(q, k, g * quads_per_group,
                                                           quads_per_group, weights, sums);
    const uint16_t* sz = scale_zero + g * 2 * kPanel * kBlock;
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) {
      const __m512 scale = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + c * kBlock)));
      const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(sz + (kPanel + c) * kBlock)));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const __m512i a = sums[t * kPanel + c];
        float* o = out[t] + c * kBlock;
        __m512 v = _mm512_add_ps(_mm512_load_ps(o), _mm512_mul_ps(scale, _mm512_cvtepi32_ps(a)));
        v = _mm512_add_ps(v, _mm512_mul_ps(zero, _mm512_set1_ps(group_sums[t * groups + g])));
        _mm512_store_ps(o, v);
      }
    }
  }

#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) {
    const __m512 s = _mm512_set1_ps(scales[t] / kResidual);
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c)
      _mm512_store_ps(out[t] + c * kBlock, _mm512_mul_ps(_mm512_load_ps(out[t] + c * kBlock), s));
  }
  for (int t = 0; t < T; ++t) std::memcpy(y + t * y_stride, out[t], cols * sizeof(float));
}

constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>};

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scale_zero, int64_t group, int64_t n) {
  return run_int4(x, packed, scale_zero, group, n, kTiles);
}

#elif LLMSERVE_HAS_INT_AVX2

namespace {

// One block of 16 output channels (c: its half and nibble in the packing) for T rows over
// the groups: the float steps of the VNNI tile, 8 lanes at a time.
template <int T>
void block_of_tile(const int8_t* q, const float* group_sums, const float* scales, int64_t k,
                   int64_t group, const uint8_t* weights, const uint16_t* scale_zero,
                   int c, float (&out)[T][kBlock]) {
  const int64_t groups = k / group, quads_per_group = group / 4;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int shift = 4 * (c % 2);
  const uint8_t* half = weights + 64 * (c / 2);
  for (int t = 0; t < T; ++t) std::fill(out[t], out[t] + kBlock, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[2 * T][2];
#pragma GCC unroll 4
    for (int r = 0; r < 2 * T; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t j = g * quads_per_group; j < (g + 1) * quads_per_group; ++j) {
      const uint8_t* wj = half + j * 128;
      if (c == 0) {  // the first block fetches both halves ahead (see int8_linear.cpp)
        _mm_prefetch(reinterpret_cast<const char*>(weights + (j + 16) * 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(weights + (j + 16) * 128 + 64),
                     _MM_HINT_T0);
      }
      const __m256i w0 = _mm256_and_si256(
          _mm256_srli_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wj)), shift),
          low);
      const __m256i w1 = _mm256_and_si256(
          _mm256_srli_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wj + 32)),
                            shift),
          low);
#pragma GCC unroll 4
      for (int r = 0; r < 2 * T; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * k + 4 * j, 4);
        const __m256i a = _mm256_set1_epi32(four);
        acc[r][0] = dot_quads(acc[r][0], w0, a);
        acc[r][1] = dot_quads(acc[r][1], w1, a);
      }
    }
    const uint16_t* sz = scale_zero + g * 2 * kPanel * kBlock;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + c * kBlock + 8 * h)));
      const __m256 zero = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(sz + (kPanel + c) * kBlock + 8 * h)));
#pragma GCC unroll 2
      for (int t = 0; t < T; ++t) {
        const __m256i a1 = acc[2 * t][h];
        const __m256i a = _mm256_add_epi32(  // 254 A1 + A2, exact
            _mm256_sub_epi32(_mm256_slli_epi32(a1, 8), _mm256_slli_epi32(a1, 1)),
            acc[2 * t + 1][h]);
        float* o = out[t] + 8 * h;
        __m256 v = _mm256_add_ps(_mm256_load_ps(o), _mm256_mul_ps(scale, _mm256_cvtepi32_ps(a)));
        v = _mm256_add_ps(v, _mm256_mul_ps(zero, _mm256_set1_ps(group_sums[t * groups + g])));
        _mm256_store_ps(o, v);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m256 s = _mm256_set1_ps(scales[t] / kResidual);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
      _mm256_store_ps(out[t] + 8 * h, _mm256_mul_ps(_mm256_load_ps(out[t] + 8 * h), s));
  }
}

template <int T>
void tile(const int8_t* q, const float* group_sums, const float* scales, int64_t k,
          int64_t group, const uint8_t* weights, const uint16_t* scale_zero, float* y,
          int64_t y_stride, int64_t cols, bool /*prefetch*/) {
  alignas(32) float out[T][kBlock];
  for (int c = 0; c < kPanel && c * kBlock < cols; ++c) {
    block_of_tile<T>(q, group_sums, scales, k, group, weights, scale_zero, c, out);
    const int64_t width = std::min<int64_t>(kBlock, cols - c * kBlock);
    for (int t = 0; t < T; ++t)
      std::memcpy(y + t * y_stride + c * kBlock, out[t], width * sizeof(float));
  }
}

constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>};

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scale_zero, int64_t group, int64_t n) {
  return run_int4(x, packed, scale_zero, group, n, kTiles);
}

#else  // neither VNNI nor AVX2: int_kernels is "" and int4 layers use PyTorch's kernel

at::Tensor int4_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       int64_t) {
  TORCH_CHECK(false, "int4_linear needs AVX-512 VNNI or AVX2");
}

#endif

}  // namespace llmserve
