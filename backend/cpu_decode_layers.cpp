// A decode step's decoder layers in one call on a CPU (built with cpu_ops.cpp into one
// extension by backend/cpu_ops.py; registered there).
//
// Why: a batch-1 decode step of SmolLM2 (30 layers) runs ~15 operators per layer, each a few
// microseconds of work in cpu_ops.cpp, but each reached from Python through a module call, the
// checks of which kernel takes it, views and slices: ~150 us per layer, 4-5 ms of a 27 ms step
// whose floor (every weight read once at the memory's speed) is 18 ms. Here the same kernels
// run layer after layer from C++ (vLLM and SGLang get there with torch.compile and CPU graphs).
//
// What: DecodeLayers holds each layer's weights (plain, row-major: the few-rows products' own;
// in bf16 also the packed ones oneDNN multiplies more rows with) and runs, per layer, exactly
// what backend/models/llama.py's DecoderLayer does: the residual add with the input norm, q/k/v
// in one product, rotary embedding on q and k, the new k/v stored in the paged cache, attention
// over it in place, the output product, the add with the post-attention norm, gate/up in one
// product, silu-and-multiply, the down product. Only for the decode steps whose every operator
// the modules would send to these kernels (cpu_decode_layers.py decides); others keep them.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string_view>
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

// oneDNN's product against a prepacked weight (cpu_linear.PackedLinear's), as torch's
// mkldnn::_linear_pointwise operator computes it for the modules
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& packed, const Bias& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 std::string_view(""));
}

// One projection: its plain weight for the few-rows kernel, its packed one (bf16) for more rows.
struct Product {
  at::Tensor plain;
  std::optional<at::Tensor> packed;
  Bias bias;

  // x @ weight.T (+ bias): the few-rows kernel of x's dtype up to `few_rows` rows, else oneDNN's
  at::Tensor operator()(const at::Tensor& x, int64_t few_rows) const {
    if (x.size(0) > few_rows) {
      TORCH_CHECK(packed.has_value(), "more rows than the few-rows kernel takes, no packed weight");
      return packed_product(x, *packed, bias);
    }
#ifdef CPU_CAPABILITY_AVX512
    if (x.scalar_type() == at::kBFloat16) return few_rows_linear_bf16(x, plain, bias);
#endif
    TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16 few-rows products need AVX-512");
    return few_rows_linear(x, plain, bias);
  }
};

struct Layer {
  at::Tensor input_norm;
  Product qkv, o;
  at::Tensor post_norm;
  Product gate_up, down;
};

class DecodeLayers {
 public:
  // Per layer: the input norm's weight, q/k/v's, the output product's, the post-attention
  // norm's, gate/up's and down's; each product's plain weight, packed weight (or None) and bias
  // (or None) in lists of their own, in that order of products.
  DecodeLayers(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_norms,
               std::vector<at::Tensor> plain, std::vector<std::optional<at::Tensor>> packed,
               std::vector<Bias> biases, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t few_rows, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), few_rows_(few_rows), eps_(eps),
        scale_(scale) {
    const size_t n = input_norms.size();
    TORCH_CHECK(post_norms.size() == n && plain.size() == 4 * n && packed.size() == 4 * n &&
                    biases.size() == 4 * n,
                "one of each weight per layer");
    for (size_t i = 0; i < n; ++i) {
      auto product = [&](size_t j) {
        return Product{plain[4 * i + j], packed[4 * i + j], biases[4 * i + j]};
      };
      layers_.push_back({input_norms[i], product(0), product(1), post_norms[i], product(2),
                         product(3)});
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
    const int64_t T = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_, F = few_rows_;
    at::Tensor residual = x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor h = i == 0 ? rms_norm(x, layer.input_norm, eps_)
                            : add_rms_norm(x, residual, layer.input_norm, eps_);
      at::Tensor qkv = layer.qkv(h, F).view({T, H + 2 * Hkv, D});
      rope_(qkv, H + Hkv, cos, sin);
      at::Tensor q = qkv.narrow(1, 0, H), k = qkv.narrow(1, H, Hkv);
      at::Tensor v = qkv.narrow(1, H + Hkv, Hkv);
      write_kv_(k, v, k_caches[i], v_caches[i], slot_mapping);
      at::Tensor attended = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables,
                                                   seq_lens, scale_);
      h = add_rms_norm(layer.o(attended.view({T, H * D}), F), residual, layer.post_norm, eps_);
      x = layer.down(silu_and_mul(layer.gate_up(h, F)), F);
    }
    return {x, residual};
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, few_rows_;
  double eps_, scale_;
};

}  // namespace

namespace py = pybind11;

void register_decode_layers(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<std::optional<at::Tensor>>, std::vector<Bias>, int64_t, int64_t,
                    int64_t, int64_t, double, double>())
      .def("forward", &DecodeLayers::forward);
}
