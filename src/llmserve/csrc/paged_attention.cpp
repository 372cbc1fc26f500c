// Paged attention on CPU, reading the KV cache blocks in place.
//
// Cache layout (attention/kv_format.py): keys [blocks, Hkv, D / P, block_size, P], values
// [blocks, Hkv, block_size / P, D, P]. With P = 1 (float formats, fp8) a block's keys of one
// head are a [D, block_size] tile, so 16 scores come out of one vector per step over D; int8
// stores pairs (P = 2) and takes a path of 16-bit integer dot products (below).
//
// Every query row is computed by the same sequence of operations whatever else is in the
// batch: each score is a sum over head_dim in order (one vector lane per key), the softmax
// and the weighted sum of values run over keys 0..pos in order. Rows of a prefill chunk are
// handled in tiles that share each key and value load, but a row's own arithmetic is the
// one it would have alone. So a row's result does not depend on the batch, on chunking or
// on the tile it falls in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
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
constexpr int64_t kLoadBudget = 256 << 10;  // most bytes an item loads ahead (load_item_blocks)
std::atomic<bool> g_load_ahead{true};  // set_attention_load_ahead

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

// The same into the L2 cache only (for data needed a while later).
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// Reads a word of every 64-byte line of [p, p + bytes) into the caches: independent loads in
// a tight loop, which the core keeps many of in flight at once. Returns their xor, for the
// caller to keep (see load_item_blocks).
inline uint64_t load_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  uint64_t acc = 0;
  for (int64_t i = 0; i < bytes; i += 64) {
    uint64_t word;
    std::memcpy(&word, c + i, sizeof(word));
    acc ^= word;
  }
  return acc;
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

// ---- int8 caches: 16-bit integer dot products -------------------------------------------
//
// An int8 cache stores pairs (attention/kv_format.py, P = 2): keys [D / 2][block_size][2]
// per block and head, values [block_size / 2][D][2]. Each query vector is rounded to 16 bits
// (q16 = round(q / sq), sq = max|q| / 32767) and each block's softmax weights times the
// values' scales likewise (w16 = round(p vs / sw), sw = the largest vs / 32767 of the
// block's keys the row sees, as p <= 1), so scores and weighted sums are exact int32 sums of int16 x int8 products, two
// per lane and instruction (vpdpwssd): the int8 codes are never converted to float one by
// one. The 16-bit roundings are within 2^-16 of each vector's largest element (for the
// weights, of the largest a weight can be: an fp16 weight's precision near 1), far below
// the 8-bit rounding of the cache itself. The float steps around them (scales, softmax, the sum over
// blocks) run in a fixed order, so batch invariance holds as for the float formats.

constexpr float kQ16 = 32767.f;
typedef int16_t vi16 __attribute__((vector_size(kLanes * 2)));

#if defined(__AVX512BW__)
typedef __m512i vpairs;  // 16 lanes of int16 pairs

// 16 lanes of two consecutive int8 codes, widened to int16.
inline vpairs load_pairs(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc[l] + a[l].first * b.first + a[l].second * b.second, b an int16 pair (low half first).
inline vint dot_pairs(vint acc, vpairs a, int32_t b) {
#if defined(__AVX512VNNI__)
  return reinterpret_cast<vint>(
      _mm512_dpwssd_epi32(reinterpret_cast<__m512i>(acc), a, _mm512_set1_epi32(b)));
#else
  return acc + reinterpret_cast<vint>(_mm512_madd_epi16(a, _mm512_set1_epi32(b)));
#endif
}
#else
struct vpairs {
  vint first, second;
};

inline vpairs load_pairs(const int8_t* p) {
  vpairs r;
  for (int l = 0; l < kLanes; ++l) {
    r.first[l] = p[2 * l];
    r.second[l] = p[2 * l + 1];
  }
  return r;
}

inline vint dot_pairs(vint acc, vpairs a, int32_t b) {
  const int16_t lo = static_cast<int16_t>(b & 0xFFFF), hi = static_cast<int16_t>(b >> 16);
  return acc + a.first * lo + a.second * hi;
}
#endif

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// The largest lane, by halves (exact in any order).
inline float vmax_lanes(vfloat v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Round to the nearest integer, ties to even, for |x| < 2^22 (adding and subtracting 1.5 *
// 2^23 leaves the rounded value), then clamp to +-32767 and narrow to int16.
inline vi16 round_to_i16(vfloat x) {
  const vfloat magic = vsplat(12582912.0f), hi = vsplat(kQ16), lo = vsplat(-kQ16);
  x = (x + magic) - magic;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  return __builtin_convertvector(__builtin_convertvector(x, vint), vi16);
}

// q16[0 : n] = round(q / sq) with sq = max(max|q| / 32767, smallest normal float) (1 / sq
// is finite; each element a product by it). n a multiple of kLanes. Returns sq.
inline float round_query(const float* q, int64_t n, int16_t* q16) {
  vfloat amax{};
  for (int64_t d = 0; d < n; d += kLanes) {
    const vfloat x = vload(q + d);
    amax = vmax(amax, x < 0 ? -x : x);
  }
  const float s = std::max(vmax_lanes(amax) / kQ16, std::numeric_limits<float>::min());
  const vfloat inv = vsplat(1.f / s);
  for (int64_t d = 0; d < n; d += kLanes) {
    const vi16 r = round_to_i16(vload(q + d) * inv);
    std::memcpy(q16 + d, &r, sizeof(r));
  }
  return s;
}

// The weights' scale of one block whose first `keys` keys a row sees: sw = max vs / 32767
// over those keys (not the ones past them: they may be written later, and a row's result
// must not depend on when). vsn = vs / sw for every key of the block. Returns sw.
inline float weight_scale(const float* vs, int64_t keys, int64_t block_size, float* vsn) {
  vint lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  vfloat top{};
  for (int64_t c = 0; c < block_size; c += kLanes)
    top = vmax(top, lane < static_cast<int32_t>(keys - c) ? vload(vs + c) : vfloat{});
  const float m = vmax_lanes(top);
  const vfloat inv = vsplat(m > 0 ? kQ16 / m : 0.f);
  for (int64_t c = 0; c < block_size; c += kLanes) vstore(vsn + c, vload(vs + c) * inv);
  return m / kQ16;
}

// One block's softmax numerators p (at most 1: the row's largest score is subtracted) times
// the values' scales vs, in 16 bits of the largest scale of the keys the row sees:
// w16 = round(p vs / sw) = round(p vsn) (weight_scale), so each weight is within 2^-16 of
// the largest it could be, the precision of an fp16 softmax weight near 1. Keys past
// `keys` weigh 0 (those lanes of p are scratch).
inline void round_weights(const float* p, const float* vsn, int64_t keys, int64_t block_size,
                          int16_t* w16) {
  vint lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  for (int64_t c = 0; c < block_size; c += kLanes) {
    const vfloat w = vload(p + c) * vload(vsn + c);
    const vi16 r = round_to_i16(lane < static_cast<int32_t>(keys - c) ? w : vfloat{});
    std::memcpy(w16 + c, &r, sizeof(r));
  }
}

// dst[b][u * stride + lane] = (int32 sum over d of q16_u[d] k[b][d][lane]) * ks[b] * qs[u],
// for N query vectors and NB blocks' 16-key column: k[b] points at the column's first pair
// row, `ld` bytes apart; q[u] holds the query's int16 pairs as int32.
template <int NB, int N>
inline void block_scores_pairs(const int8_t* const* kt, int64_t ld, int64_t pairs,
                               const int32_t* const* q, const float* qs, const vfloat* ks,
                               float* const* dst, int64_t stride) {
  vint acc[NB][N] = {};
  for (int64_t d = 0; d < pairs; ++d) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const vpairs k = load_pairs(kt[b] + d * ld);
#pragma GCC unroll 4
      for (int u = 0; u < N; ++u) acc[b][u] = dot_pairs(acc[b][u], k, q[u][d]);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 4
    for (int u = 0; u < N; ++u)
      vstore(dst[b] + u * stride, __builtin_convertvector(acc[b][u], vfloat) * ks[b] * qs[u]);
}

template <int NB>
inline void block_scores_pairs_n(const int8_t* const* kt, int64_t ld, int64_t pairs,
                                 const int32_t* const* q, const float* qs, int64_t n,
                                 const vfloat* ks, float* const* dst, int64_t stride) {
  switch (n) {
    case 1: block_scores_pairs<NB, 1>(kt, ld, pairs, q, qs, ks, dst, stride); break;
    case 2: block_scores_pairs<NB, 2>(kt, ld, pairs, q, qs, ks, dst, stride); break;
    case 3: block_scores_pairs<NB, 3>(kt, ld, pairs, q, qs, ks, dst, stride); break;
    default: block_scores_pairs<NB, kScoreRows>(kt, ld, pairs, q, qs, ks, dst, stride); break;
  }
}

// a_u[0 : 16 C] += (int32 sum over token pairs j of w16_u[j] v[j]) * sw, for U query
// vectors: v points at 16 C dimensions of a block's first token pair, pairs `ld` bytes
// apart ([pairs][D][2]); w[u] holds the weights' int16 pairs as int32.
template <int C, int U>
inline void weighted_sum_pairs(const int8_t* v, int64_t ld, const int32_t* const* w,
                               float sw, int64_t pairs, float* const* a) {
  vint acc[U][C] = {};
  for (int64_t j = 0; j < pairs; ++j) {
    vpairs x[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) x[c] = load_pairs(v + j * ld + c * kLanes * 2);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[u][c] = dot_pairs(acc[u][c], x[c], w[u][j]);
  }
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      vstore(a[u] + c * kLanes, vfma(__builtin_convertvector(acc[u][c], vfloat),
                                     vsplat(sw), vload(a[u] + c * kLanes)));
}

// U query vectors (1 to 4) over the dimensions [d0, d0 + 16 C) of the block's values.
template <int C>
inline void weighted_sum_pairs_u(const int8_t* v, int64_t ld, const int32_t* const* w,
                                 float sw, int64_t pairs, float* const* a, int64_t u) {
  switch (u) {
    case 1: weighted_sum_pairs<C, 1>(v, ld, w, sw, pairs, a); break;
    case 2: weighted_sum_pairs<C, 2>(v, ld, w, sw, pairs, a); break;
    case 3: weighted_sum_pairs<C, 3>(v, ld, w, sw, pairs, a); break;
    default: weighted_sum_pairs<C, 4>(v, ld, w, sw, pairs, a); break;
  }
}

// Query vectors [0, n) of one row (same keys) through weighted_sum_pairs: up to 4 at a time
// and 64 dimensions (4 vectors) per pass, so that the sums stay in registers.
inline void weighted_sum_pairs_row(const int8_t* v, int64_t head_dim, const int32_t* const* w,
                                   float sw, int64_t pairs, float* const* a, int64_t n) {
  constexpr int kDims = 4 * kLanes;
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t u = std::min<int64_t>(4, n - i);
    for (int64_t d0 = 0; d0 < head_dim; d0 += kDims) {
      float* ad[4];
      for (int64_t k = 0; k < u; ++k) ad[k] = a[i + k] + d0;
      const int8_t* vd = v + 2 * d0;
      switch ((std::min<int64_t>(kDims, head_dim - d0)) / kLanes) {
        case 1: weighted_sum_pairs_u<1>(vd, 2 * head_dim, w + i, sw, pairs, ad, u); break;
        case 2: weighted_sum_pairs_u<2>(vd, 2 * head_dim, w + i, sw, pairs, ad, u); break;
        case 3: weighted_sum_pairs_u<3>(vd, 2 * head_dim, w + i, sw, pairs, ad, u); break;
        default: weighted_sum_pairs_u<4>(vd, 2 * head_dim, w + i, sw, pairs, ad, u); break;
      }
    }
  }
}

// ---- work items, shared by both paths -----------------------------------------------------

// What every work item of one call reads.
struct Problem {
  const float* q;
  int64_t q_stride;
  int64_t num_heads, head_dim, num_kv_heads, block_size, group, max_blocks;
  int64_t block_elems, head_elems;  // elements of one block (every head), of one head's part
  const int64_t* tables;
  const int64_t* qstart;
  const int64_t* pos;
  const float* key_scale;  // [blocks, Hkv, block_size], or null
  const float* value_scale;
  float* out;
  float sm_scale;
  int64_t window;  // keys a row sees, ending at its own position (0: all of them)
  int64_t seg_keys;  // keys of a segment (below): kSegmentKeys in whole blocks
};

// Keys are taken in segments of kSegmentKeys (ops.h) at fixed positions of the sequence:
// keys [s S, (s + 1) S) form segment s. A row that sees keys of one segment only is
// computed by one item, as a plain softmax; a row that sees several has one item per
// segment, each leaving the segment's unnormalized sum of values with its max score and its
// sum of softmax numerators, and the last of them to finish merges these in segment order
// (flash-decoding). Which segments a row has depends on its own position alone, so its
// arithmetic stays the same in any batch. One long sequence then spreads over every thread
// (a lone decode had only its KV heads to share out: 3 on 2 threads left one idle for a
// third of the time), and an item's scores stay a few kB a query vector.

// Query rows [t0, t0 + rows) of sequence b against KV head h, over the keys of one segment:
// nq = rows * group query vectors, row-major (r, g), each seeing the keys [qfirst[i],
// qlen[i]) counted from key k0 (qfirst is 0 but for a sliding window or a segment's start;
// qlen <= qfirst: the row sees none of these keys), over blocks [first_block, num_blocks) of
// the sequence's table (k0 = first_block * block_size; blocks out of the segment, or out of
// every row's window, are never read).
struct Item {
  int64_t b, t0, rows, h, nq, first_block, num_blocks, k0;
  // The first of a thread's take of every KV head of its unit: it reads the blocks of the
  // heads after its own too (see load_item_blocks).
  bool loads_heads_after;
  const int64_t* table;
  // Null when the item covers every key of its rows: it writes their output. Otherwise
  // where it leaves each vector's partial result, [nq][head_dim + 2] (sum of values, max
  // score, sum of numerators).
  float* partial;
  int64_t qlen[kTile * 64];
  int64_t qfirst[kTile * 64];
  const float* qptrs[kTile * 64];
};

// Reusable per-thread buffers.
struct Scratch {
  std::vector<float> scores, acc;
  std::vector<int16_t> q16, w16;
  std::vector<float> sw, vsn;
};

// The first key a query row sees, of its `len` (its position + 1).
inline int64_t first_key(const Problem& p, int64_t len) {
  return p.window > 0 ? std::max<int64_t>(0, len - p.window) : 0;
}

// The keys [first, end) that a query row of `len` sees in the segment starting at key
// `seg_lo`; first >= end when it sees none there.
struct KeyRange {
  int64_t first, end;
};
inline KeyRange keys_in_segment(const Problem& p, int64_t len, int64_t seg_lo) {
  return {std::max(first_key(p, len), seg_lo), std::min(len, seg_lo + p.seg_keys)};
}

// One tile of up to kTile query rows of a sequence, with the segments its rows see.
struct Tile {
  int64_t b, t0, rows, first_seg, num_segs;
  int64_t partial;  // offset of its partial results in the call's buffer (num_segs > 1)
};

// out rows [t0, t0 + rows) of KV head h from their segments' partial results (laid out
// [segment][nq][head_dim + 2] from `partial`): per query vector, over its own segments in
// order, M = the largest max, L = sum e^(m_s - M) l_s, out = (sum e^(m_s - M) a_s) / L.
// A row of one segment gets a_s / l_s, bit for bit what an item writes directly.
void merge_segments(const Problem& p, const Tile& t, int64_t h, const float* partial) {
  const int64_t nq = t.rows * p.group, width = p.head_dim + 2;
  float a[512];
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t len = p.pos[t.t0 + r] + 1;
    const int64_t s0 = first_key(p, len) / p.seg_keys - t.first_seg;
    const int64_t s1 = (len - 1) / p.seg_keys - t.first_seg;
    float* o = p.out + ((t.t0 + r) * p.num_heads + h * p.group) * p.head_dim;
    for (int64_t g = 0; g < p.group; ++g) {
      const float* part = partial + (r * p.group + g) * width;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = s0; s <= s1; ++s) m = std::max(m, part[s * nq * width + p.head_dim]);
      float sum = 0.f;
      std::fill(a, a + p.head_dim, 0.f);
      for (int64_t s = s0; s <= s1; ++s) {
        const float* seg = part + s * nq * width;
        const float f = seg[p.head_dim] == m ? 1.f : std::exp(seg[p.head_dim] - m);
        sum += f * seg[p.head_dim + 1];
        for (int64_t d = 0; d < p.head_dim; d += kLanes)
          vstore(a + d, vfma(vsplat(f), vload(seg + d), vload(a + d)));
      }
      const vfloat inv = vsplat(1.f / sum);
      for (int64_t d = 0; d < p.head_dim; d += kLanes)
        vstore(o + g * p.head_dim + d, vload(a + d) * inv);
    }
  }
}

// Calls body(item, scratch) for every (tile of up to kTile query rows of a sequence, KV
// head, segment of keys its rows see), over the threads, and merges the segments of tiles
// that have several.
template <typename F>
void for_each_item(const Problem& p, int64_t num_seqs, F&& body) {
  c10::SmallVector<Tile, 64> tiles;  // on the stack for small steps
  int64_t partial_floats = 0;
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t t = p.qstart[b]; t < p.qstart[b + 1]; t += kTile) {
      const int64_t rows = std::min<int64_t>(kTile, p.qstart[b + 1] - t);
      int64_t max_len = 0, min_first = INT64_MAX;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t len = p.pos[t + r] + 1;
        max_len = std::max(max_len, len);
        min_first = std::min(min_first, first_key(p, len));
      }
      TORCH_CHECK(max_len <= p.max_blocks * p.block_size, "position past the block table");
      const int64_t first_seg = min_first / p.seg_keys;
      const int64_t num_segs = (max_len - 1) / p.seg_keys - first_seg + 1;
      tiles.push_back({b, t, rows, first_seg, num_segs, partial_floats});
      if (num_segs > 1)
        partial_floats += p.num_kv_heads * num_segs * rows * p.group * (p.head_dim + 2);
    }
  // Units of work: (tile, segment), each for every KV head.
  c10::SmallVector<int64_t, 64> unit_tile, unit_seg, cost;
  for (size_t t = 0; t < tiles.size(); ++t)
    for (int64_t s = 0; s < tiles[t].num_segs; ++s) {
      unit_tile.push_back(static_cast<int64_t>(t));
      unit_seg.push_back(tiles[t].first_seg + s);
      int64_t keys = 0;  // what the unit's rows see of the segment
      for (int64_t r = 0; r < tiles[t].rows; ++r) {
        const KeyRange k = keys_in_segment(p, p.pos[tiles[t].t0 + r] + 1,
                                           (tiles[t].first_seg + s) * p.seg_keys);
        keys += std::max<int64_t>(0, k.end - k.first);
      }
      cost.push_back(keys);
    }
  const int64_t num_units = static_cast<int64_t>(unit_tile.size());
  const int64_t num_items = num_units * p.num_kv_heads;
  // Items differ in cost (rows x keys): a prefill chunk's tiles beside decodes of short and
  // long sequences. Threads take them from a shared counter, costliest first, so that none
  // idles while another still has a long list (an even split of the range left one thread
  // waiting on the other). With units to spare, a thread takes every KV head of a unit at
  // once (neighbouring slices of the same blocks); with few, one item at a time, so that a
  // single sequence's heads still spread over the threads. Which thread computes an item
  // does not change its arithmetic.
  c10::SmallVector<int64_t, 64> order(static_cast<size_t>(num_items));
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cost[a / p.num_kv_heads] > cost[b / p.num_kv_heads];
  });
  // Kept by the calling thread from call to call, like the workers' scratch.
  static thread_local std::vector<float> partials;
  static thread_local std::vector<int32_t> pending;  // per (tile, head): segments to go
  partials.resize(static_cast<size_t>(partial_floats));
  pending.resize(tiles.size() * p.num_kv_heads);
  for (size_t t = 0; t < tiles.size(); ++t)
    std::fill_n(pending.begin() + t * p.num_kv_heads, p.num_kv_heads,
                static_cast<int32_t>(tiles[t].num_segs));
  float* const partial_base = partials.data();
  int32_t* const pending_base = pending.data();

  std::atomic<int64_t> next_item{0};
  const bool load_ahead = g_load_ahead.load(std::memory_order_relaxed);
  const int64_t workers = std::min<int64_t>(num_threads(), num_items);
  const int64_t grab = num_units >= 4 * workers ? p.num_kv_heads : 1;

  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const FlushDenormals ftz;
    // Kept by each thread from call to call: grown to the largest item seen, not allocated
    // and freed by every layer of every step.
    static thread_local Scratch scratch;
    Item it;
    // Each take is `grab` consecutive entries of `order`, computed one item after another.
    for (int64_t k0; (k0 = next_item.fetch_add(grab, std::memory_order_relaxed)) < num_items;)
    for (int64_t k = k0; k < std::min(k0 + grab, num_items); ++k) {
      const int64_t item = order[k], unit = item / p.num_kv_heads;
      const Tile& tile = tiles[unit_tile[unit]];
      const int64_t seg = unit_seg[unit];
      const int64_t seg_lo = seg * p.seg_keys;
      it.h = item % p.num_kv_heads;
      it.loads_heads_after = load_ahead && grab > 1 && k == k0;
      it.b = tile.b;
      it.t0 = tile.t0;
      it.rows = tile.rows;
      it.nq = it.rows * p.group;
      it.table = p.tables + it.b * p.max_blocks;
      int64_t lo = INT64_MAX, hi = 0;  // keys any row sees in the segment
      for (int64_t r = 0; r < it.rows; ++r) {
        const KeyRange k = keys_in_segment(p, p.pos[it.t0 + r] + 1, seg_lo);
        if (k.first < k.end) {
          lo = std::min(lo, k.first);
          hi = std::max(hi, k.end);
        }
      }
      if (lo >= hi) lo = hi = 0;  // no row sees this segment (cannot happen in a chunk)
      it.first_block = lo / p.block_size;
      it.num_blocks = (hi + p.block_size - 1) / p.block_size;
      it.k0 = it.first_block * p.block_size;
      for (int64_t r = 0, i = 0; r < it.rows; ++r) {
        const KeyRange k = keys_in_segment(p, p.pos[it.t0 + r] + 1, seg_lo);
        int64_t first = k.first - it.k0, end = k.end - it.k0;  // relative to the item's keys
        if (end <= first) first = end = 0;
        const float* row = p.q + (it.t0 + r) * p.q_stride + it.h * p.group * p.head_dim;
        for (int64_t g = 0; g < p.group; ++g, ++i) {
          it.qlen[i] = end;
          it.qfirst[i] = first;
          it.qptrs[i] = row + g * p.head_dim;
        }
      }
      const int64_t head_floats = tile.num_segs * it.nq * (p.head_dim + 2);
      it.partial = tile.num_segs == 1 ? nullptr
                                      : partial_base + tile.partial + it.h * head_floats +
                                            (seg - tile.first_seg) * it.nq * (p.head_dim + 2);
      body(it, scratch);
      // The last segment of a (tile, head) to finish merges them all (acquiring what the
      // others left).
      if (it.partial &&
          __atomic_sub_fetch(pending_base + unit_tile[unit] * p.num_kv_heads + it.h, 1,
                             __ATOMIC_ACQ_REL) == 0)
        merge_segments(p, tile, it.h, partial_base + tile.partial + it.h * head_floats);
    }
  });
}

// Blocks sit anywhere in the pool, out of the hardware prefetcher's sight: each pass asks
// for block i + kAhead (and its scales) as it starts on block i.
template <typename T>
struct BlockReader {
  const Problem& p;
  const Item& it;
  const T* cache;
  const float* scales;

  // Where block i's data of the item's head start, and its scales.
  const T* data(int64_t i) const {
    return cache + it.table[i] * p.block_elems + it.h * p.head_elems;
  }
  const float* scale(int64_t i) const {
    return scales + (it.table[i] * p.num_kv_heads + it.h) * p.block_size;
  }
  void fetch(int64_t i) const {
    if (i >= it.num_blocks) return;
    prefetch(data(i), p.head_elems * sizeof(T));
    if (scales) prefetch(scale(i), p.block_size * sizeof(float));
  }
  // Loads block i's data and scales of the item's head and of every head after it (they
  // follow it in the block). Returns the loaded words' xor.
  uint64_t load_heads_from_own(int64_t i) const {
    uint64_t acc = load_lines(data(i), (p.block_elems - it.h * p.head_elems) * sizeof(T));
    if (scales)
      acc ^= load_lines(scale(i), (p.num_kv_heads - it.h) * p.block_size * sizeof(float));
    return acc;
  }
  void fetch_first() const {
    for (int64_t i = it.first_block; i < std::min<int64_t>(it.first_block + kAhead,
                                                           it.num_blocks); ++i)
      fetch(i);
  }
  // Block i's data into L2 (values, while the scores are computed).
  void fetch_later(int64_t i) const {
    if (i < it.num_blocks) prefetch_l2(data(i), p.head_elems * sizeof(T));
  }
  // Every block's scales (a line each for blocks of 16), read one after another by the
  // int8 path's weight scales: asked for at once, they arrive together.
  void fetch_scales() const {
    if (scales)
      for (int64_t i = it.first_block; i < it.num_blocks; ++i)
        prefetch(scale(i), p.block_size * sizeof(float));
  }
};

// A decode item reads its blocks before it computes anything. Software prefetches alone
// (one per line, spread over the computation) left most of this host's memory bandwidth
// unused: 30 layers of decodes from memory took the time of a read of the blocks plus that
// of the computation from cache, and more. A tight loop of loads keeps many lines in flight.
// The first item of a take of every KV head of a unit (Item::loads_heads_after) reads the
// blocks of the heads after its own too: they lie side by side in a block, so each block is
// one contiguous read (6 KiB of keys and 6 of values for SmolLM2's three heads at blocks of
// 32), and the take's next items find theirs in L2. Items of a prefill tile skip it (the
// tiles before them read the same blocks), as do items of more than kLoadBudget bytes
// (float32 caches: their blocks crowd L2, and measured slower). Measured on a Zen 4:
// BENCHMARKS.md, session 42 (`set_attention_load_ahead(False)`: prefetches alone).
template <typename T>
void load_item_blocks(const BlockReader<T>& keys, const BlockReader<T>& values,
                      const Item& it) {
  if (!it.loads_heads_after || it.rows > 1) return;
  const Problem& p = keys.p;
  const int64_t heads = p.num_kv_heads - it.h;  // its own and those after it
  const int64_t head_bytes = p.head_elems * sizeof(T) +
                             (keys.scales ? p.block_size * sizeof(float) : 0);
  const int64_t block_bytes = heads * head_bytes;
  if (2 * block_bytes * (it.num_blocks - it.first_block) > kLoadBudget) return;
  uint64_t acc = 0;
  for (int64_t blk = it.first_block; blk < it.num_blocks; ++blk)
    acc ^= keys.load_heads_from_own(blk) ^ values.load_heads_from_own(blk);
  asm volatile("" : : "r"(acc));  // the loads are the point: keep them
}

// Scores of every query vector of the item against every key of its blocks (also past a
// vector's own length: those lanes are scratch), stored from key k0 on, two blocks at a
// time, a column of 16 keys at a time:
// score(nb, kt, ks, i, n, dst) fills query vectors [i, i + n) for the column of nb blocks,
// kt[b] the column's first keys (P elements each), ks[b] their scales times sm_scale.
// The values' blocks are fetched into L2 on the way, for the weighted sums after.
template <typename T, typename F>
void for_each_score_tile(const BlockReader<T>& keys, const BlockReader<T>& values,
                         const Item& it, int64_t bs, int64_t pack, int64_t stride,
                         float* scores, float sm_scale, F&& score) {
  keys.fetch_scales();
  values.fetch_scales();
  for (int64_t blk = it.first_block; blk < it.num_blocks; blk += 2) {
    const int nb = blk + 1 < it.num_blocks ? 2 : 1;
    for (int b = 0; b < nb; ++b) {
      keys.fetch(blk + b + kAhead);
      values.fetch_later(blk + b);
    }
    for (int64_t c = 0; c < bs; c += kLanes) {
      const T* kt[2];
      vfloat ks[2];
      for (int b = 0; b < nb; ++b) {
        kt[b] = keys.data(blk + b) + pack * c;
        ks[b] = keys.scales ? vload(keys.scale(blk + b) + c) * sm_scale : vsplat(sm_scale);
      }
      for (int64_t i = 0; i < it.nq; i += kScoreRows) {
        float* const dst[2] = {scores + i * stride + blk * bs - it.k0 + c,
                               scores + i * stride + (blk + 1) * bs - it.k0 + c};
        score(nb, kt, ks, i, std::min<int64_t>(kScoreRows, it.nq - i), dst);
      }
    }
  }
}

// Softmax numerators of each query vector's scores, in place (lanes past a vector's length
// are scratch); the max is exact in any order, the sum runs lane-wise over whole vectors,
// then the tail in order: a fixed order for a given length. row_max[i] = the largest score,
// row_sum[i] = the sum of the numerators; vectors that see none of the item's keys are left
// alone. Keys before a vector's first (qfirst) get exact zeros, whatever was there (scores
// of blocks the item did not read are never written): the row's sum is then the same
// whichever blocks its item skipped (k0 moves by whole blocks, whole vectors of zeros).
void softmax_numerators(float* scores, int64_t stride, const Item& it, float* row_max,
                        float* row_sum) {
  for (int64_t i = 0; i < it.nq; ++i) {
    float* sc = scores + i * stride;
    const int64_t n = it.qlen[i], body = n - n % kLanes, first = it.qfirst[i];
    if (n <= first) continue;
    if (first > 0) std::fill(sc, sc + first, -std::numeric_limits<float>::infinity());
    float m = sc[0];
    if (body > 0) {
      vfloat mv = vload(sc);
      for (int64_t j = kLanes; j < body; j += kLanes) mv = vmax(mv, vload(sc + j));
      m = std::max(m, vmax_lanes(mv));
    }
    for (int64_t j = body; j < n; ++j) m = std::max(m, sc[j]);
    const vfloat mvec = vsplat(m);
    for (int64_t j = 0; j < n; j += kLanes) vstore(sc + j, vexp(vload(sc + j) - mvec));
    if (first > 0) std::fill(sc, sc + first, 0.f);  // vexp(-inf) is tiny, not 0
    vfloat sv{};
    for (int64_t j = 0; j < body; j += kLanes) sv += vload(sc + j);
    float sum = vsum(sv);
    for (int64_t j = body; j < n; ++j) sum += sc[j];
    row_max[i] = m;
    row_sum[i] = sum;
  }
}

// The item's results from acc (each vector's sum of values weighted by its numerators): the
// output rows acc / row_sum when the item covers its rows' every key, else each vector's
// partial result for merge_segments (vectors that see none of the item's keys are left out:
// merge_segments does not read them).
void finish_item(const Problem& p, const Item& it, const float* acc, const float* row_max,
                 const float* row_sum) {
  for (int64_t r = 0, i = 0; r < it.rows; ++r) {
    float* o = p.out + ((it.t0 + r) * p.num_heads + it.h * p.group) * p.head_dim;
    for (int64_t g = 0; g < p.group; ++g, ++i) {
      if (it.qlen[i] <= it.qfirst[i]) continue;
      if (it.partial) {
        float* part = it.partial + i * (p.head_dim + 2);
        std::memcpy(part, acc + i * p.head_dim, p.head_dim * sizeof(float));
        part[p.head_dim] = row_max[i];
        part[p.head_dim + 1] = row_sum[i];
        continue;
      }
      const vfloat inv = vsplat(1.f / row_sum[i]);
      for (int64_t d = 0; d < p.head_dim; d += kLanes)
        vstore(o + g * p.head_dim + d, vload(acc + i * p.head_dim + d) * inv);
    }
  }
}

// Float formats (and any cache stored one element at a time): keys [D, block_size] and values
// [block_size, D] per block and head, converted to float32 as they are read.
template <typename T>
void attend_float(const Problem& p, int64_t num_seqs, const T* k_ptr, const T* v_ptr) {
  const int64_t bs = p.block_size, head_dim = p.head_dim, group = p.group;
  for_each_item(p, num_seqs, [&](const Item& it, Scratch& s) {
    const BlockReader<T> keys{p, it, k_ptr, p.key_scale}, values{p, it, v_ptr, p.value_scale};
    const int64_t nq = it.nq, num_blocks = it.num_blocks;
    const int64_t stride = (num_blocks - it.first_block) * bs;  // scores per query vector
    load_item_blocks(keys, values, it);
    keys.fetch_first();
    s.scores.resize(static_cast<size_t>(nq * stride));

    // 1. Scores: lane c of a vector sums q[d] k_c[d] over d in order; then times scale
    //    (and the key's stored scale).
    for_each_score_tile(keys, values, it, bs, 1, stride, s.scores.data(), p.sm_scale,
                        [&](int nb, const T* const* kt, const vfloat* ks, int64_t i, int64_t n,
                            float* const* dst) {
      if (nb == 2)
        block_scores_n<2>(kt, bs, head_dim, it.qptrs + i, n, ks, dst, stride);
      else
        block_scores_n<1>(kt, bs, head_dim, it.qptrs + i, n, ks, dst, stride);
    });
    float row_max[kTile * 64], row_sum[kTile * 64];
    softmax_numerators(s.scores.data(), stride, it, row_max, row_sum);
    values.fetch_first();
    // 3. Weighted sum of values in key order, a block at a time (its values stay in L1
    //    while every query vector of the item takes its share), then normalize.
    s.acc.assign(static_cast<size_t>(nq * head_dim), 0.f);
    for (int64_t blk = it.first_block; blk < num_blocks; ++blk) {
      values.fetch(blk + kAhead);
      const T* v = values.data(blk);
      const int64_t j0 = blk * bs - it.k0;  // the block's first key in the scores
      const float* vs = p.value_scale ? values.scale(blk) : nullptr;
      // The query vectors of one row share their keys: taken together, up to four.
      for (int64_t i = 0; i < nq; i += group) {
        const int64_t n_keys = std::min(bs, it.qlen[i] - j0);
        if (n_keys <= 0) continue;
        const float* w[64];
        float* a[64];
        for (int64_t u = 0; u < group; ++u) {
          w[u] = s.scores.data() + (i + u) * stride + j0;
          a[u] = s.acc.data() + (i + u) * head_dim;
        }
        if (head_dim == 64)
          weighted_sum_row<4>(v, w, vs, n_keys, a, group);
        else if (head_dim == 128)
          weighted_sum_row<8>(v, w, vs, n_keys, a, group);
        else
          for (int64_t u = 0; u < group; ++u)
            weighted_sum_any(v, w[u], vs, n_keys, head_dim, a[u]);
      }
    }
    finish_item(p, it, s.acc.data(), row_max, row_sum);
  });
}

// int8 caches stored in pairs (see above): keys [D / 2][block_size][2] and values
// [block_size / 2][D][2] per block and head.
void attend_int8_pairs(const Problem& p, int64_t num_seqs, const int8_t* k_ptr,
                       const int8_t* v_ptr) {
  const int64_t bs = p.block_size, head_dim = p.head_dim, group = p.group;
  const int64_t pairs = head_dim / 2;
  for_each_item(p, num_seqs, [&](const Item& it, Scratch& s) {
    const BlockReader<int8_t> keys{p, it, k_ptr, p.key_scale},
        values{p, it, v_ptr, p.value_scale};
    const int64_t nq = it.nq, num_blocks = it.num_blocks;
    const int64_t stride = (num_blocks - it.first_block) * bs;
    load_item_blocks(keys, values, it);
    keys.fetch_first();
    s.scores.resize(static_cast<size_t>(nq * stride));
    s.q16.resize(static_cast<size_t>(nq * head_dim));
    float qs[kTile * 64];
    const int32_t* q32[kTile * 64];
    for (int64_t i = 0; i < nq; ++i) {
      int16_t* q16 = s.q16.data() + i * head_dim;
      qs[i] = round_query(it.qptrs[i], head_dim, q16);
      q32[i] = reinterpret_cast<const int32_t*>(q16);
    }

    // 1. Scores: exact int32 sums over d, then the scales.
    for_each_score_tile(keys, values, it, bs, 2, stride, s.scores.data(), p.sm_scale,
                        [&](int nb, const int8_t* const* kt, const vfloat* ks, int64_t i,
                            int64_t n, float* const* dst) {
      if (nb == 2)
        block_scores_pairs_n<2>(kt, 2 * bs, pairs, q32 + i, qs + i, n, ks, dst, stride);
      else
        block_scores_pairs_n<1>(kt, 2 * bs, pairs, q32 + i, qs + i, n, ks, dst, stride);
    });
    // 2. Softmax numerators, then the weights p vs of each block in 16 bits.
    float row_max[kTile * 64], row_sum[kTile * 64];
    softmax_numerators(s.scores.data(), stride, it, row_max, row_sum);
    values.fetch_first();
    // Scales of whole blocks, shared by every query vector; a row's last block, if the
    // row sees only part of it, gets its own. Indexed by the block's place in the item
    // (keys counted from k0, which is a block's first).
    const int64_t item_blocks = num_blocks - it.first_block;
    s.w16.resize(static_cast<size_t>(nq * stride));
    s.sw.resize(static_cast<size_t>(item_blocks + it.rows));
    s.vsn.resize(static_cast<size_t>(stride + bs));
    for (int64_t b = 0; b < item_blocks; ++b)
      s.sw[b] = weight_scale(values.scale(it.first_block + b), bs, bs, s.vsn.data() + b * bs);
    float* partial_vsn = s.vsn.data() + stride;
    for (int64_t r = 0, i = 0; r < it.rows; ++r) {
      const int64_t len = it.qlen[i], whole = len - len % bs;
      if (whole < len)
        s.sw[item_blocks + r] = weight_scale(values.scale(it.first_block + whole / bs),
                                             len - whole, bs, partial_vsn);
      for (int64_t g = 0; g < group; ++g, ++i)
        for (int64_t j0 = 0; j0 < len; j0 += bs)
          round_weights(s.scores.data() + i * stride + j0,
                        j0 < whole ? s.vsn.data() + j0 : partial_vsn, len - j0, bs,
                        s.w16.data() + i * stride + j0);
    }
    // 3. Weighted sums of values, a block at a time: exact int32 sums over its keys, then
    //    added to the float sums times the weights' scale.
    s.acc.assign(static_cast<size_t>(nq * head_dim), 0.f);
    for (int64_t blk = it.first_block; blk < num_blocks; ++blk) {
      values.fetch(blk + kAhead);
      const int8_t* v = values.data(blk);
      const int64_t j0 = blk * bs - it.k0;  // the block's first key in the scores
      for (int64_t r = 0, i = 0; r < it.rows; ++r, i += group) {
        const int64_t n_keys = std::min(bs, it.qlen[i] - j0);
        if (n_keys <= 0) continue;
        // The row's query vectors share its keys, so the weights' scale too.
        const float sw = s.sw[n_keys < bs ? item_blocks + r : blk - it.first_block];
        const int32_t* w[64];
        float* a[64];
        for (int64_t u = 0; u < group; ++u) {
          w[u] = reinterpret_cast<const int32_t*>(s.w16.data() + (i + u) * stride + j0);
          a[u] = s.acc.data() + (i + u) * head_dim;
        }
        const int64_t n_pairs = (n_keys + 1) / 2;  // an odd last key pairs with weight 0
        weighted_sum_pairs_row(v, head_dim, w, sw, n_pairs, a, group);
      }
    }
    finish_item(p, it, s.acc.data(), row_max, row_sum);
  });
}

}  // namespace

bool set_attention_load_ahead(bool on) { return g_load_ahead.exchange(on); }

// q: [T, Hq, D] float32 (rows may be strided); caches in kv_format.py's layout, keys
// [blocks, Hkv, D / P, block_size, P] and values [blocks, Hkv, block_size / P, D, P]
// (P = 2 only for int8); scales (8-bit formats): [blocks, Hkv, block_size] float32;
// block_tables: [B, max_blocks] int64; query_start: [B + 1] int64 (rows of sequence b are
// query_start[b]..query_start[b+1]); positions: [T] int64 (row t sees keys 0..positions[t]
// of its sequence, or with window > 0 only the last `window` of them: keys
// positions[t] - window + 1..positions[t]). Returns [T, Hq * D] float32.
void paged_attention_out(const at::Tensor& q, const at::Tensor& key_cache,
                         const at::Tensor& value_cache,
                         const c10::optional<at::Tensor>& key_scale,
                         const c10::optional<at::Tensor>& value_scale,
                         const at::Tensor& block_tables, const at::Tensor& query_start,
                         const at::Tensor& positions, double scale, int64_t window,
                         at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be a float32 [T, Hq, D] tensor with contiguous heads");
  TORCH_CHECK(q.size(2) % kLanes == 0, "head_dim must be a multiple of ", kLanes);
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 5 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              "the KV cache must be contiguous [blocks, Hkv, D / P, block_size, P] keys and "
              "[blocks, Hkv, block_size / P, D, P] values");
  const int64_t pack = key_cache.size(4), block_size = key_cache.size(3);
  TORCH_CHECK(block_size % kLanes == 0, "block_size must be a multiple of ", kLanes);
  TORCH_CHECK(key_cache.size(2) * pack == q.size(2), "key cache head_dim does not match q");
  TORCH_CHECK(q.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) / key_cache.size(1) <= 64, "more than 64 query heads per KV head");
  TORCH_CHECK(q.size(2) <= 512, "head_dim above 512");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "index tensors must be int64");
  const bool pairs = pack == 2;
  TORCH_CHECK(pack == 1 || (pairs && key_cache.scalar_type() == at::kChar && key_scale &&
                            value_scale),
              "pairs (P = 2) are an int8 layout, with scales");
  auto tables = block_tables.contiguous();
  check_out(out, q.size(0), q.size(1) * q.size(2), "out");
  const int64_t num_kv_heads = key_cache.size(1), head_dim = q.size(2);
  const Problem p{q.data_ptr<float>(),
                  q.stride(0),
                  q.size(1),
                  head_dim,
                  num_kv_heads,
                  block_size,
                  q.size(1) / num_kv_heads,
                  tables.size(1),
                  num_kv_heads * head_dim * block_size,
                  head_dim * block_size,
                  tables.data_ptr<int64_t>(),
                  query_start.data_ptr<int64_t>(),
                  positions.data_ptr<int64_t>(),
                  key_scale ? key_scale->data_ptr<float>() : nullptr,
                  value_scale ? value_scale->data_ptr<float>() : nullptr,
                  out.data_ptr<float>(),
                  static_cast<float>(scale),
                  window,
                  std::max<int64_t>(1, kSegmentKeys / block_size) * block_size};
  const int64_t num_seqs = query_start.size(0) - 1;
  if (pairs) {
    attend_int8_pairs(p, num_seqs, key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>());
  } else {
    dispatch_kv_dtype(key_cache.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      attend_float<T>(p, num_seqs, key_cache.data_ptr<T>(), value_cache.data_ptr<T>());
    });
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache,
                           const c10::optional<at::Tensor>& key_scale,
                           const c10::optional<at::Tensor>& value_scale,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& positions, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be a float32 [T, Hq, D] tensor with contiguous heads");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  paged_attention_out(q, key_cache, value_cache, key_scale, value_scale, block_tables,
                      query_start, positions, scale, window, out);
  return out;
}

}  // namespace llmserve
