// Paged attention on CPU, reading the KV cache blocks in place.
//
// Cache layout (attention/kv_format.py): keys [blocks, Hkv, D, block_size] (a block's keys
// of one head are a [D, block_size] tile, so 16 scores come out of one vector per step
// over D), values [blocks, Hkv, block_size, D].
//
// Every query row is computed by the same sequence of operations whatever else is in the
// batch: each score is a sum over head_dim in order (one vector lane per key), the softmax
// and the weighted sum of values run over keys 0..pos in order. Rows of a prefill chunk are
// handled in tiles that share each key and value load, but a row's own arithmetic is the
// one it would have alone. So a row's result does not depend on the batch, on chunking or
// on the tile it falls in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_math.h"
#include "ops.h"

namespace llmserve {

namespace {

constexpr int kTile = 8;    // query rows of one sequence handled together
constexpr int kAhead = 4;  // blocks prefetched ahead of the one being read

typedef int8_t vi8 __attribute__((vector_size(kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));

// kLanes consecutive cached values as float32.
template <typename T>
inline vfloat load16(const T* p);

template <>
inline vfloat load16<float>(const float* p) { return vload(p); }

template <>
inline vfloat load16<c10::BFloat16>(const c10::BFloat16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vint bits = __builtin_convertvector(h, vint) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <>
inline vfloat load16<int8_t>(const int8_t* p) {
#if defined(__AVX512F__)
  // GCC lowers the generic conversion below lane by lane (16 scalar loads and inserts).
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  vi8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vfloat);
#endif
}

const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

template <>
inline vfloat load16<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
  static const float* table = fp8_table();
#if defined(__AVX512F__)
  const __m512i codes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm512_i32gather_ps(codes, table, 4));
#else
  const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
  float f[kLanes];
  for (int i = 0; i < kLanes; ++i) f[i] = table[b[i]];
  return vload(f);
#endif
}

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

constexpr int kScoreRows = 4;  // most query vectors scored together (one accumulator each)

// dst[b][u * stride + lane] = (sum_d q_u[d] kt[b][d * ld + lane]) * ks[b], over d in order
// (fused multiply-adds), for N <= kScoreRows query vectors q_u and NB key tiles kt[b]: one
// load of each key vector feeds every query's accumulator, and the NB * N independent
// accumulators keep both FMA pipes busy. A lane's arithmetic is the same for any NB and N.
// (N is a template argument so that every accumulator index is a constant: with a runtime
// count GCC kept the accumulators in memory, a store each per step over d.)
template <int NB, int N, typename T>
inline void block_scores(const T* const* kt, int64_t ld, int64_t head_dim,
                         const float* const* q, const vfloat* ks, float* const* dst,
                         int64_t stride) {
  vfloat acc[NB][N] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    vfloat s[N];
#pragma GCC unroll 4
    for (int u = 0; u < N; ++u) s[u] = vsplat(q[u][d]);
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const vfloat k = load16(kt[b] + d * ld);
#pragma GCC unroll 4
      for (int u = 0; u < N; ++u) acc[b][u] = vfma(s[u], k, acc[b][u]);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 4
    for (int u = 0; u < N; ++u) vstore(dst[b] + u * stride, acc[b][u] * ks[b]);
}

template <int NB, typename T>
inline void block_scores_n(const T* const* kt, int64_t ld, int64_t head_dim,
                           const float* const* q, int64_t n, const vfloat* ks,
                           float* const* dst, int64_t stride) {
  switch (n) {
    case 1: block_scores<NB, 1>(kt, ld, head_dim, q, ks, dst, stride); break;
    case 2: block_scores<NB, 2>(kt, ld, head_dim, q, ks, dst, stride); break;
    case 3: block_scores<NB, 3>(kt, ld, head_dim, q, ks, dst, stride); break;
    default: block_scores<NB, kScoreRows>(kt, ld, head_dim, q, ks, dst, stride); break;
  }
}

// a_u[0 : 16 C] += sum_j w_u[j] (* vs[j]) v[j], over j = 0..keys in order, for U query
// vectors at once (each value vector loaded once for all of them), accumulating in
// registers. v: [block_size, 16 C] values of one head. A vector's own arithmetic is the same
// for any U.
template <int C, int U, typename T>
inline void weighted_sum(const T* v, const float* const* w, const float* vs, int64_t keys,
                         float* const* a) {
  vfloat acc[U][C];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[u][c] = vload(a[u] + c * kLanes);
  for (int64_t j = 0; j < keys; ++j) {
    vfloat vj[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vj[c] = load16(v + j * C * kLanes + c * kLanes);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const float wj = vs ? w[u][j] * vs[j] : w[u][j];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[u][c] = vfma(vsplat(wj), vj[c], acc[u][c]);
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vstore(a[u] + c * kLanes, acc[u][c]);
}

// The same for any head_dim (a multiple of 16), one query vector at a time.
template <typename T>
inline void weighted_sum_any(const T* v, const float* w, const float* vs, int64_t keys,
                             int64_t head_dim, float* a) {
  for (int64_t j = 0; j < keys; ++j) {
    const float wj = vs ? w[j] * vs[j] : w[j];
    for (int64_t d = 0; d < head_dim; d += kLanes)
      vstore(a + d, vfma(vsplat(wj), load16(v + j * head_dim + d), vload(a + d)));
  }
}

// Query vectors [i, i + n) of one row (same keys), n <= 4, through weighted_sum.
template <int C, typename T>
inline void weighted_sum_row(const T* v, const float* const* w, const float* vs, int64_t keys,
                             float* const* a, int64_t n) {
  constexpr int kMax = C <= 4 ? 4 : 2;
  for (int64_t i = 0; i < n; i += kMax) {
    switch (std::min<int64_t>(kMax, n - i)) {
      case 1: weighted_sum<C, 1>(v, w + i, vs, keys, a + i); break;
      case 2: weighted_sum<C, 2>(v, w + i, vs, keys, a + i); break;
      case 3: weighted_sum<C, kMax == 4 ? 3 : 1>(v, w + i, vs, keys, a + i); break;
      default: weighted_sum<C, kMax>(v, w + i, vs, keys, a + i); break;
    }
  }
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const c10::optional<at::Tensor>& key_scale,
            const c10::optional<at::Tensor>& value_scale, const at::Tensor& block_tables,
            const at::Tensor& query_start, const at::Tensor& positions, double scale,
            at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = query_start.size(0) - 1;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t block_elems = num_kv_heads * head_dim * block_size;
  const int64_t head_elems = head_dim * block_size;
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
  // Items differ in cost (rows x keys): a prefill chunk's tiles beside decodes of short and
  // long sequences. Threads take them from a shared counter, costliest first, so that none
  // idles while another still has a long list (an even split of the range left one thread
  // waiting on the other). With tiles to spare, a thread takes every KV head of a tile at
  // once (neighbouring slices of the same blocks); with few, one item at a time, so that a
  // single sequence's heads still spread over the threads. Which thread computes an item
  // does not change its arithmetic.
  std::vector<int64_t> order(static_cast<size_t>(num_items));
  {
    std::vector<int64_t> cost(item_seq.size());
    for (size_t t = 0; t < item_seq.size(); ++t) {
      const int64_t last = std::min<int64_t>(item_row[t] + kTile, qstart[item_seq[t] + 1]) - 1;
      cost[t] = (last - item_row[t] + 1) * (pos[last] + 1);
    }
    for (int64_t i = 0; i < num_items; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return cost[a / num_kv_heads] > cost[b / num_kv_heads];
    });
  }
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  const int64_t grab =
      static_cast<int64_t>(item_seq.size()) >= 4 * workers ? num_kv_heads : 1;

  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const FlushDenormals ftz;
    std::vector<float> scores, acc;
    // Each take is `grab` consecutive entries of `order`, computed one item after another.
    for (int64_t k0; (k0 = next_item.fetch_add(grab, std::memory_order_relaxed)) < num_items;)
    for (int64_t k = k0; k < std::min(k0 + grab, num_items); ++k) {
      const int64_t item = order[k];
      const int64_t tile = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t b = item_seq[tile], t0 = item_row[tile];
      const int64_t rows = std::min<int64_t>(kTile, qstart[b + 1] - t0);
      const int64_t nq = rows * group;  // query vectors of this item, row-major (r, g)
      const int64_t* table = tables + b * max_blocks;
      int64_t len[kTile];
      int64_t max_len = 0;
      for (int64_t r = 0; r < rows; ++r) {
        len[r] = pos[t0 + r] + 1;
        max_len = std::max(max_len, len[r]);
      }
      TORCH_CHECK(max_len <= max_blocks * block_size, "position past the block table");
      TORCH_CHECK(group <= 64, "more than 64 query heads per KV head");
      int64_t qlen[kTile * 64];  // keys visible to each query vector
      for (int64_t i = 0; i < rows * group; ++i) qlen[i] = len[i / group];
      const int64_t num_blocks = (max_len + block_size - 1) / block_size;
      // Blocks sit anywhere in the pool, out of the hardware prefetcher's sight: each pass
      // asks for block i + kAhead (and its scales) as it starts on block i.
      // Where block i's head-h data start: keys or values, and their scales.
      auto data_at = [&](int64_t i) { return table[i] * block_elems + h * head_elems; };
      auto scale_at = [&](int64_t i) { return (table[i] * num_kv_heads + h) * block_size; };
      auto fetch = [&](const T* cache, const float* scales, int64_t i) {
        if (i >= num_blocks) return;
        prefetch(cache + data_at(i), head_elems * sizeof(T));
        if (scales) prefetch(scales + scale_at(i), block_size * sizeof(float));
      };
      for (int64_t i = 0; i < std::min<int64_t>(kAhead, num_blocks); ++i)
        fetch(k_ptr, ks_ptr, i);
      const int64_t stride = num_blocks * block_size;  // scores per query vector
      scores.resize(static_cast<size_t>(nq * stride));
      const float* qptrs[kTile * 64];
      for (int64_t i = 0; i < nq; ++i)
        qptrs[i] = q_ptr + (t0 + i / group) * q_stride + (h * group + i % group) * head_dim;

      // 1. Scores, two blocks of keys at a time: lane c of a vector sums q[d] k_c[d] over
      //    d in order; then times scale (and the key's stored scale).
      for (int64_t blk = 0; blk < num_blocks; blk += 2) {
        const int nb = blk + 1 < num_blocks ? 2 : 1;
        int64_t at[2], sat[2];  // the blocks' keys and scales of head h
        for (int b = 0; b < nb; ++b) {
          at[b] = data_at(blk + b);
          sat[b] = scale_at(blk + b);
          fetch(k_ptr, ks_ptr, blk + b + kAhead);
        }
        for (int64_t c = 0; c < block_size; c += kLanes) {
          const T* kt[2];
          vfloat ks[2];
          for (int b = 0; b < nb; ++b) {
            kt[b] = k_ptr + at[b] + c;  // [D, block_size], from column c
            ks[b] = ks_ptr ? vload(ks_ptr + sat[b] + c) * sm_scale
                           : vsplat(sm_scale);
          }
          // Every query vector, also past its own length (those lanes are scratch).
          for (int64_t i = 0; i < nq; i += kScoreRows) {
            float* const dst[2] = {scores.data() + i * stride + blk * block_size + c,
                                   scores.data() + i * stride + (blk + 1) * block_size + c};
            const int64_t n = std::min<int64_t>(kScoreRows, nq - i);
            if (nb == 2)
              block_scores_n<2>(kt, block_size, head_dim, qptrs + i, n, ks, dst, stride);
            else
              block_scores_n<1>(kt, block_size, head_dim, qptrs + i, n, ks, dst, stride);
          }
        }
      }
      // 2. Softmax numerators (lanes past a row's length are scratch); the max is exact in
      //    any order, the sum runs lane-wise over whole vectors, then the tail in order: a
      //    fixed order for a given row length.
      float inv_sum[kTile * 64];
      for (int64_t i = 0; i < nq; ++i) {
        float* sc = scores.data() + i * stride;
        const int64_t n = qlen[i], body = n - n % kLanes;
        float m = sc[0];
        if (body > 0) {
          vfloat mv = vload(sc);
          for (int64_t j = kLanes; j < body; j += kLanes) {
            const vfloat x = vload(sc + j);
            mv = x > mv ? x : mv;
          }
          for (int l = 0; l < kLanes; ++l) m = std::max(m, mv[l]);
        }
        for (int64_t j = body; j < n; ++j) m = std::max(m, sc[j]);
        const vfloat mvec = vsplat(m);
        for (int64_t j = 0; j < n; j += kLanes) vstore(sc + j, vexp(vload(sc + j) - mvec));
        vfloat sv{};
        for (int64_t j = 0; j < body; j += kLanes) sv += vload(sc + j);
        float sum = vsum(sv);
        for (int64_t j = body; j < n; ++j) sum += sc[j];
        inv_sum[i] = 1.f / sum;
      }
      for (int64_t i = 0; i < std::min<int64_t>(kAhead, num_blocks); ++i)
        fetch(v_ptr, vs_ptr, i);
      // 3. Weighted sum of values in key order, a block at a time (its values stay in L1
      //    while every query vector of the item takes its share), then normalize.
      acc.assign(static_cast<size_t>(nq * head_dim), 0.f);
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t at = data_at(blk);
        fetch(v_ptr, vs_ptr, blk + kAhead);
        const int64_t j0 = blk * block_size;
        const float* vs = vs_ptr ? vs_ptr + scale_at(blk) : nullptr;
        // The query vectors of one row share their keys: taken together, up to four.
        for (int64_t i = 0; i < nq; i += group) {
          const int64_t keys = std::min(block_size, qlen[i] - j0);
          if (keys <= 0) continue;
          const float* w[64];
          float* a[64];
          for (int64_t u = 0; u < group; ++u) {
            w[u] = scores.data() + (i + u) * stride + j0;
            a[u] = acc.data() + (i + u) * head_dim;
          }
          if (head_dim == 64)
            weighted_sum_row<4>(v_ptr + at, w, vs, keys, a, group);
          else if (head_dim == 128)
            weighted_sum_row<8>(v_ptr + at, w, vs, keys, a, group);
          else
            for (int64_t u = 0; u < group; ++u)
              weighted_sum_any(v_ptr + at, w[u], vs, keys, head_dim, a[u]);
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* o = out_ptr + ((t0 + i / group) * num_heads + h * group + i % group) * head_dim;
        const vfloat inv = vsplat(inv_sum[i]);
        for (int64_t d = 0; d < head_dim; d += kLanes)
          vstore(o + d, vload(acc.data() + i * head_dim + d) * inv);
      }
    }
  });
}

}  // namespace

// q: [T, Hq, D] float32 (rows may be strided); caches as above; scales (8-bit formats):
// [blocks, Hkv, block_size] float32; block_tables: [B, max_blocks] int64; query_start:
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
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the KV cache must be contiguous");
  TORCH_CHECK(key_cache.size(3) % kLanes == 0, "block_size must be a multiple of ", kLanes);
  TORCH_CHECK(key_cache.size(2) == q.size(2), "key cache head_dim does not match q");
  TORCH_CHECK(q.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "index tensors must be int64");
  auto tables = block_tables.contiguous();
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  dispatch_kv_dtype(key_cache.scalar_type(), [&](auto tag) {
    attend<decltype(tag)>(q, key_cache, value_cache, key_scale, value_scale, tables,
                          query_start, positions, scale, out);
  });
  return out;
}

}  // namespace llmserve
