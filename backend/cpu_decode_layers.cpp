// A decode step's decoder layers in one call on a CPU (built with cpu_ops.cpp into one
// extension by backend/cpu_ops.py; registered there).
//
// Why: a batch-1 decode step of SmolLM2 (30 layers) runs ~15 operators per layer, each a few
// microseconds of work in cpu_ops.cpp, but each reached from Python through a module call, the
// checks of which kernel takes it, views and slices: ~150 us per layer, 4-5 ms of a 27 ms step
// whose floor (every weight read once at the memory's speed) is 18 ms. Here the same kernels
// run layer after layer from C++ (vLLM and SGLang get there with torch.compile and CPU graphs).
//
// What: DecodeLayers holds each layer's weights (plain, row-major: the few-rows products' own)
// and runs, per layer, exactly what backend/models/llama.py's DecoderLayer does: the residual
// add with the input norm, q/k/v in one product, rotary embedding on q and k, the new k/v stored
// in the paged cache, attention over it in place, the output product, the add with the
// post-attention norm, gate/up in one product, silu-and-multiply, the down product. Only for the
// few rows the few-rows products take (cpu_ops.py decides); everything else keeps the modules.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <vector>

// cpu_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rope_(at::Tensor qkv, int64_t heads, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale);
void write_kv_(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
               at::Tensor slot_mapping);
at::Tensor few_rows_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias);
#ifdef CPU_CAPABILITY_AVX512
at::Tensor few_rows_linear_bf16(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias);
#endif

namespace {

using Bias = std::optional<at::Tensor>;

// x @ weight.T (+ bias) by the few-rows kernel of x's dtype
at::Tensor product(const at::Tensor& x, const at::Tensor& weight, const Bias& bias) {
#ifdef CPU_CAPABILITY_AVX512
  if (x.scalar_type() == at::kBFloat16) return few_rows_linear_bf16(x, weight, bias);
#endif
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16 few-rows products need AVX-512");
  return few_rows_linear(x, weight, bias);
}

struct Layer {
  at::Tensor input_norm, qkv;
  Bias qkv_bias;
  at::Tensor o;
  Bias o_bias;
  at::Tensor post_norm, gate_up, down;
};

class DecodeLayers {
 public:
  DecodeLayers(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> qkv,
               std::vector<Bias> qkv_biases, std::vector<at::Tensor> o,
               std::vector<Bias> o_biases, std::vector<at::Tensor> post_norms,
               std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    const size_t n = input_norms.size();
    TORCH_CHECK(qkv.size() == n && qkv_biases.size() == n && o.size() == n &&
                    o_biases.size() == n && post_norms.size() == n && gate_up.size() == n &&
                    down.size() == n,
                "one of each weight per layer");
    for (size_t i = 0; i < n; ++i) {
      layers_.push_back({input_norms[i], qkv[i], qkv_biases[i], o[i], o_biases[i],
                         post_norms[i], gate_up[i], down[i]});
    }
  }

  // x [T, hidden]: the embeddings of each sequence's one new token; cos/sin [T, head_dim / 2]
  // fp32; the caches, slots, tables and lengths as paged_decode_attention and write_kv_ take
  // them. Returns the last layer's output and the residual stream (the final norm adds them).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                             std::vector<at::Tensor> k_caches,
                                             std::vector<at::Tensor> v_caches,
                                             at::Tensor slot_mapping, at::Tensor block_tables,
                                             at::Tensor seq_lens) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one k and v cache per layer");
    const int64_t T = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_;
    at::Tensor residual = x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor h = i == 0 ? rms_norm(x, layer.input_norm, eps_)
                            : add_rms_norm(x, residual, layer.input_norm, eps_);
      at::Tensor qkv = product(h, layer.qkv, layer.qkv_bias).view({T, H + 2 * Hkv, D});
      rope_(qkv, H + Hkv, cos, sin);
      at::Tensor q = qkv.narrow(1, 0, H), k = qkv.narrow(1, H, Hkv);
      at::Tensor v = qkv.narrow(1, H + Hkv, Hkv);
      write_kv_(k, v, k_caches[i], v_caches[i], slot_mapping);
      at::Tensor attended = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables,
                                                   seq_lens, scale_);
      h = product(attended.view({T, H * D}), layer.o, layer.o_bias);
      h = add_rms_norm(h, residual, layer.post_norm, eps_);
      x = product(silu_and_mul(product(h, layer.gate_up, std::nullopt)), layer.down,
                  std::nullopt);
    }
    return {x, residual};
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

namespace py = pybind11;

void register_decode_layers(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<Bias>,
                    std::vector<at::Tensor>, std::vector<Bias>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                    int64_t, double, double>())
      .def("forward", &DecodeLayers::forward);
}
