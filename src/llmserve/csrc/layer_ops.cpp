// Elementwise and row-wise layer ops: RMSNorm (with the residual add fused), SiLU-and-mul,
// rotary embedding in place, the argmax of each row. Each row is computed on its own in a fixed order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <cmath>

#include "cpu_math.h"
#include "ops.h"

namespace llmserve {

namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              name, " must be a float32 [rows, hidden] tensor with contiguous rows");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

void rms_norm_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_out(out, rows, n, "out");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      norm_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_out(x, weight, eps, out);
  return out;
}

void add_rms_norm_out(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                      double eps, at::Tensor& out) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == delta.sizes(),
              "residual must be contiguous and the shape of delta");
  const int64_t rows = residual.size(0), n = residual.size(1);
  check_out(out, rows, n, "out");
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t dstride = delta.stride(0);
  parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* x = rp + r * n;
      const float* d = dp + r * dstride;
      for (int64_t i = 0; i < n; ++i) x[i] += d[i];
      norm_row(x, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                         double eps) {
  check_rows(residual, "residual");
  auto out = at::empty({residual.size(0), residual.size(1)}, residual.options());
  add_rms_norm_out(residual, delta, weight, eps, out);
  return out;
}

void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  check_out(out, rows, n, "out");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * stride;
      const float* u = g + n;
      float* o = op + r * n;
      const int64_t body = n - n % kLanes;
      for (int64_t i = 0; i < body; i += kLanes) {
        const vfloat gv = vload(g + i);
        vstore(o + i, gv / (1.f + vexp(-gv)) * vload(u + i));
      }
      for (int64_t i = body; i < n; ++i) {  // the tail through a zero-padded vector
        float gt[kLanes] = {0}, et[kLanes];
        gt[0] = -g[i];
        vstore(et, vexp(vload(gt)));
        o[i] = g[i] / (1.f + et[0]) * u[i];
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul_out(gate_up, out);
  return out;
}

void rotary_embedding_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                       const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
              q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "q and k must be float32 [T, heads, head_dim] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat,
              "rotary tables must be contiguous float32");
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  const int64_t max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t qh = q.size(1), kh = k.size(1), qs = q.stride(0), ks = k.stride(0);
  parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    c10::SmallVector<float, 256> tmp(dim);  // on the stack up to head_dim 256
    for (int64_t t = b; t < e; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of the rotary table");
      const float* c = cp + pos[t] * dim;  // [2, D/2]: cos for both halves
      const float* s = sp + pos[t] * dim;  // [2, D/2]: -sin, then sin
      auto rotate = [&](float* x) {
        for (int64_t i = 0; i < half; ++i) {
          tmp[i] = x[i] * c[i] + x[i + half] * s[i];
          tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        std::copy(tmp.begin(), tmp.end(), x);
      };
      for (int64_t h = 0; h < qh; ++h) rotate(qp + t * qs + h * dim);
      for (int64_t h = 0; h < kh; ++h) rotate(kp + t * ks + h * dim);
    }
  });
}

// torch.argmax(x, dim=1) for float32 rows, NaN counted as the largest, the first index of
// the largest value on ties. PyTorch's CPU argmax runs ~10x slower than this on a [64, 49152]
// batch of logits (~4 ms, a few percent of a decode step).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "argmax of an empty row");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = x.stride(0), body = n - n % kLanes;
  parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * stride;
      // Pass 1: the maximum (exact in any order) and whether a NaN is present.
      float m = row[0];
      bool nan = false;
      if (body > 0) {
        vfloat mv = vload(row);
        vint nv{};
        for (int64_t i = 0; i < body; i += kLanes) {
          const vfloat v = vload(row + i);
          mv = v > mv ? v : mv;
          nv |= v != v;
        }
        for (int l = 0; l < kLanes; ++l) {
          m = std::max(m, mv[l]);
          nan |= nv[l] != 0;
        }
      }
      for (int64_t i = body; i < n; ++i) {
        m = std::max(m, row[i]);
        nan |= std::isnan(row[i]);
      }
      // Pass 2: the first index holding it (or the first NaN).
      int64_t i = 0;
#if defined(__AVX512F__)
      if (!nan) {  // skip whole vectors without it
        const __m512 mv = _mm512_set1_ps(m);
        while (i < body && _mm512_cmpeq_ps_mask(_mm512_loadu_ps(row + i), mv) == 0) i += kLanes;
      }
#endif
      int64_t at = 0;
      for (; i < n; ++i)
        if (nan ? std::isnan(row[i]) : row[i] == m) {
          at = i;
          break;
        }
      op[r] = at;
    }
  });
  return out;
}

}  // namespace llmserve
