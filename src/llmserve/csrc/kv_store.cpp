// Writes a step's keys and values into the paged cache at their slots, in the cache's
// format. The 8-bit formats keep one float32 scale per token and KV head,
// max|x| / max_code, exactly as attention/kv_format.py computes it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "ops.h"

namespace llmserve {

namespace {

template <typename T>
void store(const at::Tensor& x, at::Tensor& cache, float* scales, const int64_t* slots,
           double max_code) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  T* cp = cache.data_ptr<T>();
  const float tiny = std::numeric_limits<float>::min();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const float* src = xp + t * stride + h * dim;
      const int64_t at = slots[t] * heads + h;
      T* dst = cp + at * dim;
      if (scales == nullptr) {
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[d]);
        continue;
      }
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(src[d]));
      const float s = std::max(amax, tiny) / static_cast<float>(max_code);
      scales[at] = s;
      for (int64_t d = 0; d < dim; ++d) {
        const float c = src[d] / s;
        if constexpr (std::is_same_v<T, int8_t>)
          dst[d] = static_cast<int8_t>(std::nearbyint(c));
        else
          dst[d] = static_cast<T>(c);
      }
    }
  });
}

}  // namespace

void store_kv(const at::Tensor& x, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots, double max_code) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "keys/values must be float32 [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(cache.is_contiguous() && cache.size(2) == x.size(1) && cache.size(3) == x.size(2),
              "cache must be a contiguous [blocks, block_size, Hkv, D] tensor matching x");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0),
              "slot mapping must be int64 [T]");
  float* sp = scales ? scales->data_ptr<float>() : nullptr;
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t capacity = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < capacity, "slot out of range");
  switch (cache.scalar_type()) {
    case at::kFloat: store<float>(x, cache, sp, slot_ptr, max_code); break;
    case at::kBFloat16: store<c10::BFloat16>(x, cache, sp, slot_ptr, max_code); break;
    case at::kChar: store<int8_t>(x, cache, sp, slot_ptr, max_code); break;
    case at::kFloat8_e4m3fn: store<c10::Float8_e4m3fn>(x, cache, sp, slot_ptr, max_code); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", cache.scalar_type());
  }
}

}  // namespace llmserve
