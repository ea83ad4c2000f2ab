// grpo's CPU kernels beside the matmuls (loaded by grpo/models/native_kernels.py):
//
// - the sampler's decoding step (native_decode.py): at a decoding step's few rows each of
//   PyTorch's small operators (an RMSNorm is eight of them, the rotary embedding ten, the KV-cache
//   writes and grouped-query attention a dozen more) costs more in dispatch and passes over memory
//   than in arithmetic; these do a layer's non-matmul work in four calls;
// - the trainer's RMSNorms, SiLU * up and rotary embeddings, forward and backward, and its loss head
//   (native_layers.py): one pass over memory each where autograd takes several;
// - the trainer's attention over packed sequences, forward and backward (packed_attention.py): each
//   sequence's queries over its own keys, no padding, where SDPA took padded blocks gathered per call;
// - the sampler's token choice (sampler.py): one pass over a row's logits where PyTorch takes five;
// - a product by a float32 or bf16 weight in a streaming layout (stream_linear), for the sampler's few
//   rows.
//
// In float32 or bfloat16, rounding to the tensor's dtype wherever the eager operators do, so that
// they compute what transformers' Llama layers compute up to the order of float sums. Built once
// per machine by torch.utils.cpp_extension; registered as torch.ops.grpo_native.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

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

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

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

// n values of T as floats (bf16: the high half of a float's bits, a shift that vectorizes)
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // bit_cast, not a uint32_t* over dst: stores through another type's pointer may be reordered
  // past the float loads that follow (strict aliasing), which broke bf16 once loops were unrolled
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i].x) << 16);
}
// floats rounded to T, as T's own conversion rounds (to nearest even)
inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
// n values of T as floats without a copy where they are floats already (else widened into buf)
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const c10::BFloat16* src, float* buf, int64_t n) {
  to_float(src, buf, n);
  return buf;
}
// a float rounded to T and back: where an eager operator's result would be stored in T
template <typename T> inline float in_dtype(float v) { return static_cast<float>(static_cast<T>(v)); }

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

void check_rows(const at::Tensor& t, int64_t rows, int64_t width, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": a CPU tensor is expected");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width && t.stride(1) == 1, what,
              ": expected [", rows, ", ", width, "] with contiguous rows, got ", t.sizes(), " strides ", t.strides());
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

// hidden = residual + x (rounded to T), then out = weight * T(hidden * rsqrt(mean(hidden^2) + eps)):
// the residual add before transformers' LlamaRMSNorm, and the norm itself.
template <typename T>
void add_rms_norm_impl(const T* res, int64_t res_stride, const T* x, int64_t x_stride, const T* weight, T* hidden,
                       T* out, int64_t rows, int64_t dim, float eps) {
  if constexpr (std::is_same_v<T, float>) {  // in place, no copies of rows (as silu_mul's)
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* h = res + r * res_stride;
        if (x != nullptr) {
          float* sum_row = hidden + r * dim;
          const float* xr = x + r * x_stride;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) sum_row[i] = h[i] + xr[i];
          h = sum_row;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) sum += h[i] * h[i];
        const float scale = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
        float* o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (h[i] * scale);
      }
    });
    return;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), w(dim), y(dim), xs(dim);
    to_float(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(res + r * res_stride, h.data(), dim);
      if (x != nullptr) {
        to_float(x + r * x_stride, xs.data(), dim);
        for (int64_t i = 0; i < dim; ++i) h[i] = in_dtype<T>(h[i] + xs[i]);
        from_float(h.data(), hidden + r * dim, dim);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += h[i] * h[i];
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) y[i] = w[i] * in_dtype<T>(h[i] * scale);
      from_float(y.data(), out + r * dim, dim);
    }
  });
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& residual, const c10::optional<at::Tensor>& x,
                                     const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2, "add_rms_norm: residual must be [rows, dim], got ", residual.sizes());
  const int64_t rows = residual.size(0), dim = residual.size(1);
  check_rows(residual, rows, dim, "add_rms_norm: residual");
  if (x.has_value()) {
    check_rows(*x, rows, dim, "add_rms_norm: x");
    TORCH_CHECK(x->scalar_type() == residual.scalar_type(), "add_rms_norm: x and residual differ in dtype");
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous() &&
                  weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: weight must be a contiguous [", dim, "] of the residual's dtype");
  auto out = at::empty({rows, dim}, residual.options());
  auto hidden = x.has_value() ? at::empty({rows, dim}, residual.options()) : residual;
  DISPATCH_SAMPLER_TYPES(residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(residual.data_ptr<scalar_t>(), residual.stride(0),
                                x.has_value() ? x->data_ptr<scalar_t>() : nullptr, x.has_value() ? x->stride(0) : 0,
                                weight.data_ptr<scalar_t>(), hidden.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                rows, dim, static_cast<float>(eps));
  });
  return {hidden, out};
}

// T(silu(gate)) * up, rounded to T: the Llama MLP's activation and product
template <typename T>
void silu_mul_impl(const T* gate, int64_t gate_stride, const T* up, int64_t up_stride, T* out, int64_t rows,
                   int64_t width) {
  if constexpr (std::is_same_v<T, float>) {  // one pass, no copies: 0.7x the time at [32, 1536]
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gp = gate + r * gate_stride;
        const float* upp = up + r * up_stride;
        float* op = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) op[i] = gp[i] / (1.f + vexp(-gp[i])) * upp[i];
      }
    });
    return;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g(width), u(width);
    for (int64_t r = begin; r < end; ++r) {
      to_float(gate + r * gate_stride, g.data(), width);
      to_float(up + r * up_stride, u.data(), width);
      float* gp = g.data();
      const float* upp = u.data();
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) gp[i] = gp[i] / (1.f + vexp(-gp[i]));
      for (int64_t i = 0; i < width; ++i) gp[i] = in_dtype<T>(gp[i]) * upp[i];
      from_float(gp, out + r * width, width);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2, "silu_mul: gate must be [rows, width], got ", gate.sizes());
  const int64_t rows = gate.size(0), width = gate.size(1);
  check_rows(gate, rows, width, "silu_mul: gate");
  check_rows(up, rows, width, "silu_mul: up");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "silu_mul: gate and up differ in dtype");
  auto out = at::empty({rows, width}, gate.options());
  DISPATCH_SAMPLER_TYPES(gate.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate.data_ptr<scalar_t>(), gate.stride(0), up.data_ptr<scalar_t>(), up.stride(0),
                            out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}

// The input gradient of weight * T(x * rsqrt(mean(x^2) + eps)) with the weight frozen (LoRA
// trains none of a model's norms): what autograd computes through transformers' RMSNorm, in one
// pass. The product grad * weight is rounded to T where the eager backward stores it in T.
template <typename T>
void rms_norm_backward_impl(const T* grad, const T* x, const T* weight, T* dx, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), w(dim), g(dim);
    to_float(weight, w.data(), dim);
    float* hp = h.data();
    float* gp = g.data();
    const float* wp = w.data();
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * dim, hp, dim);
      to_float(grad + r * dim, gp, dim);
      float sum = 0.f, dot = 0.f;
#pragma omp simd reduction(+ : sum, dot)
      for (int64_t i = 0; i < dim; ++i) {
        gp[i] = in_dtype<T>(gp[i] * wp[i]);
        sum += hp[i] * hp[i];
        dot += gp[i] * hp[i];
      }
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      const float c = scale * scale * scale * dot / static_cast<float>(dim);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) gp[i] = gp[i] * scale - c * hp[i];
      from_float(gp, dx + r * dim, dim);
    }
  });
}

at::Tensor rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2, "rms_norm_backward: x must be [rows, dim], got ", x.sizes());
  const int64_t rows = x.size(0), dim = x.size(1);
  TORCH_CHECK(x.is_contiguous() && grad.is_contiguous() && grad.sizes() == x.sizes(),
              "rms_norm_backward: grad and x must be contiguous [", rows, ", ", dim, "], got ", grad.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(),
              "rms_norm_backward: weight must be a contiguous [", dim, "]");
  TORCH_CHECK(grad.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm_backward: grad, x and weight must share one dtype");
  auto dx = at::empty_like(x);
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
    rms_norm_backward_impl<scalar_t>(grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                     dx.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return dx;
}

// The gradients of T(silu(gate)) * up for gate and up, as autograd computes them through the Llama
// MLP's activation and product: d_up = grad * T(silu(gate)), d_gate = silu'(gate) * T(grad * up).
template <typename T>
void silu_mul_backward_impl(const T* grad, const T* gate, const T* up, T* d_gate, T* d_up, int64_t rows,
                            int64_t width) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> g(width), a(width), u(width);
    float* gp = g.data();
    float* ap = a.data();
    float* upp = u.data();
    for (int64_t r = begin; r < end; ++r) {
      to_float(grad + r * width, gp, width);
      to_float(gate + r * width, ap, width);
      to_float(up + r * width, upp, width);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float x = ap[i];
        const float s = 1.f / (1.f + vexp(-x));
        const float d_act = in_dtype<T>(gp[i] * upp[i]);
        upp[i] = gp[i] * in_dtype<T>(x * s);
        ap[i] = d_act * (s * (1.f + x * (1.f - s)));
      }
      from_float(ap, d_gate + r * width, width);
      from_float(upp, d_up + r * width, width);
    }
  });
}

std::vector<at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2, "silu_mul_backward: gate must be [rows, width], got ", gate.sizes());
  TORCH_CHECK(grad.is_contiguous() && gate.is_contiguous() && up.is_contiguous() && grad.sizes() == gate.sizes() &&
                  up.sizes() == gate.sizes(),
              "silu_mul_backward: grad, gate and up must be contiguous and of one shape, got ", grad.sizes(), ", ",
              gate.sizes(), ", ", up.sizes());
  TORCH_CHECK(grad.scalar_type() == gate.scalar_type() && up.scalar_type() == gate.scalar_type(),
              "silu_mul_backward: grad, gate and up must share one dtype");
  auto d_gate = at::empty_like(gate), d_up = at::empty_like(up);
  DISPATCH_SAMPLER_TYPES(gate.scalar_type(), "silu_mul_backward", [&] {
    silu_mul_backward_impl<scalar_t>(grad.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(),
                                     d_gate.data_ptr<scalar_t>(), d_up.data_ptr<scalar_t>(), gate.size(0),
                                     gate.size(1));
  });
  return {d_gate, d_up};
}

// transformers' rotary embedding (rotate_half convention) of each head of each row, and its
// backward: forward y = T(T(x * cos) + T(rotate_half(x) * sin)), backward
// dx = T(T(g * cos) + rotate_half^T(T(g * sin))), each product and sum rounded to T where
// apply_rotary_pos_emb's operators and their autograd store them. x: [rows, heads * dim], cos and
// sin: [rows, dim].
template <typename T>
void rope_impl(const T* x, int64_t x_stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
               int64_t dim, bool backward) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), xf(dim), y(dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(cos + r * dim, c.data(), dim);
      to_float(sin + r * dim, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        to_float(x + r * x_stride + h * dim, xf.data(), dim);
        if (!backward) {
          rotate<T>(xf.data(), c.data(), s.data(), y.data(), dim);
        } else {
          for (int64_t i = 0; i < half; ++i)
            y[i] = in_dtype<T>(in_dtype<T>(xf[i] * c[i]) + in_dtype<T>(xf[i + half] * s[i + half]));
          for (int64_t i = half; i < dim; ++i)
            y[i] = in_dtype<T>(in_dtype<T>(xf[i] * c[i]) - in_dtype<T>(xf[i - half] * s[i - half]));
        }
        from_float(y.data(), out + (r * heads + h) * dim, dim);
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, bool backward) {
  TORCH_CHECK(x.dim() == 2 && heads > 0 && x.size(1) % heads == 0,
              "rope: x must be [rows, heads * dim] for ", heads, " heads, got ", x.sizes());
  const int64_t rows = x.size(0), dim = x.size(1) / heads;
  TORCH_CHECK(dim % 2 == 0, "rope: an even head dim is needed, got ", dim);
  check_rows(x, rows, heads * dim, "rope: x");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == at::IntArrayRef({rows, dim}) &&
                  sin.sizes() == cos.sizes(),
              "rope: cos and sin must be contiguous [", rows, ", ", dim, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: x, cos and sin must share one dtype");
  auto out = at::empty({rows, heads * dim}, x.options());
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "rope", [&] {
    rope_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), rows, heads, dim, backward);
  });
  return out;
}

// Each row's next token and its logprob under the untempered policy (log_softmax at the token), in
// one pass over the row's logits where the sampler's PyTorch operators take five (log_softmax,
// softmax, a float64 copy, its cumsum, searchsorted). temperatures[r] == 0 takes the argmax (the
// first of equal maxima, as torch.argmax); otherwise the token is drawn by inverting the CDF of
// softmax(logits / temperature) at uniforms[r], as sampler._draw does: the first index whose
// cumulative probability, summed in float64, exceeds u * total (kept below total), so that a token
// of probability 0 is never taken.
// The trainer's loss head, a row of logits at a time: log_softmax at each row's target, the row's
// entropy, and (max, log of the sum of exp(logit - max)) kept for the backward. Two reads of the
// row where autograd's float32 log_softmax, exp and entropy sweep it (and a bf16 model's float32
// copy of it) about eight times.
template <typename T>
void target_logprobs_impl(const T* base, const int64_t* tp, float* lp, float* ent, float* st, int64_t rows,
                          int64_t vocab) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* x = row_buffer(vocab);
    for (int64_t r = begin; r < end; ++r) {
      to_float(base + r * vocab, x, vocab);
      const float top = row_max(x, vocab);
      // summed in float64 across blocks of 512 (float in vector lanes inside one): the backward's
      // probabilities are exp(logit - max - log_total), and a loss whose coefficients cancel
      // across positions (a variance, DPO's pairs) reads their last bits
      double sum = 0.0, weighted = 0.0;
      for (int64_t start = 0; start < vocab; start += 512) {
        const int64_t stop = std::min(vocab, start + 512);
        float block_sum = 0.f, block_weighted = 0.f;
#pragma omp simd reduction(+ : block_sum, block_weighted)
        for (int64_t i = start; i < stop; ++i) {
          const float d = x[i] - top;
          const float e = d < -87.f ? 0.f : vexp(d);
          block_sum += e;
          block_weighted += d < -87.f ? 0.f : e * d;  // (an -inf logit: 0 * -inf would be NaN)
        }
        sum += block_sum;
        weighted += block_weighted;
      }
      const float log_total = static_cast<float>(std::log(sum));
      lp[r] = (x[tp[r]] - top) - log_total;
      ent[r] = static_cast<float>(std::log(sum) - weighted / sum);
      st[2 * r] = top;
      st[2 * r + 1] = log_total;
    }
  });
}

std::vector<at::Tensor> target_logprobs(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu() && logits.size(1) > 0,
              "target_logprobs: logits must be a contiguous CPU [rows, vocab], got ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == rows && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous(),
              "target_logprobs: targets must be a contiguous int64 [", rows, "], got ", targets.sizes());
  const int64_t* tp = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < vocab, "target_logprobs: row ", r, " targets token ", tp[r], " of ", vocab);
  auto options = logits.options().dtype(at::kFloat);
  auto logprobs = at::empty({rows}, options), entropy = at::empty({rows}, options);
  auto stats = at::empty({rows, 2}, options);
  float *lp = logprobs.data_ptr<float>(), *ent = entropy.data_ptr<float>(), *st = stats.data_ptr<float>();
  DISPATCH_SAMPLER_TYPES(logits.scalar_type(), "target_logprobs", [&] {
    target_logprobs_impl<scalar_t>(logits.data_ptr<scalar_t>(), tp, lp, ent, st, rows, vocab);
  });
  return {logprobs, entropy, stats};
}

// Its backward, written over the logits (no longer needed) in their dtype:
// d logprob[t] / d logits = onehot(t) - softmax(logits), times each row's incoming gradient.
template <typename T>
void target_logprobs_backward_impl(const float* gp, T* base, const int64_t* tp, const float* st, int64_t rows,
                                   int64_t vocab) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* x = row_buffer(vocab);
    for (int64_t r = begin; r < end; ++r) {
      to_float(base + r * vocab, x, vocab);
      // (logit - max) - log_total: max + log_total in one float would round at the max's scale
      const float top = st[2 * r], log_total = st[2 * r + 1], g = gp[r];
      const float target = x[tp[r]];
#pragma omp simd
      for (int64_t i = 0; i < vocab; ++i) {
        const float d = (x[i] - top) - log_total;
        x[i] = d < -87.f ? 0.f : -g * vexp(d);
      }
      // the target's own term: g * (1 - p), as one product (not -g * p + g: no cancellation)
      const float d = (target - top) - log_total;
      x[tp[r]] = g * (1.f - (d < -87.f ? 0.f : vexp(d)));
      from_float(x, base + r * vocab, vocab);
    }
  });
}

at::Tensor target_logprobs_backward_(const at::Tensor& grad, at::Tensor& logits, const at::Tensor& targets,
                                     const at::Tensor& stats) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(),
              "target_logprobs_backward_: logits must be a contiguous CPU [rows, vocab], got ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == rows && grad.scalar_type() == at::kFloat && grad.is_contiguous(),
              "target_logprobs_backward_: grad must be a contiguous float32 [", rows, "], got ", grad.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == rows && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous() && stats.sizes() == at::IntArrayRef({rows, 2}) &&
                  stats.scalar_type() == at::kFloat && stats.is_contiguous(),
              "target_logprobs_backward_: targets and stats must be target_logprobs' for these logits");
  const float *gp = grad.data_ptr<float>(), *st = stats.data_ptr<float>();
  const int64_t* tp = targets.data_ptr<int64_t>();
  DISPATCH_SAMPLER_TYPES(logits.scalar_type(), "target_logprobs_backward_", [&] {
    target_logprobs_backward_impl<scalar_t>(gp, logits.data_ptr<scalar_t>(), tp, st, rows, vocab);
  });
  return logits;
}

constexpr int64_t BLOCK = 512;  // tokens per block of sample_tokens' CDF

std::vector<at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& temperatures,
                                      const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.stride(1) == 1,
              "sample_tokens: logits must be float32 [rows, vocab] with contiguous rows on the CPU, got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_tokens: an empty vocabulary");
  for (const at::Tensor* t : {&temperatures, &uniforms})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kDouble && t->device().is_cpu(),
                "sample_tokens: temperatures and uniforms must be float64 [", rows, "] CPU tensors, got ",
                t->scalar_type(), " ", t->sizes());
  auto temps = temperatures.contiguous(), us = uniforms.contiguous();
  const double* tp = temps.data_ptr<double>();
  const double* up = us.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] >= 0 && std::isfinite(tp[r]), "sample_tokens: row ", r, " has temperature ", tp[r]);
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({rows}, logits.options());
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* ep = row_buffer(vocab);
    thread_local std::vector<double> masses;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = base + r * stride;
      const float top = row_max(x, vocab);
      // the first of equal maxima: the greedy choice, and a draw's fallback (a scan a value at a
      // time, a third of a tempered row's time on a 49k vocabulary: only where it is needed)
      auto first_max = [&] {
        int64_t best = 0;
        while (best + 1 < vocab && !(x[best] == top)) ++best;
        return best;
      };
      // summed as the trainer's loss head sums (target_logprobs): float lanes inside blocks of 512,
      // float64 across them, so that the sampler's logprobs and the trainer's agree to float rounding
      double sum = 0.0;
      for (int64_t start = 0; start < vocab; start += 512) {
        const int64_t stop = std::min(vocab, start + 512);
        float block = 0.f;
#pragma omp simd reduction(+ : block)
        for (int64_t i = start; i < stop; ++i) {
          const float d = x[i] - top;
          ep[i] = d < -87.f ? 0.f : vexp(d);  // below, expf underflows to (almost) 0 anyway
          block += ep[i];
        }
        sum += block;
      }
      const float log_total = static_cast<float>(std::log(sum));
      int64_t chosen = -1;
      const double temperature = tp[r];
      if (temperature > 0) {
        if (temperature != 1.0) {  // softmax(logits / temperature): its max is top / temperature
          const float t = static_cast<float>(temperature), scaled_top = top / t;
          float tempered = 0.f;
#pragma omp simd reduction(+ : tempered)
          for (int64_t i = 0; i < vocab; ++i) {
            const float d = x[i] / t - scaled_top;
            ep[i] = d < -87.f ? 0.f : vexp(d);
            tempered += ep[i];
          }
          sum = tempered;
        }
        // the CDF by blocks: each block's mass summed in vector lanes, the blocks' masses added in
        // order; the draw finds its block in that order, then its token inside the block
        const float inverse = static_cast<float>(1.0 / sum);
        const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
        masses.resize(blocks);
        double total = 0.0;
        for (int64_t b = 0; b < blocks; ++b) {
          float mass = 0.f;
          const int64_t stop = std::min(vocab, (b + 1) * BLOCK);
#pragma omp simd reduction(+ : mass)
          for (int64_t i = b * BLOCK; i < stop; ++i) {
            ep[i] *= inverse;
            mass += ep[i];
          }
          masses[b] = mass;
          total += mass;
        }
        const double draw = std::min(up[r] * total, std::nextafter(total, 0.0));
        double before = 0.0;
        int64_t b = 0;
        while (b + 1 < blocks && before + masses[b] <= draw) before += masses[b++];
        // inside the block, in order; should its sum in order fall short of the lanes' (rounding),
        // its last token of nonzero probability
        const int64_t stop = std::min(vocab, (b + 1) * BLOCK);
        double cumulative = before;
        for (int64_t i = b * BLOCK; i < stop; ++i) {
          if (ep[i] <= 0.f) continue;
          chosen = i;
          cumulative += ep[i];
          if (cumulative > draw) break;
        }
      }
      if (chosen < 0) chosen = first_max();  // greedy; or a draw's block of no mass (every probability underflowed)
      tok[r] = chosen;
      lp[r] = (x[chosen] - top) - log_total;
    }
  });
  return {tokens, logprobs};
}

// 16 values of a weight, a key or a value as float32, bf16 widened as loaded
#if defined(__AVX512F__)
inline __m512 load_columns(const float* w) { return _mm512_loadu_ps(w); }
// 16 bf16 values widened to float32 (bf16 is float32's upper half: a shift)
inline __m512 widen_bf16(__m256i half) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load_columns(const c10::BFloat16* w) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load_columns(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load_columns(const c10::BFloat16* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

// One vector register of floats: avx512's sixteen or avx2's eight. Kernels written once over it:
// vexp_lanes, and the packed-attention loops, whose KEY_BLOCKS (sixteen keys each), ROW_PAIRS,
// SPLIT_GRADS and REGS_A_PASS (a row's sums over the head dimension per pass) say how many sums a
// loop keeps in registers: avx512 has 32 of them, avx2 16.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FLOAT_LANES 1
struct FloatLanes {
#if defined(__AVX512F__)
  using reg = __m512;
  static constexpr int W = 16, KEY_BLOCKS = 2, ROW_PAIRS = 2, SPLIT_GRADS = 1, REGS_A_PASS = 8;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  // 2^n for lanes holding whole numbers n (the exponent's bits)
  static reg pow2(reg n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  // x's lanes that are NaN, y's elsewhere
  static reg nan_from(reg x, reg y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x); }
  // v's lanes t0 + i below n, zeros past it
  static reg below(reg v, int64_t t0, int64_t n) {
    const __mmask16 m = n - t0 >= 16 ? static_cast<__mmask16>(0xffff)
                        : n > t0 ? static_cast<__mmask16>((1u << (n - t0)) - 1) : static_cast<__mmask16>(0);
    return _mm512_maskz_mov_ps(m, v);
  }
#else
  using reg = __m256;
  static constexpr int W = 8, KEY_BLOCKS = 1, ROW_PAIRS = 1, SPLIT_GRADS = 2, REGS_A_PASS = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg pow2(reg n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static reg nan_from(reg x, reg y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
  static reg below(reg v, int64_t t0, int64_t n) {
    const __m256i index =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), index)), v);
  }
#endif
};

// vexp of a register's lanes at once, each lane the same steps in the same order as vexp's (no fused
// multiply-adds: the kernels are built with -ffp-contract=off), so each lane is bit for bit vexp
// (a loop of vexp calls stays scalar: its NaN test keeps GCC from vectorizing it)
inline FloatLanes::reg vexp_lanes(FloatLanes::reg x) {
  using V = FloatLanes;
  const V::reg clamped = V::min(V::max(x, V::set1(-87.0f)), V::set1(88.0f));
  const V::reg magic = V::set1(12582912.0f);
  const V::reg n = V::sub(V::add(V::mul(clamped, V::set1(1.44269504088896341f)), magic), magic);
  V::reg r = V::sub(clamped, V::mul(n, V::set1(0.693359375f)));
  r = V::sub(r, V::mul(n, V::set1(-2.12194440e-4f)));
  V::reg p = V::set1(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = V::add(V::mul(p, r), V::set1(c));
  const V::reg y = V::add(V::add(V::mul(V::mul(p, r), r), r), V::set1(1.0f));
  return V::nan_from(x, V::mul(y, V::pow2(n)));
}
#endif

#if defined(__AVX512F__)
// Lane c of the result: the sum of t[c]'s 16 lanes, each column summed in the same order (pairs
// inside 128-bit lanes, then across them) whichever c it is: a 16 x 16 transpose folded into the
// additions, where one horizontal sum per column took a dozen scalar-ish steps.
inline __m512 sum_lanes16(const __m512 t[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // a[i], 128-bit lane L: columns 2i, 2i+1, two partial sums each
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // b[i], lane L: columns 4i..4i+3, lane L's sum of each
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // c[i]: columns 8i..8i+3 (lanes 0+1, 2+3), then 8i+4..8i+7
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// x[p] = vexp(x[p] - top) for p < n, sixteen at a time; their total (sixteen running sums, then
// added across): softmax's numerators and denominator for one query's scores
inline float exp_shifted_total(float* x, int64_t n, float top) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; p += 16) {
    const __mmask16 m = n - p >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - p)) - 1);
    const __m512 e = vexp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + p), shift));
    _mm512_mask_storeu_ps(x + p, m, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(total);
}

// t[col] for the block's keys col < m (zeros after): sixteen lanes whose sum is the query's dot product with key
// col, DIM floats of the query against keys widened to float32 as loaded
template <int64_t DIM, typename T>
inline void score_lanes(const float* query, const T* block, int64_t m, __m512 (&t)[16]) {
  constexpr int CHUNKS = DIM / 16;
  __m512 q[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) q[c] = _mm512_loadu_ps(query + 16 * c);
  for (int col = 0; col < 16; ++col) {
    if (col >= m) {
      t[col] = _mm512_setzero_ps();
      continue;
    }
    const T* key = block + col * DIM;
    __m512 sum = _mm512_mul_ps(q[0], load_columns(key));
    for (int c = 1; c < CHUNKS; ++c) sum = _mm512_fmadd_ps(q[c], load_columns(key + 16 * c), sum);
    t[col] = sum;
  }
}

#if defined(__AVX512BF16__)
// The same for a bf16 query and bf16 keys by avx512_bf16's dot product: DIM / 32 instructions a key over
// pairs of dims, where the float32 query's path widens each key for every query that reads it (a
// grouped-query head's queries, a run's rows over shared columns) before DIM / 16 multiply-adds. The
// products are exact either way (a query is rotated and rounded to bf16 first, as transformers stores it;
// a product of two bf16 values is exact in float32); the sums differ in their order (pairs of dims, then
// the lanes), and the instruction takes denormal inputs as zero.
template <int64_t DIM>
inline void score_lanes(const c10::BFloat16* query, const c10::BFloat16* block, int64_t m, __m512 (&t)[16]) {
  static_assert(DIM % 32 == 0, "pairs of dims, 32 bf16 values a register");
  constexpr int CHUNKS = DIM / 32;
  __m512bh q[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
  for (int col = 0; col < 16; ++col) {
    if (col >= m) {
      t[col] = _mm512_setzero_ps();
      continue;
    }
    const c10::BFloat16* key = block + col * DIM;
    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(key));
    for (int c = 1; c < CHUNKS; ++c) sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    t[col] = sum;
  }
}
#define ATTEND_DOT 1
#endif

// out[i][p] = scale * (query i . key p) for p in [first, last), nq queries of DIM values one after
// another (float32, or bf16 for the dot product): sixteen keys at a time, each query's sixteen dot
// products summed by sum_lanes16. A score depends only on its query and key, not on which other keys
// share its block.
template <int64_t DIM, typename Q, typename T>
void attend_scores(const Q* queries, int64_t nq, const T* keys, int64_t first, int64_t last, float* const* out,
                   float scale) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t c0 = first; c0 < last; c0 += 16) {
    const int64_t m = std::min<int64_t>(16, last - c0);
    const T* block = keys + c0 * DIM;
    for (int64_t i = 0; i < nq; ++i) {
      __m512 t[16];
      score_lanes<DIM>(queries + i * DIM, block, m, t);
      _mm512_mask_storeu_ps(out[i] + c0, static_cast<__mmask16>((1u << m) - 1), _mm512_mul_ps(sum_lanes16(t), factor));
    }
  }
}

// acc[i] += w[i][p] * value p for p in [first, last) in order, for the queries lo <= i < hi of a
// chunk of NQ held in registers
template <int64_t DIM, int NQ, typename T>
inline void attend_values(__m512 (&acc)[NQ][DIM / 16], int lo, int hi, const float* const* w, const T* values,
                          int64_t first, int64_t last) {
  constexpr int CHUNKS = DIM / 16;
  // the sums in a local copy, in registers: `acc` itself is memory the compiler must keep up to
  // date before every weight it loads (an __m512 may alias a float), which stored all 24 sums at
  // each column
  __m512 sums[NQ][CHUNKS];
#pragma GCC unroll 8
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) sums[i][c] = acc[i][c];
  for (int64_t p = first; p < last; ++p) {
    __m512 v[CHUNKS];
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) v[c] = load_columns(values + p * DIM + 16 * c);
#pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) {
      if (i < lo || i >= hi) continue;
      const __m512 weight = _mm512_set1_ps(w[i][p]);
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) sums[i][c] = _mm512_fmadd_ps(weight, v[c], sums[i][c]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) acc[i][c] = sums[i][c];
}

// The attention outputs of queries qa..qa+NQ of a run (query i belongs to row i / group): their
// weights w (unnormalised, by column) over the shared columns from `shared_values`, then over each
// row's own from `row_values[u]` (columns common..columns[u]), times their totals' inverses (as the
// scalar path), rounded to T. A row's sums run over its columns in one order, shared or its own.
template <int64_t DIM, int NQ, typename T>
void attend_chunk(int64_t qa, int64_t group, const float* const* w, const T* shared_values, int64_t common,
                  const T* const* row_values, const int64_t* columns, const float* totals, T* const* out) {
  constexpr int CHUNKS = DIM / 16;
  __m512 acc[NQ][CHUNKS];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < CHUNKS; ++c) acc[i][c] = _mm512_setzero_ps();
  attend_values<DIM, NQ>(acc, 0, NQ, w + qa, shared_values, 0, common);
  for (int64_t u = qa / group; u <= (qa + NQ - 1) / group; ++u) {
    const int lo = static_cast<int>(std::max(qa, u * group) - qa);
    const int hi = static_cast<int>(std::min(qa + NQ, (u + 1) * group) - qa);
    attend_values<DIM, NQ>(acc, lo, hi, w + qa, row_values[u], common, columns[u]);
  }
  float buffer[DIM];
  for (int i = 0; i < NQ; ++i) {
    const __m512 inverse = _mm512_set1_ps(1.f / totals[qa + i]);
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(buffer + 16 * c, _mm512_mul_ps(acc[i][c], inverse));
    from_float(buffer, out[qa + i], DIM);
  }
}

// attend_chunk for a chunk of nq <= N queries (24 accumulators: 6 queries of 64 dims, 3 of 128)
template <int64_t DIM, int N, typename T>
void attend_chunk_of(int64_t nq, int64_t qa, int64_t group, const float* const* w, const T* shared_values,
                     int64_t common, const T* const* row_values, const int64_t* columns, const float* totals,
                     T* const* out) {
  if constexpr (N > 0) {
    if (nq == N) return attend_chunk<DIM, N>(qa, group, w, shared_values, common, row_values, columns, totals, out);
    attend_chunk_of<DIM, N - 1>(nq, qa, group, w, shared_values, common, row_values, columns, totals, out);
  }
}
#define ATTEND_AVX512 1
#endif

// One decoding step's attention in a layer: q and k rotated (rotate_half convention, each product
// and the sum rounded to T, as transformers' apply_rotary_pos_emb), the new key and value written
// to each row's next cache column (lengths[r]), then each query head attends over its row's
// columns 0..lengths[r] through key head h / (heads / kv_heads), in float32, output rounded to T.
// HEAD_DIM: the head dimension known when compiling (64, 128: loops of fixed length, unrolled
// and without remainders), or 0 for any other, taken from ``head_dim``.
//
// Rows that share their first columns (a GRPO group's samples of one prompt, each slot holding
// its own copy): `from[r]` is the row whose cache is read for row r's first `shared[r]` columns
// (r itself where it shares nothing), and the rows reading one row's columns are attended
// together, up to ROPE_SHARERS at a time: each shared key and value is read once for all of
// them rather than once a row. A row's sums are the same, in the same order, either way.
//
// With avx512 and a head dimension of a multiple of 16 known when compiling (64, 128), the scores
// are taken sixteen keys at a time for each query (attend_scores: no horizontal sum per key) and the
// weighted values summed in registers, a few queries at a time (attend_chunk); at SmolLM2's shapes
// (32 rows, 61 columns, 45 shared in groups of 4; Intel Xeon, avx512, 2 cores) 30 layers' calls
// took 2.7 against 5.6 ms with the caches in cache, 5.0 against 6.7 ms cold; then with the values'
// sums kept in registers (attend_values) and the softmax's exponentials sixteen at a time
// (exp_shifted_total), 1.55 against 2.26 ms hot, 4.0 against 4.95 ms cold (docs/benchmark.md).
// With `dot` (bf16, a build with avx512_bf16, a head dimension of 64 or 128), the scores are
// avx512_bf16's dot products (score_lanes' bf16 queries): 1.25-1.47x the call's speed hot, 1.05-1.10x cold,
// on an AMD EPYC (Zen 4), 2 cores (docs/benchmark.md); the caller passes it where the sampler's
// weights are packed in pairs, i.e. where that instruction measured the faster.
constexpr int64_t ROPE_SHARERS = 8;

template <typename T, int64_t HEAD_DIM>
void rope_attend_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                      const T* cos, int64_t cos_stride, const T* sin, int64_t sin_stride, T* k_cache, T* v_cache,
                      int64_t slot_stride, int64_t head_stride, const int64_t* lengths, const int64_t* from,
                      const int64_t* shared, T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      float scale, bool dot) {
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = heads / kv_heads;
  // the rows in sets that read one row's shared columns (that row first), and the work: a run of
  // up to ROPE_SHARERS of a set's rows, through one key head
  std::vector<int64_t> order, runs;  // runs: {offset into order, count} pairs
  if (from == nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      order.push_back(r);
      runs.insert(runs.end(), {r, 1});
    }
  } else {
    std::vector<std::vector<int64_t>> sets(rows);  // (a source is in its own set: from[f] == f)
    for (int64_t r = 0; r < rows; ++r) sets[from[r]].push_back(r);
    for (int64_t r = 0; r < rows; ++r)
      for (size_t i = 0; i < sets[r].size(); i += ROPE_SHARERS) {
        runs.push_back(static_cast<int64_t>(order.size()));
        runs.push_back(std::min<int64_t>(ROPE_SHARERS, static_cast<int64_t>(sets[r].size() - i)));
        order.insert(order.end(), sets[r].begin() + i, sets[r].begin() + i + runs.back());
      }
  }
  const int64_t tasks = static_cast<int64_t>(runs.size() / 2) * kv_heads;
  auto rotate_row = [&](const T* x, const float* c, const float* s, float* xf, float* y) {
    to_float(x, xf, dim);
    rotate<T>(xf, c, s, y, dim);
  };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), xf(dim), rotated(dim), queries(ROPE_SHARERS * group * dim),
        acc(ROPE_SHARERS * group * dim), widened(dim), scores, totals(ROPE_SHARERS * group);
    std::vector<c10::BFloat16> query_pairs(dot && std::is_same_v<T, c10::BFloat16> ? ROPE_SHARERS * group * dim : 0);
    std::vector<float*> weights(ROPE_SHARERS * group);  // (query i's scores, then softmax numerators)
    std::vector<T*> outs(ROPE_SHARERS * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / kv_heads, g = task % kv_heads;
      const int64_t* members = order.data() + runs[2 * run];
      const int64_t count = runs[2 * run + 1];
      const int64_t source = from == nullptr ? members[0] : from[members[0]];
      const int64_t common = from == nullptr ? 0 : shared[members[0]];  // columns read from `source`
      const T* source_keys = k_cache + source * slot_stride + g * head_stride;
      const T* source_values = v_cache + source * slot_stride + g * head_stride;
      auto columns = [&](int64_t u) { return lengths[members[u]] + 1; };  // the run's row u attends to
      int64_t offsets[ROPE_SHARERS + 1] = {0};  // where each row's scores start: group x its columns
      for (int64_t u = 0; u < count; ++u) {
        const int64_t r = members[u];
        offsets[u + 1] = offsets[u] + group * columns(u);
        to_float(cos + r * cos_stride, c.data(), dim);
        to_float(sin + r * sin_stride, s.data(), dim);
        T* row_keys = k_cache + r * slot_stride + g * head_stride;
        T* row_values = v_cache + r * slot_stride + g * head_stride;
        rotate_row(k + r * k_stride + g * dim, c.data(), s.data(), xf.data(), rotated.data());
        from_float(rotated.data(), row_keys + lengths[r] * dim, dim);
        std::memcpy(row_values + lengths[r] * dim, v + r * v_stride + g * dim, dim * sizeof(T));
        for (int64_t j = 0; j < group; ++j)
          rotate_row(q + r * q_stride + (g * group + j) * dim, c.data(), s.data(), xf.data(),
                     queries.data() + (u * group + j) * dim);
      }
      // query i (row i / group's head g * group + i % group): its scores, by column, and its output
      scores.resize(offsets[count]);
      const int64_t nq = count * group;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t u = i / group, j = i % group;
        weights[i] = scores.data() + offsets[u] + j * columns(u);
        outs[i] = out + members[u] * heads * dim + (g * group + j) * dim;
      }
      // each query's scores -> softmax's numerators, exp(score - the largest), and their totals
      auto numerators = [&] {
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t n = columns(i / group);
          float* sp = weights[i];
          const float top = row_max(sp, n);
#if defined(ATTEND_AVX512)
          totals[i] = exp_shifted_total(sp, n, top);  // (the loop below ran one value at a time)
#else
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t p = 0; p < n; ++p) {
            sp[p] = vexp(sp[p] - top);
            total += sp[p];
          }
          totals[i] = total;
#endif
        }
      };
#if defined(ATTEND_AVX512)
      if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {  // sixteen keys at a time, outputs in registers
        const T* row_values[ROPE_SHARERS];
        int64_t lengths_of[ROPE_SHARERS];
        for (int64_t u = 0; u < count; ++u) {
          row_values[u] = v_cache + members[u] * slot_stride + g * head_stride;
          lengths_of[u] = columns(u);
        }
        // the run's queries over the shared columns, then each row's over its own
        auto score = [&](const auto* run_queries) {
          attend_scores<HEAD_DIM>(run_queries, nq, source_keys, 0, common, weights.data(), scale);
          for (int64_t u = 0; u < count; ++u)
            attend_scores<HEAD_DIM>(run_queries + u * group * dim, group,
                                    k_cache + members[u] * slot_stride + g * head_stride, common, lengths_of[u],
                                    weights.data() + u * group, scale);
        };
        bool scored = false;
#if defined(ATTEND_DOT)
        if constexpr (std::is_same_v<T, c10::BFloat16> && HEAD_DIM % 32 == 0) {
          if (dot) {  // (the rotated queries are bf16 values already: the same numbers in half the bytes)
            from_float(queries.data(), query_pairs.data(), nq * dim);
            score(query_pairs.data());
            scored = true;
          }
        }
#endif
        if (!scored) score(queries.data());
        numerators();
        constexpr int CHUNK = 24 / static_cast<int>(HEAD_DIM / 16);
        for (int64_t qa = 0; qa < nq; qa += CHUNK)
          attend_chunk_of<HEAD_DIM, CHUNK>(std::min<int64_t>(CHUNK, nq - qa), qa, group, weights.data(),
                                           source_values, common, row_values, lengths_of, totals.data(), outs.data());
        continue;
      }
#endif
      // Each key and value read once from the cache for every query head that attends to it
      // (float32 in place; bf16 widened as read): the shared columns for all of the run's rows,
      // then each row's own.
      // visit(x, p, u) for each column p of each row u of the run, x its key or value as float32:
      // the shared columns once (from `source`), for every row, then each row's own
      auto each_column = [&](const T* source_cache, T* cache, auto visit) {
        for (int64_t p = 0; p < common; ++p) {
          const float* x = as_float(source_cache + p * dim, widened.data(), dim);
          for (int64_t u = 0; u < count; ++u) visit(x, p, u);
        }
        for (int64_t u = 0; u < count; ++u) {
          const T* row = cache + members[u] * slot_stride + g * head_stride;
          for (int64_t p = common; p < columns(u); ++p) visit(as_float(row + p * dim, widened.data(), dim), p, u);
        }
      };
      each_column(source_keys, k_cache, [&](const float* kp, int64_t p, int64_t u) {
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = queries.data() + (u * group + j) * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < dim; ++i) dot += qj[i] * kp[i];
          weights[u * group + j][p] = dot * scale;
        }
      });
      numerators();
      std::fill(acc.begin(), acc.begin() + nq * dim, 0.f);
      each_column(source_values, v_cache, [&](const float* vp, int64_t p, int64_t u) {
        for (int64_t j = 0; j < group; ++j) {
          float* a = acc.data() + (u * group + j) * dim;
          const float weight = weights[u * group + j][p];
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) a[i] += weight * vp[i];
        }
      });
      for (int64_t i = 0; i < nq; ++i) {
        float* a = acc.data() + i * dim;
        const float inv = 1.f / totals[i];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= inv;
        from_float(a, outs[i], dim);
      }
    }
  });
}

at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lengths,
                       int64_t heads, double scale, const c10::optional<at::Tensor>& shared_from,
                       const c10::optional<at::Tensor>& shared, bool dot) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.device().is_cpu(),
              "rope_attend: the caches must be contiguous CPU [slots, kv_heads, capacity, head_dim] tensors of one "
              "shape, got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t slots = k_cache.size(0), kv_heads = k_cache.size(1), capacity = k_cache.size(2),
                dim = k_cache.size(3);
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.device().is_cpu(),
              "rope_attend: lengths must be a 1-d int64 CPU tensor");
  const int64_t rows = lengths.size(0);
  TORCH_CHECK(rows <= slots, "rope_attend: ", rows, " rows for ", slots, " cache slots");
  TORCH_CHECK(dim % 2 == 0 && heads > 0 && heads % kv_heads == 0,
              "rope_attend: ", heads, " query heads over ", kv_heads, " key heads of dim ", dim);
  check_rows(q, rows, heads * dim, "rope_attend: q");
  check_rows(k, rows, kv_heads * dim, "rope_attend: k");
  check_rows(v, rows, kv_heads * dim, "rope_attend: v");
  check_rows(cos, rows, dim, "rope_attend: cos");
  check_rows(sin, rows, dim, "rope_attend: sin");
  const auto dtype = k_cache.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype, "rope_attend: every tensor must have the caches' dtype ", dtype);
  auto lens = lengths.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(lp[r] >= 0 && lp[r] < capacity, "rope_attend: row ", r, " is at column ", lp[r],
                " of a cache with ", capacity, " columns");
  // which rows read which row's first columns: checked whole, since a wrong index would read
  // (or race with) another row's cache
  TORCH_CHECK(shared_from.has_value() == shared.has_value(), "rope_attend: shared_from and shared go together");
  at::Tensor from_t, shared_t;
  const int64_t *fp = nullptr, *sp = nullptr;
  if (shared_from.has_value()) {
    for (const at::Tensor* t : {&*shared_from, &*shared})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kLong && t->device().is_cpu(),
                  "rope_attend: shared_from and shared must be int64 CPU tensors of one value a row (", rows,
                  "), got ", t->scalar_type(), " ", t->sizes());
    from_t = shared_from->contiguous(), shared_t = shared->contiguous();
    fp = from_t.data_ptr<int64_t>(), sp = shared_t.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t f = fp[r];
      TORCH_CHECK(f >= 0 && f < rows && fp[f] == f && sp[r] == sp[f] && sp[r] >= 0 && sp[r] <= lp[r] && sp[f] <= lp[f],
                  "rope_attend: row ", r, " reads its first ", sp[r], " columns from row ", f,
                  ": that row must read its own (shared_from[", f, "] == ", f, "), share as many columns, and "
                  "both must have written them (lengths ", lp[r], ", ", f >= 0 && f < rows ? lp[f] : -1, ")");
    }
  }
  auto out = at::empty({rows, heads * dim}, q.options());
  DISPATCH_SAMPLER_TYPES(dtype, "rope_attend", [&] {
    auto run = [&](auto impl) {
      impl(q.data_ptr<scalar_t>(), q.stride(0), k.data_ptr<scalar_t>(), k.stride(0), v.data_ptr<scalar_t>(),
           v.stride(0), cos.data_ptr<scalar_t>(), cos.stride(0), sin.data_ptr<scalar_t>(), sin.stride(0),
           k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k_cache.stride(0), k_cache.stride(1), lp, fp,
           sp, out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, static_cast<float>(scale), dot);
    };
    if (dim == 64) run(rope_attend_impl<scalar_t, 64>);
    else if (dim == 128) run(rope_attend_impl<scalar_t, 128>);
    else run(rope_attend_impl<scalar_t, 0>);
  });
  return out;
}


// ---------------------------------------------------------------------------------------------
// x @ W.T for a decoding step's few rows, streaming the weight once (stream_linear).
//
// At ~24 rows a decoding step is a pass over every weight of the model, and oneDNN's packed
// product neither overlapped that stream with its arithmetic nor reached its own hot rate on it
// (SmolLM2-135M's Linears at 24 rows, 30 layers' distinct weights: 48 ms, 11 GB/s of a 20 GB/s
// read bandwidth; docs/benchmark.md). Here the weight is laid out in panels of STREAM_COLUMNS
// output columns, [N / 16][K][16], so that each thread reads its panels front to back, once,
// prefetching ahead of the loads; every row of a block of up to STREAM_ROWS rows takes each
// weight vector from a register. Each output is the sum over k in order 0..K-1 (one fused
// multiply-add at a time), then the bias: a row's result does not depend on the other rows or
// the threads.
//
// The weight is float32 or bfloat16. A bf16 weight streams half the bytes and is widened to
// float32 in a register (bf16 is float32's upper half: a shift), each widened vector serving all of
// a block's rows, so the arithmetic is float32 multiply-adds either way: a product of two bf16
// values is exact in float32, so the sums are what oneDNN's bf16 product computes (float32
// accumulation, one rounding to bf16 at the end) up to their order. Where the CPU has avx512_bf16,
// a bf16 weight may instead be packed in pairs for its dot-product instruction (stream_dot_block
// below): twice the multiply-adds an instruction on an AMD EPYC (Zen 4), half float32's rate on an
// Intel Xeon without AMX -- the sampler takes whichever measured faster (kernel_probe.py).
//
// A LoRA side path, (x @ A.T) @ B.T with the scale in B, is part of the same sums: d = x @ A.T is
// computed first (in float32, A packed as a weight of its own), and each output's sum goes on over
// d's R values against B's panel ([N / 16][R][16]) before the bias is added, as if the product were
// [x, d] @ [W, B].T. One pass over the output and one rounding, where a side path of its own (two
// more products, the second adding into the base's rounded output) cost 32-34% of a bf16 step's
// products at 16-32 rows on the Xeon.
constexpr int64_t STREAM_COLUMNS = 16;
constexpr int64_t STREAM_PREFETCH_BYTES = 4096;  // how far ahead of the weight being read
#if defined(__AVX512F__)
// float32 weights prefetched into L2 rather than L1: 3-6% faster at 1-8 rows on an Intel Xeon
// (avx512, no AMX), the same at 16-128; bf16's into L1 (L2 measured ~1% slower)
// (__builtin_prefetch's locality: 3 is _MM_HINT_T0, 2 is _MM_HINT_T1)
template <typename W>
constexpr int STREAM_PREFETCH_LOCALITY = std::is_same_v<W, float> ? 2 : 3;
#endif
// how many k ahead stream_block prefetches its inputs ([k][row]: up to 32 rows, 128 bytes a k)
constexpr int64_t STREAM_INPUTS_AHEAD = 32;

inline float scalar_float(float v) { return v; }
inline float scalar_float(c10::BFloat16 v) { return static_cast<float>(v); }

// 16 float32 results into y: as they are, or rounded to bf16 as c10::BFloat16 rounds (to nearest
// even; a NaN to c10's NaN), sixteen at a time where the vectors allow
inline void store_columns(const float* out, float* y) { std::memcpy(y, out, STREAM_COLUMNS * sizeof(float)); }
inline void store_columns(const float* out, c10::BFloat16* y) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_loadu_ps(out);
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
#else
  from_float(out, y, STREAM_COLUMNS);
#endif
}

// The kernels' loops over k inlined wherever they are instantiated: out of line, a block's
// accumulators live in memory (GCC stopped inlining bf16's at 12 rows once the blocks grew to 32
// rows: 2x the time)
#define STREAM_INLINE __attribute__((always_inline))

// The weight of one block: `w` (K x 16, the panel of W) then, for a LoRA side path, `w2` (K2 x 16,
// the panel of B), the inputs `xt` [k][row] over k = 0..K, then `xt2` [k][row] over k = 0..K2 (d).
template <typename W>
struct Panel {
  const W* w;
  int64_t K;
  const W* w2;
  int64_t K2;
};

// y[r, 0..16) = bias + sum_k xt[k * ldx + r] * w[k * 16 + 0..16) (+ sum_k xt2[..] * w2[..]) for
// r < ROWS, rounded to O (float32, or bf16)
template <int ROWS, typename W, typename O>
inline void stream_block(const float* xt, const float* xt2, int64_t ldx, Panel<W> panel, const float* bias, O* y,
                         int64_t ldy) {
  float out[ROWS][STREAM_COLUMNS];
#if defined(__AVX512F__)
  __m512 acc[ROWS];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  auto run = [&](const float* x, const W* w, int64_t K) STREAM_INLINE {
    for (int64_t k = 0; k < K; ++k) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + k * STREAM_COLUMNS) + STREAM_PREFETCH_BYTES, 0,
                         STREAM_PREFETCH_LOCALITY<W>);
      const __m512 wk = load_columns(w + k * STREAM_COLUMNS);
      const float* xk = x + k * ldx;
      if constexpr (ROWS >= 8) {  // the inputs ahead too: just laid out by another core, each would wait on it
        const char* ahead = reinterpret_cast<const char*>(xk + STREAM_INPUTS_AHEAD * ldx);
        _mm_prefetch(ahead, _MM_HINT_T0);
        if constexpr (ROWS > 16) _mm_prefetch(ahead + 16 * sizeof(float), _MM_HINT_T0);
      }
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), wk, acc[r]);
    }
  };
  run(xt, panel.w, panel.K);
  run(xt2, panel.w2, panel.K2);
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out[r], _mm512_add_ps(acc[r], b));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 lo[ROWS], hi[ROWS];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  auto run = [&](const float* x, const W* w, int64_t K) STREAM_INLINE {
    for (int64_t k = 0; k < K; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k * STREAM_COLUMNS) + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
      const __m256 w0 = load_columns(w + k * STREAM_COLUMNS), w1 = load_columns(w + k * STREAM_COLUMNS + 8);
      const float* xk = x + k * ldx;
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xr = _mm256_broadcast_ss(xk + r);
        lo[r] = _mm256_fmadd_ps(xr, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(xr, w1, hi[r]);
      }
    }
  };
  run(xt, panel.w, panel.K);
  run(xt2, panel.w2, panel.K2);
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(out[r], _mm256_add_ps(lo[r], b0));
    _mm256_storeu_ps(out[r] + 8, _mm256_add_ps(hi[r], b1));
  }
#else
  for (int r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < STREAM_COLUMNS; ++j) out[r][j] = 0.0f;
  auto run = [&](const float* x, const W* w, int64_t K) STREAM_INLINE {
    for (int64_t k = 0; k < K; ++k)
      for (int r = 0; r < ROWS; ++r)
        for (int64_t j = 0; j < STREAM_COLUMNS; ++j)
          out[r][j] = std::fma(x[k * ldx + r], scalar_float(w[k * STREAM_COLUMNS + j]), out[r][j]);
  };
  run(xt, panel.w, panel.K);
  run(xt2, panel.w2, panel.K2);
  for (int r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < STREAM_COLUMNS; ++j) out[r][j] += bias ? bias[j] : 0.0f;
#endif
  for (int r = 0; r < ROWS; ++r) store_columns(out[r], y + r * ldy);
}

// rows in one block: as many accumulators as the vector registers hold beside a weight vector --
// with avx512, one more: 32 rows (a GRPO batch of 8 prompts x 4) in one pass over the weight, where
// 24 rows and then 8 had re-read every panel from the cache at 8 multiply-adds a k (35.6 -> 32.3 ms
// for SmolLM2's 121 products at 32 rows, Intel Xeon avx512, 2 cores; docs/benchmark.md; bf16's the
// same, 0.99x). The compiler keeps the accumulators that do not fit (two) in L1: each k's
// load-add-store chain (~10 cycles) fits in the 16 cycles of a k's 32 multiply-adds.
#if defined(__AVX512F__)
constexpr int STREAM_ROWS = 32;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int STREAM_ROWS = 6;  // 12 ymm accumulators of 16
#else
constexpr int STREAM_ROWS = 4;
#endif

#if defined(__AVX512F__)
// Two adjacent panels (32 columns) for ROWS rows: half the broadcasts per multiply-add of
// stream_block, for rows beyond a block (a prefill; a second block from the cache), where the
// arithmetic sets the time: at 120-504 rows, 1.08-1.10x stream_block's rate (still 0.85-0.99x
// oneDNN's; docs/benchmark.md).
template <int ROWS, typename W, typename O>
inline void stream_block_wide(const float* xt, const float* xt2, int64_t ldx, Panel<W> panel, Panel<W> next,
                              const float* bias, O* y, int64_t ldy) {
  __m512 a0[ROWS], a1[ROWS];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  auto run = [&](const float* x, const W* w, const W* w1, int64_t K) STREAM_INLINE {
    for (int64_t k = 0; k < K; ++k) {
      const __m512 u = load_columns(w + k * STREAM_COLUMNS), v = load_columns(w1 + k * STREAM_COLUMNS);
      const float* xk = x + k * ldx;
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xr = _mm512_set1_ps(xk[r]);
        a0[r] = _mm512_fmadd_ps(xr, u, a0[r]);
        a1[r] = _mm512_fmadd_ps(xr, v, a1[r]);
      }
    }
  };
  run(xt, panel.w, next.w, panel.K);
  run(xt2, panel.w2, next.w2, panel.K2);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + STREAM_COLUMNS) : _mm512_setzero_ps();
  float out[2 * STREAM_COLUMNS];
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(out, _mm512_add_ps(a0[r], b0));
    _mm512_storeu_ps(out + STREAM_COLUMNS, _mm512_add_ps(a1[r], b1));
    store_columns(out, y + r * ldy);
    store_columns(out + STREAM_COLUMNS, y + r * ldy + STREAM_COLUMNS);
  }
}
constexpr bool STREAM_WIDE = true;
constexpr int STREAM_WIDE_ROWS = 12;  // 24 zmm accumulators beside two weight vectors
#else
constexpr bool STREAM_WIDE = false;
constexpr int STREAM_WIDE_ROWS = 1;
template <int ROWS, typename W, typename O>
inline void stream_block_wide(const float*, const float*, int64_t, Panel<W>, Panel<W>, const float*, O*, int64_t) {}
#endif

// stream_block_wide for `rows` <= ROWS rows
template <int ROWS, typename W, typename O>
inline void stream_wide_tail(int64_t rows, const float* xt, const float* xt2, int64_t ldx, Panel<W> panel,
                             Panel<W> next, const float* bias, O* y, int64_t ldy) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return stream_block_wide<ROWS>(xt, xt2, ldx, panel, next, bias, y, ldy);
    stream_wide_tail<ROWS - 1>(rows, xt, xt2, ldx, panel, next, bias, y, ldy);
  }
}

// a last block of `rows` < STREAM_ROWS rows
template <int ROWS, typename W, typename O>
inline void stream_tail(int64_t rows, const float* xt, const float* xt2, int64_t ldx, Panel<W> panel,
                        const float* bias, O* y, int64_t ldy) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return stream_block<ROWS>(xt, xt2, ldx, panel, bias, y, ldy);
    stream_tail<ROWS - 1>(rows, xt, xt2, ldx, panel, bias, y, ldy);
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 weights multiplied by avx512_bf16's dot-product instruction (vdpbf16ps): each instruction
// takes two k of a column at once, x[2i] * w[2i] and x[2i + 1] * w[2i + 1] added into the float32
// sum (the odd product first, then the even, each addition rounded to float32 -- the instruction's
// definition -- with denormal inputs and results taken as zero). On an AMD EPYC (Zen 4) it runs as
// many instructions a cycle as float32's FMA, so twice the multiply-adds: the bf16 products of a
// decoding step's rows ~2x the widened ones' rate (docs/benchmark.md). On an Intel Xeon without AMX
// it ran half as many multiply-adds a second as float32's FMA: which of the two kernels a sampler
// uses is measured (kernel_probe.py's bf16 decoding layout), never taken from the flags.
//
// The weight is packed in pairs of k, [N / 16][ceil(K / 2)][16][2] (a K of odd length padded with a
// zero), the inputs as pairs too: [k / 2][row], each a 32-bit word of two bf16 that the instruction
// broadcasts to the sixteen columns. A row's sums still depend only on its own inputs, in one order.
// A LoRA side path's A is packed in pairs like its weight; d = x @ A.T is float32, so B's part of
// the sums is float32 multiply-adds over B's plain panel, after the dot products.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define STREAM_DOT 1
constexpr int64_t STREAM_PAIR_COLUMNS = 2 * STREAM_COLUMNS;  // bf16 values in a pair-packed k-pair row

template <int ROWS, typename O>
inline void stream_dot_block(const float* xt, const float* xt2, int64_t ldx, const c10::BFloat16* w, int64_t pairs,
                             const c10::BFloat16* w2, int64_t K2, const float* bias, O* y, int64_t ldy) {
  __m512 acc[ROWS];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const auto* wi = w + i * STREAM_PAIR_COLUMNS;
    __builtin_prefetch(reinterpret_cast<const char*>(wi) + STREAM_PREFETCH_BYTES, 0, 3);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wi);
    const float* xi = xt + i * ldx;  // (each float's bits: a pair of bf16)
    if constexpr (ROWS >= 8) {
      const char* ahead = reinterpret_cast<const char*>(xi + STREAM_INPUTS_AHEAD * ldx);
      _mm_prefetch(ahead, _MM_HINT_T0);
      if constexpr (ROWS > 16) _mm_prefetch(ahead + 16 * sizeof(float), _MM_HINT_T0);
    }
    // each input pair broadcast by the instruction itself (an operand {1to16}): GCC emits a
    // broadcast of its own before each dot product, which on Zen 4 costs them a quarter of their rate
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc[r]) : "m"(xi[r]), "v"(wv));
  }
  for (int64_t k = 0; k < K2; ++k) {  // LoRA's B over d, float32
    const __m512 wk = load_columns(w2 + k * STREAM_COLUMNS);
    const float* xk = xt2 + k * ldx;
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), wk, acc[r]);
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  float out[STREAM_COLUMNS];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(out, _mm512_add_ps(acc[r], b));
    store_columns(out, y + r * ldy);
  }
}

template <int ROWS, typename O>
inline void stream_dot_tail(int64_t rows, const float* xt, const float* xt2, int64_t ldx, const c10::BFloat16* w,
                            int64_t pairs, const c10::BFloat16* w2, int64_t K2, const float* bias, O* y, int64_t ldy) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return stream_dot_block<ROWS>(xt, xt2, ldx, w, pairs, w2, K2, bias, y, ldy);
    stream_dot_tail<ROWS - 1>(rows, xt, xt2, ldx, w, pairs, w2, K2, bias, y, ldy);
  }
}
#endif

// Memory for the packed weights that a decoding step streams, in 2 MiB-aligned chunks the kernel
// is asked to back with 2 MiB pages (transparent huge pages, madvise). Streaming SmolLM2's 540 MB
// once a step touches ~130,000 4 KiB pages, each a TLB miss and a page walk beside its 64 loads; in
// 2 MiB pages a step's products alone took 0.80-0.84x the time and the fp32 sampler's decoding steps
// 0.94x (Intel Xeon, avx512, 2 cores, docs/benchmark.md). Weights of at least half a huge page are placed one after another in the
// chunk being filled (32 MiB, or one of their own when larger), each tensor holding its chunk.
// The sampler packs its weights anew at each optimizer step (folded_lora.py), freeing the last
// step's first, so a chunk whose last tensor goes is kept for the next pack rather than unmapped
// and faulted in again (~65 ms for SmolLM2's 540 MB here), up to as many bytes as were ever in use
// at once; beyond that it is unmapped. Where the kernel has no transparent huge pages the chunks
// keep 4 KiB pages; where a mapping fails, the weight is a plain tensor: the same bytes either way.
#if defined(__linux__) && defined(MADV_HUGEPAGE)
constexpr size_t HUGE_PAGE = size_t{2} << 20;
constexpr size_t HUGE_CHUNK = size_t{32} << 20;

inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct HugeChunk {
  char* base;
  size_t size;
  size_t used = 0;
};

// The chunks: the one being filled (weakly: it goes when its tensors do), those kept for reuse,
// and the bytes mapped. Never destroyed: a tensor freed late in the process's exit still finds it.
struct HugePool {
  std::mutex mutex;
  std::weak_ptr<HugeChunk> filling;
  std::vector<HugeChunk*> kept;
  size_t in_use = 0, most_in_use = 0, kept_bytes = 0;
};
HugePool& huge_pool() {
  static HugePool* pool = new HugePool();
  return *pool;
}

// the last tensor of a chunk went: keep it (within what was ever in use at once), or unmap it
void chunk_freed(HugeChunk* chunk) {
  HugePool& pool = huge_pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  pool.in_use -= chunk->size;
  if (pool.kept_bytes + chunk->size <= pool.most_in_use) {
    chunk->used = 0;
    pool.kept.push_back(chunk);
    pool.kept_bytes += chunk->size;
    return;
  }
  munmap(chunk->base, chunk->size);
  delete chunk;
}

// a chunk of at least `size` bytes (a multiple of HUGE_PAGE) at a HUGE_PAGE boundary, or nullptr;
// the pool's mutex held
std::shared_ptr<HugeChunk> take_chunk(HugePool& pool, size_t size) {
  HugeChunk* chunk = nullptr;
  for (size_t i = 0; i < pool.kept.size(); ++i)
    if (pool.kept[i]->size >= size) {
      chunk = pool.kept[i];
      pool.kept.erase(pool.kept.begin() + static_cast<int64_t>(i));
      pool.kept_bytes -= chunk->size;
      break;
    }
  if (chunk == nullptr) {
    void* mapped = mmap(nullptr, size + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return nullptr;
    char* start = static_cast<char*>(mapped);
    char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(start), HUGE_PAGE));
    const size_t head = static_cast<size_t>(base - start);  // the mapping's unaligned head and tail back
    if (head > 0) munmap(start, head);
    munmap(base + size, HUGE_PAGE - head);
    madvise(base, size, MADV_HUGEPAGE);  // (a request: refused, the chunk keeps 4 KiB pages)
    chunk = new HugeChunk{base, size};
  }
  pool.in_use += chunk->size;
  pool.most_in_use = std::max(pool.most_in_use, pool.in_use);
  return std::shared_ptr<HugeChunk>(chunk, chunk_freed);
}

// Unmaps the chunks kept for the next pack; the bytes given back. The engine calls it after each
// call (heap.py): a repack frees and reuses within one call, so what is still kept by then is
// memory nothing will pack into soon (a probe's weights, a sampler gone).
int64_t release_kept_chunks() {
  HugePool& pool = huge_pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  const auto released = static_cast<int64_t>(pool.kept_bytes);
  for (HugeChunk* chunk : pool.kept) {
    munmap(chunk->base, chunk->size);
    delete chunk;
  }
  pool.kept.clear();
  pool.kept_bytes = 0;
  return released;
}

at::Tensor weight_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                       c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (bytes < HUGE_PAGE / 2) return at::empty(sizes, options);
  const size_t need = round_up(bytes, 4096);
  HugePool& pool = huge_pool();
  std::shared_ptr<HugeChunk> chunk;
  char* data;
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    chunk = pool.filling.lock();
    if (!chunk || chunk->used + need > chunk->size) {
      chunk = take_chunk(pool, std::max(HUGE_CHUNK, round_up(need, HUGE_PAGE)));
      if (!chunk) return at::empty(sizes, options);
      if (need <= HUGE_CHUNK) pool.filling = chunk;  // (a weight larger than a chunk has one to itself)
    }
    data = chunk->base + chunk->used;
    chunk->used += need;
  }
  auto* keep = new std::shared_ptr<HugeChunk>(std::move(chunk));
  return at::from_blob(data, sizes, [keep](void*) { delete keep; }, options);
}
#else
at::Tensor weight_empty(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }
int64_t release_kept_chunks() { return 0; }
#endif

// [N, K] -> [N / 16][K][16], in the weight's dtype (float32 or bf16); with `pairs` (bf16, a build
// with avx512_bf16), [N / 16][ceil(K / 2)][32] for the dot-product kernel: k-pairs of 16 columns,
// each column's two values side by side, an odd K's last pair completed with a zero
at::Tensor stream_pack(const at::Tensor& weight, bool pairs) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
                  weight.device().is_cpu(),
              "stream_pack: a float32 or bfloat16 CPU weight [out_features, in_features], got ", weight.scalar_type(),
              " ", weight.device(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % STREAM_COLUMNS == 0 && k > 0, "stream_pack: out_features must be a multiple of ", STREAM_COLUMNS,
              " (got ", n, ") and in_features positive (got ", k, ")");
  const auto w = weight.contiguous();
  if (pairs) {
#if defined(STREAM_DOT)
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "stream_pack: pairs are for bfloat16 weights, got ", w.scalar_type());
    const int64_t half = (k + 1) / 2;
    auto packed = weight_empty({n / STREAM_COLUMNS, half, STREAM_PAIR_COLUMNS}, w.options());
    const auto* src = w.data_ptr<c10::BFloat16>();
    auto* dst = packed.data_ptr<c10::BFloat16>();
    at::parallel_for(0, n / STREAM_COLUMNS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t i = 0; i < half; ++i)
          for (int64_t j = 0; j < STREAM_COLUMNS; ++j)
            for (int64_t e = 0; e < 2; ++e)
              dst[((p * half + i) * STREAM_COLUMNS + j) * 2 + e] =
                  2 * i + e < k ? src[(p * STREAM_COLUMNS + j) * k + 2 * i + e] : c10::BFloat16(0.0f);
    });
    return packed;
#else
    TORCH_CHECK(false, "stream_pack: pairs need avx512_bf16's dot product, which this build of the kernels lacks "
                "(stream_dot_available() is false)");
#endif
  }
  auto packed = weight_empty({n / STREAM_COLUMNS, k, STREAM_COLUMNS}, w.options());
  DISPATCH_SAMPLER_TYPES(w.scalar_type(), "stream_pack", [&] {
    const scalar_t* src = w.data_ptr<scalar_t>();
    scalar_t* dst = packed.data_ptr<scalar_t>();
    at::parallel_for(0, n / STREAM_COLUMNS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t i = 0; i < k; ++i)
          for (int64_t j = 0; j < STREAM_COLUMNS; ++j)
            dst[(p * k + i) * STREAM_COLUMNS + j] = src[(p * STREAM_COLUMNS + j) * k + i];
    });
  });
  return packed;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STREAM_TRANSPOSE_AVX512 1
// 16 vectors of 16 floats (rows) -> their transpose (r[j] = every row's j-th value), in registers
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // t[2i], lane L: rows 2i, 2i+1 interleaved over columns 4L, 4L+1 (t[2i+1]: 4L+2, 4L+3)
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], lane L: column 4L + c of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 2; ++i)  // t[8i + c]: columns c, 8+c (c < 4; 4+c, 12+c for t[8i+4+c]) of rows 8i..8i+7
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0xdd);
    }
  for (int c = 0; c < 8; ++c) {  // whole columns
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
  }
}
inline __m512 load_floats(const float* src, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, src); }
inline __m512 load_floats(const c10::BFloat16* src, __mmask16 mask) {
  return widen_bf16(_mm256_maskz_loadu_epi16(mask, src));
}
#endif

// `count` rows (at a stride of ld) of k values as float32 [k][count]: with avx512, 16 x 16 at a time
// in registers (a decoding step's 24 rows of 1,536 values took ~50 us a value at a time, the
// stores at a stride of `count` missing the cache: ~1.5 ms of a decoding step's 30 layers)
template <typename T>
void transpose_rows(const T* src, int64_t ld, int64_t count, int64_t k, float* to) {
#if defined(STREAM_TRANSPOSE_AVX512)
  if (count == 1) return to_float(src, to, k);
  __m512 r[16];
  for (int64_t i0 = 0; i0 < k; i0 += 16) {
    const int64_t width = std::min<int64_t>(16, k - i0);
    const __mmask16 columns = static_cast<__mmask16>((1u << width) - 1);
    for (int64_t r0 = 0; r0 < count; r0 += 16) {
      const int64_t height = std::min<int64_t>(16, count - r0);
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j < height ? load_floats(src + (r0 + j) * ld + i0, columns) : _mm512_setzero_ps();
      transpose16(r);
      const __mmask16 lanes = static_cast<__mmask16>((1u << height) - 1);
      for (int64_t j = 0; j < width; ++j) _mm512_mask_storeu_ps(to + (i0 + j) * count + r0, lanes, r[j]);
    }
  }
#else  // (STREAM_ROWS rows of 6 or 4: a k's values take a cache line or less)
  std::vector<float> widened(std::is_same_v<T, float> ? 0 : k);
  for (int64_t r = 0; r < count; ++r) {
    const float* row = as_float(src + r * ld, widened.data(), k);
    for (int64_t i = 0; i < k; ++i) to[i * count + r] = row[i];
  }
#endif
}

// `rows` rows of k values (at a stride of ld) as float32 [block of STREAM_ROWS rows][k][row in the
// block]: a k's inputs side by side, and each block read front to back (the last block's rows at a
// stride of its own count: a decoding step's few rows then take a few KiB of cache beside the
// weights, not a whole block's)
template <typename T>
std::unique_ptr<float[]> stream_inputs(const T* src, int64_t ld, int64_t rows, int64_t k) {
  const int64_t blocks = (rows + STREAM_ROWS - 1) / STREAM_ROWS;
  std::unique_ptr<float[]> xp(new float[blocks * k * STREAM_ROWS]);  // (every value written below)
  // a prefill's hundreds of rows on every thread; a decoding step's block or two on this one
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (STREAM_ROWS * k));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      transpose_rows(src + block * STREAM_ROWS * ld, ld, std::min<int64_t>(STREAM_ROWS, rows - block * STREAM_ROWS), k,
                     xp.get() + block * k * STREAM_ROWS);
  });
  return xp;
}

// y [rows, panels * 16] = the inputs `xp` (stream_inputs, k values) @ the panels' weights + bias,
// each panel's sums going on over `xp2` (k2 values) against `w2`'s panel where given. Each thread
// streams a contiguous run of panels (pairs of them for many rows), and every block of rows over a
// panel in turn.
template <typename W, typename O>
void stream_product(const float* xp, int64_t k, const float* xp2, int64_t k2, int64_t rows, int64_t panels,
                    const W* wd, const W* w2d, const float* bd, O* yd) {
  const int64_t n = panels * STREAM_COLUMNS, blocks = (rows + STREAM_ROWS - 1) / STREAM_ROWS;
  // more rows than a block: panels in pairs (two threads' runs of them), a block's rows across both
  // panels of a pair at a time (half the broadcasts a multiply-add). Up to two blocks, the first
  // still one panel at a time, streaming it (its 32 multiply-adds a k hide the loads), the second
  // across the pair from the cache: 33-64 rows in 0.91-0.99x the time of both blocks one panel at a
  // time, whose second block had re-read each panel at fewer multiply-adds a k (Intel Xeon avx512).
  const int64_t step = rows > STREAM_ROWS && STREAM_WIDE ? 2 : 1;
  auto panel_at = [&](int64_t p) {
    return Panel<W>{wd + p * k * STREAM_COLUMNS, k, w2d ? w2d + p * k2 * STREAM_COLUMNS : nullptr, w2d ? k2 : 0};
  };
  at::parallel_for(0, (panels + step - 1) / step, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin * step; p < std::min(end * step, panels); p += step) {
      const bool pair = step == 2 && p + 1 < panels;
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t r = block * STREAM_ROWS, count = std::min<int64_t>(STREAM_ROWS, rows - r);
        const float* x = xp + block * k * STREAM_ROWS;
        const float* x2 = xp2 ? xp2 + block * k2 * STREAM_ROWS : nullptr;
        if (pair && (block > 0 || rows > 2 * STREAM_ROWS)) {
          // in chunks of at most STREAM_WIDE_ROWS rows, as even as they divide (32: 10 + 11 + 11)
          const int64_t chunks = (count + STREAM_WIDE_ROWS - 1) / STREAM_WIDE_ROWS;
          for (int64_t c = 0, at = 0; c < chunks; ++c) {
            const int64_t size = (count - at) / (chunks - c);
            stream_wide_tail<STREAM_WIDE_ROWS>(size, x + at, x2 ? x2 + at : nullptr, count, panel_at(p),
                                               panel_at(p + 1), bd ? bd + p * STREAM_COLUMNS : nullptr,
                                               yd + (r + at) * n + p * STREAM_COLUMNS, n);
            at += size;
          }
          continue;
        }
        for (int64_t q = p; q < p + (pair ? 2 : 1); ++q) {
          const float* bq = bd ? bd + q * STREAM_COLUMNS : nullptr;
          O* y = yd + r * n + q * STREAM_COLUMNS;
          if (count == STREAM_ROWS) stream_block<STREAM_ROWS>(x, x2, STREAM_ROWS, panel_at(q), bq, y, n);
          else stream_tail<STREAM_ROWS - 1>(count, x, x2, count, panel_at(q), bq, y, n);
        }
      }
    }
  });
}

#if defined(STREAM_DOT)
// stream_product for pair-packed bf16 weights (stream_dot_block): `xp` the inputs' k-pairs
// (stream_inputs over the pairs' 32-bit words), `xp2` / `w2d` LoRA's d and B as stream_product's.
// Each thread streams a contiguous run of panels, every block of rows over a panel in turn.
template <typename O>
void stream_dot_product(const float* xp, int64_t pairs, const float* xp2, int64_t k2, int64_t rows, int64_t panels,
                        const c10::BFloat16* wd, const c10::BFloat16* w2d, const float* bd, O* yd) {
  const int64_t n = panels * STREAM_COLUMNS, blocks = (rows + STREAM_ROWS - 1) / STREAM_ROWS;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t r = block * STREAM_ROWS, count = std::min<int64_t>(STREAM_ROWS, rows - r);
        const float* x = xp + block * pairs * STREAM_ROWS;
        const float* x2 = xp2 ? xp2 + block * k2 * STREAM_ROWS : nullptr;
        const c10::BFloat16* w = wd + p * pairs * STREAM_PAIR_COLUMNS;
        const c10::BFloat16* w2 = w2d ? w2d + p * k2 * STREAM_COLUMNS : nullptr;
        const float* b = bd ? bd + p * STREAM_COLUMNS : nullptr;
        O* y = yd + r * n + p * STREAM_COLUMNS;
        if (count == STREAM_ROWS)
          stream_dot_block<STREAM_ROWS>(x, x2, STREAM_ROWS, w, pairs, w2, w2d ? k2 : 0, b, y, n);
        else
          stream_dot_tail<STREAM_ROWS - 1>(count, x, x2, count, w, pairs, w2, w2d ? k2 : 0, b, y, n);
      }
  });
}
#endif

bool stream_dot_available() {
#if defined(STREAM_DOT)
  return true;
#else
  return false;
#endif
}

// Whether a packed weight is in k-pairs for the dot-product kernel (stream_pack's `pairs`).
bool stream_pairs(const at::Tensor& packed) {
  return packed.dim() == 3 && packed.size(2) == 2 * STREAM_COLUMNS && stream_dot_available();
}

// Checks a packed weight (and its input width, where `k` >= 0); its number of output columns.
int64_t stream_check(const char* what, const at::Tensor& packed, at::ScalarType dtype, int64_t k = -1) {
  const bool pairs = stream_pairs(packed) && dtype == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == STREAM_COLUMNS || pairs) && packed.scalar_type() == dtype &&
                  packed.is_contiguous() && packed.device().is_cpu() &&
                  (k < 0 || packed.size(1) == (pairs ? (k + 1) / 2 : k)),
              "stream_linear: ", what, " must come from stream_pack ([out / ", STREAM_COLUMNS, ", in, ",
              STREAM_COLUMNS, "] ", dtype, k < 0 ? "" : ", in = ", k < 0 ? std::string() : std::to_string(k),
              stream_dot_available() ? "; or in pairs for bfloat16: [out / 16, ceil(in / 2), 32]" : "", "), got ",
              packed.scalar_type(), " ", packed.sizes());
  return packed.size(0) * STREAM_COLUMNS;
}

// x [..., K] @ W.T + bias for a weight packed by stream_pack: [..., N], in the weight's dtype (the
// input's and the bias's too). With LoRA's A [R, K] and B [N, R] (the scale in B) packed by
// stream_pack (R a multiple of 16: pad A's rows and B's columns with zeros), x @ W.T + (x @ A.T) @
// B.T + bias, one sum per output, rounded once. A bf16 weight packed in pairs takes its A in pairs
// too and its B plain (B multiplies d = x @ A.T, float32).
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "stream_linear: a weight from stream_pack (float32 or bfloat16), got ", dtype);
  const bool pairs = dtype == at::kBFloat16 && stream_pairs(packed);
  const int64_t k = x.dim() >= 1 ? x.size(-1) : 0;
  const int64_t n = stream_check("the weight", packed, dtype);
  TORCH_CHECK(x.dim() >= 1 && (pairs ? (k + 1) / 2 == packed.size(1) : k == packed.size(1)) &&
                  x.scalar_type() == dtype && x.device().is_cpu(),
              "stream_linear: a ", dtype, " CPU input with ", pairs ? 2 * packed.size(1) : packed.size(1),
              pairs ? " (or one fewer)" : "", " features last (the weight's), got ", x.scalar_type(), " ", x.device(),
              " ", x.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype),
              "stream_linear: bias must be ", dtype, " [", n, "], got ", bias->scalar_type(), " ", bias->sizes());
  TORCH_CHECK(lora_a.has_value() == lora_b.has_value(), "stream_linear: a LoRA side path needs both A and B");
  int64_t rank = 0;
  if (lora_a.has_value()) {
    TORCH_CHECK(stream_pairs(*lora_a) == pairs && !stream_pairs(*lora_b),
                "stream_linear: LoRA's A must be packed as the weight is (", pairs ? "in pairs" : "plain",
                ") and its B plain");
    rank = stream_check("LoRA's A", *lora_a, dtype, k);
    TORCH_CHECK(stream_check("LoRA's B", *lora_b, dtype, rank) == n, "stream_linear: LoRA's B must have ", n,
                " rows (the weight's), got ", lora_b->size(0) * STREAM_COLUMNS);
  }
  const int64_t rows = x.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto out = at::empty(shape, x.options());
  if (rows == 0) return out;
  DISPATCH_SAMPLER_TYPES(dtype, "stream_linear", [&] {
    // the inputs laid out for the kernel: as they are, or as k-pairs for the dot product (an odd K
    // completed with a zero, as the weight was), each pair's 32 bits moved as a float's, never
    // computed with
    const auto xc = pairs && k % 2 ? at::constant_pad_nd(x.reshape({rows, k}), {0, 1}) : x.contiguous();
    const int64_t width = pairs ? (k + 1) / 2 : k;
    const auto xp = pairs ? stream_inputs(reinterpret_cast<const float*>(xc.data_ptr<scalar_t>()), width, rows, width)
                          : stream_inputs(xc.data_ptr<scalar_t>(), k, rows, k);
    // xp @ a weight's panels (+ x2 @ w2's, LoRA's B over d) into y, through the weight's kernel
    auto product = [&](const float* x2, int64_t k2, int64_t panels, const scalar_t* w, const scalar_t* w2,
                       const float* bd, auto* y) {
#if defined(STREAM_DOT)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
        if (pairs) return stream_dot_product(xp.get(), width, x2, k2, rows, panels, w, w2, bd, y);
#endif
      stream_product<scalar_t>(xp.get(), k, x2, k2, rows, panels, w, w2, bd, y);
    };
    std::vector<float> b(bias.has_value() ? n : 0), down;
    std::unique_ptr<float[]> dp;
    if (bias.has_value()) to_float(bias->contiguous().data_ptr<scalar_t>(), b.data(), n);
    if (rank > 0) {  // d = x @ A.T, kept in float32, then laid out as the inputs of B's part of the sums
      down.resize(rows * rank);
      product(nullptr, 0, rank / STREAM_COLUMNS, lora_a->data_ptr<scalar_t>(), nullptr, nullptr, down.data());
      dp = stream_inputs(down.data(), rank, rows, rank);
    }
    product(dp.get(), rank, n / STREAM_COLUMNS, packed.data_ptr<scalar_t>(),
            rank ? lora_b->data_ptr<scalar_t>() : nullptr, b.empty() ? nullptr : b.data(), out.data_ptr<scalar_t>());
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// A whole decoding step's layers in one call (native_decode.py's NativeDecoder): the same calls in
// the same order as its Python loop -- oneDNN's Linear on the sampler's packed weights (with a
// LoRA side path's two calls where it has one), rope_attend, add_rms_norm, silu_mul -- made from
// here, so that a step pays one call from Python instead of ~8 a layer (with the modules' own
// calls between them: ~12% of an fp32 step at 24 rows on SmolLM2's 30 layers).

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

// Every layer of a Llama-layout decoder for one decoding step. Per layer: 4 packed weights (q/k/v
// stacked, o, gate/up stacked, down) in `weights`, and 3 optional tensors per weight in `extras`
// (bias, LoRA's packed A and packed B, the scale in B); `norms` holds each layer's input and
// post-attention norm weights in turn, then the final norm's. `hidden` is the embedded tokens
// [rows, dim]; returns the final norm's output [rows, dim]. `shared_from` and `shared`: rows that
// share their first columns, as rope_attend takes them (every layer's caches alike).
at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& lengths, at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& extras, at::TensorList norms,
                         at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef qkv_sizes,
                         int64_t heads, double scale, double eps, const c10::optional<at::Tensor>& shared_from,
                         const c10::optional<at::Tensor>& shared) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(extras.size()) == 12 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers + 1,
              "decode_layers: for ", layers, " layers: 4 weights, 12 extras and 2 norms a layer, one final norm; got ",
              weights.size(), " weights, ", extras.size(), " extras, ", norms.size(), " norms, ", v_caches.size(),
              " value caches");
  TORCH_CHECK(qkv_sizes.size() == 3, "decode_layers: qkv_sizes must be [q, k, v] widths");
  auto linear = [&](const at::Tensor& x, int64_t layer, int64_t which) {
    const int64_t e = 12 * layer + 3 * which;
    return packed_linear(x, weights[4 * layer + which], extras.get(e), extras.get(e + 1), extras.get(e + 2));
  };
  // the attention's scores by avx512_bf16's dot product where the products take it: the weights packed in
  // pairs, which the sampler does only where kernel_probe.py measured that instruction the faster here
  const bool dot = !weights[0].is_mkldnn() && weights[0].scalar_type() == at::kBFloat16 && stream_pairs(weights[0]);
  auto state = add_rms_norm(hidden_in, c10::nullopt, norms[0], eps);  // {hidden, normed}
  for (int64_t i = 0; i < layers; ++i) {
    auto qkv = linear(state[1], i, 0);
    auto q = qkv.narrow(1, 0, qkv_sizes[0]);
    auto k = qkv.narrow(1, qkv_sizes[0], qkv_sizes[1]);
    auto v = qkv.narrow(1, qkv_sizes[0] + qkv_sizes[1], qkv_sizes[2]);
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    auto attended = rope_attend(q, k, v, cos, sin, k_cache, v_cache, lengths, heads, scale, shared_from, shared, dot);
    state = add_rms_norm(state[0], linear(attended, i, 1), norms[2 * i + 1], eps);
    auto gate_up = linear(state[1], i, 2);
    const int64_t inter = gate_up.size(1) / 2;
    auto act = silu_mul(gate_up.narrow(1, 0, inter), gate_up.narrow(1, inter, inter));
    state = add_rms_norm(state[0], linear(act, i, 3), norms[i + 1 < layers ? 2 * (i + 1) : 2 * layers], eps);
  }
  return state[1];
}

// ---------------------------------------------------------------------------------------------
// The trainer's attention over packed sequences (packed_attention.py), forward and backward.
//
// A training pass holds every sequence's tokens back to back in one row; sequence s has its
// queries at rows q_start..q_start+q_len and sees key_rows[key_offset..key_offset+prefix+q_len]
// (the rows of the sequences it continues, then its own), query j the first prefix + j + 1 of
// them: causal within its own tokens. PyTorch's SDPA took this as padded blocks gathered per call,
// with an explicit mask (no block skipped), each (sequence, head) a few small GEMM calls: ~87
// GFLOP/s padded over SmolLM2's bench pass on an AMD EPYC, 2 cores, forward + backward 0.22 s of a
// 2.1 s training call. Here a task is up to 64 queries of one sequence through one key head: the
// keys and values they see gathered once into float32 panels shared by the query heads reading
// them, scores for four queries by thirty-two keys in registers (avx512), no padding and nothing
// past a query's last key. float32 sums, q/k/v widened from bf16 as read, outputs rounded once to
// their dtype (as SDPA over float32 copies, the path it replaces). The backward recomputes the
// weights from the saved log-sum-exp (as flash attention does) and sums the key and value
// gradients of the rows that several tasks see (a shared prompt, a long sequence's first tokens) in
// one float32 buffer, each task's added in the tasks' order (the same bits every run; a buffer per
// thread would also be threads x the keys' and values' size: gigabytes for a 16k-token pass on 16
// cores).

// seqs: [S, 4] int64 rows (q_start, q_len, prefix, key_offset)
struct PackedSeq {
  int64_t q_start, q_len, prefix, key_offset;
};

constexpr int64_t PA_ROWS = 4;   // queries whose scores are taken together
constexpr int64_t PA_KEYS = 16;  // keys a score block covers (one avx512 register of floats)

inline int64_t pa_round(int64_t n) { return (n + PA_KEYS - 1) / PA_KEYS * PA_KEYS; }

// The panels of one (sequence, key head): keys row-major [kl][dim] and transposed [dim][klp]
// (klp: kl rounded up to PA_KEYS, zeros past kl), values the same; all float32.
struct KeyPanels {
  std::vector<float> keys, keys_t, values, values_t;
};

template <typename T>
void gather_panels(const T* k, const T* v, int64_t k_stride, const int64_t* rows, int64_t kl, int64_t head,
                   int64_t dim, bool transposed_values, bool row_keys, KeyPanels& p) {
  const int64_t klp = pa_round(kl);
  p.keys_t.assign(dim * klp, 0.f);
  p.values.resize(kl * dim);
  if (row_keys) p.keys.resize(kl * dim);
  if (transposed_values) p.values_t.assign(dim * klp, 0.f);
  std::vector<float> row(dim);
  for (int64_t t = 0; t < kl; ++t) {
    to_float(k + rows[t] * k_stride + head * dim, row.data(), dim);
    for (int64_t d = 0; d < dim; ++d) p.keys_t[d * klp + t] = row[d];
    if (row_keys) std::memcpy(p.keys.data() + t * dim, row.data(), dim * sizeof(float));
    to_float(v + rows[t] * k_stride + head * dim, p.values.data() + t * dim, dim);
    if (transposed_values)
      for (int64_t d = 0; d < dim; ++d) p.values_t[d * klp + t] = p.values[t * dim + d];
  }
}

#if defined(FLOAT_LANES)
// pa_scores with a head dimension known when compiling: KEY_BLOCKS x sixteen keys by four queries
// in registers (each query's value broadcast once for all of them), sixteen where fewer are left
template <int64_t DIM, int BLOCKS>
inline void pa_scores_block(const float* rows, int64_t nr, const float* bt, int64_t ldb, int64_t t0, float* out,
                            int64_t ldo) {
  using V = FloatLanes;
  constexpr int R = BLOCKS * PA_KEYS / V::W;  // registers a query's sums take
  typename V::reg acc[PA_ROWS][R];
#pragma GCC unroll 4
  for (int i = 0; i < PA_ROWS; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[i][r] = V::zero();
  for (int64_t d = 0; d < DIM; ++d) {
    typename V::reg b[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) b[r] = V::load(bt + d * ldb + t0 + r * V::W);
#pragma GCC unroll 4
    for (int i = 0; i < PA_ROWS; ++i) {
      const typename V::reg x = V::set1(rows[i * DIM + d]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[i][r] = V::fma(x, b[r], acc[i][r]);
    }
  }
  for (int64_t i = 0; i < nr; ++i)
    for (int r = 0; r < R; ++r) V::store(out + i * ldo + t0 + r * V::W, acc[i][r]);
}

template <int64_t DIM>
inline void pa_scores_vec(const float* a, int64_t nr, const float* bt, int64_t ldb, int64_t keys, float* out,
                          int64_t ldo) {
  float rows[PA_ROWS * DIM];  // (absent rows as zeros: one loop of fixed shape)
  std::memcpy(rows, a, nr * DIM * sizeof(float));
  std::fill(rows + nr * DIM, rows + PA_ROWS * DIM, 0.f);
  constexpr int64_t SPAN = FloatLanes::KEY_BLOCKS * PA_KEYS;
  int64_t t0 = 0;
  for (; t0 + SPAN <= keys; t0 += SPAN) pa_scores_block<DIM, FloatLanes::KEY_BLOCKS>(rows, nr, bt, ldb, t0, out, ldo);
  for (; t0 < keys; t0 += PA_KEYS) pa_scores_block<DIM, 1>(rows, nr, bt, ldb, t0, out, ldo);
}

// out[i] = scale * sum_{t < limit[i]} w[i][t] * b[t], ROW_PAIRS rows' sums in registers at a time
// (avx512: two rows, each row of b loaded once for both; avx2: one)
template <int64_t DIM>
inline void pa_weighted_rows_vec(const float* w, int64_t ldw, int64_t nr, const int64_t* limit, const float* b,
                                 float scale, float* out) {
  using V = FloatLanes;
  constexpr int C = V::REGS_A_PASS < DIM / V::W ? V::REGS_A_PASS : DIM / V::W;  // a row's sums a pass
  const typename V::reg factor = V::set1(scale);
  for (int64_t i = 0; i < nr; i += V::ROW_PAIRS) {
    const bool pair = V::ROW_PAIRS == 2 && i + 1 < nr;
    const float* w0 = w + i * ldw;
    const float* w1 = pair ? w0 + ldw : w0;
    const int64_t both = pair ? std::min(limit[i], limit[i + 1]) : 0;
    for (int64_t h = 0; h < DIM; h += C * V::W) {  // (avx2 and 128 dims: two passes of 64)
      typename V::reg acc0[C], acc1[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = V::zero();
      int64_t t = 0;
      if (pair)
        for (; t < both; ++t) {
          const typename V::reg x0 = V::set1(w0[t]), x1 = V::set1(w1[t]);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) {
            const typename V::reg v = V::load(b + t * DIM + h + V::W * c);
            acc0[c] = V::fma(x0, v, acc0[c]);
            acc1[c] = V::fma(x1, v, acc1[c]);
          }
        }
      for (int64_t u = t; u < limit[i]; ++u) {  // (a row's keys past the other's, or every key of one row)
        const typename V::reg x0 = V::set1(w0[u]);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc0[c] = V::fma(x0, V::load(b + u * DIM + h + V::W * c), acc0[c]);
      }
      if (pair)
        for (int64_t u = t; u < limit[i + 1]; ++u) {
          const typename V::reg x1 = V::set1(w1[u]);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) acc1[c] = V::fma(x1, V::load(b + u * DIM + h + V::W * c), acc1[c]);
        }
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        V::store(out + i * DIM + h + V::W * c, V::mul(acc0[c], factor));
        if (pair) V::store(out + (i + 1) * DIM + h + V::W * c, V::mul(acc1[c], factor));
      }
    }
  }
}

// dk[t] += sum_i scale * a[i][t] * q[i], dv[t] += sum_i b[i][t] * g[i] for t < keys: a key's sums
// over the nr queries in registers, one add to memory each (avx2: the key's then the value's, 64
// dims at a time, as more at once would take every register)
template <int64_t DIM>
inline void pa_key_grads_vec(const float* a, const float* bw, int64_t ldw, int64_t nr, int64_t keys, float scale,
                             const float* q, const float* g, float* dk, float* dv) {
  using V = FloatLanes;
  constexpr int C = V::REGS_A_PASS < DIM / V::W ? V::REGS_A_PASS : DIM / V::W;
  constexpr bool both = V::SPLIT_GRADS == 1;
  for (int64_t t = 0; t < keys; ++t)
    for (int part = 0; part < 2; part += both ? 2 : 1)
      for (int64_t h = 0; h < DIM; h += C * V::W) {
        typename V::reg ak[C], av[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) ak[c] = av[c] = V::zero();
        for (int64_t i = 0; i < nr; ++i) {
          if (both || part == 0) {
            const typename V::reg x = V::set1(a[i * ldw + t] * scale);
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) ak[c] = V::fma(x, V::load(q + i * DIM + h + V::W * c), ak[c]);
          }
          if (both || part == 1) {
            const typename V::reg y = V::set1(bw[i * ldw + t]);
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) av[c] = V::fma(y, V::load(g + i * DIM + h + V::W * c), av[c]);
          }
        }
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          float* k_out = dk + t * DIM + h + V::W * c;
          float* v_out = dv + t * DIM + h + V::W * c;
          if (both || part == 0) V::store(k_out, V::add(V::load(k_out), ak[c]));
          if (both || part == 1) V::store(v_out, V::add(V::load(v_out), av[c]));
        }
      }
}
#endif

// out[i][t] = sum_d a[i][d] * bt[d][t] for nr <= PA_ROWS rows of a (dim floats each) and t < keys
// (a multiple of PA_KEYS), bt [dim][ldb]: sixteen columns by PA_ROWS rows in registers
template <int64_t DIM>
inline void pa_scores(const float* a, int64_t nr, const float* bt, int64_t ldb, int64_t keys, int64_t dim_, float* out,
                      int64_t ldo) {
#if defined(FLOAT_LANES)
  if constexpr (DIM > 0 && DIM % 16 == 0) return pa_scores_vec<DIM>(a, nr, bt, ldb, keys, out, ldo);
#endif
  const int64_t dim = DIM > 0 ? DIM : dim_;
  float rows[PA_ROWS * (DIM > 0 ? DIM : 1)];
  const float* x = a;
  if constexpr (DIM > 0) {  // (absent rows as zeros: one loop of fixed shape)
    std::memcpy(rows, a, nr * DIM * sizeof(float));
    std::fill(rows + nr * DIM, rows + PA_ROWS * DIM, 0.f);
    x = rows;
  }
  for (int64_t t0 = 0; t0 < keys; t0 += PA_KEYS) {
    float acc[PA_ROWS][PA_KEYS] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float* b = bt + d * ldb + t0;
#pragma GCC unroll 4
      for (int64_t i = 0; i < PA_ROWS; ++i) {
        const float v = (DIM > 0 || i < nr) ? x[i * dim + d] : 0.f;
#pragma omp simd
        for (int64_t u = 0; u < PA_KEYS; ++u) acc[i][u] = std::fma(v, b[u], acc[i][u]);
      }
    }
    for (int64_t i = 0; i < nr; ++i) std::memcpy(out + i * ldo + t0, acc[i], PA_KEYS * sizeof(float));
  }
}

// out[i][:] = scale * sum_{t < limit[i]} w[i][t] * b[t][:] for nr rows, b [*][dim] row-major
template <int64_t DIM>
inline void pa_weighted_rows(const float* w, int64_t ldw, int64_t nr, const int64_t* limit, const float* b,
                             int64_t dim_, float scale, float* out) {
#if defined(FLOAT_LANES)
  if constexpr (DIM > 0 && DIM % 16 == 0) return pa_weighted_rows_vec<DIM>(w, ldw, nr, limit, b, scale, out);
#endif
  const int64_t dim = DIM > 0 ? DIM : dim_;
  for (int64_t i = 0; i < nr; ++i) {
    const float* wi = w + i * ldw;
    float* __restrict o = out + i * dim;
    if constexpr (DIM > 0) {  // the row's sums in registers
      float acc[DIM] = {};
      for (int64_t t = 0; t < limit[i]; ++t) {
        const float x = wi[t];
        const float* row = b + t * DIM;
#pragma omp simd
        for (int64_t d = 0; d < DIM; ++d) acc[d] = std::fma(x, row[d], acc[d]);
      }
#pragma omp simd
      for (int64_t d = 0; d < DIM; ++d) o[d] = acc[d] * scale;
    } else {
      std::fill(o, o + dim, 0.f);
      for (int64_t t = 0; t < limit[i]; ++t) {
        const float x = wi[t];
        const float* row = b + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = std::fma(x, row[d], o[d]);
      }
      for (int64_t d = 0; d < dim; ++d) o[d] *= scale;
    }
  }
}

// dk[t] += scale * sum_i a[i][t] * q[i], dv[t] += sum_i bw[i][t] * g[i] for t < keys (a and bw zero
// past each query's last key)
template <int64_t DIM>
inline void pa_key_grads(const float* a, const float* bw, int64_t ldw, int64_t nr, int64_t keys, float scale,
                         const float* q, const float* g, int64_t dim_, float* dk, float* dv) {
#if defined(FLOAT_LANES)
  if constexpr (DIM > 0 && DIM % 16 == 0) return pa_key_grads_vec<DIM>(a, bw, ldw, nr, keys, scale, q, g, dk, dv);
#endif
  const int64_t dim = DIM > 0 ? DIM : dim_;
  for (int64_t t = 0; t < keys; ++t)
    for (int64_t i = 0; i < nr; ++i) {
      const float x = a[i * ldw + t] * scale, y = bw[i * ldw + t];
      float* __restrict k_out = dk + t * dim;
      float* __restrict v_out = dv + t * dim;
      const float* qi = q + i * dim;
      const float* gi = g + i * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        k_out[d] = std::fma(x, qi[d], k_out[d]);
        v_out[d] = std::fma(y, gi[d], v_out[d]);
      }
    }
}

// x[t] = exp(x[t] * scale - lse), the weight, and dx[t] = x[t] * (dx[t] - delta), the score's
// gradient before the scale, for t < n; both zero for n <= t < keys
inline void pa_weights_backward(float* x, float* dx, int64_t n, int64_t keys, float scale, float lse, float delta) {
#if defined(FLOAT_LANES)
  using V = FloatLanes;
  const V::reg factor = V::set1(scale), shift = V::set1(lse), d = V::set1(delta);
  for (int64_t t = 0; t < keys; t += V::W) {  // (keys: a multiple of sixteen, past n zero)
    const V::reg w = V::below(vexp_lanes(V::sub(V::mul(V::load(x + t), factor), shift)), t, n);
    V::store(x + t, w);
    V::store(dx + t, V::mul(w, V::sub(V::load(dx + t), d)));
  }
  return;
#endif
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    x[t] = vexp(x[t] * scale - lse);
    dx[t] = x[t] * (dx[t] - delta);
  }
  for (int64_t t = n; t < keys; ++t) x[t] = dx[t] = 0.f;
}

// x[t] = exp(x[t] * scale - top) for t < n, top their largest scaled value; returns their sum
inline float pa_softmax_numerators(float* x, int64_t n, float scale, float& top) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) x[t] *= scale;
  top = row_max(x, n);
#if defined(ATTEND_AVX512)
  return exp_shifted_total(x, n, top);  // (sixteen at a time, the last sixteen masked: no scalar tail)
#elif defined(FLOAT_LANES)
  // a register at a time, lanes past n zero (x has room: a row's scores run to a multiple of sixteen)
  using V = FloatLanes;
  const V::reg shift = V::set1(top);
  V::reg sums = V::zero();
  for (int64_t t = 0; t < n; t += V::W) {
    const V::reg e = V::below(vexp_lanes(V::sub(V::load(x + t), shift)), t, n);
    V::store(x + t, e);
    sums = V::add(sums, e);
  }
  float lanes[V::W];
  V::store(lanes, sums);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
#endif
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    x[t] = vexp(x[t] - top);
    total += x[t];
  }
  return total;
}

// A task: PA_CHUNK queries (or fewer, a sequence's last) of one sequence through one key head, and
// only the keys they see. A long sequence is then many tasks, not one per key head (a single
// 2,048-token sequence of a model with one key head would otherwise keep one thread busy).
constexpr int64_t PA_CHUNK = 64;

struct PaTask {
  int64_t seq, head, first, count;  // queries first..first+count of sequence seq, key head `head`
};

// the tasks, most work first: taken in turn by whichever thread is free
std::vector<PaTask> pa_tasks(const std::vector<PackedSeq>& seqs, int64_t kv_heads) {
  std::vector<PaTask> tasks;
  for (size_t i = 0; i < seqs.size(); ++i)
    for (int64_t first = 0; first < seqs[i].q_len; first += PA_CHUNK)
      for (int64_t g = 0; g < kv_heads; ++g)
        tasks.push_back({static_cast<int64_t>(i), g, first, std::min(PA_CHUNK, seqs[i].q_len - first)});
  auto cost = [&](const PaTask& t) { return t.count * (seqs[t.seq].prefix + t.first + t.count); };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const PaTask& a, const PaTask& b) { return cost(a) > cost(b); });
  return tasks;
}

// work(task, i) for every task (tasks[i]), each thread taking the next task not yet taken (a static
// split of tasks of such uneven sizes left one thread idle): task i is started before task i + 1
template <typename F>
void pa_run(const std::vector<PaTask>& tasks, F&& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot)
      for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) work(tasks[i], i);
  });
}

std::vector<PackedSeq> pa_sequences(const at::Tensor& seqs, const at::Tensor& key_rows, int64_t rows) {
  TORCH_CHECK(seqs.device().is_cpu() && seqs.scalar_type() == at::kLong && seqs.dim() == 2 && seqs.size(1) == 4 &&
                  seqs.is_contiguous(),
              "packed_attention: seqs must be a contiguous int64 [sequences, 4] CPU tensor, got ", seqs.sizes());
  TORCH_CHECK(key_rows.device().is_cpu() && key_rows.scalar_type() == at::kLong && key_rows.dim() == 1 &&
                  key_rows.is_contiguous(),
              "packed_attention: key_rows must be a contiguous int64 vector");
  std::vector<PackedSeq> out(seqs.size(0));
  const int64_t* s = seqs.data_ptr<int64_t>();
  const int64_t* kr = key_rows.data_ptr<int64_t>();
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = {s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]};
    const PackedSeq& q = out[i];
    TORCH_CHECK(q.q_start >= 0 && q.q_len >= 0 && q.q_start + q.q_len <= rows && q.prefix >= 0 && q.key_offset >= 0 &&
                    q.key_offset + q.prefix + q.q_len <= key_rows.size(0),
                "packed_attention: sequence ", i, " is out of range");
    for (int64_t t = 0; t < q.prefix + q.q_len; ++t)
      TORCH_CHECK(kr[q.key_offset + t] >= 0 && kr[q.key_offset + t] < rows, "packed_attention: key row out of range");
  }
  return out;
}

struct PaShape {
  int64_t rows, heads, kv_heads, dim;
};

PaShape pa_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "packed_attention: ", heads,
              " query heads are not a multiple of ", kv_heads, " key heads");
  TORCH_CHECK(q.dim() == 2 && q.size(1) % heads == 0, "packed_attention: q must be [rows, heads * dim], got ",
              q.sizes());
  const int64_t rows = q.size(0), dim = q.size(1) / heads;
  check_rows(q, rows, heads * dim, "packed_attention: q");
  check_rows(k, rows, kv_heads * dim, "packed_attention: k");
  check_rows(v, rows, kv_heads * dim, "packed_attention: v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "packed_attention: q, k and v must share one dtype");
  return {rows, heads, kv_heads, dim};
}

template <typename T, int64_t DIM>
void packed_attention_impl(const T* q, const T* k, const T* v, const std::vector<PackedSeq>& seqs,
                           const int64_t* key_rows, PaShape sh, float scale, T* out, float* lse) {
  const int64_t dim = DIM > 0 ? DIM : sh.dim, group = sh.heads / sh.kv_heads;
  const int64_t q_stride = sh.heads * dim, k_stride = sh.kv_heads * dim;
  pa_run(pa_tasks(seqs, sh.kv_heads), [&](const PaTask& task, int64_t) {
    const PackedSeq& s = seqs[task.seq];
    const int64_t g = task.head, end = task.first + task.count, kl = s.prefix + end, klp = pa_round(kl);
    thread_local KeyPanels p;
    thread_local std::vector<float> qf, w, o;
    gather_panels(k, v, k_stride, key_rows + s.key_offset, kl, g, dim, false, false, p);
    qf.resize(PA_ROWS * dim);
    w.resize(PA_ROWS * klp);
    o.resize(PA_ROWS * dim);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t r0 = task.first; r0 < end; r0 += PA_ROWS) {
        const int64_t nr = std::min(PA_ROWS, end - r0);
        int64_t limit[PA_ROWS];
        for (int64_t i = 0; i < nr; ++i) {
          limit[i] = s.prefix + r0 + i + 1;  // query r0 + i sees its prefix and its sequence up to itself
          to_float(q + (s.q_start + r0 + i) * q_stride + h * dim, qf.data() + i * dim, dim);
        }
        pa_scores<DIM>(qf.data(), nr, p.keys_t.data(), klp, pa_round(limit[nr - 1]), dim, w.data(), klp);
        for (int64_t i = 0; i < nr; ++i) {
          float top;
          float* x = w.data() + i * klp;
          const float total = pa_softmax_numerators(x, limit[i], scale, top);
          const float inverse = 1.f / total;
#pragma omp simd
          for (int64_t t = 0; t < limit[i]; ++t) x[t] *= inverse;
          lse[(s.q_start + r0 + i) * sh.heads + h] = top + std::log(total);
        }
        pa_weighted_rows<DIM>(w.data(), klp, nr, limit, p.values.data(), dim, 1.f, o.data());
        for (int64_t i = 0; i < nr; ++i)
          from_float(o.data() + i * dim, out + (s.q_start + r0 + i) * q_stride + h * dim, dim);
      }
    }
  });
}

std::vector<at::Tensor> packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& seqs, const at::Tensor& key_rows, int64_t heads,
                                         int64_t kv_heads, double scale) {
  const PaShape sh = pa_shape(q, k, v, heads, kv_heads);
  const auto list = pa_sequences(seqs, key_rows, sh.rows);
  auto out = at::zeros_like(q, at::MemoryFormat::Contiguous);
  auto lse = at::zeros({sh.rows, sh.heads}, q.options().dtype(at::kFloat));
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "packed_attention", [&] {
    auto run = [&](auto dim) {
      packed_attention_impl<scalar_t, decltype(dim)::value>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), list, key_rows.data_ptr<int64_t>(),
          sh, static_cast<float>(scale), out.data_ptr<scalar_t>(), lse.data_ptr<float>());
    };
    if (sh.dim == 64) return run(std::integral_constant<int64_t, 64>{});
    if (sh.dim == 128) return run(std::integral_constant<int64_t, 128>{});
    run(std::integral_constant<int64_t, 0>{});
  });
  return {out, lse};
}

template <typename T, int64_t DIM>
void packed_attention_backward_impl(const T* grad, const T* q, const T* k, const T* v, const T* out, const float* lse,
                                    const std::vector<PackedSeq>& seqs, const int64_t* key_rows, PaShape sh,
                                    float scale, T* dq, float* dkv) {
  const int64_t dim = DIM > 0 ? DIM : sh.dim, group = sh.heads / sh.kv_heads;
  const int64_t q_stride = sh.heads * dim, k_stride = sh.kv_heads * dim;
  // dkv: the key gradients' float32 sums [rows, k_stride], then the values'; tasks add theirs in turn
  std::mutex turn_lock;
  std::condition_variable turn_changed;
  int64_t turn = 0;
  std::exception_ptr failure;
  pa_run(pa_tasks(seqs, sh.kv_heads), [&](const PaTask& task, int64_t index) {
    const PackedSeq& s = seqs[task.seq];
    const int64_t g = task.head, end = task.first + task.count, kl = s.prefix + end, klp = pa_round(kl);
    thread_local KeyPanels p;
    thread_local std::vector<float> qf, gf, of, w, dw, dqf, dkl, dvl;
    bool computed = false;
    try {  // (a task that fails, out of memory, still takes its turn below: the others wait for it)
      gather_panels(k, v, k_stride, key_rows + s.key_offset, kl, g, dim, true, true, p);
      qf.resize(PA_ROWS * dim);
      gf.resize(PA_ROWS * dim);
      of.resize(dim);
      w.resize(PA_ROWS * klp);
      dw.resize(PA_ROWS * klp);
      dqf.resize(PA_ROWS * dim);
      dkl.assign(kl * dim, 0.f);  // this task's key and value gradients, added to the shared sums at the end
      dvl.assign(kl * dim, 0.f);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t r0 = task.first; r0 < end; r0 += PA_ROWS) {
          const int64_t nr = std::min(PA_ROWS, end - r0);
          int64_t limit[PA_ROWS];
          float delta[PA_ROWS];  // sum_d grad * out of each query: softmax's backward
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t row = s.q_start + r0 + i;
            limit[i] = s.prefix + r0 + i + 1;
            to_float(q + row * q_stride + h * dim, qf.data() + i * dim, dim);
            to_float(grad + row * q_stride + h * dim, gf.data() + i * dim, dim);
            to_float(out + row * q_stride + h * dim, of.data(), dim);
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += gf[i * dim + d] * of[d];
            delta[i] = dot;
          }
          const int64_t keys = pa_round(limit[nr - 1]);
          pa_scores<DIM>(qf.data(), nr, p.keys_t.data(), klp, keys, dim, w.data(), klp);     // scores
          pa_scores<DIM>(gf.data(), nr, p.values_t.data(), klp, keys, dim, dw.data(), klp);  // d weights
          for (int64_t i = 0; i < nr; ++i) {
            float* x = w.data() + i * klp;
            float* dx = dw.data() + i * klp;
            const float m = lse[(s.q_start + r0 + i) * sh.heads + h], di = delta[i];
            pa_weights_backward(x, dx, limit[i], keys, scale, m, di);
          }
          pa_weighted_rows<DIM>(dw.data(), klp, nr, limit, p.keys.data(), dim, scale, dqf.data());
          for (int64_t i = 0; i < nr; ++i)
            from_float(dqf.data() + i * dim, dq + (s.q_start + r0 + i) * q_stride + h * dim, dim);
          // dk[t] += scale * sum_i ds[i][t] q[i], dv[t] += sum_i w[i][t] g[i]
          pa_key_grads<DIM>(dw.data(), w.data(), klp, nr, limit[nr - 1], scale, qf.data(), gf.data(), dim, dkl.data(),
                            dvl.data());
        }
      }
      computed = true;
    } catch (...) {
      std::lock_guard<std::mutex> guard(turn_lock);
      if (!failure) failure = std::current_exception();
    }
    // into the shared sums in the tasks' order, whichever thread finished first: float sums in an
    // order set by the tasks alone, so that a run's gradients are the same bits every time (runs
    // resume and repeat bit for bit, tests/test_reproducibility.py). Task i was started before
    // task i + 1, so the wait is for a task under way; the adds are a small part of a task.
    std::unique_lock<std::mutex> held(turn_lock);
    turn_changed.wait(held, [&] { return turn == index; });
    const int64_t* rows = key_rows + s.key_offset;
    for (int64_t t = 0; computed && t < kl; ++t) {
      float* dk = dkv + rows[t] * k_stride + g * dim;
      float* dv = dk + sh.rows * k_stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        dk[d] += dkl[t * dim + d];
        dv[d] += dvl[t * dim + d];
      }
    }
    ++turn;
    held.unlock();
    turn_changed.notify_all();
  });
  if (failure) std::rethrow_exception(failure);
}

std::vector<at::Tensor> packed_attention_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                  const at::Tensor& seqs, const at::Tensor& key_rows, int64_t heads,
                                                  int64_t kv_heads, double scale) {
  const PaShape sh = pa_shape(q, k, v, heads, kv_heads);
  check_rows(grad, sh.rows, heads * sh.dim, "packed_attention_backward: grad");
  check_rows(out, sh.rows, heads * sh.dim, "packed_attention_backward: out");
  TORCH_CHECK(grad.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "packed_attention_backward: grad and out must have q's dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({sh.rows, heads}),
              "packed_attention_backward: lse must be float32 [rows, heads]");
  const auto list = pa_sequences(seqs, key_rows, sh.rows);
  auto dq = at::zeros_like(q, at::MemoryFormat::Contiguous);
  auto dkv = at::zeros({2, sh.rows, kv_heads * sh.dim}, q.options().dtype(at::kFloat));
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "packed_attention_backward", [&] {
    auto run = [&](auto dim) {
      packed_attention_backward_impl<scalar_t, decltype(dim)::value>(
          grad.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          out.data_ptr<scalar_t>(), lse.data_ptr<float>(), list, key_rows.data_ptr<int64_t>(), sh,
          static_cast<float>(scale), dq.data_ptr<scalar_t>(), dkv.data_ptr<float>());
    };
    if (sh.dim == 64) return run(std::integral_constant<int64_t, 64>{});
    if (sh.dim == 128) return run(std::integral_constant<int64_t, 128>{});
    run(std::integral_constant<int64_t, 0>{});
  });
  return {dq, dkv[0].to(q.scalar_type()), dkv[1].to(q.scalar_type())};
}

}  // namespace

TORCH_LIBRARY(grpo_native, m) {
  m.def("add_rms_norm(Tensor residual, Tensor? x, Tensor weight, float eps) -> Tensor[]");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> Tensor[]");
  m.def("sample_tokens(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor[]");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int heads, bool backward) -> Tensor");
  m.def("target_logprobs(Tensor logits, Tensor targets) -> Tensor[]");
  m.def("target_logprobs_backward_(Tensor grad, Tensor(a!) logits, Tensor targets, Tensor stats) -> Tensor(a!)");
  m.def("rope_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor lengths, int heads, float scale, Tensor? shared_from=None, Tensor? shared=None, bool dot=False) "
        "-> Tensor");
  m.def("stream_pack(Tensor weight, bool pairs=False) -> Tensor");
  m.def("stream_dot_available() -> bool", stream_dot_available);
  m.def("release_kept_chunks() -> int", release_kept_chunks);  // (no tensor to dispatch on: one kernel)
  m.def("stream_linear(Tensor x, Tensor packed, Tensor? bias, Tensor? lora_a=None, Tensor? lora_b=None) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor lengths, Tensor[] weights, Tensor?[] extras, "
        "Tensor[] norms, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] qkv_sizes, int heads, float scale, "
        "float eps, Tensor? shared_from=None, Tensor? shared=None) -> Tensor");
  m.def("packed_attention(Tensor q, Tensor k, Tensor v, Tensor seqs, Tensor key_rows, int heads, int kv_heads, "
        "float scale) -> Tensor[]");
  m.def("packed_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor seqs, "
        "Tensor key_rows, int heads, int kv_heads, float scale) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(grpo_native, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rms_norm_backward", rms_norm_backward);
  m.impl("silu_mul_backward", silu_mul_backward);
  m.impl("sample_tokens", sample_tokens);
  m.impl("rope", rope);
  m.impl("target_logprobs", target_logprobs);
  m.impl("target_logprobs_backward_", target_logprobs_backward_);
  m.impl("rope_attend", rope_attend);
  m.impl("decode_layers", decode_layers);
  m.impl("stream_pack", stream_pack);
  m.impl("stream_linear", stream_linear);
  m.impl("packed_attention", packed_attention);
  m.impl("packed_attention_backward", packed_attention_backward);
}

// decode_layers takes oneDNN's packed weights (opaque tensors of the MkldnnCPU backend, which the
// dispatcher then picks for the call) or streaming ones (plain CPU tensors)
TORCH_LIBRARY_IMPL(grpo_native, MkldnnCPU, m) { m.impl("decode_layers", decode_layers); }
