// Small branch-free float helpers shared by the kernels: loops over them vectorize, and
// each result depends only on its own inputs (no reassociation across a row).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace llmserve {

constexpr int kLanes = 16;  // partial sums of a reduction over a row

// exp(x) (Cephes expf polynomial, about 2 ulp), inputs clamped to [-87.3, 88]: no inf,
// no denormals.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// sum_i a[i] * b[i] over n (a multiple of kLanes) in kLanes interleaved partial sums,
// combined pairwise: a fixed order for every n.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  for (int64_t d = 0; d < n; d += kLanes)
    for (int i = 0; i < kLanes; ++i) acc[i] = std::fma(a[d + i], b[d + i], acc[i]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) acc[i] += acc[i + w];
  return acc[0];
}

// sum_i a[i]^2 with any n: kLanes partial sums, then the tail, in a fixed order.
inline float sum_squares(const float* a, int64_t n) {
  float acc[kLanes] = {0};
  const int64_t body = n - n % kLanes;
  for (int64_t d = 0; d < body; d += kLanes)
    for (int i = 0; i < kLanes; ++i) acc[i] = std::fma(a[d + i], a[d + i], acc[i]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) acc[i] += acc[i + w];
  float s = acc[0];
  for (int64_t d = body; d < n; ++d) s = std::fma(a[d], a[d], s);
  return s;
}

}  // namespace llmserve
