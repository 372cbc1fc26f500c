#include <torch/extension.h>

#include <chrono>
#include <thread>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace llmserve;
  m.def("paged_attention", &paged_attention,
        "softmax(q k^T * scale) v per query row, reading the paged cache in place (with "
        "window > 0, only each row's last `window` keys)",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scale"),
        py::arg("value_scale"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("positions"), py::arg("scale"), py::arg("window") = 0);
  m.attr("attention_segment_keys") = kSegmentKeys;
  m.def("set_attention_load_ahead", &set_attention_load_ahead,
        "whether paged attention's decode items read their blocks (every KV head) before "
        "computing; returns the previous setting (the results are the same either way)",
        py::arg("on"));
  m.def("store_kv", &store_kv, "write keys or values into the paged cache at their slots");
  m.def("rms_norm", &rms_norm, "weight * x / sqrt(mean(x^2) + eps), row by row");
  m.def("add_rms_norm_", &add_rms_norm_,
        "residual += delta (in place); returns rms_norm(residual)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for a fused [rows, 2 d] input");
  m.def("int8_linear", &int8_linear,
        "x W^T for int8 W packed for VNNI, activations as two int8 levels per row, or one "
        "level with a scale per group of inputs");
  m.def("int8_embedding", &int8_embedding,
        "rows of an int8 weight packed for int8_linear, times their scales (an embedding)");
  m.def("int4_linear", &int4_linear,
        "x W^T for int4 W (group scales and zeros) packed for VNNI, two-level int8 x");
  m.def("dense_linear", &dense_linear,
        "x W^T for float32 or bfloat16 W packed in panels of 16 output channels; each output "
        "a chain of fused multiply-adds over the inputs in order (batch-invariant)");
  m.attr("dense_panel_width") = dense_panel_width();
  // What this build targets (LLMSERVE_CPU_ISA picks it): the integer kernels' instruction set
  // ("" when neither VNNI nor AVX2 was available: int8/int4 layers use PyTorch's kernels),
  // and the widest vector extension the compiler was allowed.
  m.attr("int_kernels") = int_kernels();
  m.attr("has_vnni") = int_kernels() == "avx512_vnni";
#if defined(__AVX512F__)
  m.attr("isa") = "avx512";
#elif defined(__AVX2__)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "baseline";
#endif
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=1) for float32 rows, faster");
  m.def("exponential_race", &exponential_race,
        "one draw per row of probabilities, keyed by the row's two 32-bit words");
  m.def("exponential_race_scores", &exponential_race_scores,
        "every score of exponential_race (for the tests)");
  m.def("rotary_embedding_", &rotary_embedding_, "rotate-half rotary embedding, in place");
  m.def(
      "parallel_shares",
      [](int64_t n, int64_t grain, int64_t rounds, bool team, int64_t fail_at,
         int64_t slow_item) {
        // For the tests of team.h: `rounds` parallel loops over n items, in one team or each
        // through at::parallel_for; per round and item, the first item of the share that
        // computed it and the OpenMP thread that did. Item fail_at throws; item slow_item
        // takes 2 ms (long enough for the other threads' waits to sleep).
        at::Tensor out = at::full({rounds, n, 2}, -1, at::kLong);
        int64_t* o = out.data_ptr<int64_t>();
        const auto loops = [&] {
          for (int64_t r = 0; r < rounds; ++r)
            parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
              for (int64_t i = b; i < e; ++i) {
                TORCH_CHECK(i != fail_at, "item ", i, " failed");
                if (i == slow_item) std::this_thread::sleep_for(std::chrono::milliseconds(2));
                o[(r * n + i) * 2] = b;
                o[(r * n + i) * 2 + 1] = omp_get_thread_num();
              }
            });
        };
        if (team)
          run_as_team(loops);
        else
          loops();
        return out;
      },
      "for the tests: how parallel loops split n items, in a team or not",
      py::call_guard<py::gil_scoped_release>(), py::arg("n"), py::arg("grain"),
      py::arg("rounds"), py::arg("team"), py::arg("fail_at") = -1, py::arg("slow_item") = -1);

  // Fused decoder layers (decoder_layer.cpp, built by models/fused.py).
  py::class_<LinearPlan, std::shared_ptr<LinearPlan>>(m, "LinearPlan");
  m.def("make_linear_plan", &make_linear_plan,
        "a linear layer's kernel ('dense', 'int8' or 'int4') with its packed weights bound",
        py::arg("kind"), py::arg("packed"), py::arg("aux"), py::arg("w_scale"),
        py::arg("out_features"), py::arg("levels"), py::arg("group"), py::arg("bias"));
  py::class_<DecoderLayerPlan, std::shared_ptr<DecoderLayerPlan>>(m, "DecoderLayerPlan");
  m.def(
      "make_layer_plan",
      [](const LinearPlan& qkv, const LinearPlan& o, const LinearPlan& gate_up,
         const LinearPlan& down, at::Tensor input_norm, at::Tensor post_norm,
         c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double eps,
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos,
         at::Tensor sin, double attn_scale, int64_t window) {
        return std::make_shared<DecoderLayerPlan>(DecoderLayerPlan{
            qkv, o, gate_up, down, std::move(input_norm), std::move(post_norm),
            std::move(q_norm), std::move(k_norm), eps, num_heads, num_kv_heads, head_dim,
            std::move(cos), std::move(sin), attn_scale, window});
      },
      "a Llama-shaped decoder layer's weights and shapes");
  py::class_<DecoderStack, std::shared_ptr<DecoderStack>>(m, "DecoderStack")
      // Without the GIL: a structured-output worker builds its masks while the stack runs,
      // as it does between the modules' calls.
      .def("run", &DecoderStack::run,
           "every layer on a step's hidden states: (last output, residual stream)",
           py::call_guard<py::gil_scoped_release>(),
           py::arg("hidden"), py::arg("positions"), py::arg("slots"), py::arg("block_tables"),
           py::arg("query_start"))
      .def_readwrite("team", &DecoderStack::team,
                     "one OpenMP region for the whole stack (csrc/team.h), or one a kernel");
  m.def(
      "make_decoder_stack",
      [](std::vector<std::shared_ptr<DecoderLayerPlan>> layers, std::vector<at::Tensor> keys,
         std::vector<at::Tensor> values, std::vector<c10::optional<at::Tensor>> key_scales,
         std::vector<c10::optional<at::Tensor>> value_scales, double max_code) {
        const size_t n = layers.size();
        TORCH_CHECK(keys.size() == n && values.size() == n && key_scales.size() == n &&
                        value_scales.size() == n,
                    "one KV cache per layer");
        auto stack = std::make_shared<DecoderStack>();
        stack->layers = std::move(layers);
        for (size_t i = 0; i < n; ++i)
          stack->caches.push_back(
              KVCacheRef{keys[i], values[i], key_scales[i], value_scales[i], max_code});
        return stack;
      },
      "decoder layers with their KV caches bound");
}
