// Paged attention on CPU, reading the KV cache blocks in place.
//
// Every query row is computed by the same sequence of operations whatever else is in the
// batch: its scores are dot products over head_dim with a fixed lane layout, its softmax
// and its weighted sum of values run over keys 0..pos in order. Rows of a prefill chunk are
// processed in tiles (each key row is converted once and used by every row of the tile),
// but a row's own arithmetic is the one it would have alone. That makes the result of a
// row independent of the batch, of chunking and of the tile it falls in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "ops.h"

namespace llmserve {

namespace {

constexpr int kTile = 8;  // query rows of one sequence handled together

// Converts one cached head vector of `d` values to float32.
template <typename T>
struct Loader;

template <>
struct Loader<float> {
  static const float* load(const float* src, float*, int) { return src; }
};

template <>
struct Loader<c10::BFloat16> {
  static const float* load(const c10::BFloat16* src, float* dst, int d) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int i = 0; i < d; ++i)
      dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16);
    return dst;
  }
};

template <>
struct Loader<int8_t> {
  static const float* load(const int8_t* src, float* dst, int d) {
    for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
    return dst;
  }
};

template <>
struct Loader<c10::Float8_e4m3fn> {
  static const float* load(const c10::Float8_e4m3fn* src, float* dst, int d) {
    static const std::vector<float> table = [] {
      std::vector<float> t(256);
      for (int i = 0; i < 256; ++i)
        t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i),
                                                     c10::Float8_e4m3fn::from_bits()));
      return t;
    }();
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    for (int i = 0; i < d; ++i) dst[i] = table[s[i]];
    return dst;
  }
};

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const c10::optional<at::Tensor>& key_scale,
            const c10::optional<at::Tensor>& value_scale, const at::Tensor& block_tables,
            const at::Tensor& query_start, const at::Tensor& positions, double scale,
            at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = query_start.size(0) - 1;
  const int64_t max_blocks = block_tables.size(1);
  const float* q_ptr = q.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const float* ks_ptr = key_scale ? key_scale->data_ptr<float>() : nullptr;
  const float* vs_ptr = value_scale ? value_scale->data_ptr<float>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* qstart = query_start.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float sm_scale = static_cast<float>(scale);

  // Work items: (sequence, tile of up to kTile consecutive query rows, KV head).
  std::vector<int64_t> item_seq, item_row;
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t t = qstart[b]; t < qstart[b + 1]; t += kTile) {
      item_seq.push_back(b);
      item_row.push_back(t);
    }
  const int64_t num_items = static_cast<int64_t>(item_seq.size()) * num_kv_heads;

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf(head_dim), vbuf(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t b = item_seq[tile], t0 = item_row[tile];
      const int64_t rows = std::min<int64_t>(kTile, qstart[b + 1] - t0);
      const int64_t* table = tables + b * max_blocks;
      int64_t len[kTile];
      int64_t max_len = 0;
      for (int64_t r = 0; r < rows; ++r) {
        len[r] = pos[t0 + r] + 1;
        max_len = std::max(max_len, len[r]);
      }
      TORCH_CHECK(max_len <= max_blocks * block_size, "position past the block table");
      // scores[(r * group + g) * max_len + j]
      scores.resize(static_cast<size_t>(rows * group * max_len));

      // 1. Scores: q . k * scale (* the key's stored scale), in key order.
      for (int64_t j = 0; j < max_len; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const int64_t at = slot * num_kv_heads + h;
        const float* k = Loader<T>::load(k_ptr + at * head_dim, kbuf.data(), head_dim);
        const float s = ks_ptr ? ks_ptr[at] * sm_scale : sm_scale;
        for (int64_t r = 0; r < rows; ++r) {
          if (j >= len[r]) continue;
          const float* qr = q_ptr + (t0 + r) * q_stride + h * group * head_dim;
          for (int64_t g = 0; g < group; ++g)
            scores[(r * group + g) * max_len + j] = dot(qr + g * head_dim, k, head_dim) * s;
        }
      }
      // 2. Softmax numerators per row and head; the sums in key order.
      std::vector<float> inv_sum(rows * group);
      for (int64_t rg = 0; rg < rows * group; ++rg) {
        float* sc = scores.data() + rg * max_len;
        const int64_t n = len[rg / group];
        float m = sc[0];
        for (int64_t j = 1; j < n; ++j) m = std::max(m, sc[j]);
        for (int64_t j = 0; j < n; ++j) sc[j] = exp_approx(sc[j] - m);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) sum += sc[j];
        inv_sum[rg] = 1.f / sum;
      }
      // 3. Weighted sum of values in key order, then normalize.
      float* o_tile = out_ptr + (t0 * num_heads + h * group) * head_dim;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g)
          std::memset(o_tile + (r * num_heads + g) * head_dim, 0, head_dim * sizeof(float));
      for (int64_t j = 0; j < max_len; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const int64_t at = slot * num_kv_heads + h;
        const float* v = Loader<T>::load(v_ptr + at * head_dim, vbuf.data(), head_dim);
        const float vs = vs_ptr ? vs_ptr[at] : 1.f;
        for (int64_t r = 0; r < rows; ++r) {
          if (j >= len[r]) continue;
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[(r * group + g) * max_len + j] * vs;
            float* o = o_tile + (r * num_heads + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = std::fma(w, v[d], o[d]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          float* o = o_tile + (r * num_heads + g) * head_dim;
          const float inv = inv_sum[r * group + g];
          for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
        }
    }
  });
}

}  // namespace

// q: [T, Hq, D] float32 (rows may be strided); caches: [num_blocks, block_size, Hkv, D]; scales (8-bit formats):
// [num_blocks, block_size, Hkv] float32; block_tables: [B, max_blocks] int64; query_start:
// [B + 1] int64 (rows of sequence b are query_start[b]..query_start[b+1]); positions: [T]
// int64 (row t sees keys 0..positions[t] of its sequence). Returns [T, Hq * D] float32.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache,
                           const c10::optional<at::Tensor>& key_scale,
                           const c10::optional<at::Tensor>& value_scale,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be a float32 [T, Hq, D] tensor with contiguous heads");
  TORCH_CHECK(q.size(2) % kLanes == 0, "head_dim must be a multiple of ", kLanes);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the KV cache must be contiguous");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
              positions.scalar_type() == at::kLong, "index tensors must be int64");
  auto tables = block_tables.contiguous();
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      attend<float>(q, key_cache, value_cache, key_scale, value_scale, tables, query_start,
                    positions, scale, out);
      break;
    case at::kBFloat16:
      attend<c10::BFloat16>(q, key_cache, value_cache, key_scale, value_scale, tables,
                            query_start, positions, scale, out);
      break;
    case at::kChar:
      attend<int8_t>(q, key_cache, value_cache, key_scale, value_scale, tables, query_start,
                     positions, scale, out);
      break;
    case at::kFloat8_e4m3fn:
      attend<c10::Float8_e4m3fn>(q, key_cache, value_cache, key_scale, value_scale, tables,
                                 query_start, positions, scale, out);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", key_cache.scalar_type());
  }
  return out;
}

}  // namespace llmserve
