// One random draw per row of probabilities by the exponential race (sample/ops.py,
// exponential_race): token argmax_v p[v] / E[v] with E[v] = -log(u[v]) ~ Exp(1), so that
// token v wins with probability p[v]. u[v] comes from a counter-based hash of the row's
// 64-bit key and v, so a row's draw depends on its key and its probabilities alone (never on
// the batch, the thread count or the CPU), and needs no generator state.
//
// The arithmetic is the PyTorch reference's (ops._race_scores), operation for operation:
// 32-bit integer hashing, the exact conversion of 23 bits and a half to a float in (0, 1),
// Cephes' logf polynomial as separate float32 multiplies and adds (-ffp-contract=off), one
// division. The reference gives the same bits on any device; this runs ~20x faster than
// PyTorch's per-row exponential_ and needs no [rows, vocab] temporaries.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "ops.h"

namespace llmserve {

namespace {

typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));

constexpr int64_t kChunk = 4096;  // inputs per work item (a multiple of kLanes)

// lowbias32 (C. Wellons): a bijection of 32-bit words with near-ideal avalanche.
inline vuint mix32(vuint x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// log(x) for normal positive x (Cephes logf): x = m 2^e, m in [sqrt(1/2), sqrt(2)).
inline vfloat vlog(vfloat x) {
  vint bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const vint exponent = ((bits >> 23) & 0xff) - 126;
  const vint mant_bits = (bits & 0x007fffff) | 0x3f000000;  // in [0.5, 1)
  vfloat m;
  std::memcpy(&m, &mant_bits, sizeof(m));
  vfloat e = __builtin_convertvector(exponent, vfloat);
  const vint small = m < 0x1.6a09e6p-1f;  // sqrt(1/2)
  e = small ? e - 1.0f : e;
  m = small ? (m + m) - 1.0f : m - 1.0f;
  const vfloat z = m * m;
  vfloat y = vsplat(0x1.204376p-4f);
  y = y * m + -0x1.d7a37p-4f;
  y = y * m + 0x1.de4a34p-4f;
  y = y * m + -0x1.fcba9ep-4f;
  y = y * m + 0x1.23d37ep-3f;
  y = y * m + -0x1.555ca0p-3f;
  y = y * m + 0x1.999d58p-3f;
  y = y * m + -0x1.fffff8p-3f;
  y = y * m + 0x1.555554p-2f;
  y = (y * m) * z;
  y = y + e * -0x1.bd0106p-13f;
  y = y + z * -0.5f;
  vfloat r = m + y;
  r = r + e * 0x1.63p-1f;
  return r;
}

struct Best {
  float score;
  int64_t index;
  bool nan;  // a NaN probability: the first one wins (torch.argmax's rule)
};

// The chunk [begin, end) of a row: its largest score and the first index holding it;
// with `scores`, each score is stored there too (for the tests).
Best race_chunk(const float* p, int64_t begin, int64_t end, uint32_t k0, uint32_t k1,
                float* scores) {
  vuint lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = static_cast<uint32_t>(l);
  vfloat best = vsplat(-1.0f);  // every score is >= 0
  vint best_idx{};
  vint nan{};
  for (int64_t i = begin; i < end; i += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, end - i);
    vfloat probs = vsplat(0.0f);
    std::memcpy(&probs, p + i, n * sizeof(float));
    const vuint idx = static_cast<uint32_t>(i) + lane;
    const vuint h = mix32(mix32(idx ^ k0) ^ k1);
    const vfloat u = (__builtin_convertvector(h >> 9, vfloat) + 0.5f) * 0x1p-23f;  // < 1
    vfloat score = probs / (0.0f - vlog(u));
    if (scores != nullptr) std::memcpy(scores + i, &score, n * sizeof(float));
    if (n < kLanes) {
      const vint valid = __builtin_convertvector(lane, vint) < static_cast<int32_t>(n);
      score = valid ? score : vsplat(-1.0f);
    }
    nan |= score != score;
    const vint take = score > best;
    best = take ? score : best;
    best_idx = take ? __builtin_convertvector(idx, vint) : best_idx;
  }
  Best out{-1.0f, begin, false};
  for (int l = 0; l < kLanes; ++l) {
    if (nan[l]) out.nan = true;
    if (best[l] > out.score || (best[l] == out.score && best_idx[l] < out.index)) {
      out.score = best[l];
      out.index = best_idx[l];
    }
  }
  if (out.nan) {
    for (int64_t i = begin; i < end; ++i)
      if (std::isnan(p[i])) {
        out.index = i;
        break;
      }
  }
  return out;
}

}  // namespace

namespace {

// Runs the race on every row; with `scores` [rows, vocab], stores every score as well.
at::Tensor race(const at::Tensor& probs, const at::Tensor& keys, float* scores) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1,
              "probs must be a float32 [rows, vocab] tensor with contiguous rows");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "vocab must be in [1, 2^31), got ",
              vocab);
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == rows && keys.size(1) == 2 &&
                  keys.scalar_type() == at::kLong,
              "keys must be an int64 [rows, 2] tensor (two 32-bit words a row)");
  const at::Tensor k = keys.contiguous();
  const float* pp = probs.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t stride = probs.stride(0), chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<Best> found(rows * chunks);
  parallel_for(0, rows * chunks, 1, [&](int64_t b, int64_t e) {
    IeeeDenormals ieee;  // tiny probabilities stay denormal, as in the reference
    for (int64_t item = b; item < e; ++item) {
      const int64_t r = item / chunks, c = item % chunks;
      found[item] = race_chunk(pp + r * stride, c * kChunk, std::min(vocab, (c + 1) * kChunk),
                               static_cast<uint32_t>(kp[2 * r]),
                               static_cast<uint32_t>(kp[2 * r + 1]),
                               scores == nullptr ? nullptr : scores + r * vocab);
    }
  });
  auto out = at::empty({rows}, probs.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // the chunks in order: the first largest wins
    Best best = found[r * chunks];
    for (int64_t c = 1; c < chunks && !best.nan; ++c) {
      const Best& next = found[r * chunks + c];
      if (next.nan || next.score > best.score) best = next;
    }
    op[r] = best.index;
  }
  return out;
}

}  // namespace

at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& keys) {
  return race(probs, keys, nullptr);
}

at::Tensor exponential_race_scores(const at::Tensor& probs, const at::Tensor& keys) {
  auto scores = at::empty({probs.size(0), probs.size(1)}, probs.options());
  race(probs, keys, scores.data_ptr<float>());
  return scores;
}

}  // namespace llmserve
