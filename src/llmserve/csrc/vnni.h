// What the VNNI linear kernels (int8_linear.cpp, int4_linear.cpp) share: whether the CPU has
// the instructions, and the split of an activation row into two int8 levels,
// x = s (x1 + x2 / 254), the arithmetic of llmserve.layers.quantization.int8.split_levels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LLMSERVE_HAS_VNNI 1
#else
#define LLMSERVE_HAS_VNNI 0
#endif

namespace llmserve {

constexpr float kLevels = 127.f;
constexpr float kResidual = 254.f;  // the rounding residual is within +-s/2: 254 steps of s/254

// s = max|x| / 127 (floored at the smallest normal float).
inline float level_scale(const float* x, int64_t k) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  return std::max(amax, std::numeric_limits<float>::min()) / kLevels;
}

// x1 = round(x / s), x2 = round((x - s x1) 254 / s), each clamped to [-127, 127].
inline void split_levels(float x, float s, int32_t* x1, int32_t* x2) {
  const float a = std::nearbyint(x / s);
  const float b = std::nearbyint(((x - a * s) * kResidual) / s);
  *x1 = static_cast<int32_t>(std::clamp(a, -kLevels, kLevels));
  *x2 = static_cast<int32_t>(std::clamp(b, -kLevels, kLevels));
}

}  // namespace llmserve
