// grpo's CPU kernels beside the matmuls (loaded by grpo/models/native_kernels.py), one file a job:
//
// - layers.cpp: the trainer's RMSNorms, SiLU * up and rotary embeddings, forward and backward, and its
//   loss head (native_layers.py): one pass over memory each where autograd takes several; the
//   sampler's residual add + RMSNorm (or a sublayer's norm + the residual add: OLMo2's) and SiLU * up
//   (GELU * up for Gemma); Gemma 2's cap on the logits (in the loss head, and soft_cap_ for the sampler's);
// - decode_attention.cpp: a decoding step's attention, the new keys and values rotated into the
//   caches (rope_attend), and over the caches a model's own forward keeps (cached_attend);
// - decode_layers.cpp: a decoding step's layers in one call (native_decode.py): at a decoding
//   step's few rows each of PyTorch's small operators (an RMSNorm is eight of them, the rotary
//   embedding ten, the KV-cache writes and grouped-query attention a dozen more) costs more in
//   dispatch and passes over memory than in arithmetic;
// - stream_linear.cpp: a product by a float32 or bf16 weight in a streaming layout, for the
//   sampler's few rows; weight_pool.cpp: the memory those weights are packed in;
// - packed_attention.cpp: the trainer's attention over packed sequences, forward and backward
//   (packed_attention.py): each sequence's queries over its own keys, no padding, where SDPA took
//   padded blocks gathered per call;
// - delta_rule.cpp: a decoding step of the gated delta rule (Qwen3.5's linear-attention layers,
//   delta_rule.py): each row's recurrent state updated in place, where PyTorch's operators write
//   four state-sized temporaries; and the short convolution's step before it;
// - chunked_delta_rule.cpp: the gated delta rule over a sequence, forward and backward (a prefill's and a
//   training pass's, delta_rule.py): each head's chunks in a core's cache, where transformers' reference
//   runs ~40 operators over every head at once forward and autograd ~80 backward;
// - short_conv.cpp: the short causal convolution before it over a sequence, SiLU fused in, forward and
//   backward: the channels read where they lie, where PyTorch pads, convolves, activates and rounds in
//   passes of their own;
// - zero_centred_norms.cpp: the RMSNorm that scales by 1 + weight (Qwen3.5's, Qwen3-Next's, Gemma's) and
//   Qwen3.5's gated norm, forward and backward, for the trainer and the sampler's copy (native_layers.py),
//   and Gemma 3's norm-add-norm between sublayers for its decoding step (gemma_decode.py);
// - sample_tokens.cpp: the sampler's token choice (sampler.py): one pass over a row's logits (float32, or bf16 widened as read) where
//   PyTorch takes five;
// - register.cpp: the operators' schemas, registered as torch.ops.grpo_native.
//
// Shared by them: common.h (conversions, rounding, a vectorizable exp, checks) and simd.h (vector
// registers of floats). In float32 or bfloat16, rounding to the tensor's dtype wherever the eager
// operators do, so that they compute what transformers' Llama layers compute up to the order of
// float sums. Built once per machine by torch.utils.cpp_extension, with -ffp-contract=off: the
// compiler fuses no multiply and add of its own (the kernels' fused multiply-adds are written out),
// so a kernel's bits do not depend on what it inlines where (within a file or across them).
#pragma once

#include "common.h"

namespace grpo_native {

// layers.cpp
std::vector<at::Tensor> add_rms_norm(const at::Tensor& residual, const c10::optional<at::Tensor>& x,
                                     const at::Tensor& weight, double eps, double multiplier = 1.0);
at::Tensor post_norm_add(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view norms,
                         const c10::optional<at::Tensor>& residual);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up);
std::vector<at::Tensor> gelu_tanh_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                               const at::Tensor& up);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, bool backward);
std::vector<at::Tensor> target_logprobs(at::Tensor& logits, const at::Tensor& targets, double softcap);
at::Tensor target_logprobs_backward_(const at::Tensor& grad, at::Tensor& logits, const at::Tensor& targets,
                                     const at::Tensor& stats, double softcap);
at::Tensor soft_cap_(at::Tensor& logits, double softcap);

// sample_tokens.cpp
std::vector<at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& temperatures,
                                      const at::Tensor& uniforms);

// decode_attention.cpp
at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lengths,
                       int64_t heads, double scale, const c10::optional<at::Tensor>& shared_from,
                       const c10::optional<at::Tensor>& shared, bool dot, const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, double norm_eps, c10::string_view norms,
                       int64_t window, double softcap);
at::Tensor cached_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale);

// weight_pool.cpp: an empty tensor for a packed weight (in the 2 MiB-page chunks where they are
// had), and the chunks kept for the next pack given back
at::Tensor weight_empty(at::IntArrayRef sizes, const at::TensorOptions& options);
int64_t release_kept_chunks();

// stream_linear.cpp
at::Tensor stream_pack(const at::Tensor& weight, bool pairs);
bool stream_dot_available();
bool stream_pairs(const at::Tensor& packed);  // a packed weight in k-pairs for the dot-product kernel
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b);

// decode_layers.cpp
at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& lengths, at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& extras, at::TensorList norms,
                         at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef qkv_sizes,
                         int64_t heads, double scale, double eps, at::TensorList head_norms,
                         const c10::optional<at::Tensor>& shared_from, const c10::optional<at::Tensor>& shared,
                         bool post_norms, double residual_multiplier, at::IntArrayRef unrotated);
at::Tensor decode_gemma_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& lengths, at::TensorList weights,
                               const c10::List<c10::optional<at::Tensor>>& extras, at::TensorList norms,
                               at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef qkv_sizes,
                               int64_t heads, double scale, double eps, at::TensorList head_norms,
                               at::IntArrayRef kinds, at::IntArrayRef windows, double softcap,
                               const c10::optional<at::Tensor>& shared_from, const c10::optional<at::Tensor>& shared);

// delta_rule.cpp
at::Tensor gated_delta_step_(at::Tensor& state, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta);
at::Tensor causal_conv_step_(at::Tensor& state, const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, bool silu);

// chunked_delta_rule.cpp
std::vector<at::Tensor> chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta,
                                         const c10::optional<at::Tensor>& initial_state, int64_t chunk,
                                         bool final_state, bool l2norm, const c10::optional<at::Tensor>& segments);
std::vector<at::Tensor> chunk_delta_rule_backward(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final,
                                                  const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta,
                                                  const c10::optional<at::Tensor>& initial_state, int64_t chunk,
                                                  bool l2norm, const c10::optional<at::Tensor>& segments);
bool chunk_delta_rule_blas(bool on);  // products through BLAS (where linked) or the loops; returns which

// short_conv.cpp
at::Tensor short_conv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool silu);
std::vector<at::Tensor> short_conv_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& bias, bool silu, bool weight_grads);

// zero_centred_norms.cpp
at::Tensor zero_centred_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_zero_centred_norms(const at::Tensor& residual, const at::Tensor& x,
                                               const at::Tensor& post_weight, const at::Tensor& pre_weight, double eps);
at::Tensor zero_centred_rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                          double eps);
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps);
std::vector<at::Tensor> gated_rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& gate,
                                                const at::Tensor& weight, double eps);

// packed_attention.cpp
std::vector<at::Tensor> packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& seqs, const at::Tensor& key_rows, int64_t heads,
                                         int64_t kv_heads, double scale, bool dot, int64_t window, double softcap,
                                         const c10::optional<at::Tensor>& sinks);
std::vector<at::Tensor> packed_attention_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                  const at::Tensor& seqs, const at::Tensor& key_rows, int64_t heads,
                                                  int64_t kv_heads, double scale, bool dot, int64_t window,
                                                  double softcap);

}  // namespace grpo_native
