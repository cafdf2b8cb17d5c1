// The bundled engine's compiled operators on a CPU, for fp32 and bf16 (backend/cpu_ops.py
// builds this file once per machine and falls back to plain PyTorch without a compiler).
//
// Why: between its matrix products a decoder layer runs a dozen elementwise operators, and in
// PyTorch each is a pass of its own over the activations, with its own bf16 <-> fp32
// conversions and its own dispatch. On one core (Xeon with AMX, SmolLM2, 512 tokens) they took
// ~1.9 ms per layer in bf16, as much as a third of a prefill chunk. Here each is one pass:
// values are widened to fp32 once, computed, and rounded to the activations' dtype once.
// Decode attention reads the paged KV cache where it lies (see paged_decode_attention; fp32
// prefill attention does too, in cpu_prefill_attention.cpp, registered below), new keys
// and values are stored in it by one copy per row (write_kv_), and a decode step's few rows are
// multiplied with the weight read once for all of them (few_rows_linear, fp32 and bf16).
//
// Every elementwise function takes contiguous rows ([T, H]: T tokens) of fp32 or bf16 except
// where said, and spreads the rows over torch's intra-op threads.
// The few headers used, not <torch/extension.h>: on one Zen 3 core that header alone took 34 s
// of a 43 s build, and with these the build takes 17 (a first `prefixgate serve` waits for it).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <tuple>
#include <vector>

namespace {

using at::vec::Vectorized;
using bf16 = c10::BFloat16;
using FloatVec = Vectorized<float>;
using BF16Vec = Vectorized<bf16>;
// Elements per step of the vector loops: one bf16 vector, two fp32 ones.
constexpr int64_t kStep = BF16Vec::size();
static_assert(kStep == 2 * FloatVec::size(), "a bf16 vector widens to two fp32 vectors");
constexpr int64_t kRowsPerTask = 16;   // rows per parallel task: a few microseconds of work

// --- loads and stores of kStep elements as two fp32 vectors --------------------------------

inline std::tuple<FloatVec, FloatVec> load2(const float* p) {
  return {FloatVec::loadu(p), FloatVec::loadu(p + FloatVec::size())};
}
inline std::tuple<FloatVec, FloatVec> load2(const bf16* p) {
  return at::vec::convert_to_float<bf16>(BF16Vec::loadu(p));
}
inline void store2(float* p, FloatVec a, FloatVec b) {
  a.store(p);
  b.store(p + FloatVec::size());
}
inline void store2(bf16* p, FloatVec a, FloatVec b) {
  at::vec::convert_from_float<bf16>(a, b).store(p);
}
// a and b as the dtype T would hold them (bf16 rounds; fp32 is as is)
template <typename T>
inline std::tuple<FloatVec, FloatVec> as_stored(FloatVec a, FloatVec b) {
  if constexpr (std::is_same_v<T, float>) {
    return {a, b};
  } else {
    return at::vec::convert_to_float<bf16>(at::vec::convert_from_float<bf16>(a, b));
  }
}
// exp as accurate as the dtype needs: Sleef's exact one for fp32; for bf16 exp_u20 (within 20
// ulp of fp32, Inductor's choice too), far below bf16's rounding, at about half the cost
template <typename T>
inline FloatVec exp_for(FloatVec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp();
  } else {
    return x.exp_u20();
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be contiguous [T, H]");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "weight must be [H] of x's dtype");
}

// Runs fn<T>() with T the C++ type of x's dtype (float or bf16; check_rows has checked it).
template <typename Fn>
void with_type(const at::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(float{});
  } else {
    fn(bf16{});
  }
}

// sum of squares of one row, accumulated in fp32
template <typename T>
float sum_of_squares(const T* row, int64_t n) {
  FloatVec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    auto [a, b] = load2(row + i);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  float sum = at::vec::vec_reduce_all<float>(
      [](FloatVec& p, FloatVec& q) { return p + q; }, acc0 + acc1);
  for (; i < n; ++i) sum += float(row[i]) * float(row[i]);
  return sum;
}

// out = weight * T(row * inverse_rms), as Hugging Face's LlamaRMSNorm rounds it
template <typename T>
void normalize_row(const T* row, const T* weight, float inverse_rms, T* out, int64_t n) {
  const FloatVec scale(inverse_rms);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    auto [a, b] = load2(row + i);
    auto [wa, wb] = load2(weight + i);
    auto [na, nb] = as_stored<T>(a * scale, b * scale);
    store2(out + i, na * wa, nb * wb);
  }
  for (; i < n; ++i) out[i] = T(float(T(float(row[i]) * inverse_rms)) * float(weight[i]));
}

template <typename T>
void rms_norm_row(const T* row, const T* weight, T* out, int64_t n, float eps) {
  normalize_row(row, weight, 1.f / std::sqrt(sum_of_squares(row, n) / n + eps), out, n);
}

template <typename T>
void add_rows(T* row, const T* add, int64_t n) {
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    auto [a, b] = load2(row + i);
    auto [c, d] = load2(add + i);
    store2(row + i, a + c, b + d);
  }
  for (; i < n; ++i) row[i] = T(float(row[i]) + float(add[i]));
}

template <typename T>
void rotate_head(T* x1, const float* c, const float* s, int64_t half) {
  T* x2 = x1 + half;
  int64_t i = 0;
  for (; i + kStep <= half; i += kStep) {
    auto [a0, a1] = load2(x1 + i);
    auto [b0, b1] = load2(x2 + i);
    auto [c0, c1] = load2(c + i);
    auto [s0, s1] = load2(s + i);
    store2(x1 + i, a0 * c0 - b0 * s0, a1 * c1 - b1 * s1);
    store2(x2 + i, b0 * c0 + a0 * s0, b1 * c1 + a1 * s1);
  }
  for (; i < half; ++i) {
    float a = x1[i], b = x2[i];
    x1[i] = T(a * c[i] - b * s[i]);
    x2[i] = T(b * c[i] + a * s[i]);
  }
}

template <typename T>
void silu_and_mul_row(const T* gate, T* out, int64_t n) {
  const T* up = gate + n;
  const FloatVec one(1.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    auto [g0, g1] = load2(gate + i);
    auto [u0, u1] = load2(up + i);
    FloatVec s0 = g0 / (one + exp_for<T>(g0.neg())), s1 = g1 / (one + exp_for<T>(g1.neg()));
    store2(out + i, s0 * u0, s1 * u1);
  }
  for (; i < n; ++i) {
    float g = gate[i];
    out[i] = T(g / (1.f + std::exp(-g)) * float(up[i]));
  }
}

}  // namespace

namespace {

// RMSNorm of each row of `rows` [T, H] with weight [H]; where `add` is given (x's shape and
// dtype), rows += add first, in place, row by row in the same pass.
at::Tensor normalize(at::Tensor rows, const at::Tensor* add, const at::Tensor& weight,
                        double eps) {
  check_weight(weight, rows);
  auto out = at::empty_like(rows);
  auto w = weight.contiguous();
  const int64_t n = rows.size(1);
  with_type(rows, [&](auto type) {
    using T = decltype(type);
    T* rp = rows.data_ptr<T>();
    const T* ap = add ? add->data_ptr<T>() : nullptr;
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (ap) add_rows(rp + t * n, ap + t * n, n);
        rms_norm_row(rp + t * n, wp, op + t * n, n, float(eps));
      }
    });
  });
  return out;
}

}  // namespace

// RMSNorm of each row of x [T, H] with weight [H].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  return normalize(x, nullptr, weight, eps);
}

// residual += x (rounded to the dtype, as `residual + x` is), then RMSNorm of the sum: the
// residual stream's add and the next norm in one pass. Returns the normalized rows; residual is
// updated in place.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                           double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have one shape and dtype");
  return normalize(residual, &x, weight, eps);
}

// Rotary embedding in place, Hugging Face's rotate_half layout: the first `heads` heads of
// qkv [T, heads_total, D] (any row stride, heads contiguous) rotate by cos/sin [T, D / 2] fp32:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rope_(at::Tensor qkv, int64_t heads, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(qkv.dim() == 3 && (qkv.scalar_type() == at::kBFloat16 ||
                                 qkv.scalar_type() == at::kFloat),
              "qkv: float32 or bfloat16 [T, H, D]");
  TORCH_CHECK(qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "qkv's heads must be dense");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin: contiguous float32 [T, D / 2]");
  const int64_t T_ = qkv.size(0), D = qkv.size(2), half = D / 2, row_stride = qkv.stride(0);
  TORCH_CHECK(cos.size(0) == T_ && cos.size(1) == half, "cos/sin: [T, D / 2]");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  with_type(qkv, [&](auto type) {
    using T = decltype(type);
    T* base = qkv.data_ptr<T>();
    at::parallel_for(0, T_, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          rotate_head(base + t * row_stride + h * D, cp + t * half, sp + t * half, half);
        }
      }
    });
  });
}

// SwiGLU's gate: x [T, 2I] holds gate and up side by side; returns silu(gate) * up [T, I].
at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dimension must be even");
  const int64_t n = x.size(1) / 2;
  auto out = at::empty({x.size(0), n}, x.options());
  with_type(x, [&](auto type) {
    using T = decltype(type);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_and_mul_row(xp + t * 2 * n, op + t * n, n);
    });
  });
  return out;
}

// --- decode attention over the paged cache ---------------------------------------------------

namespace {

constexpr int64_t kLanes = FloatVec::size();

// the sum of v's lanes (taken by value: a reference into the caller's accumulators made GCC keep
// them in memory through the whole loop)
inline float reduce_sum(FloatVec v) {
  return at::vec::vec_reduce_all<float>([](FloatVec& p, FloatVec& q) { return p + q; }, v);
}

// The totals of kLanes vectors' lanes as one vector (lane i: the sum of v[i]'s lanes): a tree of
// adds over shuffled halves instead of a reduction per vector.
#ifdef CPU_CAPABILITY_AVX512
inline __m512 reduce_16(const __m512 v[16]) {
  __m512 halves[8], quarters[4];
  for (int i = 0; i < 8; ++i) {     // 128-bit lanes: v[2i]'s in 0-1, v[2i + 1]'s in 2-3
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {     // 128-bit lane j: four partial sums of v[4i + j]
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  }
  const __m512 low = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]),
                                   _mm512_unpackhi_ps(quarters[0], quarters[1]));
  const __m512 high = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]),
                                    _mm512_unpackhi_ps(quarters[2], quarters[3]));
  // element 4q + p: the total of v[4p + q]; transposed to lane i = v[i]'s
  const __m512 totals = _mm512_add_ps(_mm512_shuffle_ps(low, high, 0x44),
                                      _mm512_shuffle_ps(low, high, 0xEE));
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(transpose, totals);
}
inline FloatVec lane_totals(const FloatVec v[kLanes]) {
  __m512 raw[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) raw[i] = v[i];
  return reduce_16(raw);
}
#else
inline FloatVec lane_totals(const FloatVec v[kLanes]) {
  // hadd(a, b) = a0+a1, a2+a3, b0+b1, b2+b3 | the same of the upper halves
  const __m256 pairs01 = _mm256_hadd_ps(v[0], v[1]), pairs23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 pairs45 = _mm256_hadd_ps(v[4], v[5]), pairs67 = _mm256_hadd_ps(v[6], v[7]);
  // v[0..3]'s lower-half totals | their upper-half totals; the same for v[4..7]
  const __m256 low = _mm256_hadd_ps(pairs01, pairs23), high = _mm256_hadd_ps(pairs45, pairs67);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

// q . k for kLanes cached rows at once, as one vector (lane t: row t's score): the rows' partial
// sums stay in registers and are totalled together, not one horizontal sum per row. q: D fp32.
template <typename T>
inline FloatVec scores_of(const float* q, const T* const keys[kLanes], int64_t D) {
  FloatVec acc[kLanes];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kLanes; ++t) acc[t] = FloatVec(0.f);
  for (int64_t i = 0; i < D; i += kStep) {
    const auto [q0, q1] = load2(q + i);
#pragma GCC unroll 16
    for (int64_t t = 0; t < kLanes; ++t) {
      const auto [k0, k1] = load2(keys[t] + i);
      acc[t] = at::vec::fmadd(q1, k1, at::vec::fmadd(q0, k0, acc[t]));
    }
  }
  return lane_totals(acc);
}

// Asks for the next block's K and V rows (the slice of `bytes` each row's heads take) one cache
// line of each at a time, the asks spread over the work on this block (kAsksPerScores per
// vector of scores, kAsksPerValuePair per pair of value rows added: for SmolLM2's fp32 cache,
// room for 264 asks where a block has 192 lines each of K and V). Blocks lie anywhere in the
// cache, where the hardware's prefetchers do not look; asked for a few rows' every line at
// once, the loads queued behind the asks, and the kernel's memory time added to its arithmetic
// instead of hiding under it. 30 layers, 1,024 shuffled tokens, one Zen 3 core: batch 8 53-57 ->
// 33-35 ms, batch 32 246-251 -> 128-149 ms (6-7 -> 10-12 GB/s); two blocks ahead: no better.
struct BlockPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, stride = 0, rows = 0, row = 0, at = 0;
  inline void step() {
    if (row >= rows) return;
    __builtin_prefetch(k + row * stride + at);
    __builtin_prefetch(v + row * stride + at);
    at += 64;
    if (at >= bytes) at = 0, ++row;
  }
};
constexpr int64_t kAsksPerScores = 4;
constexpr int64_t kAsksPerValuePair = 2;

// acc[g] += sum over the block's n rows of probs[g][t] * v_t, for kG query rows. The rows' sums
// for kStep of D stay in registers over the block, in two sets (even and odd rows) so that
// 4 * kG chains of FMAs run side by side (one chain waits on each FMA's latency); each value row
// is widened once.
template <int64_t kG, typename T>
void add_values(float* acc, const float* probs, int64_t width, const T* v_block,
                int64_t token_stride, int64_t n, int64_t D, BlockPrefetch& ahead) {
  for (int64_t i = 0; i < D; i += kStep) {
    FloatVec sums[2][kG][2];                       // [row parity][query row][low/high half]
#pragma GCC unroll 4
    for (int64_t g = 0; g < kG; ++g) {
      std::tie(sums[0][g][0], sums[0][g][1]) = load2(acc + g * D + i);
      sums[1][g][0] = sums[1][g][1] = FloatVec(0.f);
    }
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
      for (int64_t ask = 0; ask < kAsksPerValuePair; ++ask) ahead.step();
#pragma GCC unroll 2
      for (int64_t parity = 0; parity < 2; ++parity) {
        const auto [v0, v1] = load2(v_block + (t + parity) * token_stride + i);
#pragma GCC unroll 4
        for (int64_t g = 0; g < kG; ++g) {
          const FloatVec p(probs[g * width + t + parity]);
          sums[parity][g][0] = at::vec::fmadd(p, v0, sums[parity][g][0]);
          sums[parity][g][1] = at::vec::fmadd(p, v1, sums[parity][g][1]);
        }
      }
    }
    if (t < n) {
      const auto [v0, v1] = load2(v_block + t * token_stride + i);
#pragma GCC unroll 4
      for (int64_t g = 0; g < kG; ++g) {
        const FloatVec p(probs[g * width + t]);
        sums[0][g][0] = at::vec::fmadd(p, v0, sums[0][g][0]);
        sums[0][g][1] = at::vec::fmadd(p, v1, sums[0][g][1]);
      }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < kG; ++g) {
      store2(acc + g * D + i, sums[0][g][0] + sums[1][g][0], sums[0][g][1] + sums[1][g][1]);
    }
  }
}

// add_values for all G rows, three at a time (12 accumulators: room in AVX2's 16 registers)
template <typename T>
void add_all_values(float* acc, const float* probs, int64_t width, int64_t G, const T* v_block,
                    int64_t token_stride, int64_t n, int64_t D, BlockPrefetch& ahead) {
  using Add = void (*)(float*, const float*, int64_t, const T*, int64_t, int64_t, int64_t,
                       BlockPrefetch&);
  static constexpr Add kAdd[] = {nullptr, add_values<1, T>, add_values<2, T>, add_values<3, T>};
  for (int64_t g = 0; g < G; g += 3) {
    kAdd[std::min<int64_t>(3, G - g)](acc + g * D, probs + g * width, width, v_block,
                                      token_stride, n, D, ahead);
  }
}

// One query row's online softmax over a block: s (the block's n scores, padded to whole vectors)
// becomes exp(s - the new running max), lanes past n 0; returns the factor that rescales what
// was summed before (0 at the first block).
inline float softmax_step(float* s, int64_t n, float& running_max, float& sum) {
  const FloatVec minus_inf(-std::numeric_limits<float>::infinity());
  FloatVec max_vec = minus_inf;
  for (int64_t t = 0; t < n; t += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, n - t);
    max_vec = at::vec::maximum(max_vec, FloatVec::set(minus_inf, FloatVec::loadu(s + t), lanes));
  }
  const float block_max = at::vec::vec_reduce_all<float>(
      [](FloatVec& a, FloatVec& b) { return at::vec::maximum(a, b); }, max_vec);
  const float new_max = std::max(running_max, block_max);
  const float factor = std::exp(running_max - new_max);
  running_max = new_max;
  const FloatVec new_max_vec(new_max);
  FloatVec total(0.f);
  for (int64_t t = 0; t < n; t += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, n - t);
    const FloatVec p = FloatVec::set(FloatVec(0.f), (FloatVec::loadu(s + t) - new_max_vec).exp(),
                                     lanes);
    p.store(s + t);
    total = total + p;
  }
  sum = sum * factor + reduce_sum(total);
  return factor;
}

// Where a sequence's cache lies: its block table, its length, and the cache's strides.
struct PagedRows {
  const int32_t* table;
  int64_t length, block_size, token_stride, block_stride;
  // the first row of the block that holds `position` (its rows follow token_stride apart)
  template <typename T>
  const T* block(const T* head_base, int64_t position) const {
    return head_base + table[position / block_size] * block_stride;
  }
  // the asks for the block from `start` (none past the end): its rows' `heads` heads of D
  template <typename T>
  BlockPrefetch prefetch_of(const T* k_base, const T* v_base, int64_t start, int64_t heads,
                            int64_t D) const {
    BlockPrefetch ahead;
    if (start >= length) return ahead;
    ahead.k = reinterpret_cast<const char*>(block(k_base, start));
    ahead.v = reinterpret_cast<const char*>(block(v_base, start));
    ahead.bytes = heads * D * int64_t(sizeof(T));
    ahead.stride = token_stride * int64_t(sizeof(T));
    ahead.rows = std::min(block_size, length - start);
    return ahead;
  }
};

// The online softmax's state of R query rows over some of a sequence's cached tokens: the
// rows' running max, the sum of exp(score - max), and the values weighted by those exps.
struct Partial {
  std::vector<float> acc, max, sum;
  Partial(int64_t R, int64_t D)
      : acc(R * D, 0.f), max(R, -std::numeric_limits<float>::infinity()), sum(R, 0.f) {}
};

// `heads` consecutive KV heads of one sequence (all of them, or one where there are fewer
// sequences than threads) with the G query heads that share each, over the cached positions
// [begin, end) (begin at a block's first row): online softmax over the cache's blocks (per head
// the block's scores, the running max and sum updated once per block, then the block's values),
// everything in fp32, into `part`. Taking a block's every head in turn reads it as one range of
// memory rather than a strided slice per head. q_rows: heads * G rows of D, pre-scaled.
template <typename T>
void attend_heads(const float* q_rows, int64_t heads, int64_t G, int64_t D, const T* k_base,
                  const T* v_base, const PagedRows& rows, int64_t begin, int64_t end,
                  Partial& part) {
  const int64_t width = (rows.block_size + kLanes - 1) / kLanes * kLanes;
  std::vector<float> probs(G * width);
  float* acc = part.acc.data();
  for (int64_t start = begin; start < end; start += rows.block_size) {
    const int64_t n = std::min(rows.block_size, end - start);
    BlockPrefetch ahead = start + rows.block_size < end
        ? rows.prefetch_of(k_base, v_base, start + rows.block_size, heads, D) : BlockPrefetch{};
    for (int64_t h = 0; h < heads; ++h) {
      const T* k_block = rows.block(k_base + h * D, start);
      const T* v_block = rows.block(v_base + h * D, start);
      const int64_t r0 = h * G;                     // the head's first query row
      for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
        const T* keys[kLanes];        // rows past the block's n: its last row again (masked)
        for (int64_t t = 0; t < kLanes; ++t) {
          keys[t] = k_block + std::min(t0 + t, n - 1) * rows.token_stride;
        }
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t ask = 0; ask < kAsksPerScores; ++ask) ahead.step();
          scores_of(q_rows + (r0 + g) * D, keys, D).store(probs.data() + g * width + t0);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float factor = softmax_step(probs.data() + g * width, n, part.max[r0 + g],
                                          part.sum[r0 + g]);
        if (factor != 1.f) {
          for (int64_t i = 0; i < D; ++i) acc[(r0 + g) * D + i] *= factor;
        }
      }
      add_all_values(acc + r0 * D, probs.data(), width, G, v_block, rows.token_stride, n, D,
                     ahead);
    }
  }
}

// out's R rows of D: the parts' weighted values, each rescaled to the rows' largest running
// max, over the parts' sums (one part: acc / sum, nothing rescaled); no cached token: zeros.
template <typename T>
void merge_parts(const Partial* parts, int64_t n_parts, int64_t R, int64_t D, T* out) {
  std::vector<float> weights(n_parts);
  for (int64_t r = 0; r < R; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n_parts; ++p) top = std::max(top, parts[p].max[r]);
    float total = 0.f;
    for (int64_t p = 0; p < n_parts; ++p) {
      weights[p] = parts[p].sum[r] <= 0.f ? 0.f
                   : n_parts == 1    ? 1.f
                                     : std::exp(parts[p].max[r] - top);
      total += parts[p].sum[r] * weights[p];
    }
    const float inverse = total > 0.f ? 1.f / total : 0.f;
    for (int64_t i = 0; i < D; ++i) {
      float value = 0.f;
      for (int64_t p = 0; p < n_parts; ++p) value += parts[p].acc[r * D + i] * weights[p];
      out[r * D + i] = T(value * inverse);
    }
  }
}

// Into how many position ranges each (sequence, KV head) task is split so that `tasks` of them
// spread evenly over the threads (SmolLM2's 3 KV heads of one sequence on 2 threads: 2:1, so
// 6 halves); 1 where they already do, or where the longest sequence is too short to be worth
// merging (fewer than kMinBlocksPerSplit blocks a range).
constexpr int64_t kMinBlocksPerSplit = 8;
int64_t splits_for(int64_t tasks, int64_t threads, int64_t longest_blocks) {
  const int64_t splits = threads / std::gcd(tasks, threads);
  return longest_blocks >= splits * kMinBlocksPerSplit ? splits : 1;
}

}  // namespace

// One new token per sequence attends to its seq_lens[s] cached tokens, read in place from the
// paged cache (no gathered copy: the gather wrote and re-read every cached row, which at batch 32
// and 1,024 tokens of SmolLM2 in fp32 was most of a decode step). q [S, H, D] (heads dense, any
// row stride), k_cache/v_cache [blocks, block_size, Hkv, D] of q's dtype, block_tables [S, *]
// int32, seq_lens [S] int32; H a multiple of Hkv (query head h reads KV head h / (H / Hkv)).
// Returns [S, H, D] of q's dtype; a sequence with nothing cached gets zeros.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor block_tables,
                                     at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [S, H, D] with dense heads");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "k_cache/v_cache: contiguous [blocks, block_size, Hkv, D] of q's dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "block_tables [S, *] and seq_lens [S]: contiguous int32");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "q's heads must be a multiple of the cache's");
  TORCH_CHECK(D % kStep == 0, "head_dim must be a multiple of ", kStep);
  TORCH_CHECK(block_tables.size(0) == S && seq_lens.size(0) == S, "one table and length per sequence");
  const int64_t G = H / Hkv, block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_blocks * block_size,
                "seq_lens[", s, "] does not fit its block table");
  }
  auto out = at::empty({S, H, D}, q.options());
  with_type(q, [&](auto type) {
    using T = decltype(type);
    const T* qp = q.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    // a task per sequence (its every KV head) where there are enough for the threads, else
    // per KV head, each split into position ranges where that spreads them evenly
    const int64_t threads = at::get_num_threads();
    const int64_t heads = S >= threads ? Hkv : 1, runs = Hkv / heads, R = heads * G;
    const int64_t longest = *std::max_element(lens, lens + S);
    const int64_t splits = heads == Hkv ? 1
        : splits_for(S * runs, threads, (longest + block_size - 1) / block_size);
    std::vector<Partial> parts(splits == 1 ? 0 : S * runs * splits, Partial(R, D));
    at::parallel_for(0, S * runs * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q_rows(R * D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / (runs * splits), j = task / splits % runs * heads;
        const int64_t split = task % splits;
        const T* q_head = qp + s * q.stride(0) + j * G * D;
        for (int64_t i = 0; i < R * D; ++i) q_rows[i] = float(q_head[i]) * float(scale);
        PagedRows rows{tables + s * max_blocks, lens[s], block_size, Hkv * D, block_size * Hkv * D};
        const int64_t blocks = (lens[s] + block_size - 1) / block_size;
        const int64_t first = blocks * split / splits, last = blocks * (split + 1) / splits;
        T* out_rows = op + (s * H + j * G) * D;
        if (splits == 1) {
          Partial part(R, D);
          attend_heads(q_rows.data(), heads, G, D, kp + j * D, vp + j * D, rows, 0, lens[s],
                       part);
          merge_parts(&part, 1, R, D, out_rows);
        } else {
          attend_heads(q_rows.data(), heads, G, D, kp + j * D, vp + j * D, rows,
                       first * block_size, std::min<int64_t>(last * block_size, lens[s]),
                       parts[task]);
        }
      }
    });
    for (int64_t first = 0; first < int64_t(parts.size()); first += splits) {
      const int64_t s = first / (runs * splits), j = first / splits % runs * heads;
      merge_parts(parts.data() + first, splits, R, D, op + (s * H + j * G) * D);
    }
  });
  return out;
}

// --- the KV cache's scatter -------------------------------------------------------------------

// k and v [T, Hkv, D] (heads dense, any row stride) stored at their flat slots of the paged
// caches [blocks, block_size, Hkv, D] (slot = block * block_size + offset; negative: skipped, a
// padded row). In PyTorch (kernels/write_kv_ref.py) this was a dozen operators per layer, a
// check of the slots and two index_put, ~60 us of a decode step's layer; here one copy per row.
void write_kv_(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
               at::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache: contiguous [blocks, block_size, Hkv, D] alike");
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3), row = Hkv * D;
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (const auto* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(1) == Hkv && x->size(2) == D && x->stride(2) == 1 &&
                    x->stride(1) == D && x->scalar_type() == k_cache.scalar_type(),
                "k/v: [T, Hkv, D] with dense heads, of the cache's dtype");
  }
  TORCH_CHECK(v.size(0) == k.size(0) && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous(),
              "one slot per token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int64 or int32");
  const int64_t T = k.size(0), bytes = row * k.element_size();
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const bool wide = slot_mapping.scalar_type() == at::kLong;
  const int64_t* slots64 = wide ? slot_mapping.data_ptr<int64_t>() : nullptr;
  const int32_t* slots32 = wide ? nullptr : slot_mapping.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {             // all checked before any row is written
    const int64_t slot = wide ? slots64[t] : slots32[t];
    TORCH_CHECK(slot < capacity, "slot ", slot, " is past the cache's ", capacity, " slots");
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = wide ? slots64[t] : slots32[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * bytes, kp + t * k.stride(0) * k.element_size(), bytes);
    std::memcpy(vc + slot * bytes, vp + t * v.stride(0) * v.element_size(), bytes);
  }
}

// --- fp32 products of a few rows ---------------------------------------------------------------

namespace {

constexpr int64_t kOutputsPerTile = 4;   // weight rows per tile: 4 x K fp32 stays in L1
// fp32: x rows per pass over the tile, as many as keep the sums, the x rows and one weight
// vector in registers (AVX2's 16: 3 x 4 + 3 + 1; with 4 rows the sums spilled, and batches of
// 4-16 rows ran at ~35 GFLOP/s on a Zen 3 core)
#ifdef CPU_CAPABILITY_AVX512
constexpr int64_t kRowsPerPass = 4;
#else
constexpr int64_t kRowsPerPass = 3;
#endif

// y[m, n0 + j * quarter] = x[m] . w[n0 + j * quarter] for j < 4 and the kRows rows of x from
// m0, the sums in registers. A tile's weight rows come one from each quarter of the weight:
// the memory is read as 4 long sequential streams, which one core's hardware prefetchers keep
// far fuller than the 4 short streams of 4 neighbouring rows (SmolLM2's 576-wide rows, one x
// row, a Zen 3 core: 28-30 GB/s against 16-18, and a plain sequential read's 18-20). Quarters
// exactly 256 MB apart fell onto the same DRAM banks there (18.6 GB/s); weights' seldom are.
template <int64_t kRows>
void tile_product(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
                  int64_t quarter, int64_t m0) {
  FloatVec acc[kRows][kOutputsPerTile];
  for (auto& row : acc) {
    for (auto& a : row) a = FloatVec(0.f);
  }
  const float* rows[kOutputsPerTile];
  for (int64_t j = 0; j < kOutputsPerTile; ++j) rows[j] = w + (n0 + j * quarter) * K;
  int64_t k = 0;
  for (; k + FloatVec::size() <= K; k += FloatVec::size()) {
    FloatVec xv[kRows];
    for (int64_t r = 0; r < kRows; ++r) xv[r] = FloatVec::loadu(x + (m0 + r) * K + k);
    for (int64_t j = 0; j < kOutputsPerTile; ++j) {
      const FloatVec wv = FloatVec::loadu(rows[j] + k);
      for (int64_t r = 0; r < kRows; ++r) acc[r][j] = at::vec::fmadd(xv[r], wv, acc[r][j]);
    }
  }
  float sums[kRows][kOutputsPerTile];
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kOutputsPerTile; ++j) sums[r][j] = reduce_sum(acc[r][j]);
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kOutputsPerTile; ++j) {
      float sum = sums[r][j];
      for (int64_t i = k; i < K; ++i) sum += x[(m0 + r) * K + i] * rows[j][i];
      y[(m0 + r) * N + n0 + j * quarter] = sum;
    }
  }
}

// every row of x times one tile of weight rows: the first pass reads memory, the rest L1
void tile_products(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                   int64_t n0, int64_t quarter) {
  using Pass = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t);
  static constexpr Pass kPasses[] = {nullptr, tile_product<1>, tile_product<2>, tile_product<3>,
                                     tile_product<4>};
  static_assert(kRowsPerPass < std::size(kPasses));
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    kPasses[std::min(kRowsPerPass, M - m0)](x, w, y, K, N, n0, quarter, m0);
  }
}

}  // namespace

// x [M, K] @ weight [N, K]^T (+ bias [N]) in fp32, for the few rows of a decode step. MKL's
// sgemm reads the weight at the memory's speed for one row but at a third of it for 4 to 8
// (SmolLM2's products and head, one core: 8 rows 108 ms against 41 for one); here each tile of
// weight rows is read from memory once and multiplied by every row of x while it sits in L1.
at::Tensor few_rows_linear(at::Tensor x, at::Tensor weight,
                              std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "x and weight must be float32");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "x [M, K] and weight [N, K] must be contiguous");
  TORCH_CHECK(weight.size(0) >= kOutputsPerTile, "weight needs at least ", kOutputsPerTile, " rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t quarter = N / kOutputsPerTile;     // tile n0: rows n0 + j * quarter
  at::parallel_for(0, quarter, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; ++n0) tile_products(xp, wp, yp, M, K, N, n0, quarter);
  });
  for (int64_t n = quarter * kOutputsPerTile; n < N; ++n) {    // the last N % 4 weight rows
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t i = 0; i < K; ++i) sum += xp[m * K + i] * wp[n * K + i];
      yp[m * N + n] = sum;
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "bias: float32 [N]");
    y.add_(*bias);
  }
  return y;
}

// --- bf16 products of a few rows (AVX-512) ----------------------------------------------------

#ifdef CPU_CAPABILITY_AVX512
namespace {

constexpr int64_t kBF16PerLine = 32;     // bf16 per 64-byte line of the weight: one step
constexpr int64_t kParts = 8;            // weight rows per tile, one from each eighth
constexpr int64_t kInputsPerPass = 2;    // x rows per pass over the tile: 16 sums
constexpr int64_t kLinesAhead = 8;       // how far ahead each stream is prefetched, in lines

// 16 bf16 widened to fp32 (a bf16 is an fp32's top half); lanes at and past `left` read as 0
inline __m512 widen_bf16(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 widen_bf16(const bf16* p, int64_t left) {
  if (left >= 16) return widen_bf16(p);
  const __mmask16 lanes = left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

// y[m, n0 + j * part] = x[m] . w[n0 + j * part] for j < 8 and the kRows rows of x (fp32, K
// padded to a multiple of 32 with zeros) from m0. The tile's weight rows come one from each
// eighth of the weight, so that memory is read as 8 long sequential streams, each prefetched
// kLinesAhead lines ahead on the first pass (SmolLM2's products and head at one row, one core of
// the Xeon with AMX: 14.4 GB/s, the memory's speed, against 10.3 for tiles of 4 neighbouring
// rows prefetched 4 tiles ahead). Each weight line is widened to fp32 once per pass and
// multiplied by every row with fp32 FMAs (vdpbf16ps issues at a quarter of their rate there: 78
// vs 165 GFLOP/s on one core), the sums rounded to bf16 once, the bias added before.
template <int64_t kRows, bool kPrefetch>
void tile_product_bf16(const float* x, int64_t x_stride, const bf16* w, const bf16* bias, bf16* y,
                       int64_t K, int64_t N, int64_t n0, int64_t m0) {
  const int64_t part = N / kParts;
  __m512 acc[kInputsPerPass * kParts];       // row r, output j at 8r + j; unused: 0
#pragma GCC unroll 16
  for (int64_t i = 0; i < kInputsPerPass * kParts; ++i) acc[i] = _mm512_setzero_ps();
  const float* xt = x + m0 * x_stride;
  for (int64_t k = 0; k < K; k += kBF16PerLine) {
    __m512 x_low[kRows], x_high[kRows];
#pragma GCC unroll 2
    for (int64_t r = 0; r < kRows; ++r) {
      x_low[r] = _mm512_loadu_ps(xt + r * x_stride + k);
      x_high[r] = _mm512_loadu_ps(xt + r * x_stride + k + 16);
    }
#pragma GCC unroll 8
    for (int64_t j = 0; j < kParts; ++j) {
      const bf16* line = w + (n0 + j * part) * K + k;
      if constexpr (kPrefetch) {
        _mm_prefetch((const char*)(line + kLinesAhead * kBF16PerLine), _MM_HINT_T0);
      }
      const bool whole = k + kBF16PerLine <= K;
      const __m512 low = whole ? widen_bf16(line) : widen_bf16(line, K - k);
      const __m512 high = whole ? widen_bf16(line + 16) : widen_bf16(line + 16, K - k - 16);
#pragma GCC unroll 2
      for (int64_t r = 0; r < kRows; ++r) {
        acc[r * kParts + j] = _mm512_fmadd_ps(x_low[r], low, acc[r * kParts + j]);
        acc[r * kParts + j] = _mm512_fmadd_ps(x_high[r], high, acc[r * kParts + j]);
      }
    }
  }
  FloatVec totals(reduce_16(acc));                        // row r, output j in lane 8r + j
  if (bias != nullptr) {
    alignas(64) float b[kParts];
    for (int64_t j = 0; j < kParts; ++j) b[j] = float(bias[n0 + j * part]);
    const __m256 half = _mm256_load_ps(b);
    totals = totals + FloatVec(_mm512_insertf32x8(_mm512_castps256_ps512(half), half, 1));
  }
  alignas(64) bf16 rounded[kStep];
  at::vec::convert_from_float<bf16>(totals, FloatVec(0.f)).store(rounded);
#pragma GCC unroll 2
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kParts; ++j) y[(m0 + r) * N + n0 + j * part] = rounded[r * kParts + j];
  }
}

// every row of x times one tile: the first pass reads memory, the rest L1
void tile_products_bf16(const float* x, int64_t x_stride, const bf16* w, const bf16* bias,
                        bf16* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  using Pass = void (*)(const float*, int64_t, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                        int64_t, int64_t);
  static constexpr Pass kFirst[] = {nullptr, tile_product_bf16<1, true>,
                                    tile_product_bf16<2, true>};
  static constexpr Pass kLater[] = {nullptr, tile_product_bf16<1, false>,
                                    tile_product_bf16<2, false>};
  static_assert(kInputsPerPass < std::size(kFirst));
  for (int64_t m0 = 0; m0 < M; m0 += kInputsPerPass) {
    const int64_t rows = std::min(kInputsPerPass, M - m0);
    (m0 == 0 ? kFirst : kLater)[rows](x, x_stride, w, bias, y, K, N, n0, m0);
  }
}

}  // namespace

// x [M, K] @ weight [N, K]^T (+ bias [N]) in bf16 for the few rows of a decode step, on the plain
// (row-major) weight, N a multiple of 8. oneDNN's prepacked product at a few rows reads the weight
// well below the memory's speed; here, as in few_rows_linear, each tile of weight rows (one from
// each eighth) is read from memory once for every row of x (widened to fp32 once per call).
at::Tensor few_rows_linear_bf16(at::Tensor x, at::Tensor weight,
                                   std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "x [M, K] and weight [N, K] must be contiguous");
  TORCH_CHECK(weight.size(0) % kParts == 0, "weight's rows must be a multiple of ", kParts);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bf16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N &&
                    bias->is_contiguous(),
                "bias: contiguous bfloat16 [N]");
    bp = bias->data_ptr<bf16>();
  }
  // x in fp32, each row padded with zeros to whole steps
  const int64_t x_stride = (K + kBF16PerLine - 1) / kBF16PerLine * kBF16PerLine;
  std::vector<float> xf(M * x_stride, 0.f);
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < K; ++i) xf[m * x_stride + i] = float(xp[m * K + i]);
  }
  auto y = at::empty({M, N}, x.options());
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, N / kParts, 16, [&](int64_t begin, int64_t end) {     // tile n0: rows
    for (int64_t n0 = begin; n0 < end; ++n0) {                             // n0 + j * N / 8
      tile_products_bf16(xf.data(), x_stride, wp, bp, yp, M, K, N, n0);
    }
  });
  return y;
}
#endif  // CPU_CAPABILITY_AVX512

// How many of torch's threads a parallel loop of `tasks` one-task chunks ran on: 1 in a build
// without OpenMP whatever torch's thread count (what the build's flags are tested by).
int64_t parallel_threads(int64_t tasks) {
  std::vector<char> ran(at::get_num_threads(), 0);
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) { ran[at::get_thread_num()] = 1; });
  return std::count(ran.begin(), ran.end(), 1);
}

// cpu_prefill_attention.cpp
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   at::Tensor query_start_loc, double scale);

// cpu_decode_layers.cpp
void register_decode_layers(pybind11::module& m);

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 or bf16 rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual");
  m.def("rope_", &rope_, "rotary embedding in place (rotate_half layout)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its paged KV cache, read in place");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "new tokens over their paged KV cache, causal, read in place (fp32)");
  m.def("write_kv_", &write_kv_, "k/v rows stored at their slots of the paged caches");
  m.def("few_rows_linear", &few_rows_linear, "x @ weight.T (+ bias) in fp32 for a few rows",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("parallel_threads", &parallel_threads, "threads a parallel loop of N tasks ran on");
  m.attr("VECTOR_STEP") = kStep;   // head_dim must be a multiple of it
  register_decode_layers(m);
#ifdef CPU_CAPABILITY_AVX512
  m.def("few_rows_linear_bf16", &few_rows_linear_bf16,
        "x @ weight.T (+ bias) in bf16 for a few rows", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
#endif
}
