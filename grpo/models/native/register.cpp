// The operators' schemas (torch.ops.grpo_native) and their CPU kernels; what each does: ops.h.

#include "ops.h"

#include <torch/library.h>

TORCH_LIBRARY(grpo_native, m) {
  m.def("add_rms_norm(Tensor residual, Tensor? x, Tensor weight, float eps, float multiplier=1.0) -> Tensor[]");
  m.def("post_norm_add(Tensor x, Tensor weight, float eps, str norms, Tensor? residual=None) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> Tensor[]");
  m.def("gelu_tanh_mul_backward(Tensor grad, Tensor gate, Tensor up) -> Tensor[]");
  m.def("sample_tokens(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor[]");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int heads, bool backward) -> Tensor");
  // (with softcap > 0, target_logprobs caps the logits in place: its backward reads them capped)
  m.def("target_logprobs(Tensor(a!) logits, Tensor targets, float softcap=0.0) -> Tensor[]");
  m.def("target_logprobs_backward_(Tensor grad, Tensor(a!) logits, Tensor targets, Tensor stats, float softcap=0.0) "
        "-> Tensor(a!)");
  m.def("soft_cap_(Tensor(a!) logits, float softcap) -> Tensor(a!)");
  m.def("rope_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor lengths, int heads, float scale, Tensor? shared_from=None, Tensor? shared=None, bool dot=False, "
        "Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=0.0, str norms=\"llama\", int window=0, "
        "float softcap=0.0) -> Tensor");
  m.def("cached_attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("stream_pack(Tensor weight, bool pairs=False) -> Tensor");
  m.def("stream_dot_available() -> bool", grpo_native::stream_dot_available);
  m.def("release_kept_chunks() -> int", grpo_native::release_kept_chunks);  // (no tensor to dispatch on: one kernel)
  m.def("stream_linear(Tensor x, Tensor packed, Tensor? bias, Tensor? lora_a=None, Tensor? lora_b=None) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor lengths, Tensor[] weights, Tensor?[] extras, "
        "Tensor[] norms, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] qkv_sizes, int heads, float scale, "
        "float eps, Tensor[] head_norms, Tensor? shared_from=None, Tensor? shared=None, bool post_norms=False, "
        "float residual_multiplier=1.0, int[] unrotated=[]) -> Tensor");
  m.def("decode_gemma_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor lengths, Tensor[] weights, Tensor?[] extras, "
        "Tensor[] norms, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] qkv_sizes, int heads, float scale, "
        "float eps, Tensor[] head_norms, int[] kinds, int[] windows, float softcap, Tensor? shared_from=None, "
        "Tensor? shared=None) -> Tensor");
  m.def("gated_delta_step_(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor");
  m.def("causal_conv_step_(Tensor(a!) state, Tensor x, Tensor weight, Tensor? bias, bool silu) -> Tensor");
  m.def("chunk_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, int chunk, "
        "bool final_state, bool l2norm, Tensor? segments=None) -> Tensor[]");
  m.def("chunk_delta_rule_backward(Tensor grad_out, Tensor? grad_final, Tensor q, Tensor k, Tensor v, Tensor g, "
        "Tensor beta, Tensor? initial_state, int chunk, bool l2norm, Tensor? segments=None) -> Tensor[]");
  m.def("chunk_delta_rule_blas(bool on) -> bool", grpo_native::chunk_delta_rule_blas);  // (no tensor: one kernel)
  m.def("short_conv(Tensor x, Tensor weight, Tensor? bias, bool silu) -> Tensor");
  m.def("short_conv_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, bool silu, bool weight_grads) "
        "-> Tensor[]");
  m.def("zero_centred_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_zero_centred_norms(Tensor residual, Tensor x, Tensor post_weight, Tensor pre_weight, float eps) "
        "-> Tensor[]");
  m.def("zero_centred_rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
  m.def("gated_rms_norm_backward(Tensor grad, Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor[]");
  m.def("packed_attention(Tensor q, Tensor k, Tensor v, Tensor seqs, Tensor key_rows, int heads, int kv_heads, "
        "float scale, bool dot=False, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor[]");
  m.def("packed_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor seqs, "
        "Tensor key_rows, int heads, int kv_heads, float scale, bool dot=False, int window=0, float softcap=0.0) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(grpo_native, CPU, m) {
  m.impl("add_rms_norm", grpo_native::add_rms_norm);
  m.impl("post_norm_add", grpo_native::post_norm_add);
  m.impl("silu_mul", grpo_native::silu_mul);
  m.impl("gelu_tanh_mul", grpo_native::gelu_tanh_mul);
  m.impl("rms_norm_backward", grpo_native::rms_norm_backward);
  m.impl("silu_mul_backward", grpo_native::silu_mul_backward);
  m.impl("gelu_tanh_mul_backward", grpo_native::gelu_tanh_mul_backward);
  m.impl("sample_tokens", grpo_native::sample_tokens);
  m.impl("rope", grpo_native::rope);
  m.impl("target_logprobs", grpo_native::target_logprobs);
  m.impl("target_logprobs_backward_", grpo_native::target_logprobs_backward_);
  m.impl("soft_cap_", grpo_native::soft_cap_);
  m.impl("rope_attend", grpo_native::rope_attend);
  m.impl("cached_attend", grpo_native::cached_attend);
  m.impl("decode_layers", grpo_native::decode_layers);
  m.impl("decode_gemma_layers", grpo_native::decode_gemma_layers);
  m.impl("stream_pack", grpo_native::stream_pack);
  m.impl("stream_linear", grpo_native::stream_linear);
  m.impl("gated_delta_step_", grpo_native::gated_delta_step_);
  m.impl("causal_conv_step_", grpo_native::causal_conv_step_);
  m.impl("chunk_delta_rule", grpo_native::chunk_delta_rule);
  m.impl("chunk_delta_rule_backward", grpo_native::chunk_delta_rule_backward);
  m.impl("short_conv", grpo_native::short_conv);
  m.impl("short_conv_backward", grpo_native::short_conv_backward);
  m.impl("zero_centred_rms_norm", grpo_native::zero_centred_rms_norm);
  m.impl("add_zero_centred_norms", grpo_native::add_zero_centred_norms);
  m.impl("zero_centred_rms_norm_backward", grpo_native::zero_centred_rms_norm_backward);
  m.impl("gated_rms_norm", grpo_native::gated_rms_norm);
  m.impl("gated_rms_norm_backward", grpo_native::gated_rms_norm_backward);
  m.impl("packed_attention", grpo_native::packed_attention);
  m.impl("packed_attention_backward", grpo_native::packed_attention_backward);
}

// decode_layers takes oneDNN's packed weights (opaque tensors of the MkldnnCPU backend, which the
// dispatcher then picks for the call) or streaming ones (plain CPU tensors)
TORCH_LIBRARY_IMPL(grpo_native, MkldnnCPU, m) {
  m.impl("decode_layers", grpo_native::decode_layers);
  m.impl("decode_gemma_layers", grpo_native::decode_gemma_layers);
}
