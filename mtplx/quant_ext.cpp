// MLX primitives around quant_kernel.c's batch-invariant quantized product, attn_kernel.c's
// batch-invariant fused attention and layer_kernel.c's fused layer halves.
//
// A primitive (rather than a Python call on evaluated arrays) keeps the product inside
// MLX's lazy graph: it composes with mx.compile, and async_eval runs it on the CPU stream's
// worker thread while Python builds the next step. Built and cached by mtplx.quant.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
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
void mtplx_qmm_set_many_rows_tiles(int on);
int mtplx_qmm_fused(void);
int mtplx_qmm_lanes(void);
int mtplx_attend(const float* q, const float* keys, const float* values, const int32_t* slot,
                 const int32_t* count, int n, int heads, int kv, int d, int slots, int cap,
                 int dv, float scale, float* out);
void mtplx_attn_set_threads(int threads);
unsigned long mtplx_attn_split_calls(void);
float mtplx_attn_exp(float x);
int mtplx_attn_lanes(void);
typedef struct {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  int half;
  int N, K, bits, group;
  int int8;
} mtplx_qweight;
int mtplx_layer_before(const float* x, int n, int H, const float* norm, float eps,
                       const mtplx_qweight* qkv, int heads, int kv, int d, int dims,
                       const float* cos, const float* sin, int rope_rows, float* q, float* k,
                       float* v);
int mtplx_layer_after(const float* x, const float* attended, int n, int H,
                      const mtplx_qweight* o_proj, const float* norm, float eps,
                      const mtplx_qweight* gate_up, const mtplx_qweight* down, float* out);
void mtplx_layer_rms_norm(const float* x, const float* w, float eps, int n, int H, float* out);
int mtplx_head_into(const float* e, const float* h, int n, int H, const float* w_e, float eps_e,
                    const float* w_h, float eps_h, const mtplx_qweight* fc, float* out);
int mtplx_head_out(const float* x, int n, int H, const float* w, float eps, const int32_t* at,
                   int R, const mtplx_qweight* head, float* logits, float* normed);
void mtplx_layer_swiglu(const float* gate_up, int n, int I, float* out);
float mtplx_layer_exp(float x);
void mtplx_softmax_rows(const float* logits, long n, long V, float T, int top_k, float top_p,
                        float min_p, float* p, float* scratch);
void mtplx_draw_rows(const float* w, long n, long V, const float* u, int32_t* tokens);
int mtplx_sampled_verdict(const float* x, long V, int k, float T, const int32_t* drafts,
                          const float* const* qs, const float* accept_u, float sample_u,
                          float* scratch, int32_t* tokens);
}

namespace {

// a's elements in row-major order: its own data when it is row-contiguous, else a copy
// gathered through its strides into scratch (whole rows at a time where the last dimension
// is dense, as a slice of rows or a broadcast row is: an element at a time, a vocabulary
// row's copy showed in profiles).
const void* dense(const mx::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<void>();
  const size_t item = a.itemsize();
  scratch.resize(a.size() * item);
  const char* src = a.data<char>();
  const int ndim = static_cast<int>(a.ndim());
  if (ndim >= 1 && a.strides()[ndim - 1] == 1 && a.shape(ndim - 1) > 0) {
    const int64_t width = a.shape(ndim - 1);
    std::vector<int64_t> index(ndim - 1, 0);
    for (size_t row = 0; row < a.size() / width; row++) {
      int64_t at = 0;
      for (int d = 0; d < ndim - 1; d++) at += index[d] * a.strides()[d];
      std::memcpy(scratch.data() + row * width * item, src + at * static_cast<int64_t>(item),
                  width * item);
      for (int d = ndim - 2; d >= 0; d--) {  // the next row, the last leading dimension fastest
        if (++index[d] < a.shape(d)) break;
        index[d] = 0;
      }
    }
    return scratch.data();
  }
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

// Weak copies of a node's arrays for its dispatched task (the task must not keep the graph's
// arrays alive; MLX keeps them until the task has run).
std::vector<mx::array> weak_copies(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> copies;
  copies.reserve(arrays.size());
  for (const auto& a : arrays) copies.push_back(mx::array::unsafe_weak_copy(a));
  return copies;
}

using Arrays = std::vector<mx::array>;

// The preamble every primitive's eval_cpu shares, as MLX's own CPU operations run: each
// output without a buffer gets one (a primitive that hands a donated input's buffer to an
// output does that first), the inputs and outputs are declared to the stream's command
// encoder (as MLX's operations declare them; the CPU encoder of the MLX built against does
// nothing with them), and task(in, out) is dispatched to the stream's thread with weak
// copies of both.
template <class Task>
void run_on_cpu(mx::Stream stream, const Arrays& inputs, Arrays& outputs, Task task) {
  for (auto& out : outputs) {
    if (out.data_shared_ptr() == nullptr) out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) encoder.set_input_array(input);
  for (auto& out : outputs) encoder.set_output_array(out);
  encoder.dispatch([in = weak_copies(inputs), out = weak_copies(outputs),
                    task = std::move(task)]() mutable { task(in, out); });
}

// The same for a primitive of one output: task(in, y).
template <class Task>
void run_on_cpu(mx::Stream stream, const Arrays& inputs, mx::array& output, Task task) {
  Arrays outputs = {output};  // the same array: its buffer is set on output itself
  run_on_cpu(stream, inputs, outputs,
             [task = std::move(task)](Arrays& in, Arrays& out) mutable { task(in, out[0]); });
}

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int bits, int group, bool int8)
      : mx::UnaryPrimitive(stream), bits_(bits), group_(group), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int K = static_cast<int>(inputs[0].shape(-1));
    const int M = static_cast<int>(inputs[0].size() / (K > 0 ? K : 1));
    const int N = static_cast<int>(inputs[1].shape(0));
    run_on_cpu(stream(), inputs, out,
               [M, K, N, bits = bits_, group = group_,
                int8 = int8_](Arrays& in, mx::array& y) mutable {
      const mx::array &x = in[0], &w = in[1], &s = in[2], &b = in[3];
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
    run_on_cpu(stream(), inputs, out,
               [n, heads, d, slots, kv, cap, dv,
                scale = scale_](Arrays& in, mx::array& y) mutable {
      const mx::array &q = in[0], &k = in[1], &v = in[2], &s = in[3], &c = in[4];
      // Row-contiguous inputs are read in place (the store always is); a view is gathered
      // here rather than by a Contiguous node per input in every layer's graph.
      std::vector<char> qd, kd, vd, sd, cd;
      const int status = mtplx_attend(
          static_cast<const float*>(dense(q, qd)), static_cast<const float*>(dense(k, kd)),
          static_cast<const float*>(dense(v, vd)), static_cast<const int32_t*>(dense(s, sd)),
          static_cast<const int32_t*>(dense(c, cd)), n, heads, kv, d, slots, cap, dv, scale,
          y.data<float>());
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
  // astype adds no node when the dtype already matches; contiguity is seen to in eval_cpu.
  auto c = [&](const mx::array& a, mx::Dtype t) { return mx::astype(a, t, stream); };
  return mx::array({n, q.shape(1) * q.shape(2)}, mx::float32,
                   std::make_shared<StoreAttention>(stream, scale),
                   {c(q, mx::float32), c(keys, mx::float32), c(values, mx::float32),
                    c(slot, mx::int32), c(count, mx::int32)});
}


// -- fused layer halves (layer_kernel.c) and the KV write ---------------------------------

// A quantized weight's three arrays (w, scales, biases) as the kernel reads them, in the
// dispatched task (their data ready): row-contiguous ones in place, views gathered.
struct QWeightData {
  std::vector<char> wd, sd, bd;
  mtplx_qweight view(const mx::array& w, const mx::array& s, const mx::array& b, int bits,
                     int group, bool int8) {
    mtplx_qweight q;
    q.w = static_cast<const uint32_t*>(dense(w, wd));
    q.scales = dense(s, sd);
    q.biases = dense(b, bd);
    q.half = s.dtype() == mx::float16;
    q.N = static_cast<int>(w.shape(0));
    q.K = static_cast<int>(w.shape(1) * 32 / bits);
    q.bits = bits;
    q.group = group;
    q.int8 = int8;
    return q;
  }
};

// Scales and biases as the kernel takes them: float16 pairs as they are (exact), anything
// else as float32 (astype adds no node when the dtype already matches).
void kernel_params(std::vector<mx::array>& arrays, size_t at, mx::Stream stream) {
  const auto params = arrays[at].dtype() == mx::float16 && arrays[at + 1].dtype() == mx::float16
                          ? mx::float16
                          : mx::float32;
  arrays[at] = mx::astype(arrays[at], params, stream);
  arrays[at + 1] = mx::astype(arrays[at + 1], params, stream);
}

void check_weight(const mx::array& w, const mx::array& s, const mx::array& b, int bits,
                  int group, int K) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("group_size must be 32, 64 or 128");
  if (w.ndim() != 2 || w.dtype() != mx::uint32 || w.shape(1) * 32 / bits != K ||
      K % group != 0 || s.ndim() != 2 || s.shape(0) != w.shape(0) || s.shape(1) != K / group ||
      b.shape() != s.shape())
    throw std::invalid_argument("fused layer: a weight's shapes do not match");
}

// The first half of a layer: inputs x [..., n, H], norm [H], the fused q/k/v weight (w,
// scales, biases), cos, sin [rope_rows, dims / 2] -> q [n, heads, d], k [n, kv, d], v [n, kv, d].
class LayerBefore : public mx::Primitive {
 public:
  LayerBefore(mx::Stream stream, float eps, int heads, int kv, int d, int dims, int bits,
              int group, bool int8)
      : mx::Primitive(stream), eps_(eps), heads_(heads), kv_(kv), d_(d), dims_(dims),
        bits_(bits), group_(group), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_on_cpu(stream(), inputs, outputs,
               [eps = eps_, heads = heads_, kv = kv_, d = d_, dims = dims_, bits = bits_,
                group = group_, int8 = int8_](Arrays& in, Arrays& out) mutable {
      const int H = static_cast<int>(in[0].shape(-1));
      const int n = static_cast<int>(in[0].size() / H);
      std::vector<char> xd, nd, cd, sd;
      QWeightData qw;
      const mtplx_qweight qkv = qw.view(in[2], in[3], in[4], bits, group, int8);
      const int rope_rows = static_cast<int>(in[5].size() / (dims / 2)) == 1 ? 1 : n;
      const int status = mtplx_layer_before(
          static_cast<const float*>(dense(in[0], xd)), n, H,
          static_cast<const float*>(dense(in[1], nd)), eps, &qkv, heads, kv, d, dims,
          static_cast<const float*>(dense(in[5], cd)), static_cast<const float*>(dense(in[6], sd)),
          rope_rows, out[0].data<float>(), out[1].data<float>(), out[2].data<float>());
      if (status != 0) throw std::runtime_error("mtplx fused layer: the product failed");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mtplx fused layer runs on the CPU only");
  }

  const char* name() const override { return "MTPLXLayerBefore"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerBefore*>(&other);
    return o != nullptr && o->eps_ == eps_ && o->heads_ == heads_ && o->kv_ == kv_ &&
           o->d_ == d_ && o->dims_ == dims_ && o->bits_ == bits_ && o->group_ == group_ &&
           o->int8_ == int8_;
  }

 private:
  float eps_;
  int heads_, kv_, d_, dims_, bits_, group_;
  bool int8_;  // the products' rows quantized to 8 bits (mtplx_qmm_int8)
};

std::vector<mx::array> layer_before(const mx::array& x, const mx::array& norm,
                                    const mx::array& w, const mx::array& scales,
                                    const mx::array& biases, int bits, int group_size,
                                    const mx::array& cos, const mx::array& sin, int heads,
                                    int kv, int head_dim, int dims, float eps, bool int8) {
  const int H = static_cast<int>(x.shape(-1));
  check_weight(w, scales, biases, bits, group_size, H);
  const int n = static_cast<int>(x.size() / H);
  if (heads <= 0 || kv <= 0 || head_dim <= 0 || dims <= 0 || dims > head_dim || dims % 2 ||
      w.shape(0) != (heads + 2 * kv) * head_dim || norm.size() != static_cast<size_t>(H) ||
      cos.size() != sin.size() ||
      (cos.size() != static_cast<size_t>(dims / 2) &&
       cos.size() != static_cast<size_t>(n) * (dims / 2)))
    throw std::invalid_argument("layer_before: shapes do not match");
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::astype(x, mx::float32, stream),
                                   mx::astype(norm, mx::float32, stream),
                                   w,
                                   scales,
                                   biases,
                                   mx::astype(cos, mx::float32, stream),
                                   mx::astype(sin, mx::float32, stream)};
  kernel_params(inputs, 3, stream);
  return mx::array::make_arrays(
      {{n, heads, head_dim}, {n, kv, head_dim}, {n, kv, head_dim}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<LayerBefore>(stream, eps, heads, kv, head_dim, dims, bits, group_size,
                                    int8),
      inputs);
}

// The second half: inputs x [..., n, H], attended [n, A], norm [H], o_proj, gate/up and down
// weights (w, scales, biases each) -> [..., n, H].
class LayerAfter : public mx::UnaryPrimitive {
 public:
  LayerAfter(mx::Stream stream, float eps, std::array<int, 6> kinds, bool int8)
      : mx::UnaryPrimitive(stream), eps_(eps), kinds_(kinds), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    run_on_cpu(stream(), inputs, output,
               [eps = eps_, k = kinds_, int8 = int8_](Arrays& in, mx::array& y) mutable {
      const int H = static_cast<int>(in[0].shape(-1));
      const int n = static_cast<int>(in[0].size() / H);
      std::vector<char> xd, ad, nd;
      QWeightData ow, guw, dw;
      const mtplx_qweight o = ow.view(in[3], in[4], in[5], k[0], k[1], int8);
      const mtplx_qweight gu = guw.view(in[6], in[7], in[8], k[2], k[3], int8);
      const mtplx_qweight down = dw.view(in[9], in[10], in[11], k[4], k[5], int8);
      const int status = mtplx_layer_after(
          static_cast<const float*>(dense(in[0], xd)), static_cast<const float*>(dense(in[1], ad)),
          n, H, &o, static_cast<const float*>(dense(in[2], nd)), eps, &gu, &down,
          y.data<float>());
      if (status != 0) throw std::runtime_error("mtplx fused layer: the product failed");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtplx fused layer runs on the CPU only");
  }

  const char* name() const override { return "MTPLXLayerAfter"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerAfter*>(&other);
    return o != nullptr && o->eps_ == eps_ && o->kinds_ == kinds_ && o->int8_ == int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  std::array<int, 6> kinds_;  // (bits, group size) of o_proj, gate/up, down
  bool int8_;                 // the products' rows quantized to 8 bits (mtplx_qmm_int8)
};

mx::array layer_after(const mx::array& x, const mx::array& attended, const mx::array& norm,
                      const mx::array& o_w, const mx::array& o_s, const mx::array& o_b,
                      int o_bits, int o_group, const mx::array& gu_w, const mx::array& gu_s,
                      const mx::array& gu_b, int gu_bits, int gu_group, const mx::array& d_w,
                      const mx::array& d_s, const mx::array& d_b, int d_bits, int d_group,
                      float eps, bool int8) {
  const int H = static_cast<int>(x.shape(-1));
  const int A = static_cast<int>(attended.shape(-1));
  const int n = static_cast<int>(x.size() / H);
  check_weight(o_w, o_s, o_b, o_bits, o_group, A);
  check_weight(gu_w, gu_s, gu_b, gu_bits, gu_group, H);
  const int I = static_cast<int>(d_w.shape(1) * 32 / d_bits);
  check_weight(d_w, d_s, d_b, d_bits, d_group, I);
  if (attended.size() != static_cast<size_t>(n) * A || o_w.shape(0) != H ||
      gu_w.shape(0) != 2 * I || d_w.shape(0) != H || norm.size() != static_cast<size_t>(H))
    throw std::invalid_argument("layer_after: shapes do not match");
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::astype(x, mx::float32, stream),
                                   mx::astype(attended, mx::float32, stream),
                                   mx::astype(norm, mx::float32, stream),
                                   o_w, o_s, o_b, gu_w, gu_s, gu_b, d_w, d_s, d_b};
  kernel_params(inputs, 4, stream);
  kernel_params(inputs, 7, stream);
  kernel_params(inputs, 10, stream);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<LayerAfter>(
                       stream, eps,
                       std::array<int, 6>{o_bits, o_group, gu_bits, gu_group, d_bits, d_group},
                       int8),
                   inputs);
}

// Stores a KV write copied (another holder, or a view) instead of writing in place: a
// counter for tests and benchmarks, since a copy costs the whole store's bytes.
std::atomic<unsigned long> store_copies{0};

// A group's new keys (or values) written into a layer's store: inputs store [S, kv, cap, w]
// (values: w = d + 1), new [n, kv, d] (every packed token), write_at [R * kv * T] (the store
// row, (slot * kv + head) * cap + position, of each (row, head, token) of the group's padded
// layout), to_padded [R * T] (the packed token each padded position takes) -> the store after
// the write, features past d set to 1 (the values' constant feature). In place when MLX can
// give the store's buffer to the result (nothing else holds it), else on a copy, as MLX's
// scatter does. One output a node: an input of a node with several outputs is held by each
// of them, so it is never free to hand over.
class KVWrite : public mx::UnaryPrimitive {
 public:
  KVWrite(mx::Stream stream, int tokens) : mx::UnaryPrimitive(stream), tokens_(tokens) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& store = inputs[0];
    const bool copied = !(store.is_donatable() && store.flags().row_contiguous);
    if (copied) {
      store_copies++;  // run_on_cpu gives out a buffer of its own
    } else {
      out.copy_shared_buffer(store);
    }
    run_on_cpu(stream(), inputs, out,
               [copied, T = static_cast<int64_t>(tokens_)](Arrays& in, mx::array& y) mutable {
      std::vector<char> scratch, nd, wd, pd;
      if (copied) std::memcpy(y.data<char>(), dense(in[0], scratch), y.nbytes());
      const float* fresh = static_cast<const float*>(dense(in[1], nd));
      const int32_t* write_at = static_cast<const int32_t*>(dense(in[2], wd));
      const int32_t* to_padded = static_cast<const int32_t*>(dense(in[3], pd));
      const int64_t tokens = in[1].shape(0), kv = in[1].shape(1), d = in[1].shape(2);
      const int64_t width = y.shape(-1);
      const int64_t store_rows = static_cast<int64_t>(y.size()) / width;
      const int64_t R = static_cast<int64_t>(in[3].size()) / T;
      float* Y = y.data<float>();
      for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < kv; h++)
          for (int64_t t = 0; t < T; t++) {
            const int64_t token = to_padded[r * T + t];
            const int64_t row = write_at[(r * kv + h) * T + t];
            // Out of range: a bug upstream; nothing is written out of bounds.
            if (token < 0 || token >= tokens || row < 0 || row >= store_rows) continue;
            std::memcpy(Y + row * width, fresh + (token * kv + h) * d, sizeof(float) * d);
            for (int64_t e = d; e < width; e++) Y[row * width + e] = 1.0f;
          }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtplx KV write runs on the CPU only");
  }

  const char* name() const override { return "MTPLXKVWrite"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const KVWrite*>(&other);
    return o != nullptr && o->tokens_ == tokens_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int tokens_;  // T: tokens per row of the group's padded layout
};

mx::array kv_write(const mx::array& store, const mx::array& fresh, const mx::array& write_at,
                   const mx::array& to_padded, int tokens) {
  if (store.ndim() != 4 || fresh.ndim() != 3 || store.shape(1) != fresh.shape(1) ||
      store.shape(3) < fresh.shape(2) || tokens <= 0 || to_padded.size() % tokens != 0 ||
      write_at.size() != to_padded.size() * static_cast<size_t>(fresh.shape(1)))
    throw std::invalid_argument("kv_write: shapes do not match");
  if (store.dtype() != mx::float32) throw std::invalid_argument("kv_write: a float32 store");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(store.shape(), mx::float32, std::make_shared<KVWrite>(stream, tokens),
                   {store, mx::astype(fresh, mx::float32, stream),
                    mx::astype(write_at, mx::int32, stream),
                    mx::astype(to_padded, mx::int32, stream)});
}

// -- a whole layer in one node -------------------------------------------------------------

// The new keys (or values) of one group written into a store (KVWrite's loop): store [S, kv,
// cap, width] (its data in Y), fresh [tokens, kv, d], write_at [R * kv * T], to_padded [R * T].
void write_rows(float* Y, int64_t store_rows, int64_t width, const float* fresh, int64_t tokens,
                int64_t kv, int64_t d, const int32_t* write_at, const int32_t* to_padded,
                int64_t R, int64_t T) {
  for (int64_t r = 0; r < R; r++)
    for (int64_t h = 0; h < kv; h++)
      for (int64_t t = 0; t < T; t++) {
        const int64_t token = to_padded[r * T + t];
        const int64_t row = write_at[(r * kv + h) * T + t];
        // Out of range: a bug upstream; nothing is written out of bounds.
        if (token < 0 || token >= tokens || row < 0 || row >= store_rows) continue;
        std::memcpy(Y + row * width, fresh + (token * kv + h) * d, sizeof(float) * d);
        for (int64_t e = d; e < width; e++) Y[row * width + e] = 1.0f;
      }
}

// One group of a layer's forward: its store, its segment [start, end) of the packed tokens
// and T, the tokens per row of its padded layout.
struct LayerGroup {
  int store, start, end, tokens;
  bool operator==(const LayerGroup&) const = default;
};

// A whole decoder layer of a quantized trunk as one node: what LayerBefore, a KVWrite of the
// keys and of the values, StoreAttention and LayerAfter do, in that order and with the same
// C functions, so the same bits. Inputs: x [..., n, H], norm [H], the q/k/v weight (w, scales,
// biases), cos, sin, post norm [H], the o_proj, gate/up and down weights (w, scales, biases
// each), then each store's keys [S, kv, cap, d] and values [S, kv, cap, d + 1], then each
// group's write_at, to_padded, slots and counts (int32). Outputs: the layer's output [..., n,
// H], then each store's keys and values after the writes. Groups run in order, each one's
// writes before its attention, as the five nodes do; a store shared by several groups is one
// input and one output pair.
//
// A store is written in place when nothing but this node holds it (as KVWrite), else on a
// copy. Every output of a node holds the node's inputs until it is evaluated, so the node
// lets go of the inputs its sibling outputs hold when it is evaluated (MLX detaches them all
// right after): the store is then held only by the evaluated output, as a KVWrite's is.
class LayerStep : public mx::Primitive {
 public:
  static constexpr int kFixed = 17;  // the inputs before the stores

  LayerStep(mx::Stream stream, float eps, float post_eps, float scale, int heads, int kv, int d,
            int dims, std::array<int, 8> kinds, bool int8, std::vector<LayerGroup> groups,
            int stores)
      : mx::Primitive(stream), eps_(eps), post_eps_(post_eps), scale_(scale), heads_(heads),
        kv_(kv), d_(d), dims_(dims), kinds_(kinds), int8_(int8), groups_(std::move(groups)),
        stores_(stores) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& sibling : outputs) {
      if (&sibling.inputs() != &inputs && !sibling.is_tracer()) sibling.inputs().clear();
    }
    std::vector<char> copied(2 * stores_, 0);
    for (int s = 0; s < 2 * stores_; s++) {
      const mx::array& store = inputs[kFixed + s];
      if (store.is_donatable() && store.flags().row_contiguous) {
        outputs[1 + s].copy_shared_buffer(store);
      } else {
        copied[s] = 1;  // run_on_cpu gives the output a buffer of its own
        store_copies++;
      }
    }
    run_on_cpu(stream(), inputs, outputs,
               [copied = std::move(copied), eps = eps_, post_eps = post_eps_, scale = scale_,
                heads = heads_, kv = kv_, d = d_, dims = dims_, k = kinds_, int8 = int8_,
                groups = groups_, stores = stores_](Arrays& in, Arrays& out) mutable {
      const int H = static_cast<int>(in[0].shape(-1));
      const int n = static_cast<int>(in[0].size() / H);
      std::vector<char> xd, nd, cd, sd, pd;
      QWeightData qw, ow, guw, dw;
      const mtplx_qweight qkv = qw.view(in[2], in[3], in[4], k[0], k[1], int8);
      const mtplx_qweight o = ow.view(in[8], in[9], in[10], k[2], k[3], int8);
      const mtplx_qweight gu = guw.view(in[11], in[12], in[13], k[4], k[5], int8);
      const mtplx_qweight down = dw.view(in[14], in[15], in[16], k[6], k[7], int8);
      const float* x = static_cast<const float*>(dense(in[0], xd));
      // q, k, v [n, heads or kv, d] and the attention's output [n, heads * d], as the five
      // nodes' intermediate arrays hold them: scratch of the stream's thread, kept between
      // layers and steps (grown, never cleared: every element read is written first), so a
      // layer allocates nothing and a prompt chunk's megabytes are not faulted in again.
      thread_local std::vector<float> q, fk, fv, attended;
      const size_t q_size = static_cast<size_t>(n) * heads * d;
      const size_t kv_size = static_cast<size_t>(n) * kv * d;
      if (q.size() < q_size) {
        q.resize(q_size);
        attended.resize(q_size);
      }
      if (fk.size() < kv_size) {
        fk.resize(kv_size);
        fv.resize(kv_size);
      }
      const int rope_rows = static_cast<int>(in[5].size() / (dims / 2)) == 1 ? 1 : n;
      if (mtplx_layer_before(x, n, H, static_cast<const float*>(dense(in[1], nd)), eps, &qkv,
                             heads, kv, d, dims, static_cast<const float*>(dense(in[5], cd)),
                             static_cast<const float*>(dense(in[6], sd)), rope_rows, q.data(),
                             fk.data(), fv.data()) != 0)
        throw std::runtime_error("mtplx fused layer: the product failed");
      for (int s = 0; s < 2 * stores; s++) {
        if (!copied[s]) continue;
        std::vector<char> scratch;
        std::memcpy(out[1 + s].data<char>(), dense(in[kFixed + s], scratch), out[1 + s].nbytes());
      }
      int64_t row_at = 0;  // the groups' results are concatenated in group order
      for (size_t g = 0; g < groups.size(); g++) {
        const LayerGroup& group = groups[g];
        const int base = kFixed + 2 * stores + 4 * static_cast<int>(g);
        std::vector<char> wd, td, sld, ctd;
        const int32_t* write_at = static_cast<const int32_t*>(dense(in[base], wd));
        const int32_t* to_padded = static_cast<const int32_t*>(dense(in[base + 1], td));
        const int64_t T = group.tokens;
        const int64_t R = static_cast<int64_t>(in[base + 1].size()) / T;
        mx::array& keys = out[1 + 2 * group.store];
        mx::array& values = out[2 + 2 * group.store];
        const int64_t kw = keys.shape(-1), vw = values.shape(-1);
        write_rows(keys.data<float>(), static_cast<int64_t>(keys.size()) / kw, kw, fk.data(), n,
                   kv, d, write_at, to_padded, R, T);
        write_rows(values.data<float>(), static_cast<int64_t>(values.size()) / vw, vw, fv.data(),
                   n, kv, d, write_at, to_padded, R, T);
        const int count = group.end - group.start;
        // -2 (a slot or count out of range) leaves NaN in the result, as StoreAttention.
        (void)mtplx_attend(q.data() + static_cast<size_t>(group.start) * heads * d,
                           keys.data<float>(), values.data<float>(),
                           static_cast<const int32_t*>(dense(in[base + 2], sld)),
                           static_cast<const int32_t*>(dense(in[base + 3], ctd)), count, heads,
                           kv, d, static_cast<int>(keys.shape(0)), static_cast<int>(keys.shape(2)),
                           static_cast<int>(vw), scale,
                           attended.data() + static_cast<size_t>(row_at) * heads * d);
        row_at += count;
      }
      if (mtplx_layer_after(x, attended.data(), n, H, &o,
                            static_cast<const float*>(dense(in[7], pd)), post_eps, &gu, &down,
                            out[0].data<float>()) != 0)
        throw std::runtime_error("mtplx fused layer: the product failed");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mtplx fused layer runs on the CPU only");
  }

  const char* name() const override { return "MTPLXLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerStep*>(&other);
    return o != nullptr && o->eps_ == eps_ && o->post_eps_ == post_eps_ && o->scale_ == scale_ &&
           o->heads_ == heads_ && o->kv_ == kv_ && o->d_ == d_ && o->dims_ == dims_ &&
           o->kinds_ == kinds_ && o->int8_ == int8_ && o->groups_ == groups_ &&
           o->stores_ == stores_;
  }

 private:
  float eps_, post_eps_, scale_;
  int heads_, kv_, d_, dims_;
  std::array<int, 8> kinds_;  // (bits, group size) of q/k/v, o_proj, gate/up, down
  bool int8_;                 // the products' rows quantized to 8 bits (mtplx_qmm_int8)
  std::vector<LayerGroup> groups_;
  int stores_;
};

std::vector<mx::array> layer_step(
    const mx::array& x, const mx::array& norm, const mx::array& w, const mx::array& scales,
    const mx::array& biases, int bits, int group_size, const mx::array& cos, const mx::array& sin,
    int heads, int kv, int head_dim, int dims, float eps, float scale, const mx::array& o_w,
    const mx::array& o_s, const mx::array& o_b, int o_bits, int o_group,
    const mx::array& post_norm, const mx::array& gu_w, const mx::array& gu_s,
    const mx::array& gu_b, int gu_bits, int gu_group, const mx::array& d_w, const mx::array& d_s,
    const mx::array& d_b, int d_bits, int d_group, float post_eps, bool int8,
    const std::vector<mx::array>& stores, const std::vector<mx::array>& group_arrays,
    const std::vector<int>& group_meta) {
  const int H = static_cast<int>(x.shape(-1));
  const int n = static_cast<int>(x.size() / H);
  const int A = heads * head_dim;
  check_weight(w, scales, biases, bits, group_size, H);
  check_weight(o_w, o_s, o_b, o_bits, o_group, A);
  check_weight(gu_w, gu_s, gu_b, gu_bits, gu_group, H);
  const int I = static_cast<int>(d_w.shape(1) * 32 / d_bits);
  check_weight(d_w, d_s, d_b, d_bits, d_group, I);
  if (heads <= 0 || kv <= 0 || head_dim <= 0 || dims <= 0 || dims > head_dim || dims % 2 ||
      heads % kv != 0 || heads / kv > 64 || head_dim > 512 ||
      w.shape(0) != (heads + 2 * kv) * head_dim || norm.size() != static_cast<size_t>(H) ||
      post_norm.size() != static_cast<size_t>(H) || cos.size() != sin.size() ||
      (cos.size() != static_cast<size_t>(dims / 2) &&
       cos.size() != static_cast<size_t>(n) * (dims / 2)) ||
      o_w.shape(0) != H || gu_w.shape(0) != 2 * I || d_w.shape(0) != H)
    throw std::invalid_argument("layer_step: shapes do not match");
  const int num_stores = static_cast<int>(stores.size() / 2);
  const size_t num_groups = group_meta.size() / 4;
  if (stores.size() % 2 || num_stores < 1 || group_meta.size() % 4 || num_groups < 1 ||
      group_arrays.size() != 4 * num_groups)
    throw std::invalid_argument("layer_step: stores (keys, values) and groups (4 arrays each)");
  for (int s = 0; s < num_stores; s++) {
    const mx::array& keys = stores[2 * s];
    const mx::array& values = stores[2 * s + 1];
    if (keys.ndim() != 4 || values.ndim() != 4 || keys.dtype() != mx::float32 ||
        values.dtype() != mx::float32 || keys.shape(1) != kv || keys.shape(3) != head_dim ||
        values.shape(0) != keys.shape(0) || values.shape(1) != kv ||
        values.shape(2) != keys.shape(2) || values.shape(3) < head_dim)
      throw std::invalid_argument("layer_step: a store's shapes do not match");
  }
  std::vector<LayerGroup> groups;
  int covered = 0;
  for (size_t g = 0; g < num_groups; g++) {
    LayerGroup group{group_meta[4 * g], group_meta[4 * g + 1], group_meta[4 * g + 2],
                     group_meta[4 * g + 3]};
    const mx::array& write_at = group_arrays[4 * g];
    const mx::array& to_padded = group_arrays[4 * g + 1];
    const size_t count = static_cast<size_t>(group.end - group.start);
    if (group.store < 0 || group.store >= num_stores || group.start < 0 ||
        group.end <= group.start || group.end > n || group.tokens <= 0 ||
        to_padded.size() % group.tokens != 0 ||
        write_at.size() != to_padded.size() * static_cast<size_t>(kv) ||
        group_arrays[4 * g + 2].size() != count || group_arrays[4 * g + 3].size() != count)
      throw std::invalid_argument("layer_step: a group's shapes do not match");
    covered += static_cast<int>(count);
    groups.push_back(group);
  }
  if (covered != n) throw std::invalid_argument("layer_step: the groups' tokens are not n");
  auto stream = mx::default_stream(mx::Device::cpu);
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, stream); };
  std::vector<mx::array> inputs = {f32(x),    f32(norm), w,   scales, biases, f32(cos),
                                   f32(sin),  f32(post_norm), o_w, o_s,   o_b,  gu_w,
                                   gu_s,      gu_b,      d_w, d_s,    d_b};
  kernel_params(inputs, 3, stream);
  kernel_params(inputs, 9, stream);
  kernel_params(inputs, 12, stream);
  kernel_params(inputs, 15, stream);
  std::vector<mx::Shape> shapes = {x.shape()};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (const auto& store : stores) {
    inputs.push_back(store);
    shapes.push_back(store.shape());
    dtypes.push_back(mx::float32);
  }
  for (const auto& a : group_arrays) inputs.push_back(mx::astype(a, mx::int32, stream));
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<LayerStep>(
          stream, eps, post_eps, scale, heads, kv, head_dim, dims,
          std::array<int, 8>{bits, group_size, o_bits, o_group, gu_bits, gu_group, d_bits,
                             d_group},
          int8, std::move(groups), num_stores),
      inputs);
}

// -- embedding lookup ----------------------------------------------------------------------

// Rows of a quantized embedding table, dequantized: inputs ids [...] (int32), w [V, H * bits /
// 32] (uint32, MLX's affine packing: element j of a word at bits (j mod (32 / bits)) * bits),
// scales and biases [V, H / g] (float16 or float32) -> [..., H] float32, each element
// scale * q rounded, then + bias rounded: mx.dequantize's CPU arithmetic (a multiply node, then
// an add node) on the gathered rows, so the same bits as the ~35 nodes of
// ``mx.dequantize(w[ids], scales[ids], biases[ids])`` in one. (This file is built without
// FMA and without floating-point contraction, so the two roundings stay two.) An id outside
// the table gives a row of NaN.
class EmbedRows : public mx::UnaryPrimitive {
 public:
  EmbedRows(mx::Stream stream, int bits, int group)
      : mx::UnaryPrimitive(stream), bits_(bits), group_(group) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    run_on_cpu(stream(), inputs, out,
               [bits = bits_, group = group_](Arrays& in, mx::array& y) mutable {
      std::vector<char> id_d, w_d, s_d, b_d;
      const int32_t* ids = static_cast<const int32_t*>(dense(in[0], id_d));
      const uint32_t* w = static_cast<const uint32_t*>(dense(in[1], w_d));
      const void* sv = dense(in[2], s_d);
      const void* bv = dense(in[3], b_d);
      const bool half = in[2].dtype() == mx::float16;
      const int64_t V = in[1].shape(0), H = y.shape(-1), n = in[0].size();
      const int64_t words = in[1].shape(1), groups = H / group, per_word = 32 / bits;
      const uint32_t mask = (1u << bits) - 1u;
      float* Y = y.data<float>();
      for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids[i];
        float* out_row = Y + i * H;
        if (row < 0 || row >= V) {
          for (int64_t j = 0; j < H; j++) out_row[j] = NAN;
          continue;
        }
        const uint32_t* packed = w + row * words;
        for (int64_t g = 0; g < groups; g++) {
          const int64_t at = row * groups + g;
          const float scale = half ? static_cast<float>(static_cast<const mx::float16_t*>(sv)[at])
                                   : static_cast<const float*>(sv)[at];
          const float bias = half ? static_cast<float>(static_cast<const mx::float16_t*>(bv)[at])
                                  : static_cast<const float*>(bv)[at];
          for (int64_t j = g * group; j < (g + 1) * group; j++) {
            const uint32_t q = (packed[j / per_word] >> ((j % per_word) * bits)) & mask;
            const float scaled = scale * static_cast<float>(q);
            out_row[j] = scaled + bias;
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtplx embedding lookup runs on the CPU only");
  }

  const char* name() const override { return "MTPLXEmbedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const EmbedRows*>(&other);
    return o != nullptr && o->bits_ == bits_ && o->group_ == group_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.push_back(static_cast<int>(inputs[1].shape(1) * 32 / bits_));
    return {shape};
  }

 private:
  int bits_;
  int group_;
};

mx::array embed_rows(const mx::array& ids, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int bits, int group_size) {
  if (bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("bits must be 2, 4 or 8");
  if (w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape() ||
      w.dtype() != mx::uint32)
    throw std::invalid_argument("embed_rows: w [V, H * bits / 32] uint32, scales/biases [V, H / g]");
  const auto H = w.shape(1) * 32 / bits;
  if (group_size <= 0 || H % group_size != 0 || scales.shape(0) != w.shape(0) ||
      scales.shape(1) != H / group_size)
    throw std::invalid_argument("embed_rows: shapes do not match");
  auto stream = mx::default_stream(mx::Device::cpu);
  const auto params = scales.dtype() == mx::float16 && biases.dtype() == mx::float16
                          ? mx::float16
                          : mx::float32;
  mx::Shape shape = ids.shape();
  shape.push_back(static_cast<int>(H));
  return mx::array(shape, mx::float32, std::make_shared<EmbedRows>(stream, bits, group_size),
                   {mx::astype(ids, mx::int32, stream), w, mx::astype(scales, params, stream),
                    mx::astype(biases, params, stream)});
}

// -- a generic MTP head's ends (layer_kernel.c's mtplx_head_into / mtplx_head_out) ----------

// The head's input: inputs e [..., n, H] (the next tokens' embeddings), h [..., n, H] (the
// target's hidden states), w_e, w_h [H], fc (w, scales, biases) over 2H -> [..., n, N]:
// fc([rms_norm(e) * w_e | rms_norm(h) * w_h]).
class HeadInto : public mx::UnaryPrimitive {
 public:
  HeadInto(mx::Stream stream, float eps_e, float eps_h, int bits, int group, bool int8)
      : mx::UnaryPrimitive(stream), eps_e_(eps_e), eps_h_(eps_h), bits_(bits), group_(group),
        int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    run_on_cpu(stream(), inputs, output,
               [eps_e = eps_e_, eps_h = eps_h_, bits = bits_, group = group_,
                int8 = int8_](Arrays& in, mx::array& y) mutable {
      const int H = static_cast<int>(in[0].shape(-1));
      const int n = static_cast<int>(in[0].size() / H);
      std::vector<char> ed, hd, wed, whd;
      QWeightData fw;
      const mtplx_qweight fc = fw.view(in[4], in[5], in[6], bits, group, int8);
      const int status = mtplx_head_into(
          static_cast<const float*>(dense(in[0], ed)), static_cast<const float*>(dense(in[1], hd)),
          n, H, static_cast<const float*>(dense(in[2], wed)), eps_e,
          static_cast<const float*>(dense(in[3], whd)), eps_h, &fc, y.data<float>());
      if (status != 0) throw std::runtime_error("mtplx head input: the product failed");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtplx head kernels run on the CPU only");
  }

  const char* name() const override { return "MTPLXHeadInto"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const HeadInto*>(&other);
    return o != nullptr && o->eps_e_ == eps_e_ && o->eps_h_ == eps_h_ && o->bits_ == bits_ &&
           o->group_ == group_ && o->int8_ == int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = static_cast<int>(inputs[4].shape(0));
    return {shape};
  }

 private:
  float eps_e_, eps_h_;
  int bits_, group_;
  bool int8_;  // the product's rows quantized to 8 bits (mtplx_qmm_int8)
};

mx::array head_into(const mx::array& e, const mx::array& h, const mx::array& w_e, float eps_e,
                    const mx::array& w_h, float eps_h, const mx::array& w,
                    const mx::array& scales, const mx::array& biases, int bits, int group_size,
                    bool int8) {
  const int H = static_cast<int>(e.shape(-1));
  check_weight(w, scales, biases, bits, group_size, 2 * H);
  if (e.ndim() < 1 || h.shape() != e.shape() || w_e.size() != static_cast<size_t>(H) ||
      w_h.size() != static_cast<size_t>(H))
    throw std::invalid_argument("head_into: shapes do not match");
  auto stream = mx::default_stream(mx::Device::cpu);
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, stream); };
  std::vector<mx::array> inputs = {f32(e), f32(h), f32(w_e), f32(w_h), w, scales, biases};
  kernel_params(inputs, 5, stream);
  mx::Shape shape = e.shape();
  shape.back() = static_cast<int>(w.shape(0));
  return mx::array(shape, mx::float32,
                   std::make_shared<HeadInto>(stream, eps_e, eps_h, bits, group_size, int8),
                   inputs);
}

// The head's output: inputs x [1, n, H], at [R] or [] int32 (rows of x), w [H], the head's
// projection (w, scales, biases) -> logits [1, R, N] (R = 1 for a [] at) of rms_norm(x) * w
// at those rows, and rms_norm(x) * w [1, n, H].
class HeadOut : public mx::Primitive {
 public:
  HeadOut(mx::Stream stream, float eps, int bits, int group, bool int8)
      : mx::Primitive(stream), eps_(eps), bits_(bits), group_(group), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_on_cpu(stream(), inputs, outputs,
               [eps = eps_, bits = bits_, group = group_,
                int8 = int8_](Arrays& in, Arrays& out) mutable {
      const int H = static_cast<int>(in[0].shape(-1));
      const int n = static_cast<int>(in[0].size() / H);
      std::vector<char> xd, ad, wd;
      QWeightData hw;
      const mtplx_qweight head = hw.view(in[3], in[4], in[5], bits, group, int8);
      const int status = mtplx_head_out(
          static_cast<const float*>(dense(in[0], xd)), n, H,
          static_cast<const float*>(dense(in[2], wd)), eps,
          static_cast<const int32_t*>(dense(in[1], ad)), static_cast<int>(in[1].size()), &head,
          out[0].data<float>(), out[1].data<float>());
      if (status != 0) throw std::runtime_error("mtplx head output: the product failed");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mtplx head kernels run on the CPU only");
  }

  const char* name() const override { return "MTPLXHeadOut"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const HeadOut*>(&other);
    return o != nullptr && o->eps_ == eps_ && o->bits_ == bits_ && o->group_ == group_ &&
           o->int8_ == int8_;
  }

 private:
  float eps_;
  int bits_, group_;
  bool int8_;  // the product's rows quantized to 8 bits (mtplx_qmm_int8)
};

std::vector<mx::array> head_out(const mx::array& x, const mx::array& at, const mx::array& norm,
                                float eps, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int bits, int group_size, bool int8) {
  const int H = static_cast<int>(x.shape(-1));
  check_weight(w, scales, biases, bits, group_size, H);
  if (x.ndim() != 3 || x.shape(0) != 1 || x.shape(1) < 1 || at.ndim() > 1 ||
      norm.size() != static_cast<size_t>(H))
    throw std::invalid_argument("head_out: x [1, n, H], at [R] or [], norm [H]");
  const int R = static_cast<int>(at.size());
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::astype(x, mx::float32, stream),
                                   mx::astype(at, mx::int32, stream),
                                   mx::astype(norm, mx::float32, stream), w, scales, biases};
  kernel_params(inputs, 4, stream);
  return mx::array::make_arrays({{1, R, static_cast<int>(w.shape(0))}, x.shape()},
                                {mx::float32, mx::float32},
                                std::make_shared<HeadOut>(stream, eps, bits, group_size, int8),
                                inputs);
}

// -- the greedy verdict of drafting rows ----------------------------------------------------

// The index of row's first maximum over V values, as MLX's CPU ArgReduce finds it: a value
// replaces the best so far when it is greater, or when it is a NaN and the best is not (so
// the first NaN wins, and a tie keeps the first index).
int32_t first_argmax(const float* row, int64_t V) {
  float best = row[0];
  int64_t at = 0;
  for (int64_t j = 1; j < V; j++) {
    const float x = row[j];
    if (x > best || (std::isnan(x) && !std::isnan(best))) {
      best = x;
      at = j;
    }
  }
  return static_cast<int32_t>(at);
}

// Inputs logits [B, n, V] float32 (the target's at a row's n = k + 1 verified positions),
// drafts [B, k] int32 -> num_accepted [B] int32 (the drafts equal to the argmax at their
// position, up to the first that is not) and output_tokens [B, n] int32 (the argmaxes up to
// the position after the accepted drafts, -1 past it): mlx_ops.mx_verify_greedy's ints.
class GreedyVerdict : public mx::Primitive {
 public:
  explicit GreedyVerdict(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_on_cpu(stream(), inputs, outputs, [](Arrays& in, Arrays& out) mutable {
      std::vector<char> ld, dd;
      const float* logits = static_cast<const float*>(dense(in[0], ld));
      const int32_t* drafts = static_cast<const int32_t*>(dense(in[1], dd));
      const int64_t V = in[0].shape(-1), n = out[1].shape(-1), B = out[0].size();
      int32_t* accepted = out[0].data<int32_t>();
      int32_t* tokens = out[1].data<int32_t>();
      for (int64_t b = 0; b < B; b++) {
        int32_t count = 0;
        for (int64_t i = 0; i < n; i++) {
          if (i > count) {  // past the first mismatch: nothing committed there
            tokens[b * n + i] = -1;
            continue;
          }
          const int32_t token = first_argmax(logits + (b * n + i) * V, V);
          tokens[b * n + i] = token;
          if (i < n - 1 && drafts[b * (n - 1) + i] == token) count++;
        }
        accepted[b] = count;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("the mtplx greedy verdict runs on the CPU only");
  }

  const char* name() const override { return "MTPLXGreedyVerdict"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const GreedyVerdict*>(&other) != nullptr;
  }
};

std::vector<mx::array> greedy_verdict(const mx::array& logits, const mx::array& drafts) {
  // [n, V] and [k] are one row ([1, n, V], [1, k]) without a reshape node.
  const bool one = logits.ndim() == 2;
  if (logits.ndim() != 2 && logits.ndim() != 3)
    throw std::invalid_argument("greedy_verdict: logits [B, n, V] or [n, V]");
  const int B = one ? 1 : static_cast<int>(logits.shape(0));
  const int n = static_cast<int>(logits.shape(-2));
  if (n < 1 || logits.shape(-1) < 1 || drafts.ndim() != logits.ndim() - 1 ||
      drafts.shape(-1) != n - 1 || (!one && drafts.shape(0) != B))
    throw std::invalid_argument("greedy_verdict: drafts [B, n - 1] for logits [B, n, V]");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{B}, {B, n}}, {mx::int32, mx::int32},
                                std::make_shared<GreedyVerdict>(stream),
                                {mx::astype(logits, mx::float32, stream),
                                 mx::astype(drafts, mx::int32, stream)});
}

// A greedy draft over a reduced draft vocabulary: inputs logits [V'] float32 (any shape of
// V' values), vocab [V'] int32 (each entry's target id) -> [] int32 vocab[argmax(logits)],
// the argmax MLX's (first_argmax).
class GreedyDraft : public mx::UnaryPrimitive {
 public:
  explicit GreedyDraft(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    run_on_cpu(stream(), inputs, output, [](Arrays& in, mx::array& y) mutable {
      std::vector<char> ld, vd;
      const float* logits = static_cast<const float*>(dense(in[0], ld));
      const int32_t* vocab = static_cast<const int32_t*>(dense(in[1], vd));
      *y.data<int32_t>() = vocab[first_argmax(logits, static_cast<int64_t>(in[0].size()))];
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the mtplx greedy draft runs on the CPU only");
  }

  const char* name() const override { return "MTPLXGreedyDraft"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const GreedyDraft*>(&other) != nullptr;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {{}}; }
};

mx::array greedy_draft(const mx::array& logits, const mx::array& vocab) {
  if (logits.size() < 1 || vocab.ndim() != 1 || vocab.size() != logits.size())
    throw std::invalid_argument("greedy_draft: logits of V' values, vocab [V']");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array({}, mx::int32, std::make_shared<GreedyDraft>(stream),
                   {mx::astype(logits, mx::float32, stream), mx::astype(vocab, mx::int32, stream)});
}

// What a queued drafting cycle's row and drafter take from its verdict, in one node: inputs
// num_accepted [1] int32, output_tokens [1, n] int32 (n = k + 1) -> num_rejected [] (k -
// accepted), num_valid [] (accepted + 1), the tokens [n] and the last committed one [1]
// (output_tokens[accepted]): MLX's subtraction, addition, reshape and take of the same ints.
class VerdictCounts : public mx::Primitive {
 public:
  explicit VerdictCounts(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_on_cpu(stream(), inputs, outputs, [](Arrays& in, Arrays& out) mutable {
      std::vector<char> ad, td;
      const int32_t accepted = *static_cast<const int32_t*>(dense(in[0], ad));
      const int32_t* tokens = static_cast<const int32_t*>(dense(in[1], td));
      const int64_t n = in[1].size();
      if (accepted < 0 || accepted >= n)
        throw std::runtime_error("verdict_counts: num_accepted outside the verified positions");
      *out[0].data<int32_t>() = static_cast<int32_t>(n - 1) - accepted;
      *out[1].data<int32_t>() = accepted + 1;
      std::memcpy(out[2].data<int32_t>(), tokens, n * sizeof(int32_t));
      *out[3].data<int32_t>() = tokens[accepted];
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("the mtplx verdict counts run on the CPU only");
  }

  const char* name() const override { return "MTPLXVerdictCounts"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const VerdictCounts*>(&other) != nullptr;
  }
};

std::vector<mx::array> verdict_counts(const mx::array& num_accepted,
                                      const mx::array& output_tokens) {
  if (num_accepted.size() != 1 || output_tokens.ndim() != 2 || output_tokens.shape(0) != 1 ||
      output_tokens.shape(1) < 1)
    throw std::invalid_argument("verdict_counts: num_accepted [1], output_tokens [1, n]");
  const int n = static_cast<int>(output_tokens.shape(1));
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{}, {}, {n}, {1}}, {mx::int32, mx::int32, mx::int32, mx::int32},
                                std::make_shared<VerdictCounts>(stream),
                                {mx::astype(num_accepted, mx::int32, stream),
                                 mx::astype(output_tokens, mx::int32, stream)});
}

// The sampled path's nodes (layer_kernel.c's sampling section: MLX's ops' bits). A row's
// scratch p [V] is this thread's, kept between calls (a vocabulary's row is ~200 KB: a fresh
// allocation a call is an mmap and its page faults).
float* sampling_scratch(int64_t V) {
  thread_local std::vector<float> kept;
  if (static_cast<int64_t>(kept.size()) < V) kept.resize(V);
  return kept.data();
}

// Input logits [..., V] float32 -> p [..., V] = softmax((logits - max) / T) per row, then
// filtered by top-k (0 < top_k < V), top-p (< 1) and min-p (> 0):
// mlx_ops.mx_distribution_from_logits' max, shift, division, softmax and filters, one node.
class SampledDistribution : public mx::UnaryPrimitive {
 public:
  SampledDistribution(mx::Stream stream, float temperature, int top_k, float top_p, float min_p)
      : mx::UnaryPrimitive(stream),
        temperature_(temperature),
        top_k_(top_k),
        top_p_(top_p),
        min_p_(min_p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    run_on_cpu(stream(), inputs, output,
               [t = temperature_, k = top_k_, top_p = top_p_,
                min_p = min_p_](Arrays& in, mx::array& y) mutable {
      const mx::array& x = in[0];
      std::vector<char> xd;
      const float* logits = static_cast<const float*>(dense(x, xd));
      const int64_t V = x.shape(-1);
      mtplx_softmax_rows(logits, static_cast<long>(x.size() / V), static_cast<long>(V), t, k,
                         top_p, min_p, y.data<float>(), sampling_scratch(V + (k > 0 ? k : 0)));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the mtplx sampled distribution runs on the CPU only");
  }

  const char* name() const override { return "MTPLXSampledDistribution"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const SampledDistribution*>(&other);
    return o != nullptr && o->temperature_ == temperature_ && o->top_k_ == top_k_ &&
           o->top_p_ == top_p_ && o->min_p_ == min_p_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float temperature_;
  int top_k_;
  float top_p_, min_p_;
};

mx::array sampled_distribution(const mx::array& logits, float temperature, int top_k,
                               float top_p, float min_p) {
  if (logits.ndim() < 1 || logits.shape(-1) < 1 || !(temperature > 0.0f))
    throw std::invalid_argument("sampled_distribution: logits [..., V], temperature > 0");
  const bool use_top_k = 0 < top_k && top_k < logits.shape(-1);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(logits.shape(), mx::float32,
                   std::make_shared<SampledDistribution>(stream, temperature,
                                                         use_top_k ? top_k : 0, top_p, min_p),
                   {mx::astype(logits, mx::float32, stream)});
}

// Inputs weights [B, V] float32, uniforms [B] float32 -> tokens [B] int32: mlx_ops.mx_sample's
// ints.
class SampledDraw : public mx::UnaryPrimitive {
 public:
  explicit SampledDraw(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    run_on_cpu(stream(), inputs, output, [](Arrays& in, mx::array& y) mutable {
      std::vector<char> wd, ud;
      const float* w = static_cast<const float*>(dense(in[0], wd));
      const float* u = static_cast<const float*>(dense(in[1], ud));
      const int64_t V = in[0].shape(-1);
      mtplx_draw_rows(w, static_cast<long>(in[0].size() / V), static_cast<long>(V), u,
                      y.data<int32_t>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the mtplx sampled draw runs on the CPU only");
  }

  const char* name() const override { return "MTPLXSampledDraw"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const SampledDraw*>(&other) != nullptr;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[1].shape(0)}};
  }
};

mx::array sampled_draw(const mx::array& weights, const mx::array& uniforms) {
  if (weights.ndim() != 2 || weights.shape(1) < 1 || uniforms.ndim() != 1 ||
      uniforms.shape(0) != weights.shape(0))
    throw std::invalid_argument("sampled_draw: weights [B, V], uniforms [B]");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array({weights.shape(0)}, mx::int32, std::make_shared<SampledDraw>(stream),
                   {mx::astype(weights, mx::float32, stream),
                    mx::astype(uniforms, mx::float32, stream)});
}

// Inputs x [n, V] float32 (p, or logits at temperature > 0), drafts [k] int32 (k = n - 1),
// uniforms [U] float32 (u_i = uniforms[accept_at + i], the draw's uniforms[sample_at]), then
// each draft position's q [V] -> num_accepted [1] int32, output_tokens [1, n] int32:
// mlx_ops.mx_verify_draft_tokens' ints for one row.
class SampledVerdict : public mx::Primitive {
 public:
  SampledVerdict(mx::Stream stream, float temperature, int accept_at, int sample_at)
      : mx::Primitive(stream),
        temperature_(temperature),
        accept_at_(accept_at),
        sample_at_(sample_at) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_on_cpu(stream(), inputs, outputs,
               [t = temperature_, accept_at = accept_at_,
                sample_at = sample_at_](Arrays& in, Arrays& out) mutable {
      std::vector<char> xd, dd, ud;
      const float* x = static_cast<const float*>(dense(in[0], xd));
      const int64_t V = in[0].shape(-1);
      const int k = static_cast<int>(in[0].shape(0)) - 1;
      const int32_t* drafts = k ? static_cast<const int32_t*>(dense(in[1], dd)) : nullptr;
      const float* u = static_cast<const float*>(dense(in[2], ud));
      std::vector<std::vector<char>> qd(k);
      std::vector<const float*> qs(k);
      for (int i = 0; i < k; i++) qs[i] = static_cast<const float*>(dense(in[3 + i], qd[i]));
      const int count = mtplx_sampled_verdict(
          x, static_cast<long>(V), k, t, drafts, qs.data(), u + accept_at, u[sample_at],
          t > 0.0f ? sampling_scratch(V) : nullptr, out[1].data<int32_t>());
      if (count < 0) throw std::runtime_error("sampled_verdict: a draft outside the vocabulary");
      *out[0].data<int32_t>() = count;
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("the mtplx sampled verdict runs on the CPU only");
  }

  const char* name() const override { return "MTPLXSampledVerdict"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const SampledVerdict*>(&other);
    return o != nullptr && o->temperature_ == temperature_ && o->accept_at_ == accept_at_ &&
           o->sample_at_ == sample_at_;
  }

 private:
  float temperature_;
  int accept_at_, sample_at_;
};

std::vector<mx::array> sampled_verdict(const mx::array& x, const mx::array& drafts,
                                       const mx::array& uniforms, const std::vector<mx::array>& qs,
                                       float temperature, int accept_at, int sample_at) {
  if (x.ndim() != 2 || x.shape(0) < 1 || x.shape(1) < 1)
    throw std::invalid_argument("sampled_verdict: x [k + 1, V]");
  const int n = static_cast<int>(x.shape(0)), k = n - 1;
  const int64_t V = x.shape(1);
  if (static_cast<int>(drafts.size()) != k || static_cast<int>(qs.size()) != k)
    throw std::invalid_argument("sampled_verdict: k drafts and k q rows for x [k + 1, V]");
  for (const auto& q : qs)
    if (static_cast<int64_t>(q.size()) != V)
      throw std::invalid_argument("sampled_verdict: each q [V]");
  const int64_t U = uniforms.size();
  if (accept_at < 0 || sample_at < 0 || accept_at + k > U || sample_at >= U)
    throw std::invalid_argument("sampled_verdict: the uniforms' offsets outside them");
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::astype(x, mx::float32, stream),
                                   mx::astype(drafts, mx::int32, stream),
                                   mx::astype(uniforms, mx::float32, stream)};
  for (const auto& q : qs) inputs.push_back(mx::astype(q, mx::float32, stream));
  return mx::array::make_arrays(
      {{1}, {1, n}}, {mx::int32, mx::int32},
      std::make_shared<SampledVerdict>(stream, temperature, accept_at, sample_at), inputs);
}

// For tests: layer_kernel.c's elementwise pieces on evaluated float32 arrays.
mx::array rms_norm_reference(const mx::array& x, const mx::array& w, float eps) {
  mx::array xc = mx::contiguous(mx::astype(x, mx::float32));
  mx::array wc = mx::contiguous(mx::astype(w, mx::float32));
  mx::eval({xc, wc});
  const int H = static_cast<int>(xc.shape(-1));
  std::vector<float> out(xc.size());
  mtplx_layer_rms_norm(xc.data<float>(), wc.data<float>(), eps,
                       static_cast<int>(xc.size() / H), H, out.data());
  return mx::array(out.begin(), xc.shape(), mx::float32);
}

mx::array swiglu_reference(const mx::array& gate_up) {
  mx::array g = mx::contiguous(mx::astype(gate_up, mx::float32));
  mx::eval({g});
  const int I = static_cast<int>(g.shape(-1) / 2);
  std::vector<float> out(g.size() / 2);
  mtplx_layer_swiglu(g.data<float>(), static_cast<int>(g.size() / (2 * I)), I, out.data());
  mx::Shape shape = g.shape();
  shape.back() = I;
  return mx::array(out.begin(), shape, mx::float32);
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
  m.def("set_many_rows_tiles", [](bool on) { mtplx_qmm_set_many_rows_tiles(on ? 1 : 0); },
        nb::arg("on"), "Whether int8 products of many rows take their own tiles (the same bits).");
  m.def("fused", []() { return mtplx_qmm_fused() != 0; });
  m.def("lanes", []() { return mtplx_qmm_lanes(); });
  m.def("attend", &attend, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("slot"),
        nb::arg("count"), nb::arg("scale"),
        "Causal attention of packed tokens over a KV store as a lazy MLX array [n, heads * d].");
  m.def("attn_set_threads", [](int t) { mtplx_attn_set_threads(t); }, nb::arg("threads"));
  m.def("attn_split_calls", []() { return mtplx_attn_split_calls(); });
  m.def("attn_exp", [](float x) { return mtplx_attn_exp(x); }, nb::arg("x"));
  m.def("attn_lanes", []() { return mtplx_attn_lanes(); });
  m.def("layer_before", &layer_before, nb::arg("x"), nb::arg("norm"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("group_size"),
        nb::arg("cos"), nb::arg("sin"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("dims"), nb::arg("eps"), nb::arg("int8") = false,
        "A layer's norm, fused q/k/v product and RoPE as one lazy node -> [q, k, v]; int8: "
        "the product's rows quantized to 8 bits per group (integer dot products).");
  m.def("layer_after", &layer_after, nb::arg("x"), nb::arg("attended"), nb::arg("norm"),
        nb::arg("o_w"), nb::arg("o_scales"), nb::arg("o_biases"), nb::arg("o_bits"),
        nb::arg("o_group"), nb::arg("gu_w"), nb::arg("gu_scales"), nb::arg("gu_biases"),
        nb::arg("gu_bits"), nb::arg("gu_group"), nb::arg("d_w"), nb::arg("d_scales"),
        nb::arg("d_biases"), nb::arg("d_bits"), nb::arg("d_group"), nb::arg("eps"),
        nb::arg("int8") = false,
        "A layer's o_proj, residual, norm, gate/up, SwiGLU, down and residual as one node; "
        "int8: the products' rows quantized to 8 bits per group.");
  m.def("kv_write", &kv_write, nb::arg("store"), nb::arg("fresh"), nb::arg("write_at"),
        nb::arg("to_padded"), nb::arg("tokens"),
        "A group's new keys (or values) written into a layer's store, lazily (one node).");
  m.def("layer_step", &layer_step, nb::arg("x"), nb::arg("norm"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("group_size"),
        nb::arg("cos"), nb::arg("sin"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("dims"), nb::arg("eps"), nb::arg("scale"), nb::arg("o_w"),
        nb::arg("o_scales"), nb::arg("o_biases"), nb::arg("o_bits"), nb::arg("o_group"),
        nb::arg("post_norm"), nb::arg("gu_w"), nb::arg("gu_scales"), nb::arg("gu_biases"),
        nb::arg("gu_bits"), nb::arg("gu_group"), nb::arg("d_w"), nb::arg("d_scales"),
        nb::arg("d_biases"), nb::arg("d_bits"), nb::arg("d_group"), nb::arg("post_eps"),
        nb::arg("int8"), nb::arg("stores"), nb::arg("group_arrays"), nb::arg("group_meta"),
        "A whole layer as one lazy node (layer_before, the KV writes, the attention and "
        "layer_after) -> [x, keys, values of each store].");
  m.def("store_copies", []() { return store_copies.load(); },
        "KV stores written on a copy rather than in place so far (KVWrite and the layer node).");
  m.def("embed_rows", &embed_rows, nb::arg("ids"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("bits"), nb::arg("group_size"),
        "Rows ids of a quantized embedding table, dequantized (mx.dequantize's bits), lazily "
        "in one node -> [..., H] float32.");
  m.def("head_into", &head_into, nb::arg("e"), nb::arg("h"), nb::arg("w_e"), nb::arg("eps_e"),
        nb::arg("w_h"), nb::arg("eps_h"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("bits"), nb::arg("group_size"), nb::arg("int8"));
  m.def("head_out", &head_out, nb::arg("x"), nb::arg("at"), nb::arg("norm"), nb::arg("eps"),
        nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"),
        nb::arg("group_size"), nb::arg("int8"));
  m.def("greedy_verdict", &greedy_verdict, nb::arg("logits"), nb::arg("drafts"),
        "The greedy verdict of drafting rows in one lazy node: logits [B, n, V] (or [n, V]: "
        "B = 1), drafts [B, n - 1] -> [num_accepted [B], output_tokens [B, n]] int32.");
  m.def("greedy_draft", &greedy_draft, nb::arg("logits"), nb::arg("vocab"),
        "A greedy draft token over a reduced vocabulary in one lazy node: vocab[argmax(logits)] "
        "[] int32.");
  m.def("verdict_counts", &verdict_counts, nb::arg("num_accepted"), nb::arg("output_tokens"),
        "A one-row verdict's counts in one lazy node: num_accepted [1], output_tokens [1, n] "
        "-> [num_rejected [], num_valid [], tokens [n], last [1]] int32.");
  m.def("sampled_distribution", &sampled_distribution, nb::arg("logits"),
        nb::arg("temperature"), nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f,
        nb::arg("min_p") = 0.0f,
        "softmax((logits - max) / T) per row, then top-k (top-p with it) and min-p, one node");
  m.def("sampled_draw", &sampled_draw, nb::arg("weights"), nb::arg("uniforms"),
        "inverse-CDF draw per row of weights [B, V] with uniforms [B], one node");
  m.def("sampled_verdict", &sampled_verdict, nb::arg("x"), nb::arg("drafts"), nb::arg("uniforms"),
        nb::arg("qs"), nb::arg("temperature"), nb::arg("accept_at"), nb::arg("sample_at"),
        "one row's exact sampled verdict, lazily, one node");
  m.def("rms_norm_reference", &rms_norm_reference, nb::arg("x"), nb::arg("w"), nb::arg("eps"));
  m.def("swiglu_reference", &swiglu_reference, nb::arg("gate_up"));
  m.def("layer_exp", [](float x) { return mtplx_layer_exp(x); }, nb::arg("x"));
}
