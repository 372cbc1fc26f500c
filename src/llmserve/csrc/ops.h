// The compiled CPU ops, bound to Python in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "team.h"

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

// A kernel's output given by the caller (the `_out` variants below, which the decoder stack
// calls on buffers it allocates once a step): float32, contiguous, [rows, cols].
inline void check_out(const at::Tensor& out, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() &&
                  out.size(0) == rows && out.size(1) == cols,
              name, " must be a contiguous float32 [", rows, ", ", cols, "] tensor");
}

// Paged attention takes a row's keys in segments of this many (rounded to whole blocks) at
// fixed positions of its sequence, one work item each, merged in order (flash-decoding).
constexpr int64_t kSegmentKeys = 512;

// Each op returning a new tensor has an `_out` variant writing into the last argument.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache,
                           const c10::optional<at::Tensor>& key_scale,
                           const c10::optional<at::Tensor>& value_scale,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& positions, double scale, int64_t window);
void paged_attention_out(const at::Tensor& q, const at::Tensor& key_cache,
                         const at::Tensor& value_cache,
                         const c10::optional<at::Tensor>& key_scale,
                         const c10::optional<at::Tensor>& value_scale,
                         const at::Tensor& block_tables, const at::Tensor& query_start,
                         const at::Tensor& positions, double scale, int64_t window,
                         at::Tensor& out);
// Whether paged attention's decode items read their blocks (every KV head of them) before
// computing (paged_attention.cpp, load_item_blocks); on by default. Returns the old setting.
bool set_attention_load_ahead(bool on);
void store_kv(const at::Tensor& x, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots, double max_code, bool transposed);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rms_norm_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                         double eps);
void add_rms_norm_out(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                      double eps, at::Tensor& out);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& keys);
at::Tensor exponential_race_scores(const at::Tensor& probs, const at::Tensor& keys);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
void dense_linear_out(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      at::Tensor& y);
int64_t dense_panel_width();
std::string int_kernels();  // "avx512_vnni", "avx2", or "" (none built)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                       const at::Tensor& w_scale, int64_t out_features, int64_t levels,
                       int64_t group);
void int8_linear_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& excess,
                     const at::Tensor& w_scale, int64_t out_features, int64_t levels,
                     int64_t group, at::Tensor& y);
// Rows `ids` of an int8 weight packed for int8_linear, as float32 [T, in] (an embedding).
at::Tensor int8_embedding(const at::Tensor& packed, const at::Tensor& w_scale,
                          const at::Tensor& ids, int64_t rows);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scale_zero, int64_t group, int64_t out_features);
void int4_linear_out(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale_zero, int64_t group, int64_t out_features,
                     at::Tensor& y);
void rotary_embedding_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                       const at::Tensor& cos, const at::Tensor& sin);

// One linear layer's compiled kernel with its packed weights bound (decoder_layer.cpp).
struct LinearPlan {
  enum class Kind { kDense, kInt8, kInt4 };
  Kind kind = Kind::kDense;
  at::Tensor packed, aux, w_scale;  // aux: int8's excess, int4's scale_zero
  int64_t out_features = 0, levels = 0, group = 0;
  c10::optional<at::Tensor> bias;
  void operator()(const at::Tensor& x, at::Tensor& y) const;  // y: [rows, out_features]
};

std::shared_ptr<LinearPlan> make_linear_plan(const std::string& kind, at::Tensor packed,
                                             c10::optional<at::Tensor> aux,
                                             c10::optional<at::Tensor> w_scale,
                                             int64_t out_features, int64_t levels,
                                             int64_t group, c10::optional<at::Tensor> bias);

// A Llama-shaped decoder layer's weights and shapes, bound once after loading.
struct DecoderLayerPlan {
  LinearPlan qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  double eps = 1e-6;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  at::Tensor cos, sin;  // the rotary tables
  double attn_scale = 1.0;
  int64_t window = 0;  // 0: every key of the context
};

// A model's decoder layers with their KV caches bound: a step's whole stack in one call.
struct KVCacheRef {
  at::Tensor key, value;
  c10::optional<at::Tensor> key_scale, value_scale;
  double max_code = 0.0;  // the 8-bit formats' largest code (0: a float cache)
};

struct DecoderStack {
  std::vector<std::shared_ptr<DecoderLayerPlan>> layers;
  std::vector<KVCacheRef> caches;  // one per layer
  bool team = true;  // one OpenMP region a step (team.h); false: one a kernel
  // (the last layer's output, the residual stream): the model's final norm adds them.
  std::pair<at::Tensor, at::Tensor> run(at::Tensor hidden, const at::Tensor& positions,
                                        const at::Tensor& slots, const at::Tensor& block_tables,
                                        const at::Tensor& query_start);
};

}  // namespace llmserve
