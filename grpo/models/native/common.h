// What every file of grpo's native kernels uses: float32 / bf16 conversions, the rounding to a
// tensor's dtype, a vectorizable exp, row checks and scratch. (The kernels: ops.h.)
#pragma once

// (ATen's per-operator headers, not ATen/ATen.h: each file of the kernels compiles in half the time)
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>


namespace grpo_native {

// float32 or bfloat16: the sampler's two precisions
#define DISPATCH_SAMPLER_TYPES(TYPE, NAME, ...)                                                  \
  [&] {                                                                                           \
    if ((TYPE) == at::kFloat) {                                                                   \
      using scalar_t = float;                                                                     \
      return __VA_ARGS__();                                                                       \
    }                                                                                             \
    TORCH_CHECK((TYPE) == at::kBFloat16, NAME, ": float32 or bfloat16 tensors only, got ", TYPE); \
    using scalar_t = c10::BFloat16;                                                               \
    return __VA_ARGS__();                                                                         \
  }()

// a value of T as a float (bf16: the high half of a float's bits, a shift that vectorizes)
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }
// n values of T as floats
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // bit_cast, not a uint32_t* over dst: stores through another type's pointer may be reordered
  // past the float loads that follow (strict aliasing), which broke bf16 once loops were unrolled
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}
// floats rounded to T, as T's own conversion rounds (to nearest even)
inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
// a float's bf16 bits, rounded to nearest even as c10::BFloat16(float) rounds (NaN: its quiet NaN),
// without its isnan call: a loop of these vectorizes
inline uint16_t bf16_bits(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint16_t rounded = static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16);
  return v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}
inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(src[i]);
}
// n values of T as floats without a copy where they are floats already (else widened into buf)
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const c10::BFloat16* src, float* buf, int64_t n) {
  to_float(src, buf, n);
  return buf;
}
// a float rounded to T and back: where an eager operator's result would be stored in T
template <typename T> inline float in_dtype(float v) { return static_cast<float>(static_cast<T>(v)); }
template <> inline float in_dtype<c10::BFloat16>(float v) {
  return std::bit_cast<float>(static_cast<uint32_t>(bf16_bits(v)) << 16);
}

// 1 / sqrt(mean(x^2) + eps) of a row of floats: an RMSNorm's scale
inline float inverse_rms(const float* x, int64_t dim, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

// The RMSNorms of a decoding step, by where they round (each rounding where the model's eager norm stores
// its dtype):
// - llama: T(w T(h r)) -- Llama's, Mistral's, Qwen2/3's (also each head of Qwen3's q and k);
// - zero_centred: T(h r (1 + w)) -- Gemma's, Qwen3.5's;
// - once: T(w h r), the weight times the float32 norm, rounded once -- OLMo2's (T5's norm).
enum class NormKind { llama, zero_centred, once };

// `name` ("llama", "zero_centred", "once") as a NormKind; anything else refused, naming the valid ones
inline NormKind norm_kind(c10::string_view name, const char* op) {
  if (name == "llama") return NormKind::llama;
  if (name == "zero_centred") return NormKind::zero_centred;
  TORCH_CHECK(name == "once", op, ": norms must be 'llama', 'zero_centred' or 'once', got '", std::string(name), "'");
  return NormKind::once;
}

// y = the norm `kind` of the row h by the weight w, given its scale r = 1 / sqrt(mean(h^2) + eps) (a row's
// own, or that of a wider row it is part of: OLMo2 normalises all of q's heads together); y may be h. The
// one place every kernel computes a norm of each kind (the sampler's adds, rope_attend's norms of q and k,
// the trainer's): the same bits wherever it is taken.
template <typename T>
inline void norm_row_scaled(const float* h, const float* w, float* y, int64_t dim, float r, NormKind kind) {
  if (kind == NormKind::llama) {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) y[i] = in_dtype<T>(w[i] * in_dtype<T>(h[i] * r));
  } else if (kind == NormKind::zero_centred) {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) y[i] = in_dtype<T>(h[i] * r * (1.f + w[i]));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) y[i] = in_dtype<T>(w[i] * (h[i] * r));
  }
}

// y = an RMSNorm of the row h by the weight w (both T's values as floats; y may be h), rounded where
// transformers' RMSNorm stores T: T(w * T(h * rsqrt(mean(h^2) + eps))) (float32: no rounding)
template <typename T>
inline void rms_norm_row(const float* h, const float* w, float* y, int64_t dim, float eps) {
  norm_row_scaled<T>(h, w, y, dim, inverse_rms(h, dim, eps), NormKind::llama);
}

// The zero-centred RMSNorm of one row (Gemma's, Qwen3.5's): y = T(h r (1 + w)), rounded once
template <typename T>
inline void zero_centred_row(const float* h, const float* w, float* y, int64_t dim, float eps) {
  norm_row_scaled<T>(h, w, y, dim, inverse_rms(h, dim, eps), NormKind::zero_centred);
}

// exp(x) in a form the compiler vectorizes (libm's expf is a call per value): 2^n * exp(r) with
// |r| <= ln(2)/2, Cephes' polynomial for exp(r), within ~2 float ulps of expf. Large arguments are
// clamped below expf's overflow, NaN passes through.
inline float vexp(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  // n = the nearest integer, by the 1.5 * 2^23 trick (floor would be a call per value)
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x != x ? x : y * scale;
}

inline float sigmoid(float x) { return 1.f / (1.f + vexp(-x)); }

// tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)) through vexp, so that a loop of it vectorizes (libm's is a call
// per value): within ~1e-7 of tanhf absolutely, which is what a soft-cap (cap * tanh(s / cap)) adds to a score
inline float vtanh(float x) {
  const float t = 1.f - 2.f / (vexp(2.f * std::fabs(x)) + 1.f);
  return x < 0.f ? -t : t;
}

// `what`, then `operand` (a kernel's name, then which of its inputs: ": gate"), name the tensor in the
// message, which is put together only where a check fails
inline void check_rows(const at::Tensor& t, int64_t rows, int64_t width, const char* what, const char* operand = "") {
  TORCH_CHECK(t.device().is_cpu(), what, operand, ": a CPU tensor is expected");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width && t.stride(1) == 1, what, operand,
              ": expected [", rows, ", ", width, "] with contiguous rows, got ", t.sizes(), " strides ", t.strides());
}

// check_rows, for a kernel that steps from row to row by the width: the rows back to back
inline void check_dense_rows(const at::Tensor& t, int64_t rows, int64_t width, const char* what) {
  check_rows(t, rows, width, what);
  TORCH_CHECK(rows < 2 || t.stride(0) == width, what, ": expected rows back to back (row stride ", width,
              "), got strides ", t.strides());
}

// n floats of scratch, kept per thread across calls: a vocabulary's floats (196 KB for 49k tokens)
// are past malloc's mmap threshold, and fresh pages every call cost more than a pass over them
inline float* row_buffer(int64_t n) {
  thread_local std::vector<float> buffer;
  buffer.resize(n);
  return buffer.data();
}

// the largest of n floats (a ternary: std::max in an omp simd max-reduction stays unvectorized,
// 8x slower on a 49k row)
inline float row_max(const float* x, int64_t n) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = top > x[i] ? top : x[i];
  return top;
}

// T(T(x * cos) + T(rotate_half(x) * sin)) of one head of dim floats, each product and the sum rounded
// to T as transformers' apply_rotary_pos_emb stores them
template <typename T>
inline void rotate(const float* x, const float* c, const float* s, float* y, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) y[i] = in_dtype<T>(in_dtype<T>(x[i] * c[i]) + in_dtype<T>(-x[i + half] * s[i]));
#pragma omp simd
  for (int64_t i = half; i < dim; ++i)
    y[i] = in_dtype<T>(in_dtype<T>(x[i] * c[i]) + in_dtype<T>(x[i - half] * s[i]));
}

// A head's rotary embedding where only its first `rotary` of dim values rotate (Phi-4-mini's partial
// rotary: cos and sin are `rotary` wide; the rest pass through), by the rotate_half convention; each
// product and the sum rounded to T where cos and sin are T's values (`round_each`: Llama's, Phi-3's), or
// the float32 sum rounded once where the model's cos and sin are float32 (OLMo2's)
template <typename T>
inline void rotate_part(const float* x, const float* c, const float* s, float* y, int64_t dim, int64_t rotary,
                        bool round_each) {
  if (round_each && rotary == dim) return rotate<T>(x, c, s, y, dim);
  const int64_t half = rotary / 2;
  if (round_each) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) y[i] = in_dtype<T>(in_dtype<T>(x[i] * c[i]) + in_dtype<T>(-x[i + half] * s[i]));
#pragma omp simd
    for (int64_t i = half; i < rotary; ++i)
      y[i] = in_dtype<T>(in_dtype<T>(x[i] * c[i]) + in_dtype<T>(x[i - half] * s[i]));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) y[i] = in_dtype<T>(x[i] * c[i] + -x[i + half] * s[i]);
#pragma omp simd
    for (int64_t i = half; i < rotary; ++i) y[i] = in_dtype<T>(x[i] * c[i] + x[i - half] * s[i]);
  }
  for (int64_t i = rotary; i < dim; ++i) y[i] = x[i];
}

}  // namespace grpo_native
