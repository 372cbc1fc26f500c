// A whole decoder layer of the Llama shape (Llama, SmolLM2, Mistral, Qwen2, Qwen3) as one call:
//   norm (with the residual add) -> fused QKV -> [QK-norm] -> rotary -> KV store -> paged
//   attention -> output projection -> residual add + norm -> gate/up -> SiLU-and-mul -> down.
//
// Each step is the compiled kernel the PyTorch modules call one by one (models/llama.py), in
// the same order on the same tensors, so the result is bitwise the modules' result; what goes
// is the Python between them: module calls, argument conversion and views, about 10 calls
// into the extension per layer. A layer's weights and shapes are bound once, in a
// DecoderLayerPlan built after loading (models/fused.py); a step passes only its activations,
// its KV cache and its batch layout.

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "ops.h"

namespace llmserve {

at::Tensor LinearPlan::operator()(const at::Tensor& x) const {
  at::Tensor y;
  switch (kind) {
    case Kind::kDense: y = dense_linear(x, packed, out_features); break;
    case Kind::kInt8:
      y = int8_linear(x, packed, aux, w_scale, out_features, levels, group);
      break;
    case Kind::kInt4: y = int4_linear(x, packed, aux, group, out_features); break;
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

std::shared_ptr<LinearPlan> make_linear_plan(const std::string& kind, at::Tensor packed,
                                             c10::optional<at::Tensor> aux,
                                             c10::optional<at::Tensor> w_scale,
                                             int64_t out_features, int64_t levels,
                                             int64_t group, c10::optional<at::Tensor> bias) {
  auto plan = std::make_shared<LinearPlan>();
  if (kind == "dense") {
    plan->kind = LinearPlan::Kind::kDense;
  } else if (kind == "int8") {
    TORCH_CHECK(aux.has_value() && w_scale.has_value(), "int8 needs excess and w_scale");
    plan->kind = LinearPlan::Kind::kInt8;
  } else if (kind == "int4") {
    TORCH_CHECK(aux.has_value(), "int4 needs scale_zero");
    plan->kind = LinearPlan::Kind::kInt4;
  } else {
    TORCH_CHECK(false, "unknown linear kind '", kind, "' (dense, int8 or int4)");
  }
  plan->packed = std::move(packed);
  if (aux.has_value()) plan->aux = *aux;
  if (w_scale.has_value()) plan->w_scale = *w_scale;
  plan->out_features = out_features;
  plan->levels = levels;
  plan->group = group;
  plan->bias = std::move(bias);
  return plan;
}

std::pair<at::Tensor, at::Tensor> decoder_layer(
    const DecoderLayerPlan& p, at::Tensor hidden, c10::optional<at::Tensor> residual,
    const at::Tensor& positions, at::Tensor& key_cache, at::Tensor& value_cache,
    const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale,
    double max_code, const at::Tensor& slots, const at::Tensor& block_tables,
    const at::Tensor& query_start) {
  // The first layer takes the embeddings as its residual stream, the others add the
  // previous layer's output to it.
  at::Tensor res, x;
  if (residual.has_value()) {
    res = *residual;
    x = add_rms_norm_(res, hidden, p.input_norm, p.eps);
  } else {
    res = hidden;
    x = rms_norm(hidden, p.input_norm, p.eps);
  }

  const int64_t d = p.head_dim, q_size = p.num_heads * d, kv_size = p.num_kv_heads * d;
  const at::Tensor qkv = p.qkv(x);
  at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, p.num_kv_heads, d});
  if (p.q_norm.has_value() && p.k_norm.has_value()) {  // per head: [T * H, D] rows
    q = rms_norm(q.reshape({-1, d}), *p.q_norm, p.eps).view({-1, p.num_heads, d});
    k = rms_norm(k.reshape({-1, d}), *p.k_norm, p.eps).view({-1, p.num_kv_heads, d});
  } else {
    q = q.view({-1, p.num_heads, d});
    k = k.view({-1, p.num_kv_heads, d});
  }
  rotary_embedding_(q, k, positions, p.cos, p.sin);
  store_kv(k, key_cache, key_scale, slots, max_code, true);
  store_kv(v, value_cache, value_scale, slots, max_code, false);
  const at::Tensor attn = paged_attention(q, key_cache, value_cache, key_scale, value_scale,
                                          block_tables, query_start, positions, p.attn_scale,
                                          p.window);
  const at::Tensor h = p.o(attn);
  x = add_rms_norm_(res, h, p.post_norm, p.eps);
  return {p.down(silu_and_mul(p.gate_up(x))), res};
}

std::pair<at::Tensor, at::Tensor> DecoderStack::run(at::Tensor hidden, const at::Tensor& positions,
                                                    const at::Tensor& slots,
                                                    const at::Tensor& block_tables,
                                                    const at::Tensor& query_start) {
  c10::optional<at::Tensor> residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    KVCacheRef& c = caches[i];
    auto [out, res] = decoder_layer(*layers[i], std::move(hidden), residual, positions, c.key,
                                    c.value, c.key_scale, c.value_scale, c.max_code, slots,
                                    block_tables, query_start);
    hidden = std::move(out);
    residual = std::move(res);
  }
  TORCH_CHECK(residual.has_value(), "a decoder stack of no layers");
  return {hidden, *residual};
}

}  // namespace llmserve
