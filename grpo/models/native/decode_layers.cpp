// A whole decoding step's layers in one call (native_decode.py's NativeDecoder; decode_gemma_layers for
// gemma_decode.py's GemmaDecoder): the same calls in
// the same order as its Python loop -- oneDNN's Linear on the sampler's packed weights (with a
// LoRA side path's two calls where it has one), rope_attend, add_rms_norm, silu_mul -- made from
// here, so that a step pays one call from Python instead of ~8 a layer (with the modules' own
// calls between them: ~12% of an fp32 step at 24 rows on SmolLM2's 30 layers).

#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace grpo_native {

// oneDNN's Linear as PyTorch registers it (mkldnn::_linear_pointwise) on oneDNN's packed weight, with
// LoRA's side path added by oneDNN's binary post-op; or stream_linear on a weight in the streaming
// layout, its side path (packed in it too) in the same sums: what cpu_linear.py's packed_product
// computes from Python.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b) {
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                            c10::optional<c10::string_view>)>();
  static const auto linear_add =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&, c10::string_view)>();
  TORCH_CHECK(lora_a.has_value() == lora_b.has_value(), "decode_layers: a LoRA side path needs both A and B");
  if (!weight.is_mkldnn()) return stream_linear(x, weight, bias, lora_a, lora_b);
  auto out = linear.call(x, weight, bias, "none", c10::List<c10::optional<c10::Scalar>>(), "");
  if (!lora_a.has_value()) return out;
  auto down = linear.call(x, *lora_a, c10::nullopt, "none", c10::List<c10::optional<c10::Scalar>>(), "");
  return linear_add.call(down, out, *lora_b, c10::nullopt, "add");
}

namespace {

// What both one-call loops below share: each layer's 4 packed weights (q/k/v stacked, o, gate/up stacked,
// down) in `weights` with 3 optional tensors a weight in `extras` (bias, LoRA's packed A and packed B, the
// scale in B), the caches, and `head_norms` (none, or each layer's norms of q and of k), checked once.
struct StackedLayers {
  at::TensorList weights;
  const c10::List<c10::optional<at::Tensor>>& extras;
  at::TensorList k_caches, v_caches, head_norms;
  at::IntArrayRef qkv_sizes;
  int64_t layers;
  // the attention's scores by avx512_bf16's dot product where the products take it: the weights packed in
  // pairs, which the sampler does only where kernel_probe.py measured that instruction the faster here
  bool dot;

  // `op` names the caller in messages; `norms`: its norms, `norms_per_layer` a layer and one final
  StackedLayers(const char* op, at::TensorList weights_, const c10::List<c10::optional<at::Tensor>>& extras_,
                at::TensorList norms, int64_t norms_per_layer, at::TensorList k_caches_, at::TensorList v_caches_,
                at::TensorList head_norms_, at::IntArrayRef qkv_sizes_)
      : weights(weights_), extras(extras_), k_caches(k_caches_), v_caches(v_caches_), head_norms(head_norms_),
        qkv_sizes(qkv_sizes_), layers(static_cast<int64_t>(k_caches_.size())) {
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                    static_cast<int64_t>(weights.size()) == 4 * layers &&
                    static_cast<int64_t>(extras.size()) == 12 * layers &&
                    static_cast<int64_t>(norms.size()) == norms_per_layer * layers + 1,
                op, ": for ", layers, " layers: 4 weights, 12 extras and ", norms_per_layer,
                " norms a layer, one final norm; got ", weights.size(), " weights, ", extras.size(), " extras, ",
                norms.size(), " norms, ", v_caches.size(), " value caches");
    TORCH_CHECK(qkv_sizes.size() == 3, op, ": qkv_sizes must be [q, k, v] widths");
    TORCH_CHECK(head_norms.empty() || static_cast<int64_t>(head_norms.size()) == 2 * layers,
                op, ": head_norms must be empty or 2 a layer (q's, k's) for ", layers, " layers, got ",
                head_norms.size());
    dot = !weights[0].is_mkldnn() && weights[0].scalar_type() == at::kBFloat16 && stream_pairs(weights[0]);
  }

  // x by layer i's weight `which` (0 q/k/v, 1 o, 2 gate/up, 3 down), with its bias and side path
  at::Tensor linear(const at::Tensor& x, int64_t i, int64_t which) const {
    const int64_t e = 12 * i + 3 * which;
    return packed_linear(x, weights[4 * i + which], extras.get(e), extras.get(e + 1), extras.get(e + 2));
  }

  // layer i's attention of x: its q/k/v product split, then rope_attend with the layer's norms of q and k
  // (where head_norms has them) and caches
  at::Tensor attend(const at::Tensor& x, int64_t i, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& lengths, int64_t heads, double scale, const c10::optional<at::Tensor>& shared_from,
                    const c10::optional<at::Tensor>& shared, double eps, c10::string_view norms, int64_t window,
                    double softcap) const {
    auto qkv = linear(x, i, 0);
    auto q = qkv.narrow(1, 0, qkv_sizes[0]);
    auto k = qkv.narrow(1, qkv_sizes[0], qkv_sizes[1]);
    auto v = qkv.narrow(1, qkv_sizes[0] + qkv_sizes[1], qkv_sizes[2]);
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    const bool normed = !head_norms.empty();
    return rope_attend(q, k, v, cos, sin, k_cache, v_cache, lengths, heads, scale, shared_from, shared, dot,
                       normed ? c10::optional<at::Tensor>(head_norms[2 * i]) : c10::nullopt,
                       normed ? c10::optional<at::Tensor>(head_norms[2 * i + 1]) : c10::nullopt, eps, norms, window,
                       softcap);
  }
};

}  // namespace

// Every layer of a Llama-layout decoder for one decoding step. `weights`, `extras`, the caches and
// `head_norms` as StackedLayers takes them; `norms` holds each layer's input and
// post-attention norm weights in turn, then the final norm's. `hidden` is the embedded tokens
// [rows, dim]; returns the final norm's output [rows, dim]. `shared_from` and `shared`: rows that
// share their first columns, as rope_attend takes them (every layer's caches alike). `head_norms`:
// none, or each layer's norms of every head of q and of k (Qwen3's q_norm, k_norm), which rope_attend
// applies before the rotary embedding, as that attention's forward does. `post_norms`: OLMo2's layers,
// whose norms follow each sublayer (`norms`: each layer's post-attention and post-feedforward norm
// weights in turn, then the final one) and normalise q and k whole (`head_norms` as wide as q and k),
// every norm rounded once (NormKind::once); cos and sin float32, as its rotary embedding hands them.
// `residual_multiplier`: each sublayer's output scaled before the residual add (Granite's; 1 elsewhere).
// `unrotated`: the layers whose attention skips the rotary embedding (SmolLM3's every fourth).
at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& lengths, at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& extras, at::TensorList norms,
                         at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef qkv_sizes,
                         int64_t heads, double scale, double eps, at::TensorList head_norms,
                         const c10::optional<at::Tensor>& shared_from, const c10::optional<at::Tensor>& shared,
                         bool post_norms, double residual_multiplier, at::IntArrayRef unrotated) {
  const StackedLayers stack("decode_layers", weights, extras, norms, 2, k_caches, v_caches, head_norms, qkv_sizes);
  const int64_t layers = stack.layers;
  TORCH_CHECK(!post_norms || residual_multiplier == 1.0, "decode_layers: a residual multiplier with post_norms");
  std::vector<bool> rotates(layers, true);
  for (const int64_t i : unrotated) {
    TORCH_CHECK(i >= 0 && i < layers, "decode_layers: unrotated layer ", i, " is not one of the ", layers, " layers");
    rotates[i] = false;
  }
  const at::Tensor no_cos = cos.narrow(1, 0, 0), no_sin = sin.narrow(1, 0, 0);
  const char* kind = post_norms ? "once" : "llama";
  // {hidden, the next sublayer's input}: its norm before it, or (post_norms) hidden itself
  std::vector<at::Tensor> state =
      post_norms ? std::vector<at::Tensor>{hidden_in, hidden_in} : add_rms_norm(hidden_in, c10::nullopt, norms[0], eps);
  auto post_add = [&](const at::Tensor& out, const at::Tensor& weight) {
    auto hidden = post_norm_add(out, weight, eps, kind, state[0]);
    return std::vector<at::Tensor>{hidden, hidden};
  };
  for (int64_t i = 0; i < layers; ++i) {
    auto attended = stack.attend(state[1], i, rotates[i] ? cos : no_cos, rotates[i] ? sin : no_sin, lengths, heads,
                                 scale, shared_from, shared, eps, kind, 0, 0.0);
    state = post_norms ? post_add(stack.linear(attended, i, 1), norms[2 * i])
                       : add_rms_norm(state[0], stack.linear(attended, i, 1), norms[2 * i + 1], eps, residual_multiplier);
    auto gate_up = stack.linear(state[1], i, 2);
    const int64_t inter = gate_up.size(1) / 2;
    auto act = silu_mul(gate_up.narrow(1, 0, inter), gate_up.narrow(1, inter, inter));
    state = post_norms ? post_add(stack.linear(act, i, 3), norms[2 * i + 1])
                       : add_rms_norm(state[0], stack.linear(act, i, 3),
                                      norms[i + 1 < layers ? 2 * (i + 1) : 2 * layers], eps, residual_multiplier);
  }
  return post_norms ? post_norm_add(state[0], norms[2 * layers], eps, kind, c10::nullopt) : state[1];
}

// Every layer of a Gemma 3 or Gemma 2 decoder for one decoding step (gemma_decode.py's GemmaDecoder), the
// calls its Python loop makes in its order: per layer the stacked q/k/v product, rope_attend (Gemma 3's
// zero-centred norms of q's and k's heads where `head_norms` has them; the layer's kind's cos and sin,
// `cos[kinds[i]]`; its `windows[i]`; the scores' `softcap`, Gemma 2's), o's product, add_zero_centred_norms
// (post-attention norm, residual add, pre-feedforward norm), the gate/up product, GELU (tanh) * up, down's
// product, add_zero_centred_norms (post-feedforward norm, residual add, the next layer's input norm or the
// final one). `weights`/`extras` as decode_layers'; `norms`: each layer's input, post-attention,
// pre-feedforward and post-feedforward norm weights in turn, then the final one; `hidden` the scaled
// embedding [rows, dim]; returns the final norm's output.
at::Tensor decode_gemma_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& lengths, at::TensorList weights,
                               const c10::List<c10::optional<at::Tensor>>& extras, at::TensorList norms,
                               at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef qkv_sizes,
                               int64_t heads, double scale, double eps, at::TensorList head_norms,
                               at::IntArrayRef kinds, at::IntArrayRef windows, double softcap,
                               const c10::optional<at::Tensor>& shared_from, const c10::optional<at::Tensor>& shared) {
  const StackedLayers stack("decode_gemma_layers", weights, extras, norms, 4, k_caches, v_caches, head_norms,
                            qkv_sizes);
  const int64_t layers = stack.layers;
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == layers && static_cast<int64_t>(windows.size()) == layers,
              "decode_gemma_layers: a kind and a window a layer for ", layers, " layers; got ", kinds.size(),
              " kinds, ", windows.size(), " windows");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes(),
              "decode_gemma_layers: cos and sin must be [kinds, rows, dims] alike, got ", cos.sizes(), " and ",
              sin.sizes());
  for (int64_t i = 0; i < layers; ++i)
    TORCH_CHECK(kinds[i] >= 0 && kinds[i] < cos.size(0), "decode_gemma_layers: layer ", i, "'s kind ", kinds[i],
                " is not one of cos's ", cos.size(0));
  at::Tensor hidden = hidden_in, x = zero_centred_rms_norm(hidden_in, norms[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    auto attended = stack.attend(x, i, cos[kinds[i]], sin[kinds[i]], lengths, heads, scale, shared_from, shared, eps,
                                 "zero_centred", windows[i], softcap);
    auto state = add_zero_centred_norms(hidden, stack.linear(attended, i, 1), norms[4 * i + 1], norms[4 * i + 2], eps);
    auto gate_up = stack.linear(state[1], i, 2);
    const int64_t inter = gate_up.size(1) / 2;
    auto act = gelu_tanh_mul(gate_up.narrow(1, 0, inter), gate_up.narrow(1, inter, inter));
    state = add_zero_centred_norms(state[0], stack.linear(act, i, 3), norms[4 * i + 3], norms[4 * (i + 1)], eps);
    hidden = state[0], x = state[1];
  }
  return x;
}

}  // namespace grpo_native
