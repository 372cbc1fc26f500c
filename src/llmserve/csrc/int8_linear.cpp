// int8 linear layers with AVX-512 VNNI: the weights packed so that one 64-byte load holds
// 4 input channels of 16 output channels, the exact layout vpdpbusd multiplies (u8 x s8,
// four products summed into each int32 lane), in the order the kernel reads them: panels of
// 64 output channels, each [in / 4][4 blocks of 16 channels][16][4], so that the whole
// weight streams from memory as one sequential read.
//
// The arithmetic is the one of llmserve.layers.quantization.int8.int8_matmul, step for
// step: each activation row is split into two int8 levels (x1 = round(x / s), x2 =
// round((x - s x1) 254 / s), each division a product by 1 / s), both multiplied by the
// weights in exact int32 arithmetic, and y = ((acc2 (1 / 254) + acc1) s) w_scale. Integer
// sums do not depend on their order, so the result is bitwise the one of the torch._int_mm
// path, for any batch and any blocking.
// With levels = 1 (the w8a8 format, w8a8.w8a8_matmul) only x1 is kept, half the integer
// products, and each group of `group` inputs of a row has its own scale s_g:
// y = (sum over g, in order, of acc_g s_g) w_scale. An outlier then coarsens only its own
// group (with group = in, one scale per row).
//
// vpdpbusd takes one unsigned operand: the activations go in as x + 128 (1..255) and the
// excess, 128 * sum_k w[n, k] over each group's inputs k, is subtracted from the column's
// sum of that group.
//
// Without VNNI, the AVX2 build reads the same packed weights and quantizes the activations
// the same way, but without the bias: vpmaddubsw multiplies |w| by sign(w) x (see vnni.h),
// an exact int32 sum with no excess to take back. Same sums, same float steps: the same
// bits as the VNNI build and the torch._int_mm reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "ops.h"
#include "vnni.h"

namespace llmserve {

std::string int_kernels() { return int_kernels_isa(); }

at::Tensor int8_embedding(const at::Tensor& packed, const at::Tensor& w_scale,
                          const at::Tensor& ids, int64_t rows) {
  // Row n of W sits in panel n / 64 at [quad][n % 64 / 16][n % 16][4]: one 4-byte word per
  // quad of inputs, 256 bytes apart. float(w) * w_scale[n], the product PyTorch's path takes.
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == 256 &&
                  packed.is_contiguous(),
              "packed must be int8 [out_padded / 64, in / 4, 256]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == packed.size(0) * 64 && rows <= w_scale.numel(),
              "w_scale must be float32 [out_padded]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be int64 [T]");
  const int64_t tokens = ids.size(0), quads = packed.size(1), k = quads * 4;
  auto out = at::empty({tokens, k}, w_scale.options());
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = w_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t n = idp[t];
    TORCH_CHECK(n >= 0 && n < rows, "token id ", n, " outside the embedding's ", rows, " rows");
    const int8_t* src = wp + (n / 64) * quads * 256 + (n % 64 / 16) * 64 + (n % 16) * 4;
    const float s = sp[n];
    float* dst = op + t * k;
    for (int64_t q = 0; q < quads; ++q)
      for (int j = 0; j < 4; ++j) dst[4 * q + j] = static_cast<float>(src[q * 256 + j]) * s;
  }
  return out;
}

#if LLMSERVE_HAS_VNNI || LLMSERVE_HAS_INT_AVX2

namespace {

constexpr int kBlock = 16;  // output columns per block (one AVX-512 vector of int32 lanes)
constexpr int kPanel = 4;   // column blocks per panel: 64 columns

// The arguments of int8_linear, checked; returns the number of activation groups per row.
int64_t check_int8_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                        const at::Tensor& w_scale, int64_t n, int64_t levels, int64_t group) {
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2, got ", levels);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a float32 [rows, in] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar &&
              packed.size(2) == kPanel * 64 && packed.is_contiguous() &&
              reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed must be 64-byte aligned int8 [out_padded / 64, in / 4, 256]");
  const int64_t k = x.size(1), panels = packed.size(0), quads = packed.size(1);
  const int64_t padded = panels * kPanel * kBlock;
  TORCH_CHECK(quads * 4 == k, "x has ", k, " input channels, the weight ", quads * 4);
  TORCH_CHECK(panels * kPanel * kBlock >= n && n > (panels - 1) * kPanel * kBlock,
              "packed holds ", panels * kPanel * kBlock, " output channels, not ", n,
              " padded to a multiple of 64");
  TORCH_CHECK(group > 0 && group % 4 == 0 && k % group == 0,
              "the activation group (", group, ") must be a multiple of 4 dividing ", k);
  const int64_t groups = k / group;
  TORCH_CHECK(groups == 1 || levels == 1, "activation groups need one level");
  TORCH_CHECK(excess.numel() == groups * padded && excess.scalar_type() == at::kInt &&
              excess.is_contiguous() && w_scale.numel() == padded &&
              w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(),
              "excess (int32) must be [in / group, out_padded], w_scale (float32) [out_padded]");
  return groups;
}

// Each row of x as `levels` rows of int8 codes (x1, then x2 with two levels; with one level,
// each group of `group` inputs with its own scale), plus `bias` (128 makes them vpdpbusd's
// unsigned operand; AVX2 keeps them signed). codes: [m][levels][k]; scales: [m][groups].
void quantize_activations(const at::Tensor& x, int64_t levels, int64_t group, int32_t bias,
                          uint8_t* codes, float* scales) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / group, stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  parallel_for(0, m, 8, [&](int64_t b, int64_t e) {
    // Locals, not the captured references: the stores of codes may alias anything, and the
    // loop would reload every capture behind them.
    const float* x_rows = xp;
    uint8_t* code_rows = codes;
    float* row_scales = scales;
    const int64_t in = k, row_stride = stride, n_levels = levels, n_groups = groups,
                  size = group;
    const int32_t offset = bias;
    for (int64_t r = b; r < e; ++r) {
      uint8_t* row_codes = code_rows + n_levels * r * in;
      const float* row = x_rows + r * row_stride;
      if (n_levels == 2)
        row_scales[r] = split_row(row, in, offset, row_codes, row_codes + in);
      else
        for (int64_t g = 0; g < n_groups; ++g)
          row_scales[r * n_groups + g] =
              split_row(row + g * size, size, offset, row_codes + g * size, nullptr);
    }
  });
}

}  // namespace

#endif

#if LLMSERVE_HAS_VNNI

namespace {

constexpr int kTileCodeRows = 6;    // integer rows per tile (24 sums in registers)
constexpr int kPrefetch = 2048;     // bytes ahead of the weight stream
// What the tiles of one call share.
struct Operands {
  const uint8_t* q;       // activation codes: rows of L levels, each level k bytes
  const float* scales;    // [rows][groups]: each row's scale per group of inputs
  int64_t k, groups;      // groups > 1 only with one level
  const int32_t* excess;  // [groups][out_padded]: 128 x the weights' sum over each group
  int64_t out_padded;
  const float* w_scale;   // [out_padded]
  float* y;
  int64_t n;              // y's columns (and row stride)
};

// acc[r][c] = the int32 sums of quads [j0, j1) of R code rows with the panel's weights
// (the prefetches: see tile). Inlined into its caller: that keeps acc in registers.
template <int R>
__attribute__((always_inline)) inline void sum_quads(__m512i (&acc)[R][kPanel],
                                                     const uint8_t* q, int64_t k,
                                                     const int8_t* panel, int64_t j0, int64_t j1,
                                                     bool prefetch, const int8_t* ahead,
                                                     int64_t ahead_lines) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t j = j0; j < j1; ++j) {
    const int8_t* wj = panel + j * kPanel * 64;
    if (prefetch) {
#pragma GCC unroll 4
      for (int c = 0; c < kPanel; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(wj) + kPrefetch + 64 * c, _MM_HINT_T0);
    }
    if (j < ahead_lines)
      _mm_prefetch(reinterpret_cast<const char*>(ahead) + 64 * j, _MM_HINT_T1);
    __m512i w[kPanel];
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) w[c] = _mm512_load_si512(wj + c * 64);
    rows_times_weights<R, kPanel, false>(acc, q, k, j, w);
  }
}

// T activation rows of L levels (L T integer rows, a row's levels adjacent), from row t0,
// times the panel of 64 output columns from n0, into y[t0 .., n0 .. n0 + cols).
// `prefetch`: the panel's first pass, from memory. `ahead`: the first `ahead_lines`
// 64-byte lines of a slice of the next panel this thread computes, fetched into L2 one per
// quad step while this panel computes from cache.
template <int T, int L>
void tile(const Operands& op, int64_t t0, const int8_t* panel, int64_t n0, bool prefetch,
          const int8_t* ahead, int64_t ahead_lines) {
  const int64_t k = op.k, quads = k / 4, group_quads = quads / op.groups;
  const uint8_t* q = op.q + L * t0 * k;
  // Every loop over registers is unrolled at compile time: indexed by a runtime value, GCC
  // would keep the accumulators on the stack.
  __m512i acc[L * T][kPanel];
  const int64_t cols = std::min<int64_t>(kPanel * kBlock, op.n - n0);
  auto store = [&](int t, int c, __m512 v) {
    const int64_t left = cols - c * kBlock;
    if (left <= 0) return;
    const __mmask16 mask = left >= kBlock ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(op.y + (t0 + t) * op.n + n0 + c * kBlock, mask, v);
  };
  if constexpr (L == 1) {
    // y = (sum over groups g, in order, of (acc_g - excess_g) s_g) w_scale; the partial
    // float sums wait in L1 while the next group's integer sums take the registers.
    alignas(64) float partial[T][kPanel * kBlock];
    for (int64_t g = 0; g < op.groups; ++g) {
      sum_quads<T>(acc, q, k, panel, g * group_quads, (g + 1) * group_quads, prefetch, ahead,
                   ahead_lines);
#pragma GCC unroll 4
      for (int c = 0; c < kPanel; ++c) {
        const __m512i ex = _mm512_loadu_si512(op.excess + g * op.out_padded + n0 + c * kBlock);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][c], ex)),
                                   _mm512_set1_ps(op.scales[(t0 + t) * op.groups + g]));
          if (g > 0) v = _mm512_add_ps(_mm512_load_ps(partial[t] + c * kBlock), v);
          _mm512_store_ps(partial[t] + c * kBlock, v);
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) {
      const __m512 ws = _mm512_loadu_ps(op.w_scale + n0 + c * kBlock);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t)
        store(t, c, _mm512_mul_ps(_mm512_load_ps(partial[t] + c * kBlock), ws));
    }
  } else {
    // Two levels, one scale per row: y = ((acc2 (1 / 254) + acc1) s) w_scale, straight
    // from the registers.
    sum_quads<L * T>(acc, q, k, panel, 0, quads, prefetch, ahead, ahead_lines);
    const __m512 inv_residual = _mm512_set1_ps(1.f / kResidual);
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) {
      const __m512i ex = _mm512_loadu_si512(op.excess + n0 + c * kBlock);
      const __m512 ws = _mm512_loadu_ps(op.w_scale + n0 + c * kBlock);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m512 a1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * t][c], ex));
        const __m512 a2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * t + 1][c], ex));
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(a2, inv_residual), a1);
        store(t, c, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(op.scales[t0 + t])), ws));
      }
    }
  }
}

using TileFn = void (*)(const Operands&, int64_t, const int8_t*, int64_t, bool, const int8_t*,
                        int64_t);
// kTiles[L - 1][T]: T rows of L levels, T up to kTileCodeRows / L.
constexpr TileFn kTiles[2][kTileCodeRows + 1] = {
    {nullptr, tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>, tile<5, 1>, tile<6, 1>},
    {nullptr, tile<1, 2>, tile<2, 2>, tile<3, 2>, nullptr, nullptr, nullptr}};

}  // namespace

void int8_linear_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                     const at::Tensor& w_scale, int64_t n, int64_t levels, int64_t group,
                     at::Tensor& y) {
  const int64_t groups = check_int8_args(x, packed, excess, w_scale, n, levels, group);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t panels = packed.size(0), quads = packed.size(1);
  const int64_t padded = panels * kPanel * kBlock;
  check_out(y, m, n, "y");
  if (m == 0) return;

  // Scratch without zero-filling (a std::vector would memset it on every call).
  std::unique_ptr<uint8_t[]> q_buf(new uint8_t[levels * m * k]);
  std::unique_ptr<float[]> scales_buf(new float[m * groups]);
  uint8_t* q = q_buf.get();
  float* scales = scales_buf.get();
  quantize_activations(x, levels, group, 128, q, scales);  // x1 + 128 (, x2 + 128)

  // Work items: (panel, tile of rows), panel-major so that a thread runs the row tiles of
  // one panel back to back while its 64 columns of weights sit in cache.
  const int64_t tile_rows = kTileCodeRows / levels;
  const TileFn* tiles_of = kTiles[levels - 1];
  const int64_t tiles = (m + tile_rows - 1) / tile_rows;
  const int8_t* wp = packed.data_ptr<int8_t>();
  const Operands op{q,       scales, k, groups, excess.data_ptr<int32_t>(), padded,
                    w_scale.data_ptr<float>(), y.data_ptr<float>(), n};
  // A panel's first pass waits on memory (one core alone draws a fraction of the machine's
  // bandwidth). With rows for four tiles or more, each of a panel's row tiles instead
  // fetches its share of the thread's next panel into L2, a line per quad step, so that the
  // weights arrive while the tiles compute from cache. With fewer, the first pass streams
  // its panel with a prefetch ahead of its own reads.
  const int64_t panel_bytes = quads * kPanel * 64, panel_lines = panel_bytes / 64;
  const bool spread = tiles >= kPanel;
  const int64_t share_lines = (panel_lines + tiles - 1) / tiles;  // <= quads when spread
  parallel_for(0, panels * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t p = item / tiles, t = item % tiles, t0 = t * tile_rows;
      const int64_t first_line = std::min(t * share_lines, panel_lines);
      const int64_t ahead_lines = spread && (p + 1) * tiles < e
                                      ? std::min(share_lines, panel_lines - first_line)
                                      : 0;
      tiles_of[std::min<int64_t>(tile_rows, m - t0)](
          op, t0, wp + p * panel_bytes, p * kPanel * kBlock, item == b || (t0 == 0 && !spread),
          wp + (p + 1) * panel_bytes + first_line * 64, ahead_lines);
    }
  });
}

#elif LLMSERVE_HAS_INT_AVX2

namespace {

constexpr int kTileCodeRows = 4;  // integer rows per tile: 8 sums of 16 columns in registers

// What the tiles of one call share (codes are signed here: no bias, no excess).
struct Operands {
  const int8_t* q;      // activation codes: rows of L levels, each level k bytes
  const float* scales;  // [rows][groups]
  int64_t k, groups;
  const float* w_scale;  // [out_padded]
  float* y;
  int64_t n;  // y's columns (and row stride)
};

constexpr int64_t kAhead = 16;  // quads (of 256 bytes) a panel's first pass prefetches ahead

// acc[r][h] = the int32 sums over quads [j0, j1) of R code rows times one block of 16
// columns (its two halves of 8) of the panel. A block reads one 64-byte line of each quad's
// 256: with `prefetch` (the panel's first block) the quad's three other lines are fetched
// too, a few quads ahead, so that the other blocks find them in cache. (Without it, every
// block pulled its lines from memory at a stride the hardware prefetcher follows badly:
// 3-4x the time at one row.)
template <int R>
__attribute__((always_inline)) inline void sum_quads(__m256i (&acc)[R][2], const int8_t* q,
                                                     int64_t k, const int8_t* block,
                                                     int64_t j0, int64_t j1, bool prefetch) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t j = j0; j < j1; ++j) {
    const int8_t* wj = block + j * kPanel * 64;
    if (prefetch) {
#pragma GCC unroll 4
      for (int c = 0; c < kPanel; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(wj) + kAhead * kPanel * 64 + 64 * c,
                     _MM_HINT_T0);
    }
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wj));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wj + 32));
    const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, q + r * k + 4 * j, 4);
      const __m256i a = _mm256_set1_epi32(four);
      acc[r][0] = dot_quads(acc[r][0], u0, _mm256_sign_epi8(a, w0));
      acc[r][1] = dot_quads(acc[r][1], u1, _mm256_sign_epi8(a, w1));
    }
  }
}

// T activation rows of L levels from row t0 times the panel of 64 columns from n0, one block
// of 16 columns at a time; the float steps of the VNNI tile, 8 lanes at a time.
template <int T, int L>
void tile(const Operands& op, int64_t t0, const int8_t* panel, int64_t n0) {
  const int64_t k = op.k, quads = k / 4, group_quads = quads / op.groups;
  const int8_t* q = op.q + L * t0 * k;
  const int64_t cols = std::min<int64_t>(kPanel * kBlock, op.n - n0);
  __m256i acc[L * T][2];
  alignas(32) float out[T][kBlock];
  for (int c = 0; c < kPanel && c * kBlock < cols; ++c) {
    const int8_t* block = panel + c * 64;
    const float* ws = op.w_scale + n0 + c * kBlock;
    if constexpr (L == 1) {
      // y = (sum over groups g, in order, of acc_g s_g) w_scale
      for (int64_t g = 0; g < op.groups; ++g) {
        sum_quads<T>(acc, q, k, block, g * group_quads, (g + 1) * group_quads, c == 0);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          const __m256 s = _mm256_set1_ps(op.scales[(t0 + t) * op.groups + g]);
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[t][h]), s);
            if (g > 0) v = _mm256_add_ps(_mm256_load_ps(out[t] + 8 * h), v);
            _mm256_store_ps(out[t] + 8 * h, v);
          }
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
          _mm256_store_ps(out[t] + 8 * h, _mm256_mul_ps(_mm256_load_ps(out[t] + 8 * h),
                                                        _mm256_loadu_ps(ws + 8 * h)));
    } else {
      // y = ((acc2 (1 / 254) + acc1) s) w_scale
      sum_quads<L * T>(acc, q, k, block, 0, quads, c == 0);
      const __m256 inv_residual = _mm256_set1_ps(1.f / kResidual);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const __m256 s = _mm256_set1_ps(op.scales[t0 + t]);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256 a1 = _mm256_cvtepi32_ps(acc[2 * t][h]);
          const __m256 a2 = _mm256_cvtepi32_ps(acc[2 * t + 1][h]);
          const __m256 v = _mm256_add_ps(_mm256_mul_ps(a2, inv_residual), a1);
          _mm256_store_ps(out[t] + 8 * h,
                          _mm256_mul_ps(_mm256_mul_ps(v, s), _mm256_loadu_ps(ws + 8 * h)));
        }
      }
    }
    const int64_t width = std::min<int64_t>(kBlock, cols - c * kBlock);
    for (int t = 0; t < T; ++t)
      std::memcpy(op.y + (t0 + t) * op.n + n0 + c * kBlock, out[t], width * sizeof(float));
  }
}

using TileFn = void (*)(const Operands&, int64_t, const int8_t*, int64_t);
// kTiles[L - 1][T]: T rows of L levels, T up to kTileCodeRows / L.
constexpr TileFn kTiles[2][kTileCodeRows + 1] = {
    {nullptr, tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>},
    {nullptr, tile<1, 2>, tile<2, 2>, nullptr, nullptr}};

}  // namespace

void int8_linear_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                     const at::Tensor& w_scale, int64_t n, int64_t levels, int64_t group,
                     at::Tensor& y) {
  const int64_t groups = check_int8_args(x, packed, excess, w_scale, n, levels, group);
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  check_out(y, m, n, "y");
  if (m == 0) return;

  std::unique_ptr<int8_t[]> q_buf(new int8_t[levels * m * k]);
  std::unique_ptr<float[]> scales_buf(new float[m * groups]);
  int8_t* q = q_buf.get();
  float* scales = scales_buf.get();
  quantize_activations(x, levels, group, 0, reinterpret_cast<uint8_t*>(q), scales);

  const int64_t tile_rows = kTileCodeRows / levels;
  const TileFn* tiles_of = kTiles[levels - 1];
  const int64_t tiles = (m + tile_rows - 1) / tile_rows;
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t panel_bytes = packed.size(1) * kPanel * 64;
  const Operands op{q, scales, k, groups, w_scale.data_ptr<float>(), y.data_ptr<float>(), n};
  // Work items: (panel, tile of rows), panel-major, as in the VNNI build.
  parallel_for(0, panels * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t p = item / tiles, t0 = (item % tiles) * tile_rows;
      tiles_of[std::min<int64_t>(tile_rows, m - t0)](op, t0, wp + p * panel_bytes,
                                                     p * kPanel * kBlock);
    }
  });
}

#else  // neither VNNI nor AVX2: int_kernels is "" and callers use torch._int_mm

void int8_linear_out(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, int64_t, int64_t, int64_t, at::Tensor&) {
  TORCH_CHECK(false, "int8_linear needs AVX-512 VNNI or AVX2");
}

#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                       const at::Tensor& w_scale, int64_t n, int64_t levels, int64_t group) {
  auto y = at::empty({x.dim() == 2 ? x.size(0) : 0, n}, x.options());
  int8_linear_out(x, packed, excess, w_scale, n, levels, group, y);
  return y;
}

}  // namespace llmserve
