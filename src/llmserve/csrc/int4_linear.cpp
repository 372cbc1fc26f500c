// int4 linear layers with AVX-512 VNNI, for weights w[n, k] = scale[n, g] q[n, k] + zero[n, g]
// (q in 0..15, groups g of 32, 64 or 128 input channels: GGUF's Q4_1 and its kin).
//
// Activations are quantized to one int8 level per group a of 32 inputs of a row, as
// llama.cpp's Q8_1 does for its 4-bit dot products: x = s_a x1 with s_a = max|x| / 127 over
// the group. The group's integer dot products A_a = sum q x1 come from vpdpbusd (the weights
// are the unsigned operand: no offset to correct), and with X_a = sum x1:
//   acc = fma(scale s_a, A_a, acc),  then  acc = fma(zero, s_a X_a, acc)
// (scale and zero of the weight group holding a; scale s_a a rounded product), in that
// order, each fused multiply-add rounded once: 4 vector steps per group and 16 outputs of a
// row where separate products and sums took 6 (about an eighth of a large batch's work).
// The integer parts are exact; the float steps run in a fixed order per output, so a row's
// result does not depend on the rest of the batch. Against the two levels
// per row of earlier versions: half the integer products, at +0.44% perplexity on SmolLM2
// against float32 weights from the same file (two levels: +0.21%; BENCHMARKS.md).
//
// Row tiles: a tile of T rows runs over a panel's groups, keeping its integer sums in
// registers and unpacking each quad's nibbles in registers. Up to 4 rows are the panel's
// only tile and read its four channel blocks at once (or, where the panels do not split
// evenly over the threads, two tiles of half a panel each); more rows are split into
// balanced tiles (5: 5; 8: 4 + 4; 9: 4 + 5), which in the VNNI build take up to 6 rows and
// run half a panel at a time with their float outputs in registers too.
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
#include <memory>
#include <vector>

#include "ops.h"
#include "vnni.h"

namespace llmserve {

#if LLMSERVE_HAS_VNNI || LLMSERVE_HAS_INT_AVX2

namespace {

constexpr int kBlock = 16;       // output channels per block (one AVX-512 vector)
constexpr int kPanel = 4;        // channel blocks per panel: 64 channels
constexpr int kMaxTileRows = 6;  // activation rows per tile (a build may take fewer)
constexpr int kActGroup = 32;    // inputs per activation scale

// A tile's activations: codes [rows][k], and per row and group of kActGroup inputs the
// scale s_a and s_a X_a (X_a: the sum of the group's codes).
struct Activations {
  const int8_t* codes;
  const float* scales;
  const float* scaled_sums;
  int64_t k, groups;
};

// What a tile fetches besides its own reads: `first_pass` (the panel comes from memory: fetch
// ahead of the reads), and `ahead_lines` 64-byte lines from `ahead` (its share of the next
// panel its thread computes, into L2 while this panel computes from cache).
struct Prefetch {
  bool first_pass;
  const uint8_t* ahead;
  int64_t ahead_lines;
};

// Which channels of a panel a tile computes: all four blocks, or one half (blocks 2h, 2h + 1).
constexpr int kWholePanel = -1;

// (activations, weight group, weights as packed, scale_zero, y, y stride, columns, prefetch,
// half: kWholePanel or 0 / 1). y and columns are the panel's, whatever the half.
using TileFn = void (*)(const Activations&, int64_t, const uint8_t*, const uint16_t*, float*,
                        int64_t, int64_t, const Prefetch&, int);

// A call of up to kSingleTileRows rows runs one tile of its rows (`single`); more rows are
// split into balanced tiles of up to `max_rows` (`by_rows`).
constexpr int kSingleTileRows = 4;

struct Tiles {
  TileFn single[kSingleTileRows + 1];  // single[T]: T rows, the panel's only tile
  TileFn by_rows[kMaxTileRows + 1];    // by_rows[T]: a tile of T rows of many, or half a panel
  int64_t max_rows;
};

// One group of kActGroup inputs to int8 codes: s = max(max|x| / 127, smallest normal float),
// codes = round(x (1 / s)) (half to even, clamped to [-127, 127]): split_row's one-level
// arithmetic (vnni.h), on two vectors at once. scaled_sum = s times the sum of the codes.
inline void quantize_group(const float* x, int8_t* codes, float& scale, float& scaled_sum) {
#if LLMSERVE_HAS_VNNI
  static_assert(kActGroup == 32, "two 16-lane vectors per group");
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float s = std::max(
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / kLevels,
      std::numeric_limits<float>::min());
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 inv = _mm512_set1_ps(1.f / s), hi = _mm512_set1_ps(kLevels),
               lo = _mm512_set1_ps(-kLevels);
  const __m512i c0 = _mm512_cvtps_epi32(_mm512_min_ps(
      _mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v0, inv), kNearest), lo), hi));
  const __m512i c1 = _mm512_cvtps_epi32(_mm512_min_ps(
      _mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v1, inv), kNearest), lo), hi));
  // Narrowed in registers and stored as one vector: Zen 4's narrowing stores (vpmovdb to
  // memory) stalled the loads behind them, a fifth of a 64-row call.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_set_m128i(_mm512_cvtepi32_epi8(c1), _mm512_cvtepi32_epi8(c0)));
  scale = s;
  scaled_sum = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
#else
  const float s = split_row(x, kActGroup, 0, reinterpret_cast<uint8_t*>(codes), nullptr);
  int32_t sum = 0;
  for (int i = 0; i < kActGroup; ++i) sum += codes[i];
  scale = s;
  scaled_sum = s * static_cast<float>(sum);
#endif
}

// Checks the arguments, quantizes each row of x (one int8 level per group of kActGroup
// inputs) and runs `tiles` over (panel, tile of up to kMaxTileRows rows) items, panel-major.
void run_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero,
              int64_t group, int64_t n, const Tiles& kernels, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a float32 [rows, in] tensor with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(group % kActGroup == 0 && k % group == 0, "in (", k,
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
  check_out(y, m, n, "y");
  if (m == 0) return;

  // Scratch without zero-filling (a std::vector would memset it on every call).
  const int64_t act_groups = k / kActGroup;
  std::unique_ptr<int8_t[]> codes_buf(new int8_t[m * k]);
  std::unique_ptr<float[]> scales_buf(new float[2 * m * act_groups]);
  int8_t* codes = codes_buf.get();
  float* scales = scales_buf.get();
  float* scaled_sums = scales + m * act_groups;
  const float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  parallel_for(0, m, 8, [&](int64_t b, int64_t e) {
    // Locals, not the captured references: the stores of codes may alias anything, and
    // every group reloaded the captures behind them.
    const float* x_rows = xp;
    int8_t* code_rows = codes;
    float *row_scales = scales, *row_sums = scaled_sums;
    const int64_t stride = x_stride, in = k, per_row = act_groups;
    for (int64_t r = b; r < e; ++r)
      for (int64_t a = 0; a < per_row; ++a) {
        const int64_t i = r * per_row + a;
        quantize_group(x_rows + r * stride + a * kActGroup, code_rows + r * in + a * kActGroup,
                       row_scales[i], row_sums[i]);
      }
  });

  // Work items: (panel, tile of rows), panel-major, so that a thread runs the row tiles of one
  // panel back to back while the panel sits in cache. A panel's first pass waits on memory;
  // with two tiles or more a panel, each tile instead fetches its share of the thread's next
  // panel into L2 while it computes (as int8_linear does). A few rows whose panels do not
  // split evenly over the threads (9 panels on 2: 5 against 4) run in half panels instead
  // where that evens the threads' shares (9 against 9), each half-panel item a tile of all
  // the rows: the same arithmetic per output, so the same bits.
  const bool single = m <= kSingleTileRows;
  const int64_t threads = num_threads();
  const auto most = [threads](int64_t items) { return (items + threads - 1) / threads; };
  const bool halves = single && most(2 * panels) < 2 * most(panels);
  const TileFn* by_rows = single && !halves ? kernels.single : kernels.by_rows;
  const int64_t tiles = single ? 1 : (m + kernels.max_rows - 1) / kernels.max_rows;
  const int64_t panel_bytes = k * 32, panel_lines = panel_bytes / 64;
  const bool spread = tiles >= 2;
  const int64_t share_lines = (panel_lines + tiles - 1) / tiles;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int parts = halves ? 2 : 1;  // items a panel is split into, across its channels
  parallel_for(0, panels * tiles * parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t part_item = b; part_item < e; ++part_item) {
      const int64_t item = part_item / parts;
      const int half = halves ? static_cast<int>(part_item % parts) : kWholePanel;
      const int64_t p = item / tiles, t = item % tiles;
      const int64_t t0 = t * m / tiles, rows = (t + 1) * m / tiles - t0;  // balanced
      const int64_t n0 = p * kPanel * kBlock;
      const int64_t first_line = std::min(t * share_lines, panel_lines);
      const Prefetch prefetch{
          part_item == b || (t == 0 && !spread), wp + (p + 1) * panel_bytes + first_line * 64,
          spread && (p + 1) * tiles < e ? std::min(share_lines, panel_lines - first_line) : 0};
      const Activations act{codes + t0 * k, scales + t0 * act_groups,
                            scaled_sums + t0 * act_groups, k, act_groups};
      by_rows[rows](act, group, wp + p * panel_bytes, szp + p * groups * 2 * kPanel * kBlock,
                    yp + t0 * n + n0, n, std::min<int64_t>(kPanel * kBlock, n - n0), prefetch,
                    half);
    }
  });
}

}  // namespace

#endif

#if LLMSERVE_HAS_VNNI

namespace {

constexpr int kPrefetch = 2048;
constexpr int kGroupQuads = kActGroup / 4;

// One activation group (quads [j0, j0 + kGroupQuads)) for T rows on the four channel blocks
// of a panel: sums[t][c] = A (exact int32). Its own function, not inlined, with the prefetch
// choice a template argument: inside tile()'s group loop, or with the loop unswitched on a
// runtime flag, GCC copied half of the accumulators through other registers around every
// vpdpbusd.
template <int T, bool prefetch>
__attribute__((noinline)) void group_dots(const int8_t* q, int64_t k, int64_t j0,
                                          const uint8_t* weights, __m512i* sums) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i acc[T][kPanel];
#pragma GCC unroll 4
  for (int r = 0; r < T; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) acc[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int64_t j = j0; j < j0 + kGroupQuads; ++j) {
    const uint8_t* wj = weights + j * 128;
    if constexpr (prefetch) {  // a panel's first pass, from memory; later ones find it cached
      _mm_prefetch(reinterpret_cast<const char*>(wj) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wj) + kPrefetch + 64, _MM_HINT_T0);
    }
    const __m512i v0 = _mm512_load_si512(wj), v1 = _mm512_load_si512(wj + 64);
    const __m512i w[kPanel] = {
        _mm512_and_si512(v0, low), _mm512_and_si512(_mm512_srli_epi16(v0, 4), low),
        _mm512_and_si512(v1, low), _mm512_and_si512(_mm512_srli_epi16(v1, 4), low)};
    rows_times_weights<T, kPanel, true>(acc, reinterpret_cast<const uint8_t*>(q), k, j, w);
  }
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) sums[t * kPanel + c] = acc[t][c];
}

// Up to 4 rows, the panel's only tile: the four channel blocks at once (4T sums in
// registers, each quad's 128 bytes read together, the nibbles unpacked in registers); the
// float outputs wait in L1 while the next group's integer sums take the registers.
template <int T>
void tile(const Activations& act, int64_t group, const uint8_t* weights,
          const uint16_t* scale_zero, float* y, int64_t y_stride, int64_t cols,
          const Prefetch& prefetch, int /*half: always the whole panel*/) {
  const int64_t per_group = group / kActGroup;
  alignas(64) float out[T][kPanel * kBlock] = {};
  alignas(64) __m512i sums[T * kPanel];
  for (int64_t a = 0; a < act.groups; ++a) {
    (prefetch.first_pass ? group_dots<T, true> : group_dots<T, false>)(
        act.codes, act.k, a * kGroupQuads, weights, sums);
    const uint16_t* sz = scale_zero + (a / per_group) * 2 * kPanel * kBlock;
#pragma GCC unroll 4
    for (int c = 0; c < kPanel; ++c) {
      const __m512 scale = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + c * kBlock)));
      const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(sz + (kPanel + c) * kBlock)));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int64_t i = t * act.groups + a;
        float* o = out[t] + c * kBlock;
        const __m512 sa = _mm512_mul_ps(scale, _mm512_set1_ps(act.scales[i]));
        __m512 v =
            _mm512_fmadd_ps(sa, _mm512_cvtepi32_ps(sums[t * kPanel + c]), _mm512_load_ps(o));
        v = _mm512_fmadd_ps(zero, _mm512_set1_ps(act.scaled_sums[i]), v);
        _mm512_store_ps(o, v);
      }
    }
  }
  for (int t = 0; t < T; ++t) std::memcpy(y + t * y_stride, out[t], cols * sizeof(float));
}

// One of several row tiles of a panel (up to 6 rows): half a panel at a time over all the
// groups, so that the integer sums and the float outputs of the half stay in registers
// (4T + 4 vectors: no loads and stores of the outputs at every group); the nibbles are
// unpacked in registers, each half of a quad read in its own pass.
template <int T, bool first_pass>
void register_tile_impl(const Activations& act, int64_t group, const uint8_t* weights,
                        const uint16_t* scale_zero, float* y, int64_t y_stride, int64_t cols,
                        const Prefetch& prefetch, int half) {
  const int64_t per_group = group / kActGroup, k = act.k;
  const auto* codes = reinterpret_cast<const uint8_t*>(act.codes);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t ahead_per_step = (prefetch.ahead_lines + 2 * act.groups - 1) / (2 * act.groups);
  int64_t ahead = 0;
  const int h_begin = half == kWholePanel ? 0 : half, h_end = half == kWholePanel ? 2 : half + 1;
  for (int h = h_begin; h < h_end && 2 * h * kBlock < cols; ++h) {
    __m512 out[T][2];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) out[t][0] = out[t][1] = _mm512_setzero_ps();
    for (int64_t a = 0; a < act.groups; ++a) {
      for (const int64_t end = std::min(ahead + ahead_per_step, prefetch.ahead_lines);
           ahead < end; ++ahead)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch.ahead) + 64 * ahead, _MM_HINT_T1);
      __m512i acc[T][2];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t j = a * kGroupQuads; j < (a + 1) * kGroupQuads; ++j) {
        const uint8_t* wj = weights + j * 128 + 64 * h;
        if constexpr (first_pass)
          _mm_prefetch(reinterpret_cast<const char*>(wj) + kPrefetch, _MM_HINT_T0);
        const __m512i v = _mm512_load_si512(wj);
        const __m512i w[2] = {_mm512_and_si512(v, low),
                              _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
        rows_times_weights<T, 2, true>(acc, codes, k, j, w);
      }
      const uint16_t* sz = scale_zero + (a / per_group) * 2 * kPanel * kBlock;
#pragma GCC unroll 2
      for (int cc = 0; cc < 2; ++cc) {
        const int c = 2 * h + cc;
        const __m512 scale = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + c * kBlock)));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(sz + (kPanel + c) * kBlock)));
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const int64_t i = t * act.groups + a;
          const __m512 sa = _mm512_mul_ps(scale, _mm512_set1_ps(act.scales[i]));
          out[t][cc] = _mm512_fmadd_ps(sa, _mm512_cvtepi32_ps(acc[t][cc]), out[t][cc]);
          out[t][cc] = _mm512_fmadd_ps(zero, _mm512_set1_ps(act.scaled_sums[i]), out[t][cc]);
        }
      }
    }
    alignas(64) float row[2 * kBlock];
    const int64_t width = std::min<int64_t>(2 * kBlock, cols - 2 * h * kBlock);
    for (int t = 0; t < T; ++t) {
      _mm512_store_ps(row, out[t][0]);
      _mm512_store_ps(row + kBlock, out[t][1]);
      std::memcpy(y + t * y_stride + 2 * h * kBlock, row, width * sizeof(float));
    }
  }
}

template <int T>
void register_tile(const Activations& act, int64_t group, const uint8_t* weights,
                   const uint16_t* scale_zero, float* y, int64_t y_stride, int64_t cols,
                   const Prefetch& prefetch, int half) {
  (prefetch.first_pass ? register_tile_impl<T, true> : register_tile_impl<T, false>)(
      act, group, weights, scale_zero, y, y_stride, cols, prefetch, half);
}

constexpr Tiles kTiles = {{nullptr, tile<1>, tile<2>, tile<3>, tile<4>},
                           {nullptr, register_tile<1>, register_tile<2>, register_tile<3>,
                            register_tile<4>, register_tile<5>, register_tile<6>},
                           6};

}  // namespace

void int4_linear_out(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale_zero, int64_t group, int64_t n, at::Tensor& y) {
  run_int4(x, packed, scale_zero, group, n, kTiles, y);
}

#elif LLMSERVE_HAS_INT_AVX2

namespace {

// One block of 16 output channels (c: its half and nibble in the packing) for T rows over
// the groups: the float steps of the VNNI tile, 8 lanes at a time.
template <int T>
void block_of_tile(const Activations& act, int64_t group, const uint8_t* weights,
                   const uint16_t* scale_zero, int c, int half, float (&out)[T][kBlock]) {
  const int64_t per_group = group / kActGroup, k = act.k;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int shift = 4 * (c % 2);
  const uint8_t* half_ahead = weights + 16 * 128 + 64 * (c / 2);  // (see int8_linear.cpp)
  const uint8_t* half_data = weights + 64 * (c / 2);
  for (int t = 0; t < T; ++t) std::fill(out[t], out[t] + kBlock, 0.f);
  for (int64_t a = 0; a < act.groups; ++a) {
    __m256i acc[T][2];
#pragma GCC unroll 4
    for (int r = 0; r < T; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t j = a * kActGroup / 4; j < (a + 1) * kActGroup / 4; ++j) {
      const uint8_t* wj = half_data + j * 128;
      if (half == kWholePanel && c == 0) {  // the first block fetches both halves ahead
        _mm_prefetch(reinterpret_cast<const char*>(weights + (j + 16) * 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(weights + (j + 16) * 128 + 64),
                     _MM_HINT_T0);
      } else if (c == 2 * half) {  // a half panel's first block fetches its half
        _mm_prefetch(reinterpret_cast<const char*>(half_ahead + j * 128), _MM_HINT_T0);
      }
      const __m256i w0 = _mm256_and_si256(
          _mm256_srli_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wj)), shift),
          low);
      const __m256i w1 = _mm256_and_si256(
          _mm256_srli_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wj + 32)),
                            shift),
          low);
#pragma GCC unroll 4
      for (int r = 0; r < T; ++r) {
        int32_t four;
        std::memcpy(&four, act.codes + r * k + 4 * j, 4);
        const __m256i x = _mm256_set1_epi32(four);
        acc[r][0] = dot_quads(acc[r][0], w0, x);
        acc[r][1] = dot_quads(acc[r][1], w1, x);
      }
    }
    const uint16_t* sz = scale_zero + (a / per_group) * 2 * kPanel * kBlock;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + c * kBlock + 8 * h)));
      const __m256 zero = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(sz + (kPanel + c) * kBlock + 8 * h)));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int64_t i = t * act.groups + a;
        float* o = out[t] + 8 * h;
        const __m256 sa = _mm256_mul_ps(scale, _mm256_set1_ps(act.scales[i]));
        __m256 v = _mm256_fmadd_ps(sa, _mm256_cvtepi32_ps(acc[t][h]), _mm256_load_ps(o));
        v = _mm256_fmadd_ps(zero, _mm256_set1_ps(act.scaled_sums[i]), v);
        _mm256_store_ps(o, v);
      }
    }
  }
}

template <int T>
void tile(const Activations& act, int64_t group, const uint8_t* weights,
          const uint16_t* scale_zero, float* y, int64_t y_stride, int64_t cols,
          const Prefetch& /*prefetch*/, int half) {
  alignas(32) float out[T][kBlock];
  const int c_begin = half == kWholePanel ? 0 : 2 * half;
  const int c_end = half == kWholePanel ? kPanel : 2 * half + 2;
  for (int c = c_begin; c < c_end && c * kBlock < cols; ++c) {
    block_of_tile<T>(act, group, weights, scale_zero, c, half, out);
    const int64_t width = std::min<int64_t>(kBlock, cols - c * kBlock);
    for (int t = 0; t < T; ++t)
      std::memcpy(y + t * y_stride + c * kBlock, out[t], width * sizeof(float));
  }
}

constexpr Tiles kTiles = {{nullptr, tile<1>, tile<2>, tile<3>, tile<4>},
                           {nullptr, tile<1>, tile<2>, tile<3>, tile<4>}, 4};

}  // namespace

void int4_linear_out(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale_zero, int64_t group, int64_t n, at::Tensor& y) {
  run_int4(x, packed, scale_zero, group, n, kTiles, y);
}

#else  // neither VNNI nor AVX2: int_kernels is "" and int4 layers use PyTorch's kernel

void int4_linear_out(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                     int64_t, at::Tensor&) {
  TORCH_CHECK(false, "int4_linear needs AVX-512 VNNI or AVX2");
}

#endif

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scale_zero, int64_t group, int64_t n) {
  auto y = at::empty({x.dim() == 2 ? x.size(0) : 0, n}, x.options());
  int4_linear_out(x, packed, scale_zero, group, n, y);
  return y;
}

}  // namespace llmserve
