// Prefill attention on a CPU, fp32, reading the paged KV cache where it lies (built with
// cpu_ops.cpp into one extension by backend/cpu_ops.py; registered there).
//
// Why: the reference (kernels/prefill_attention_ref.py) copies a sequence's whole cached prefix
// out of the paged cache for every chunk and layer and hands it to SDPA 64 queries at a time
// under an explicit mask. On one Zen 3 core (SmolLM2's 9 query and 3 KV heads of 64, fp32) a
// 512-token chunk over a 1,536-token cached prefix spent 38 ms per layer there, about as long as
// the layer's products, and SDPA's loops gained only 1.4-1.6x from a second thread.
//
// How: first each sequence's KV heads' keys are transposed, once per call, into groups of kKeys
// positions ([D][kKeys]). Then a task is one sequence's KV head and kTilePositions consecutive
// query positions with the G query heads that share the KV head: its rows (position-major) stay
// in L1 with their running max, sum and output (flash attention's online softmax). Per chunk of
// kChunk keys, kRows rows at a time: their scores against a group are kRows x 2 vector sums fed
// by broadcasts (no horizontal sums), the softmax is updated once, and the chunk's value rows
// are read where they lie in the cache. A row visits only the keys it may see, and the tasks
// are dealt to the threads in turn, so that each gets early and late positions alike.
// Measured: docs/engine.md, "fp32 prefill attention reads the paged cache in place".
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using FloatVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = FloatVec::size();
constexpr int64_t kKeys = 2 * kVec;            // keys per group: two vectors of scores per row
constexpr int64_t kGroups = 64 / kKeys;        // groups per chunk: 64 keys a softmax step
constexpr int64_t kChunk = kKeys * kGroups;
constexpr int64_t kPiece = 2 * kVec;           // output columns per pass of the value loop
constexpr int64_t kRows = 6;                   // rows per pass: 2 x 6 sums + 2 keys in AVX2's 16
constexpr int64_t kTilePositions = 16;         // query positions per task
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

inline float max_of(FloatVec v) {
  return at::vec::vec_reduce_all<float>(
      [](FloatVec& a, FloatVec& b) { return at::vec::maximum(a, b); }, v);
}
inline float sum_of(FloatVec v) {
  return at::vec::vec_reduce_all<float>([](FloatVec& a, FloatVec& b) { return a + b; }, v);
}

// One task's query rows (position-major, G heads each), what they have summed so far, and the
// chunk of keys being worked on.
struct Tile {
  int64_t D, rows = 0;
  std::vector<float> q, acc, running_max, sum;   // q pre-scaled; acc [rows][D]
  std::vector<int64_t> position;                  // each row's position in its sequence
  const float* values[kChunk];                    // the chunk's value rows, in the cache
  float scores[kRows][kChunk];

  Tile(int64_t D, int64_t max_rows)
      : D(D), q(max_rows * D), acc(max_rows * D), running_max(max_rows), sum(max_rows),
        position(max_rows) {}
};

// scores[r][j] = q_r . key_j for kR rows from r0 and the chunk's keys, `groups` groups of
// kKeys transposed ([D][kKeys] each, from keys_t): kR x 2 vector sums fed by broadcasts
template <int64_t kR>
void chunk_scores(Tile& tile, int64_t r0, const float* keys_t, int64_t groups) {
  const float* q = tile.q.data() + r0 * tile.D;
  for (int64_t group = 0; group < groups; ++group) {
    const float* keys = keys_t + group * tile.D * kKeys;
    FloatVec lo[kR], hi[kR];
    for (int64_t r = 0; r < kR; ++r) lo[r] = hi[r] = FloatVec(0.f);
    for (int64_t d = 0; d < tile.D; ++d) {
      const FloatVec k0 = FloatVec::loadu(keys + d * kKeys);
      const FloatVec k1 = FloatVec::loadu(keys + d * kKeys + kVec);
#pragma GCC unroll 6
      for (int64_t r = 0; r < kR; ++r) {
        const FloatVec qd(q[r * tile.D + d]);
        lo[r] = at::vec::fmadd(qd, k0, lo[r]);
        hi[r] = at::vec::fmadd(qd, k1, hi[r]);
      }
    }
    for (int64_t r = 0; r < kR; ++r) {
      lo[r].store(tile.scores[r] + group * kKeys);
      hi[r].store(tile.scores[r] + group * kKeys + kVec);
    }
  }
}

// Online softmax over one chunk for kR rows: keys past a row's position (or past the chunk's n)
// are masked; the scores become probabilities against the new running max, and what the row
// summed before is rescaled to it.
template <int64_t kR>
void chunk_softmax(Tile& tile, int64_t r0, int64_t chunk_start, int64_t n) {
  const int64_t width = (n + kVec - 1) / kVec * kVec;
  for (int64_t r = 0; r < kR; ++r) {
    float* s = tile.scores[r];
    const int64_t visible = std::min<int64_t>(n, tile.position[r0 + r] - chunk_start + 1);
    if (visible <= 0) {                    // sees none of the chunk: adds nothing
      std::fill_n(s, width, 0.f);
      continue;
    }
    for (int64_t j = visible; j < width; ++j) s[j] = kMinusInf;
    FloatVec top(kMinusInf);
    for (int64_t j = 0; j < width; j += kVec) top = at::vec::maximum(top, FloatVec::loadu(s + j));
    float& running_max = tile.running_max[r0 + r];
    const float new_max = std::max(running_max, max_of(top));
    const FloatVec m(new_max);
    FloatVec total(0.f);
    for (int64_t j = 0; j < width; j += kVec) {
      // exp within 20 ulp, as torch's own flash attention on CPU takes it: about half the cost
      const FloatVec p = (FloatVec::loadu(s + j) - m).exp_u20();     // masked: exp(-inf) = 0
      p.store(s + j);
      total = total + p;
    }
    const float factor = std::exp(running_max - new_max);     // 0 at the row's first chunk
    running_max = new_max;
    tile.sum[r0 + r] = tile.sum[r0 + r] * factor + sum_of(total);
    if (factor != 1.f) {
      float* acc = tile.acc.data() + (r0 + r) * tile.D;
      const FloatVec f(factor);
      for (int64_t i = 0; i < tile.D; i += kVec) (FloatVec::loadu(acc + i) * f).store(acc + i);
    }
  }
}

// acc[r] += sum over the chunk's n keys of p[r][j] * value_j, for kR rows from r0; the value
// rows read where they lie in the cache
template <int64_t kR>
void chunk_values(Tile& tile, int64_t r0, int64_t n) {
  for (int64_t i = 0; i < tile.D; i += kPiece) {
    FloatVec lo[kR], hi[kR];
    float* acc = tile.acc.data() + r0 * tile.D + i;
    for (int64_t r = 0; r < kR; ++r) {
      lo[r] = FloatVec::loadu(acc + r * tile.D);
      hi[r] = FloatVec::loadu(acc + r * tile.D + kVec);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* v = tile.values[j] + i;
      const FloatVec v0 = FloatVec::loadu(v), v1 = FloatVec::loadu(v + kVec);
#pragma GCC unroll 6
      for (int64_t r = 0; r < kR; ++r) {
        const FloatVec p(tile.scores[r][j]);
        lo[r] = at::vec::fmadd(p, v0, lo[r]);
        hi[r] = at::vec::fmadd(p, v1, hi[r]);
      }
    }
    for (int64_t r = 0; r < kR; ++r) {
      lo[r].store(acc + r * tile.D);
      hi[r].store(acc + r * tile.D + kVec);
    }
  }
}

template <int64_t kR>
void chunk_pass(Tile& tile, int64_t r0, const float* keys_t, int64_t chunk_start, int64_t n) {
  chunk_scores<kR>(tile, r0, keys_t, (n + kKeys - 1) / kKeys);
  chunk_softmax<kR>(tile, r0, chunk_start, n);
  chunk_values<kR>(tile, r0, n);
}

using Pass = void (*)(Tile&, int64_t, const float*, int64_t, int64_t);
constexpr Pass kPasses[kRows + 1] = {nullptr, chunk_pass<1>, chunk_pass<2>, chunk_pass<3>,
                                     chunk_pass<4>, chunk_pass<5>, chunk_pass<6>};

// Where the work is: the cache and the queries, as the entry point checked them.
struct Problem {
  const float* q;
  int64_t q_token_stride, H, G, D;
  const float* k_cache;
  const float* v_cache;
  int64_t block_size, token_stride, block_stride;    // token_stride = Hkv * D
  float scale;
  float* out;                                        // [T, H, D]
};

// One sequence's KV head: where its cache is, and its keys transposed in groups of kKeys
// (positions kKeys * c.. of group c: [D][kKeys], the last one padded with zeros).
struct Head {
  const int32_t* table;
  int64_t seq_len, kv_head;
  float* keys_t;

  // the cache's offset of `position`'s row of this head
  int64_t row(const Problem& pb, int64_t position) const {
    return table[position / pb.block_size] * pb.block_stride +
           position % pb.block_size * pb.token_stride + kv_head * pb.D;
  }
};

void transpose_group(const Problem& pb, const Head& head, int64_t group) {
  float* out = head.keys_t + group * pb.D * kKeys;
  const int64_t first = group * kKeys, n = std::min(kKeys, head.seq_len - first);
  if (n == kKeys && first % pb.block_size + kKeys <= pb.block_size) {
    // a whole group in one block: its rows token_stride apart, transposed a vector square at a
    // time (scalar, the strided copy took ~2.5 ns an element: most of a step whose sequences
    // add a few tokens each over long caches, as speculative decoding's do)
    const float* keys = pb.k_cache + head.row(pb, first);
    for (int64_t j = 0; j < kKeys; j += kVec) {
      for (int64_t d = 0; d < pb.D; d += kVec) {
        at::vec::transpose_mxn<float, kVec, kVec>(keys + j * pb.token_stride + d, pb.token_stride,
                                                  out + d * kKeys + j, kKeys);
      }
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* key = pb.k_cache + head.row(pb, first + j);
    for (int64_t d = 0; d < pb.D; ++d) out[d * kKeys + j] = key[d];
  }
  for (int64_t j = n; j < kKeys; ++j) {
    for (int64_t d = 0; d < pb.D; ++d) out[d * kKeys + j] = 0.f;
  }
}

struct Task {
  const Head* head;
  int64_t first_row, q_len, p0, p1;    // positions p0..p1-1 of the sequence's new rows
};

void run_task(const Problem& pb, const Task& task, Tile& tile) {
  const int64_t D = pb.D, G = pb.G;
  const Head& head = *task.head;
  const int64_t first_position = head.seq_len - task.q_len;   // of the sequence's new rows
  tile.rows = (task.p1 - task.p0) * G;
  for (int64_t p = task.p0; p < task.p1; ++p) {
    const float* q_row = pb.q + (task.first_row + p) * pb.q_token_stride + head.kv_head * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (p - task.p0) * G + g;
      for (int64_t i = 0; i < D; ++i) tile.q[r * D + i] = q_row[g * D + i] * pb.scale;
      tile.position[r] = first_position + p;
    }
  }
  std::fill_n(tile.acc.begin(), tile.rows * D, 0.f);
  std::fill_n(tile.running_max.begin(), tile.rows, kMinusInf);
  std::fill_n(tile.sum.begin(), tile.rows, 0.f);
  const int64_t last_key = tile.position[tile.rows - 1];      // the last row's own position
  for (int64_t start = 0; start <= last_key; start += kChunk) {
    const int64_t n = std::min(kChunk, last_key + 1 - start);
    for (int64_t j = 0; j < n; ++j) tile.values[j] = pb.v_cache + head.row(pb, start + j);
    const float* keys_t = head.keys_t + start / kKeys * D * kKeys;
    // rows are in position order: skip those that see none of this chunk
    int64_t r0 = 0;
    while (r0 < tile.rows && tile.position[r0] < start) r0 += G;
    for (; r0 < tile.rows; r0 += kRows) {
      kPasses[std::min(kRows, tile.rows - r0)](tile, r0, keys_t, start, n);
    }
  }
  for (int64_t r = 0; r < tile.rows; ++r) {
    const int64_t p = task.p0 + r / G, h = head.kv_head * G + r % G;
    const float inverse = tile.sum[r] > 0.f ? 1.f / tile.sum[r] : 0.f;
    float* out = pb.out + ((task.first_row + p) * pb.H + h) * D;
    for (int64_t i = 0; i < D; ++i) out[i] = tile.acc[r * D + i] * inverse;
  }
}

// How many workers `dealt` uses for n items.
int64_t workers_for(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
}

// Runs fn(i, w) for i in [0, n) on torch's threads, dealt in turn to workers_for(n) workers
// (worker w: w, w + workers, ...): each gets early and late positions alike, where contiguous
// ranges gave one thread the causal triangle's cheap half.
template <typename Fn>
void dealt(int64_t n, Fn&& fn) {
  const int64_t workers = workers_for(n);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = w; i < n; i += workers) fn(i, w);
    }
  });
}

}  // namespace

// Each sequence s's new tokens (rows query_start_loc[s]..query_start_loc[s+1] of q) at
// positions seq_lens[s] - q_len + i attend causally to the cached positions <= their own, read
// in place from the paged cache. q [T, H, D] fp32 (heads dense, any row stride); k_cache and
// v_cache [blocks, block_size, Hkv, D] fp32 contiguous; block_tables [S, *], seq_lens [S],
// query_start_loc [S + 1] int32; H a multiple of Hkv, D of 2 vectors. Returns [T, H, D] fp32; a
// row with no cached position to see (more new rows than seq_lens) gets zeros.
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   at::Tensor query_start_loc, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q: float32 [T, H, D] with dense heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "k_cache/v_cache: float32 contiguous [blocks, block_size, Hkv, D]");
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_tables, seq_lens and query_start_loc: contiguous int32");
  }
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  const int64_t S = seq_lens.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "q's heads must be a multiple of the cache's");
  TORCH_CHECK(D % kPiece == 0, "head_dim must be a multiple of ", kPiece);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S &&
                  query_start_loc.dim() == 1 && query_start_loc.size(0) == S + 1,
              "one block table and length per sequence, S + 1 query starts");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), G = H / Hkv;
  TORCH_CHECK(starts[0] == 0 && starts[S] == T, "query_start_loc must run from 0 to T");
  int64_t groups = 0;             // key groups to transpose, over every sequence's heads
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0, "query_start_loc must not decrease");
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_blocks * block_size,
                "seq_lens[", s, "] does not fit its block table");
    if (q_len > 0) groups += Hkv * ((lens[s] + kKeys - 1) / kKeys);
  }
  std::vector<float> keys_t(groups * D * kKeys);
  std::vector<Head> heads;
  std::vector<Task> tasks;
  heads.reserve(S * Hkv);
  float* next = keys_t.data();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    if (q_len == 0) continue;
    // rows before the cache's first position see nothing: left as zeros
    const int64_t first = std::max<int64_t>(0, q_len - lens[s]);
    for (int64_t h = 0; h < Hkv; ++h) {
      heads.push_back({block_tables.data_ptr<int32_t>() + s * max_blocks, lens[s], h, next});
      next += (lens[s] + kKeys - 1) / kKeys * D * kKeys;
      for (int64_t p0 = first; p0 < q_len; p0 += kTilePositions) {
        tasks.push_back({&heads.back(), starts[s], q_len, p0,
                         std::min<int64_t>(q_len, p0 + kTilePositions)});
      }
    }
  }
  auto out = at::zeros({T, H, D}, q.options());
  const Problem pb{q.data_ptr<float>(), q.stride(0), H, G, D, k_cache.data_ptr<float>(),
                   v_cache.data_ptr<float>(), block_size, Hkv * D, block_size * Hkv * D,
                   float(scale), out.data_ptr<float>()};
  // every head's keys transposed once (not once per task), then the tasks
  std::vector<std::pair<const Head*, int64_t>> transposes;
  transposes.reserve(groups);
  for (const Head& head : heads) {
    for (int64_t c = 0; c < (head.seq_len + kKeys - 1) / kKeys; ++c) transposes.push_back({&head, c});
  }
  dealt(transposes.size(), [&](int64_t i, int64_t) {
    transpose_group(pb, *transposes[i].first, transposes[i].second);
  });
  std::vector<Tile> tiles;                          // one per worker
  for (int64_t w = 0; w < workers_for(tasks.size()); ++w) tiles.emplace_back(D, kTilePositions * G);
  dealt(tasks.size(), [&](int64_t i, int64_t w) { run_task(pb, tasks[i], tiles[w]); });
  return out;
}
