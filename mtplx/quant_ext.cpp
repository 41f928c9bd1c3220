// MLX primitives around quant_kernel.c's batch-invariant quantized product and
// attn_kernel.c's batch-invariant fused attention.
//
// A primitive (rather than a Python call on evaluated arrays) keeps the product inside
// MLX's lazy graph: it composes with mx.compile, and async_eval runs it on the CPU stream's
// worker thread while Python builds the next step. Built and cached by mtplx.quant.

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

extern "C" {
int mtplx_qmm(const float* x, int M, int K, const uint32_t* w, const void* scales,
              const void* biases, int half, int N, int bits, int group, float* y);
int mtplx_qmm_int8(const float* x, int M, int K, const uint32_t* w, const void* scales,
                   const void* biases, int half, int N, int bits, int group, float* y);
void mtplx_qmm_set_threads(int threads);
int mtplx_qmm_threads(void);
unsigned long mtplx_qmm_split_calls(void);
int mtplx_qmm_fused(void);
int mtplx_qmm_lanes(void);
int mtplx_attend(const float* q, const float* keys, const float* values, const int32_t* slot,
                 const int32_t* count, int n, int heads, int kv, int d, int slots, int cap,
                 int dv, float scale, float* out);
void mtplx_attn_set_threads(int threads);
unsigned long mtplx_attn_split_calls(void);
float mtplx_attn_exp(float x);
int mtplx_attn_lanes(void);
}

namespace {

// a's elements in row-major order: its own data when it is row-contiguous, else a copy
// gathered through its strides into scratch.
const void* dense(const mx::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<void>();
  const size_t item = a.itemsize();
  scratch.resize(a.size() * item);
  const char* src = a.data<char>();
  const int ndim = static_cast<int>(a.ndim());
  std::vector<int64_t> index(ndim, 0);
  for (size_t i = 0; i < a.size(); i++) {
    int64_t at = 0;
    for (int d = 0; d < ndim; d++) at += index[d] * a.strides()[d];
    std::memcpy(scratch.data() + i * item, src + at * static_cast<int64_t>(item), item);
    for (int d = ndim - 1; d >= 0; d--) {  // the next index, last dimension fastest
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
  return scratch.data();
}

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int bits, int group, bool int8)
      : mx::UnaryPrimitive(stream), bits_(bits), group_(group), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    const mx::array& scales = inputs[2];
    const mx::array& biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_input_array(scales);
    encoder.set_input_array(biases);
    encoder.set_output_array(out);
    const int K = static_cast<int>(x.shape(-1));
    const int M = static_cast<int>(x.size() / (K > 0 ? K : 1));
    const int N = static_cast<int>(w.shape(0));
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                      s = mx::array::unsafe_weak_copy(scales),
                      b = mx::array::unsafe_weak_copy(biases),
                      y = mx::array::unsafe_weak_copy(out), M, K, N, bits = bits_,
                      group = group_, int8 = int8_]() mutable {
      const int half = s.dtype() == mx::float16;
      // The kernel reads row-contiguous inputs: the rare input that is not (a view) is
      // copied here, when its data is ready, rather than by a Contiguous node per input in
      // the graph, which would cost every product four more dispatches (~16 a layer).
      std::vector<char> xd, wd, sd, bd;
      // The integer-dot mode quantizes x per group to 8 bits (quant_kernel.c).
      auto product = int8 ? mtplx_qmm_int8 : mtplx_qmm;
      if (product(static_cast<const float*>(dense(x, xd)), M, K,
                  static_cast<const uint32_t*>(dense(w, wd)), dense(s, sd), dense(b, bd), half, N,
                  bits, group, y.data<float>()) != 0) {
        throw std::runtime_error("mtplx quantized product: unsupported arguments");
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtplx quantized product runs on the CPU only");
  }

  const char* name() const override { return "MTPLXQuantizedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedRows*>(&other);
    return o != nullptr && o->bits_ == bits_ && o->group_ == group_ && o->int8_ == int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int bits_;
  int group_;
  bool int8_;
};

mx::array qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, int bits, int group_size, bool int8) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("group_size must be 32, 64 or 128");
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2)
    throw std::invalid_argument("x [..., K], w [N, K * bits / 32], scales/biases [N, K / g]");
  const int K = static_cast<int>(x.shape(-1));
  const int N = static_cast<int>(w.shape(0));
  if (K % group_size != 0 || w.shape(1) * 32 / bits != K || scales.shape(0) != N ||
      scales.shape(1) != K / group_size || biases.shape() != scales.shape())
    throw std::invalid_argument("quantized product: shapes do not match");
  if (w.dtype() != mx::uint32) throw std::invalid_argument("w must be uint32");
  auto stream = mx::default_stream(mx::Device::cpu);
  // astype adds no node when the dtype already matches; row-contiguity is seen to in
  // eval_cpu, where it is known.
  auto xf = mx::astype(x, mx::float32, stream);
  // float16 scales and biases are read as they are (exact), anything else as float32.
  const auto params = scales.dtype() == mx::float16 && biases.dtype() == mx::float16
                          ? mx::float16
                          : mx::float32;
  auto sc = mx::astype(scales, params, stream);
  auto bc = mx::astype(biases, params, stream);
  mx::Shape shape = x.shape();
  shape.back() = N;
  return mx::array(shape, mx::float32, std::make_shared<QuantizedRows>(stream, bits, group_size, int8),
                   {xf, w, sc, bc});
}

// Attention of packed query tokens over a KV store (attn_kernel.c): inputs q [n, heads, d],
// keys [S, kv, cap, d], values [S, kv, cap, dv], slot [n], count [n] (int32) -> [n, heads * d].
class StoreAttention : public mx::UnaryPrimitive {
 public:
  StoreAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    const mx::array& q = inputs[0];
    const mx::array& keys = inputs[1];
    const mx::array& values = inputs[2];
    const int n = static_cast<int>(q.shape(0));
    const int heads = static_cast<int>(q.shape(1));
    const int d = static_cast<int>(q.shape(2));
    const int slots = static_cast<int>(keys.shape(0));
    const int kv = static_cast<int>(keys.shape(1));
    const int cap = static_cast<int>(keys.shape(2));
    const int dv = static_cast<int>(values.shape(3));
    encoder.dispatch([q = mx::array::unsafe_weak_copy(q),
                      k = mx::array::unsafe_weak_copy(keys),
                      v = mx::array::unsafe_weak_copy(values),
                      s = mx::array::unsafe_weak_copy(inputs[3]),
                      c = mx::array::unsafe_weak_copy(inputs[4]),
                      y = mx::array::unsafe_weak_copy(out), n, heads, d, slots, kv, cap, dv,
                      scale = scale_]() mutable {
      const int status =
          mtplx_attend(q.data<float>(), k.data<float>(), v.data<float>(), s.data<int32_t>(),
                       c.data<int32_t>(), n, heads, kv, d, slots, cap, dv, scale, y.data<float>());
      // -2 (a slot or count out of range) leaves NaN in the result; the shapes were checked
      // when the graph was built, so nothing else fails here.
      (void)status;
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtplx attention runs on the CPU only");
  }

  const char* name() const override { return "MTPLXStoreAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const StoreAttention*>(&other);
    return o != nullptr && o->scale_ == scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) * inputs[0].shape(2)}};
  }

 private:
  float scale_;
};

mx::array attend(const mx::array& q, const mx::array& keys, const mx::array& values,
                 const mx::array& slot, const mx::array& count, float scale) {
  if (q.ndim() != 3 || keys.ndim() != 4 || values.ndim() != 4 || slot.ndim() != 1 ||
      count.ndim() != 1)
    throw std::invalid_argument(
        "attend: q [n, heads, d], keys [S, kv, cap, d], values [S, kv, cap, dv], slot [n], "
        "count [n]");
  const auto n = q.shape(0);
  if (keys.shape(3) != q.shape(2) || values.shape(3) < q.shape(2) ||
      values.shape(0) != keys.shape(0) || values.shape(1) != keys.shape(1) ||
      values.shape(2) != keys.shape(2) || q.shape(1) % keys.shape(1) != 0 ||
      slot.shape(0) != n || count.shape(0) != n || q.shape(2) > 512 ||
      q.shape(1) / keys.shape(1) > 64)
    throw std::invalid_argument("attend: shapes do not match");
  if (q.dtype() != mx::float32 || keys.dtype() != mx::float32 || values.dtype() != mx::float32)
    throw std::invalid_argument("attend: q, keys and values must be float32");
  auto stream = mx::default_stream(mx::Device::cpu);
  auto c = [&](const mx::array& a, mx::Dtype t) {
    return mx::contiguous(mx::astype(a, t, stream), false, stream);
  };
  return mx::array({n, q.shape(1) * q.shape(2)}, mx::float32,
                   std::make_shared<StoreAttention>(stream, scale),
                   {c(q, mx::float32), c(keys, mx::float32), c(values, mx::float32),
                    c(slot, mx::int32), c(count, mx::int32)});
}

}  // namespace

NB_MODULE(_mtplx_quant, m) {
  m.doc() = "Batch-invariant quantized products (MLX affine layout) for the CPU";
  m.def("qmm", &qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("bits"), nb::arg("group_size"), nb::arg("int8") = false,
        "x @ dequantize(w, scales, biases).T as a lazy MLX array (float32, CPU stream); int8: "
        "x quantized to 8 bits per group, integer dot products.");
  m.def("set_threads", [](int t) { mtplx_qmm_set_threads(t); }, nb::arg("threads"));
  m.def("threads", []() { return mtplx_qmm_threads(); });
  m.def("split_calls", []() { return mtplx_qmm_split_calls(); });
  m.def("fused", []() { return mtplx_qmm_fused() != 0; });
  m.def("lanes", []() { return mtplx_qmm_lanes(); });
  m.def("attend", &attend, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("slot"),
        nb::arg("count"), nb::arg("scale"),
        "Causal attention of packed tokens over a KV store as a lazy MLX array [n, heads * d].");
  m.def("attn_set_threads", [](int t) { mtplx_attn_set_threads(t); }, nb::arg("threads"));
  m.def("attn_split_calls", []() { return mtplx_attn_split_calls(); });
  m.def("attn_exp", [](float x) { return mtplx_attn_exp(x); }, nb::arg("x"));
  m.def("attn_lanes", []() { return mtplx_attn_lanes(); });
}
