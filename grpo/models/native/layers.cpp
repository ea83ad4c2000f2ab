// The trainer's and the sampler's layer pieces beside the products: residual add + RMSNorm, SiLU * up,
// their backwards, the rotary embedding (forward and backward), the loss head's target logprobs, and
// Gemma 2's cap on the logits.

#include "ops.h"
#include "simd.h"

namespace grpo_native {

// hidden = residual + x (rounded to T), then out = weight * T(hidden * rsqrt(mean(hidden^2) + eps)):
// the residual add before transformers' LlamaRMSNorm, and the norm itself. With a `multiplier` m other
// than 1 (Granite's residual_multiplier), hidden = T(residual + T(x m)), as its layer computes it.
template <typename T>
void add_rms_norm_impl(const T* res, int64_t res_stride, const T* x, int64_t x_stride, const T* weight, T* hidden,
                       T* out, int64_t rows, int64_t dim, float eps, float m) {
  if constexpr (std::is_same_v<T, float>) {  // in place, no copies of rows (as silu_mul's)
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* h = res + r * res_stride;
        if (x != nullptr) {
          float* sum_row = hidden + r * dim;
          const float* xr = x + r * x_stride;
          if (m == 1.f) {
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) sum_row[i] = h[i] + xr[i];
          } else {
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) sum_row[i] = h[i] + xr[i] * m;
          }
          h = sum_row;
        }
        rms_norm_row<float>(h, weight, out + r * dim, dim, eps);
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
        if (m != 1.f)
          for (int64_t i = 0; i < dim; ++i) xs[i] = in_dtype<T>(xs[i] * m);
        for (int64_t i = 0; i < dim; ++i) h[i] = in_dtype<T>(h[i] + xs[i]);
        from_float(h.data(), hidden + r * dim, dim);
      }
      rms_norm_row<T>(h.data(), w.data(), y.data(), dim, eps);
      from_float(y.data(), out + r * dim, dim);
    }
  });
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& residual, const c10::optional<at::Tensor>& x,
                                     const at::Tensor& weight, double eps, double multiplier) {
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
                                rows, dim, static_cast<float>(eps), static_cast<float>(multiplier));
  });
  return {hidden, out};
}

// hidden = T(residual + norm(x)), the norm of a sublayer's output before the residual add (OLMo2's
// post-attention and post-feedforward norms: a layer without norms before its sublayers), or norm(x) alone
// without a residual (its final norm); the norm of `kind` (NormKind), its sum of squares in float32
template <typename T>
void post_norm_add_impl(const T* x, int64_t x_stride, const T* weight, const T* res, T* out, int64_t rows,
                        int64_t dim, float eps, NormKind kind) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y(dim), w(dim), h(dim);
    to_float(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * x_stride, y.data(), dim);
      norm_row_scaled<T>(y.data(), w.data(), y.data(), dim, inverse_rms(y.data(), dim, eps), kind);
      if (res != nullptr) {
        to_float(res + r * dim, h.data(), dim);
        for (int64_t i = 0; i < dim; ++i) y[i] = in_dtype<T>(h[i] + y[i]);
      }
      from_float(y.data(), out + r * dim, dim);
    }
  });
}

at::Tensor post_norm_add(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view norms,
                         const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "post_norm_add: x must be [rows, dim], got ", x.sizes());
  const int64_t rows = x.size(0), dim = x.size(1);
  check_rows(x, rows, dim, "post_norm_add: x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "post_norm_add: weight must be a contiguous [", dim, "] of x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->device().is_cpu() &&
                    residual->scalar_type() == x.scalar_type(),
                "post_norm_add: residual must be a contiguous CPU ", x.scalar_type(), " ", x.sizes(), ", got ",
                residual->scalar_type(), " ", residual->sizes());
  }
  const NormKind kind = norm_kind(norms, "post_norm_add");
  auto out = at::empty({rows, dim}, x.options());
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "post_norm_add", [&] {
    post_norm_add_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                                 residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                                 out.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps), kind);
  });
  return out;
}

// The MLPs' activations of the gate, as float32 functions of one value the compiler vectorizes: `apply`
// the activation, `with_slope` the activation (as the backward recomputes it) and its derivative
struct Silu {  // Llama's, Qwen's
  static float apply(float x) { return x / (1.f + vexp(-x)); }
  static float with_slope(float x, float& slope) {
    const float s = 1.f / (1.f + vexp(-x));
    slope = s * (1.f + x * (1.f - s));
    return x * s;
  }
};
struct GeluTanh {  // Gemma's (gelu_pytorch_tanh): 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
  // as x sigmoid(2u), the same function (1 + tanh(u) = 2 sigmoid(2u)) through vexp, where tanhf is a
  // call per value; within a few float ulps of PyTorch's. Its derivative, PyTorch's
  // 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) u', is s + 2 x s (1 - s) u' with s = sigmoid(2u).
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  static float apply(float x) {
    const float u = kBeta * (x + kKappa * x * x * x);
    return x / (1.f + vexp(-2.f * u));
  }
  static float with_slope(float x, float& slope) {
    const float u = kBeta * (x + kKappa * x * x * x);
    const float s = 1.f / (1.f + vexp(-2.f * u));
    slope = s + 2.f * x * s * (1.f - s) * kBeta * (1.f + 3.f * kKappa * x * x);
    return x * s;
  }
};

// T(act(gate)) * up, rounded to T: an MLP's activation and product (Llama's SiLU, Gemma's GELU)
template <typename Act, typename T>
void activation_mul_impl(const T* gate, int64_t gate_stride, const T* up, int64_t up_stride, T* out, int64_t rows,
                         int64_t width) {
  if constexpr (std::is_same_v<T, float>) {  // one pass, no copies: 0.7x the time at [32, 1536]
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gp = gate + r * gate_stride;
        const float* upp = up + r * up_stride;
        float* op = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) op[i] = Act::apply(gp[i]) * upp[i];
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
      for (int64_t i = 0; i < width; ++i) gp[i] = Act::apply(gp[i]);
      for (int64_t i = 0; i < width; ++i) gp[i] = in_dtype<T>(gp[i]) * upp[i];
      from_float(gp, out + r * width, width);
    }
  });
}

template <typename Act>
at::Tensor activation_mul(const at::Tensor& gate, const at::Tensor& up, const char* name) {
  TORCH_CHECK(gate.dim() == 2, name, ": gate must be [rows, width], got ", gate.sizes());
  const int64_t rows = gate.size(0), width = gate.size(1);
  check_rows(gate, rows, width, name, ": gate");
  check_rows(up, rows, width, name, ": up");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), name, ": gate and up differ in dtype");
  auto out = at::empty({rows, width}, gate.options());
  DISPATCH_SAMPLER_TYPES(gate.scalar_type(), name, [&] {
    activation_mul_impl<Act, scalar_t>(gate.data_ptr<scalar_t>(), gate.stride(0), up.data_ptr<scalar_t>(),
                                       up.stride(0), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) { return activation_mul<Silu>(gate, up, "silu_mul"); }

at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up) {
  return activation_mul<GeluTanh>(gate, up, "gelu_tanh_mul");
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

// The gradients of T(act(gate)) * up for gate and up, as autograd computes them through an MLP's
// activation and product: d_up = grad * T(act(gate)), d_gate = act'(gate) * T(grad * up).
template <typename Act, typename T>
void activation_mul_backward_impl(const T* grad, const T* gate, const T* up, T* d_gate, T* d_up, int64_t rows,
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
        float slope;
        const float act = Act::with_slope(ap[i], slope);
        const float d_act = in_dtype<T>(gp[i] * upp[i]);
        upp[i] = gp[i] * in_dtype<T>(act);
        ap[i] = d_act * slope;
      }
      from_float(ap, d_gate + r * width, width);
      from_float(upp, d_up + r * width, width);
    }
  });
}

template <typename Act>
std::vector<at::Tensor> activation_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                                                const char* name) {
  TORCH_CHECK(gate.dim() == 2, name, ": gate must be [rows, width], got ", gate.sizes());
  TORCH_CHECK(grad.is_contiguous() && gate.is_contiguous() && up.is_contiguous() && grad.sizes() == gate.sizes() &&
                  up.sizes() == gate.sizes(),
              name, ": grad, gate and up must be contiguous and of one shape, got ", grad.sizes(), ", ", gate.sizes(),
              ", ", up.sizes());
  TORCH_CHECK(grad.scalar_type() == gate.scalar_type() && up.scalar_type() == gate.scalar_type(), name,
              ": grad, gate and up must share one dtype");
  auto d_gate = at::empty_like(gate), d_up = at::empty_like(up);
  DISPATCH_SAMPLER_TYPES(gate.scalar_type(), name, [&] {
    activation_mul_backward_impl<Act, scalar_t>(grad.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                                                up.data_ptr<scalar_t>(), d_gate.data_ptr<scalar_t>(),
                                                d_up.data_ptr<scalar_t>(), gate.size(0), gate.size(1));
  });
  return {d_gate, d_up};
}

std::vector<at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  return activation_mul_backward<Silu>(grad, gate, up, "silu_mul_backward");
}

std::vector<at::Tensor> gelu_tanh_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  return activation_mul_backward<GeluTanh>(grad, gate, up, "gelu_tanh_mul_backward");
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

// The trainer's loss head, a row of logits at a time: log_softmax at each row's target, the row's
// entropy, and (max, log of the sum of exp(logit - max)) kept for the backward. Two reads of the
// row where autograd's float32 log_softmax, exp and entropy sweep it (and a bf16 model's float32
// copy of it) about eight times. With `softcap` > 0 (Gemma 2's logits) each row is first capped in
// place, as soft_cap_ caps the sampler's: autograd's three operators over the logits, each a copy
// (and the same three backward), in one more pass over the row.
template <typename T>
void target_logprobs_impl(T* base, const int64_t* tp, float* lp, float* ent, float* st, int64_t rows, int64_t vocab,
                          float softcap) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* x = row_buffer(vocab);
    for (int64_t r = begin; r < end; ++r) {
      to_float(base + r * vocab, x, vocab);
      if (softcap > 0.f) {  // (kept capped, rounded to T: what the backward reads, and what the stats are of)
        soft_cap(x, vocab, softcap);
        from_float(x, base + r * vocab, vocab);
        if constexpr (!std::is_same_v<T, float>) to_float(base + r * vocab, x, vocab);
      }
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

std::vector<at::Tensor> target_logprobs(at::Tensor& logits, const at::Tensor& targets, double softcap) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu() && logits.size(1) > 0,
              "target_logprobs: logits must be a contiguous CPU [rows, vocab], got ", logits.sizes());
  TORCH_CHECK(softcap >= 0, "target_logprobs: softcap must be 0 (none) or the logits' cap, got ", softcap);
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
    target_logprobs_impl<scalar_t>(logits.data_ptr<scalar_t>(), tp, lp, ent, st, rows, vocab,
                                   static_cast<float>(softcap));
  });
  return {logprobs, entropy, stats};
}

// Its backward, written over the logits (no longer needed) in their dtype:
// d logprob[t] / d logits = onehot(t) - softmax(logits), times each row's incoming gradient; with
// `softcap` > 0 the logits are the capped ones, and each gradient goes back through the cap: times
// 1 - tanh^2, tanh = capped / softcap.
template <typename T>
void target_logprobs_backward_impl(const float* gp, T* base, const int64_t* tp, const float* st, int64_t rows,
                                   int64_t vocab, float softcap) {
  const float inverse_cap = softcap > 0.f ? 1.f / softcap : 0.f;  // (0: the factor is 1 - 0)
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* x = row_buffer(vocab);
    for (int64_t r = begin; r < end; ++r) {
      to_float(base + r * vocab, x, vocab);
      // (logit - max) - log_total: max + log_total in one float would round at the max's scale
      const float top = st[2 * r], log_total = st[2 * r + 1], g = gp[r];
      const float target = x[tp[r]];
      if (softcap > 0.f) {
#pragma omp simd
        for (int64_t i = 0; i < vocab; ++i) {
          const float d = (x[i] - top) - log_total, u = x[i] * inverse_cap;
          x[i] = d < -87.f ? 0.f : -g * vexp(d) * (1.f - u * u);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < vocab; ++i) {
          const float d = (x[i] - top) - log_total;
          x[i] = d < -87.f ? 0.f : -g * vexp(d);
        }
      }
      // the target's own term: g * (1 - p), as one product (not -g * p + g: no cancellation)
      const float d = (target - top) - log_total, u = target * inverse_cap;
      x[tp[r]] = g * (1.f - (d < -87.f ? 0.f : vexp(d))) * (1.f - u * u);
      from_float(x, base + r * vocab, vocab);
    }
  });
}

at::Tensor target_logprobs_backward_(const at::Tensor& grad, at::Tensor& logits, const at::Tensor& targets,
                                     const at::Tensor& stats, double softcap) {
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
    target_logprobs_backward_impl<scalar_t>(gp, logits.data_ptr<scalar_t>(), tp, st, rows, vocab,
                                            static_cast<float>(softcap));
  });
  return logits;
}

// logits = softcap * tanh(logits / softcap), in place, each value in float32 and rounded once to the
// logits' dtype (simd.h's soft_cap: a value's result the same wherever it lies): Gemma 2's final cap
// on the sampler's logits, as target_logprobs caps the trainer's
template <typename T>
void soft_cap_impl(T* base, int64_t rows, int64_t width, float softcap) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* x = std::is_same_v<T, float> ? nullptr : row_buffer(width);
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        soft_cap(base + r * width, width, softcap);
      } else {
        to_float(base + r * width, x, width);
        soft_cap(x, width, softcap);
        from_float(x, base + r * width, width);
      }
    }
  });
}

at::Tensor soft_cap_(at::Tensor& logits, double softcap) {
  TORCH_CHECK(logits.is_contiguous() && logits.device().is_cpu() && logits.dim() >= 1,
              "soft_cap_: logits must be a contiguous CPU tensor, got ", logits.sizes());
  TORCH_CHECK(softcap > 0, "soft_cap_: softcap must be positive, got ", softcap);
  const int64_t width = logits.size(-1), rows = width ? logits.numel() / width : 0;
  DISPATCH_SAMPLER_TYPES(logits.scalar_type(), "soft_cap_", [&] {
    soft_cap_impl<scalar_t>(logits.data_ptr<scalar_t>(), rows, width, static_cast<float>(softcap));
  });
  return logits;
}

}  // namespace grpo_native
