// Writes a step's keys or values into the paged cache at their slots, in the cache's
// format and layout (attention/kv_format.py): keys [blocks, Hkv, D / P, block_size, P],
// values [blocks, Hkv, block_size / P, D, P], scales [blocks, Hkv, block_size], with P
// elements packed side by side (1, or 2 for int8). The 8-bit formats keep one float32
// scale per token and KV head, max|x| / max_code, exactly as attention/kv_format.py
// computes it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "ops.h"

namespace llmserve {

namespace {

template <typename T>
void store(const at::Tensor& x, at::Tensor& cache, float* scales, const int64_t* slots,
           double max_code, bool transposed) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t pack = cache.size(4);
  const int64_t block_size = transposed ? cache.size(3) : cache.size(2) * pack;
  const int64_t stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  T* cp = cache.data_ptr<T>();
  const float tiny = std::numeric_limits<float>::min();
  parallel_for(0, tokens * heads, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const float* src = xp + t * stride + h * dim;
      const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
      const int64_t at = (blk * heads + h) * block_size + off;  // scale index
      // Element d of this token's vector: keys at [d / P, off, d % P] of the head's block,
      // values at [off / P, d, off % P].
      T* base = cp + (blk * heads + h) * dim * block_size;
      auto slot = [&](int64_t d) -> T& {
        return transposed ? base[(d / pack * block_size + off) * pack + d % pack]
                          : base[(off / pack * dim + d) * pack + off % pack];
      };
      if (scales == nullptr) {
        for (int64_t d = 0; d < dim; ++d) slot(d) = static_cast<T>(src[d]);
        continue;
      }
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(src[d]));
      const float s = std::max(amax, tiny) / static_cast<float>(max_code);
      scales[at] = s;
      for (int64_t d = 0; d < dim; ++d) {
        const float c = src[d] / s;
        if constexpr (std::is_same_v<T, int8_t>)
          slot(d) = static_cast<int8_t>(std::nearbyint(c));
        else
          slot(d) = static_cast<T>(c);
      }
    }
  });
}

}  // namespace

void store_kv(const at::Tensor& x, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots, double max_code, bool transposed) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "keys/values must be float32 [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == x.size(1) &&
                  (transposed ? cache.size(2) * cache.size(4) : cache.size(3)) == x.size(2),
              "cache must be a contiguous [blocks, Hkv, D / P, block_size, P] (keys) or "
              "[blocks, Hkv, block_size / P, D, P] (values) tensor matching x");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0),
              "slot mapping must be int64 [T]");
  float* sp = scales ? scales->data_ptr<float>() : nullptr;
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t capacity =
      cache.size(0) * (transposed ? cache.size(3) : cache.size(2) * cache.size(4));
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < capacity, "slot out of range");
  dispatch_kv_dtype(cache.scalar_type(), [&](auto tag) {
    store<decltype(tag)>(x, cache, sp, slot_ptr, max_code, transposed);
  });
}

}  // namespace llmserve
