// The compiled CPU ops, bound to Python in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace llmserve {

// Calls f(T{}) with T the C++ type of a KV cache storage dtype (float32, bfloat16, int8,
// fp8 e4m3): the one place that lists the formats the kernels read and write.
template <typename F>
void dispatch_kv_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kChar: f(int8_t{}); break;
    case at::kFloat8_e4m3fn: f(c10::Float8_e4m3fn{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", dtype);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache,
                           const c10::optional<at::Tensor>& key_scale,
                           const c10::optional<at::Tensor>& value_scale,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& positions, double scale, int64_t window);
void store_kv(const at::Tensor& x, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots, double max_code, bool transposed);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                         double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
int64_t dense_panel_width();
std::string int_kernels();  // "avx512_vnni", "avx2", or "" (none built)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                       const at::Tensor& w_scale, int64_t out_features, int64_t levels,
                       int64_t group);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scale_zero, int64_t group, int64_t out_features);
void rotary_embedding_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                       const at::Tensor& cos, const at::Tensor& sin);

}  // namespace llmserve
