// The bundled engine's fused elementwise operators for bf16 on a CPU (backend/cpu_ops.py builds
// this file once per machine and falls back to plain PyTorch without a compiler).
//
// Why: between its matrix products a decoder layer runs a dozen elementwise operators, and in
// PyTorch each is a pass of its own over the activations, with its own bf16 <-> fp32
// conversions and its own dispatch. On one core (Xeon with AMX, SmolLM2, 512 tokens) they took
// ~1.9 ms per layer, as much as a third of a prefill chunk. Here each is one pass: values are
// widened to fp32 once, computed, and rounded to bf16 once.
//
// Every function takes contiguous bf16 rows ([T, H]: T tokens) except where said, and spreads
// the rows over torch's intra-op threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

namespace {

using at::vec::Vectorized;
using bf16 = c10::BFloat16;
using FloatVec = Vectorized<float>;
using BF16Vec = Vectorized<bf16>;
constexpr int64_t kRowsPerTask = 16;   // rows per parallel task: a few microseconds of work

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be contiguous [T, H]");
}

// sum of squares of one row, accumulated in fp32
float sum_of_squares(const bf16* row, int64_t n) {
  FloatVec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + BF16Vec::size() <= n; i += BF16Vec::size()) {
    auto [a, b] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(row + i));
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  float sum = at::vec::vec_reduce_all<float>(
      [](FloatVec& p, FloatVec& q) { return p + q; }, acc0 + acc1);
  for (; i < n; ++i) sum += float(row[i]) * float(row[i]);
  return sum;
}

// out = weight * bf16(row * inverse_rms), as Hugging Face's LlamaRMSNorm rounds it
void normalize_row(const bf16* row, const bf16* weight, float inverse_rms, bf16* out,
                   int64_t n) {
  const FloatVec scale(inverse_rms);
  int64_t i = 0;
  for (; i + BF16Vec::size() <= n; i += BF16Vec::size()) {
    auto [a, b] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(row + i));
    auto [wa, wb] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(weight + i));
    auto [na, nb] = at::vec::convert_to_float<bf16>(
        at::vec::convert_from_float<bf16>(a * scale, b * scale));
    at::vec::convert_from_float<bf16>(na * wa, nb * wb).store(out + i);
  }
  for (; i < n; ++i) out[i] = bf16(float(bf16(float(row[i]) * inverse_rms)) * float(weight[i]));
}

void rms_norm_rows(const bf16* x, const bf16* weight, bf16* out, int64_t rows, int64_t n,
                   float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const bf16* row = x + t * n;
    float inverse_rms = 1.f / std::sqrt(sum_of_squares(row, n) / n + eps);
    normalize_row(row, weight, inverse_rms, out + t * n, n);
  }
}

}  // namespace

// RMSNorm of each row of x [T, H] with weight [H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.numel() == x.size(1),
              "weight must be bfloat16 [H]");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.contiguous().data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    rms_norm_rows(xp + begin * n, wp, op + begin * n, end - begin, n, float(eps));
  });
  return out;
}

// residual += x (rounded to bf16, as `residual + x` is), then RMSNorm of the sum: the residual
// stream's add and the next norm in one pass. Returns the normalized rows; residual is updated
// in place.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                           double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have one shape");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const bf16* xp = x.data_ptr<bf16>();
  bf16* rp = residual.data_ptr<bf16>();
  const bf16* wp = weight.contiguous().data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      bf16* row = rp + t * n;
      const bf16* add = xp + t * n;
      int64_t i = 0;
      for (; i + BF16Vec::size() <= n; i += BF16Vec::size()) {
        auto [a, b] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(row + i));
        auto [c, d] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(add + i));
        at::vec::convert_from_float<bf16>(a + c, b + d).store(row + i);
      }
      for (; i < n; ++i) row[i] = bf16(float(row[i]) + float(add[i]));
      rms_norm_rows(row, wp, op + t * n, 1, n, float(eps));
    }
  });
  return out;
}

// Rotary embedding in place, Hugging Face's rotate_half layout: the first `heads` heads of
// qkv [T, heads_total, D] (any row stride, heads contiguous) rotate by cos/sin [T, D / 2] fp32:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rope_(torch::Tensor qkv, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16 && qkv.dim() == 3, "qkv: bf16 [T, H, D]");
  TORCH_CHECK(qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "qkv's heads must be dense");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin: contiguous float32 [T, D / 2]");
  const int64_t T = qkv.size(0), D = qkv.size(2), half = D / 2, row_stride = qkv.stride(0);
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == half, "cos/sin: [T, D / 2]");
  bf16* base = qkv.data_ptr<bf16>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* x1 = base + t * row_stride + h * D;
        bf16* x2 = x1 + half;
        int64_t i = 0;
        for (; i + BF16Vec::size() <= half; i += BF16Vec::size()) {
          auto [a0, a1] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(x1 + i));
          auto [b0, b1] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(x2 + i));
          FloatVec c0 = FloatVec::loadu(c + i), c1 = FloatVec::loadu(c + i + FloatVec::size());
          FloatVec s0 = FloatVec::loadu(s + i), s1 = FloatVec::loadu(s + i + FloatVec::size());
          at::vec::convert_from_float<bf16>(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1).store(x1 + i);
          at::vec::convert_from_float<bf16>(b0 * c0 + a0 * s0, b1 * c1 + a1 * s1).store(x2 + i);
        }
        for (; i < half; ++i) {
          float a = x1[i], b = x2[i];
          x1[i] = bf16(a * c[i] - b * s[i]);
          x2[i] = bf16(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

// SwiGLU's gate: x [T, 2I] holds gate and up side by side; returns silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dimension must be even");
  const int64_t T = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({T, n}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const FloatVec one(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const bf16* gate = xp + t * 2 * n;
      const bf16* up = gate + n;
      bf16* o = op + t * n;
      int64_t i = 0;
      for (; i + BF16Vec::size() <= n; i += BF16Vec::size()) {
        auto [g0, g1] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(gate + i));
        auto [u0, u1] = at::vec::convert_to_float<bf16>(BF16Vec::loadu(up + i));
        // exp_u20: within 20 ulp of fp32 (Inductor's choice too), far below bf16's rounding of
        // the result, at about half Sleef's exact exp's cost
        FloatVec s0 = g0 / (one + g0.neg().exp_u20()), s1 = g1 / (one + g1.neg().exp_u20());
        at::vec::convert_from_float<bf16>(s0 * u0, s1 * u1).store(o + i);
      }
      for (; i < n; ++i) {
        float g = gate[i];
        o[i] = bf16(g / (1.f + std::exp(-g)) * float(up[i]));
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual");
  m.def("rope_", &rope_, "rotary embedding in place (rotate_half layout)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
