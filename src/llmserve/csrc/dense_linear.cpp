// Dense linear layers, float32 or bfloat16 weights: y = x W^T with each output element's sum
// over the inputs in one fixed order, so that a row's result never depends on the batch.
//
// The arithmetic, for every m and n:
//   y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 1], w[n, 1], fma(x[m, 0], w[n, 0], +0)))
// Why it cannot depend on the batch, the threads, the instruction set or the vendor:
// 1. y[m, n] lives in one lane of one accumulator from k = 0 to K - 1. Nothing splits the
//    sum over k: no K blocking with partial sums added afterwards, no threads over k, no
//    reduction across lanes. The tile shapes (chosen by the number of rows), the blocking
//    and the threads decide which elements are computed together, never how one is.
// 2. Each step is an IEEE 754 fused multiply-add, a result defined to the bit: AVX-512's and
//    AVX2's instructions and std::fma on a CPU without FMA round alike.
// 3. bfloat16 weights widen to float32 exactly (a 16-bit shift).
// 4. Every thread computes denormals per IEEE 754 (IeeeDenormals), whatever its
//    floating-point state.
// So y[m, n] is a function of row m of x and of W alone. MKL promises nothing of the kind:
// its strict reproducibility mode (MKL_CBWR) keeps rows batch-invariant on Intel CPUs and
// not on AMD EPYC, where the same row alone and inside batches of 2..64 rows differed.
// llmserve.layers.quantization.dense.dense_reference computes the same chain with torch
// ops; the tests hold this kernel to it bitwise.
//
// Layout: W packed once at load into panels of 16 output channels, [N' / 16][K][16] (N'
// = N rounded up to 16 with zero channels): a tile streams each of its panels front to back.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_math.h"
#include "ops.h"

namespace llmserve {

namespace {

// One vector register of float32 lanes, the machine's own width. (The kernels' 16-lane
// vfloat of cpu_math.h is one register on AVX-512, but on AVX2 GCC moves it through the
// stack between every two instructions: 10x slower here.)
#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T splat(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const c10::BFloat16* p) {  // bfloat16 -> float32: a 16-bit shift, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T splat(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
};
#else  // no AVX2 and FMA: one lane at a time, std::fma rounding as the instruction does
struct Vec {
  using T = float;
  static constexpr int kWidth = 1;
  static T zero() { return 0.f; }
  static T splat(float x) { return x; }
  static T load(const float* p) { return *p; }
  static T load(const c10::BFloat16* p) { return static_cast<float>(*p); }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }
  static void store(float* p, T v) { *p = v; }
};
#endif

constexpr int kPanel = 16;                    // output channels per panel
constexpr int kRegs = kPanel / Vec::kWidth;  // registers per panel row
constexpr int kRows = 6;                      // rows per tile, when the batch has them
// Panels per tile by its rows: the accumulators (rows x panels x kRegs) and a panel row of
// weights fit the vector registers (AVX-512: 32, AVX2: 16).
#if defined(__AVX512F__)
constexpr int kPanelsFor[kRows + 1] = {0, 8, 8, 4, 4, 4, 4};
#else
constexpr int kPanelsFor[kRows + 1] = {0, 4, 2, 2, 1, 1, 1};
#endif
// Rows of x a thread keeps in cache while the panels of its columns pass: ~256 KiB of x.
constexpr int64_t kBlockBytes = 256 * 1024;

// y[r, c] for R rows of x (ldx apart) and the P panels from w (each k * 16 values), into
// y (rows ldy apart), its first `cols` columns. With `widened` (bfloat16 weights only), the
// panels also go there as float32, in the same layout, for the tiles of the rows after
// these. Loops over registers are unrolled at compile time: indexed by a runtime value, GCC
// keeps the accumulators on the stack.
template <int R, int P, typename W>
void tile(const float* x, int64_t ldx, const W* w, int64_t k, float* y, int64_t ldy,
          int64_t cols, float* widened) {
  constexpr int C = P * kRegs;  // registers across the tile's columns
  typename Vec::T acc[R][C];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  const int64_t panel = k * kPanel;
  for (int64_t i = 0; i < k; ++i) {
    typename Vec::T wv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
      wv[c] = Vec::load(w + (c / kRegs) * panel + i * kPanel + (c % kRegs) * Vec::kWidth);
    if constexpr (!std::is_same_v<W, float>) {
      if (widened != nullptr) {
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c)
          Vec::store(widened + (c / kRegs) * panel + i * kPanel + (c % kRegs) * Vec::kWidth,
                     wv[c]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const typename Vec::T xv = Vec::splat(x[r * ldx + i]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = Vec::fma(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const int64_t left = cols - c * Vec::kWidth;
      float* out = y + r * ldy + c * Vec::kWidth;
      if (left >= Vec::kWidth) {
        Vec::store(out, acc[r][c]);
      } else if (left > 0) {
        alignas(64) float lanes[Vec::kWidth];
        Vec::store(lanes, acc[r][c]);
        std::memcpy(out, lanes, left * sizeof(float));
      }
    }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t,
                        float*);

// kTiles<W, P>[R]: the tile of R rows over P panels, for the (R, P) a call can ask for
// (null for the others). A call's rows pick its span of panels (kPanelsFor), and every tile
// of the call runs over that span (or over 1 panel, at the end of a thread's columns where
// fewer than a span remain): a block's last tile of 1 or 2 rows too,
// where it used to take the span one panel at a time, each row's sums one chain of fused
// multiply-adds waiting on each other (7, 8, 13 rows: 4-8% slower than now, bench:
// benchmarks/dense_ab.py). Which elements a tile computes together changes; how one is
// computed does not.
// Whether a call can run a tile of R rows over P panels: over 1 panel, any R; over a
// span P, as many rows as a call whose rows pick that span (at most kRows a tile).
constexpr bool reachable(int R, int P) {
  if (P == 1) return true;
  for (int r = R; r <= kRows; ++r)
    if (kPanelsFor[r] == P) return true;
  return false;
}
template <int R, int P, typename W>
constexpr TileFn<W> tile_if_reachable() {
  if constexpr (reachable(R, P))
    return tile<R, P, W>;
  else
    return nullptr;
}
template <typename W, int P, int... R>
constexpr std::array<TileFn<W>, kRows + 1> tiles_over(std::integer_sequence<int, R...>) {
  return {nullptr, tile_if_reachable<R + 1, P, W>()...};
}
template <typename W, int P>
constexpr std::array<TileFn<W>, kRows + 1> kTiles =
    tiles_over<W, P>(std::make_integer_sequence<int, kRows>{});

// The tiles over `panels` panels: 1 (a span's last panels, fewer than the span) or one of
// kPanelsFor's values.
template <typename W>
const std::array<TileFn<W>, kRows + 1>& tiles_over_panels(int panels) {
  switch (panels) {
    case 1: return kTiles<W, 1>;
    case 2: return kTiles<W, 2>;
    case 4: return kTiles<W, 4>;
    default: return kTiles<W, 8>;
  }
}

template <typename W>
void run(const float* x, int64_t ldx, int64_t m, int64_t k, const W* w, int64_t panels,
         float* y, int64_t n) {
  // Threads take ranges of columns (spans of panels), never of inputs; each computes all
  // rows of its columns, a block of rows at a time, the block's x staying in cache.
  const int span = kPanelsFor[std::min<int64_t>(m, kRows)];
  const int64_t spans = (panels + span - 1) / span;
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (4 * k) / kRows) * kRows;
  const auto& wide = tiles_over_panels<W>(span);
  const auto& narrow = tiles_over_panels<W>(1);
  const auto& wide_f = tiles_over_panels<float>(span);
  const auto& narrow_f = tiles_over_panels<float>(1);
  parallel_for(0, spans, 1, [&](int64_t s0, int64_t s1) {
    IeeeDenormals ieee;
    // bfloat16 panels that several row tiles read: the first tile widens them to float32
    // as it reads them from memory, here, for the tiles after it (a pass of its own that
    // widened them first cost up to twice the step at 7 rows: it read memory while nothing
    // computed; benchmarks/dense_ab.py). Kept by the thread from call to call.
    thread_local std::vector<float> widened;
    for (int64_t m0 = 0; m0 < m; m0 += block) {
      const int64_t m1 = std::min(m, m0 + block);
      const bool widen = !std::is_same_v<W, float> && m1 - m0 > kRows;
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t p0 = s * span, count = std::min<int64_t>(span, panels - p0);
        const W* wp = w + p0 * k * kPanel;
        if (widen && widened.size() < static_cast<size_t>(count * k * kPanel))
          widened.resize(count * k * kPanel);
        for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - r0));
          const float* xr = x + r0 * ldx;
          float* yr = y + r0 * n + p0 * kPanel;
          const int64_t cols = n - p0 * kPanel, stride = k * kPanel;
          // The first tile reads w (and widens it, if asked); the others the widened panels.
          const bool from_w = !widen || r0 == m0;
          float* into = widen && r0 == m0 ? widened.data() : nullptr;
          const float* wf = widened.data();
          if (count == span) {
            if (from_w)
              wide[rows](xr, ldx, wp, k, yr, n, cols, into);
            else
              wide_f[rows](xr, ldx, wf, k, yr, n, cols, nullptr);
            continue;
          }
          for (int64_t q = 0; q < count; ++q) {
            float* yq = yr + q * kPanel;
            if (from_w)
              narrow[rows](xr, ldx, wp + q * stride, k, yq, n, cols - q * kPanel,
                           into == nullptr ? nullptr : into + q * stride);
            else
              narrow_f[rows](xr, ldx, wf + q * stride, k, yq, n, cols - q * kPanel, nullptr);
          }
        }
      }
    }
  });
}

}  // namespace

int64_t dense_panel_width() { return kPanel; }

void dense_linear_out(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a float32 [rows, in] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kFloat ||
                   packed.scalar_type() == at::kBFloat16),
              "packed must be a contiguous float32 or bfloat16 [out_padded / 16, in, 16] "
              "tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " input channels, the weight ",
              packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "packed holds ",
              panels * kPanel, " output channels, not ", n, " padded to a multiple of 16");
  check_out(y, m, n, "y");
  if (m == 0) return;
  if (k == 0) {
    y.zero_();
    return;
  }
  const float* xp = x.data_ptr<float>();
  if (packed.scalar_type() == at::kFloat)
    run(xp, x.stride(0), m, k, packed.data_ptr<float>(), panels, y.data_ptr<float>(), n);
  else
    run(xp, x.stride(0), m, k, packed.data_ptr<c10::BFloat16>(), panels, y.data_ptr<float>(),
        n);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  auto y = at::empty({x.dim() == 2 ? x.size(0) : 0, n}, x.options());
  dense_linear_out(x, packed, n, y);
  return y;
}

}  // namespace llmserve
