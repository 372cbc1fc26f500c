// Small float helpers shared by the kernels, written with GCC/Clang vector extensions so
// that they map onto the CPU's SIMD registers (AVX-512 here, narrower elsewhere) without
// relying on the auto-vectorizer. Each result depends only on its own inputs, in a fixed
// order: no reassociation across a row.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace llmserve {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

inline vfloat vsplat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_set1_ps(x));  // one broadcast
#else
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}

// a * b + c per lane, fused (one rounding) where the CPU has FMA; the same on every call
// of one build. Only for kernels not held bitwise to an unfused reference (attention).
inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                  reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(c)));
#else
  return a * b + c;
#endif
}

// Lanes summed pairwise (8 apart, then 4, 2, 1): the same order for every call.
inline float vsum(vfloat v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return v[0];
}

// While alive, the calling thread handles denormals one fixed way, whatever the thread's
// floating-point state was (x86 MXCSR: FTZ flushes denormal results, DAZ denormal inputs),
// restored on exit. A kernel's threads then all compute alike: a thread that had flushing
// switched on (torch.set_flush_denormal) cannot make an element depend on which thread
// computed it.
template <bool kFlush>
class DenormalMode {
 public:
#if defined(__SSE__)
  DenormalMode() : saved_(_mm_getcsr()) {
    _mm_setcsr(kFlush ? saved_ | kFtzDaz : saved_ & ~kFtzDaz);
  }
  ~DenormalMode() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtzDaz = 0x8040;
  unsigned saved_;
#endif
};

// Flushed: a softmax weight near exp(-87) times a value is denormal, and denormal
// arithmetic takes a microcode assist of ~100 cycles per instruction: a few rows with one
// dominant score made attention 10-20x slower. Deterministic per element.
using FlushDenormals = DenormalMode<true>;
// IEEE 754 exactly (no flushing): kernels held bitwise to a reference computed elsewhere.
using IeeeDenormals = DenormalMode<false>;

// exp(x) per lane (Cephes expf polynomial, about 2 ulp), inputs clamped to [-87.3, 88].
inline vfloat vexp(vfloat x) {
  const vfloat lo = vsplat(-87.3f), hi = vsplat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  const vfloat magic = vsplat(12582912.0f);
  const vfloat n = (x * 1.44269504088896341f + magic) - magic;
  vfloat r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vfloat p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// sum_i a[i] * b[i] for n a multiple of kLanes.
inline float dot(const float* a, const float* b, int64_t n) {
  vfloat acc{};
  for (int64_t d = 0; d < n; d += kLanes) acc += vload(a + d) * vload(b + d);
  return vsum(acc);
}

// o[i] += w * v[i] for n a multiple of kLanes.
inline void axpy(float w, const float* v, float* o, int64_t n) {
  const vfloat wv = vsplat(w);
  for (int64_t d = 0; d < n; d += kLanes) vstore(o + d, vload(o + d) + wv * vload(v + d));
}

// sum_i a[i]^2 for any n: lanes over the body, then the tail, in a fixed order.
inline float sum_squares(const float* a, int64_t n) {
  vfloat acc{};
  const int64_t body = n - n % kLanes;
  for (int64_t d = 0; d < body; d += kLanes) {
    const vfloat v = vload(a + d);
    acc += v * v;
  }
  float s = vsum(acc);
  for (int64_t d = body; d < n; ++d) s += a[d] * a[d];
  return s;
}

}  // namespace llmserve
