// A whole decoder layer of the Llama shape (Llama, SmolLM2, Mistral, Qwen2, Qwen3) as one call:
//   norm (with the residual add) -> fused QKV -> [QK-norm] -> rotary -> KV store -> paged
//   attention -> output projection -> residual add + norm -> gate/up -> SiLU-and-mul -> down.
//
// Each step is the compiled kernel the PyTorch modules call one by one (models/llama.py), in
// the same order on the same tensors, so the result is bitwise the modules' result; what goes
// is the Python between them: module calls, argument conversion and views, about 10 calls
// into the extension per layer. A layer's weights and shapes are bound once, in a
// DecoderLayerPlan built after loading (models/fused.py); a step passes only its activations,
// its KV cache and its batch layout. The stack allocates each intermediate tensor once a
// step, not once a layer (the kernels' `_out` variants write into them), and takes the
// q, k and v views of the fused projection once: at one token a step, a layer's arithmetic
// is a few microseconds and the allocations and views cost as much again.

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "ops.h"

namespace llmserve {

namespace {

// y[r] += bias for every row: at::add_'s one rounded add per element, split over the stack's
// team (ATen's own loop would run on one thread inside the team's region).
void add_bias(at::Tensor& y, const at::Tensor& bias) {
  TORCH_INTERNAL_ASSERT(bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                        bias.numel() == y.size(1));
  float* yp = y.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t n = y.size(1);
  parallel_for(0, y.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t j = 0; j < n; ++j) yp[r * n + j] += bp[j];
  });
}

}  // namespace

void LinearPlan::operator()(const at::Tensor& x, at::Tensor& y) const {
  switch (kind) {
    case Kind::kDense: dense_linear_out(x, packed, out_features, y); break;
    case Kind::kInt8:
      int8_linear_out(x, packed, aux, w_scale, out_features, levels, group, y);
      break;
    case Kind::kInt4: int4_linear_out(x, packed, aux, group, out_features, y); break;
  }
  if (bias.has_value()) add_bias(y, *bias);
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
  // As float32 (at::add_ widens a narrower bias alike), one contiguous vector for add_bias.
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "a bias of ",
                bias->sizes(), " for ", out_features, " outputs");
    plan->bias = bias->to(at::kFloat).contiguous();
  }
  return plan;
}

namespace {

// A layer's intermediate tensors for a step of T tokens, allocated once for the whole stack
// (every layer of a Llama-shaped model has the same shapes; a layer that differs gets its
// own), with q, k and v as views of the fused projection's output.
struct Workspace {
  int64_t tokens = -1, hidden = 0, q_size = 0, kv_size = 0, inter = 0, heads = 0, kv_heads = 0;
  at::Tensor x, qkv, q, k, v, attn, h, gate_up, act;

  void fit(const DecoderLayerPlan& p, int64_t t, const at::TensorOptions& options) {
    const int64_t d = p.head_dim, hid = p.o.out_features, qs = p.num_heads * d,
                  kvs = p.num_kv_heads * d, in = p.gate_up.out_features / 2;
    if (t == tokens && hid == hidden && qs == q_size && kvs == kv_size && in == inter &&
        p.num_heads == heads && p.num_kv_heads == kv_heads)
      return;
    tokens = t, hidden = hid, q_size = qs, kv_size = kvs, inter = in;
    heads = p.num_heads, kv_heads = p.num_kv_heads;
    x = at::empty({t, hid}, options);
    qkv = at::empty({t, qs + 2 * kvs}, options);
    q = qkv.narrow(1, 0, qs).view({t, heads, d});
    k = qkv.narrow(1, qs, kvs).view({t, kv_heads, d});
    v = qkv.narrow(1, qs + kvs, kvs).view({t, kv_heads, d});
    attn = at::empty({t, qs}, options);
    h = at::empty({t, hid}, options);
    gate_up = at::empty({t, 2 * in}, options);
    act = at::empty({t, in}, options);
  }
};

// One layer on `res` (the residual stream, updated in place) and `hidden` (the previous
// layer's output, none before the first layer); writes this layer's output into `out`.
void decoder_layer(const DecoderLayerPlan& p, Workspace& w, at::Tensor& res,
                   const at::Tensor* hidden, at::Tensor& out, const at::Tensor& positions,
                   KVCacheRef& cache, const at::Tensor& slots, const at::Tensor& block_tables,
                   const at::Tensor& query_start) {
  if (hidden != nullptr)
    add_rms_norm_out(res, *hidden, p.input_norm, p.eps, w.x);
  else
    rms_norm_out(res, p.input_norm, p.eps, w.x);
  p.qkv(w.x, w.qkv);
  at::Tensor q = w.q, k = w.k;
  if (p.q_norm.has_value() && p.k_norm.has_value()) {  // per head: [T * H, D] rows
    const int64_t d = p.head_dim;
    q = rms_norm(q.reshape({-1, d}), *p.q_norm, p.eps).view({-1, p.num_heads, d});
    k = rms_norm(k.reshape({-1, d}), *p.k_norm, p.eps).view({-1, p.num_kv_heads, d});
  }
  rotary_embedding_(q, k, positions, p.cos, p.sin);
  store_kv(k, cache.key, cache.key_scale, slots, cache.max_code, true);
  store_kv(w.v, cache.value, cache.value_scale, slots, cache.max_code, false);
  paged_attention_out(q, cache.key, cache.value, cache.key_scale, cache.value_scale,
                      block_tables, query_start, positions, p.attn_scale, p.window, w.attn);
  p.o(w.attn, w.h);
  add_rms_norm_out(res, w.h, p.post_norm, p.eps, w.x);
  p.gate_up(w.x, w.gate_up);
  silu_and_mul_out(w.gate_up, w.act);
  p.down(w.act, out);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> DecoderStack::run(at::Tensor hidden, const at::Tensor& positions,
                                                    const at::Tensor& slots,
                                                    const at::Tensor& block_tables,
                                                    const at::Tensor& query_start) {
  TORCH_CHECK(!layers.empty(), "a decoder stack of no layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "hidden must be a contiguous float32 [tokens, hidden] tensor");
  // The embeddings become the residual stream; each layer's output goes to `out`, which the
  // next layer adds to the stream before its own projections overwrite it.
  at::Tensor res = std::move(hidden), out = at::empty_like(res);
  Workspace w;
  // One OpenMP region for the whole stack, its kernels' parallel loops run by the region's
  // team (team.h), not one region a kernel.
  const auto all_layers = [&] {
    for (size_t i = 0; i < layers.size(); ++i) {
      w.fit(*layers[i], res.size(0), res.options());
      decoder_layer(*layers[i], w, res, i == 0 ? nullptr : &out, out, positions, caches[i],
                    slots, block_tables, query_start);
    }
  };
  if (team)
    run_as_team(all_layers);
  else
    all_layers();
  return {out, res};
}

}  // namespace llmserve
