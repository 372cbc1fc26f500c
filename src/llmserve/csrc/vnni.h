// What the integer linear kernels (int8_linear.cpp, int4_linear.cpp) share: which
// instructions they are built for, and the split of an activation row into two int8 levels,
// x = s (x1 + x2 / 254), the arithmetic of llmserve.layers.quantization.int8.split_levels.
//
// Two builds of each kernel, over the same packed weights and with bitwise the same results
// (exact integer sums, then the same float steps in the same order):
//   AVX-512 VNNI: vpdpbusd, four u8 x s8 products summed into an int32 lane;
//   AVX2 (AMD Zen 2/3, Intel before Ice Lake, or LLMSERVE_CPU_ISA=avx2): vpmaddubsw, two
//     u8 x s8 products summed into an int16 lane, then vpmaddwd into int32. Its int16 sum
//     saturates past 32767, so both operands stay small enough that it never does: int4
//     nibbles (0..15) times codes in [-127, 127]; for int8 x int8, |w| times sign(w) x
//     (llama.cpp's trick), both within 127 (2 x 127 x 127 = 32258).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LLMSERVE_HAS_VNNI 1
#define LLMSERVE_HAS_INT_AVX2 0
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define LLMSERVE_HAS_VNNI 0
#define LLMSERVE_HAS_INT_AVX2 1
#else
#define LLMSERVE_HAS_VNNI 0
#define LLMSERVE_HAS_INT_AVX2 0
#endif

namespace llmserve {

constexpr float kLevels = 127.f;
constexpr float kResidual = 254.f;  // the rounding residual is within +-s/2: 254 steps of s/254

#if LLMSERVE_HAS_VNNI

// acc += u8 . s8 (vpdpbusd: four byte products summed into each int32 lane), accumulating
// in place. The intrinsic leaves GCC free to put the sum in another register, and in the
// int4 kernel's loop it did, copying half of the accumulators around every instruction.
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

// acc[r][c] += (bytes 4j..4j+3 of code row r, broadcast) . w[c] for r < R, c < C: one
// 4-input step of a tile. The code rows are k bytes apart; in the int8 kernel they are the
// unsigned operand (biased activations), in the int4 kernel the weights are.
template <int R, int C, bool kWeightsUnsigned>
inline void rows_times_weights(__m512i (&acc)[R][C], const uint8_t* codes, int64_t k,
                               int64_t j, const __m512i (&w)[C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, codes + r * k + 4 * j, 4);
    const __m512i a = _mm512_set1_epi32(four);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      if constexpr (kWeightsUnsigned)
        dpbusd(acc[r][c], w[c], a);
      else
        dpbusd(acc[r][c], a, w[c]);
    }
  }
}

// The low bytes of 16 int32 lanes to out[0..16), the lanes of `mask` only. Narrowed in a
// register, then stored: Zen 4's narrowing store (vpmovdb to memory) stalls the loads that
// follow it, and made a fifth of a 64-row int4 call.
inline void store_bytes(uint8_t* out, __mmask16 mask, __m512i lanes) {
  const __m128i bytes = _mm512_cvtepi32_epi8(lanes);
  if (mask == 0xFFFF)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
  else
    _mm_mask_storeu_epi8(out, mask, bytes);
}

// One activation row x[0..k) split into two levels, 16 lanes at a time:
//   s = max(max|x| / 127, smallest normal float) (1 / s is finite),
//   x1 = round(x (1 / s)), x2 = round((x - s x1) 254 (1 / s)), each clamped to [-127, 127]
// (rounding half to even; no fused multiply-add; 1 / s once per row, then products),
// bitwise the arithmetic of split_levels in Python. x1 + bias goes to out1[0..k), x2 + bias
// to out2[0..k) (bias 128 makes them vpdpbusd's unsigned operand); with out2 null only x1
// is computed (one level, the arithmetic of quantize_activations). With group_sums, the
// exact sum of 254 x1 + x2 over each group of `group` inputs (a multiple of 16) goes to
// group_sums[g]. Returns s.
inline float split_row(const float* x, int64_t k, int32_t bias, uint8_t* out1, uint8_t* out2,
                       int64_t group = 0, float* group_sums = nullptr) {
  auto tail = [k](int64_t i) {
    return k - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << (k - i)) - 1);
  };
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(i), x + i)));
  const float s =
      std::max(_mm512_reduce_max_ps(amax) / kLevels, std::numeric_limits<float>::min());

  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 vs = _mm512_set1_ps(s), inv = _mm512_set1_ps(1.f / s),
               hi = _mm512_set1_ps(kLevels), lo = _mm512_set1_ps(-kLevels),
               residual = _mm512_set1_ps(kResidual);
  const __m512i vbias = _mm512_set1_epi32(bias), v254 = _mm512_set1_epi32(254);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = tail(i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    const __m512 a = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), kNearest);
    const __m512i x1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(a, lo), hi));
    store_bytes(out1 + i, mask, _mm512_add_epi32(x1, vbias));
    if (out2 == nullptr) continue;
    const __m512 b = _mm512_roundscale_ps(
        _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_mul_ps(a, vs)), residual), inv),
        kNearest);
    const __m512i x2 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(b, lo), hi));
    store_bytes(out2 + i, mask, _mm512_add_epi32(x2, vbias));
    if (group_sums != nullptr) {
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_mullo_epi32(x1, v254), x2));
      if ((i + 16) % group == 0) {
        group_sums[i / group] = static_cast<float>(_mm512_reduce_add_epi32(sum));
        sum = _mm512_setzero_si512();
      }
    }
  }
  return s;
}

#elif LLMSERVE_HAS_INT_AVX2

// The activation split of split_row above, one element at a time, the same roundings in the
// same order (products by 1 / s, round half to even, no fused multiply-add): bitwise the
// same codes, scale and group sums.
inline float split_row(const float* x, int64_t k, int32_t bias, uint8_t* out1, uint8_t* out2,
                       int64_t group = 0, float* group_sums = nullptr) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = std::max(amax / kLevels, std::numeric_limits<float>::min());
  const float inv = 1.f / s;
  int32_t sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    const float a = std::nearbyint(x[i] * inv);
    const int32_t x1 = static_cast<int32_t>(std::min(std::max(a, -kLevels), kLevels));
    out1[i] = static_cast<uint8_t>(x1 + bias);
    if (out2 == nullptr) continue;
    const float b = std::nearbyint(((x[i] - a * s) * kResidual) * inv);
    const int32_t x2 = static_cast<int32_t>(std::min(std::max(b, -kLevels), kLevels));
    out2[i] = static_cast<uint8_t>(x2 + bias);
    if (group_sums != nullptr) {
      sum += 254 * x1 + x2;
      if ((i + 1) % group == 0) {
        group_sums[i / group] = static_cast<float>(sum);
        sum = 0;
      }
    }
  }
  return s;
}

// acc (8 int32 lanes) += the sums of four adjacent byte products u8 x s8, u8 <= 255 and s8 in
// [-127, 127] with every pair sum within int16 (see the header).
inline __m256i dot_quads(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}

#endif

// The instruction set the integer kernels were built for ("" if none: callers fall back).
inline const char* int_kernels_isa() {
  return LLMSERVE_HAS_VNNI ? "avx512_vnni" : LLMSERVE_HAS_INT_AVX2 ? "avx2" : "";
}

}  // namespace llmserve
