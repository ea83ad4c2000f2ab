// Two RMSNorms other than Llama's (layers.cpp has that one), forward and backward, for the trainer and the
// sampler's copy of the model (native_layers.py routes a module to them after it computed the same):
//
// - the zero-centred norm (Qwen3.5's, Qwen3-Next's, Gemma's): y = T(x r (1 + w)), in float32 throughout,
//   with r = 1 / sqrt(mean(x^2) + eps) and one rounding to the dtype at the end; and for the sampler's
//   Gemma 3 step (gemma_decode.py), a sublayer's norm, the residual add and the next norm in one pass;
// - Qwen3.5's gated norm after the delta rule: y = T(T(w T(x r)) silu(gate)), the norm rounded to the
//   dtype, times the weight (rounded), times SiLU of the gate in float32.
//
// transformers computes each as ~8 operators forward (casts to float32 and back among them) and as many
// backward, each a pass over the rows; here one pass each way. Rounded where the eager operators store
// the tensor's dtype, so that the outputs are the eager ones up to the order of float sums.

#include "ops.h"

namespace grpo_native {

namespace {

// dx = r dh - x r^3 mean(dh x): the gradient through x r, given dh (the gradient of x r), in place
inline void through_rms(const float* x, float* dh, int64_t dim, float r) {
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < dim; ++i) dot += dh[i] * x[i];
  const float c = r * r * r * dot / static_cast<float>(dim);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) dh[i] = dh[i] * r - c * x[i];
}

template <typename T>
void zero_centred_forward(const T* x, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), w(dim);
    to_float(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * dim, h.data(), dim);
      zero_centred_row<T>(h.data(), w.data(), h.data(), dim, eps);
      from_float(h.data(), out + r * dim, dim);
    }
  });
}

// hidden = T(residual + T(x r (1 + post))), out = T(hidden r' (1 + pre)): Gemma 3's norm after a sublayer
// (post-attention, post-feedforward), the residual add, and the norm before the next sublayer, in one pass
// where the eager step takes ~20 operators; each rounded where they store the dtype
template <typename T>
void add_zero_centred_norms_impl(const T* res, const T* x, int64_t x_stride, const T* post, const T* pre, T* hidden,
                                 T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), y(dim), wpost(dim), wpre(dim);
    to_float(post, wpost.data(), dim);
    to_float(pre, wpre.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * x_stride, y.data(), dim);
      zero_centred_row<T>(y.data(), wpost.data(), y.data(), dim, eps);
      to_float(res + r * dim, h.data(), dim);
      for (int64_t i = 0; i < dim; ++i) h[i] = in_dtype<T>(h[i] + y[i]);
      from_float(h.data(), hidden + r * dim, dim);
      zero_centred_row<T>(h.data(), wpre.data(), y.data(), dim, eps);
      from_float(y.data(), out + r * dim, dim);
    }
  });
}

template <typename T>
void zero_centred_backward(const T* grad, const T* x, const T* weight, T* dx, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), w(dim), g(dim);
    to_float(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * dim, h.data(), dim);
      to_float(grad + r * dim, g.data(), dim);
      const float inv = inverse_rms(h.data(), dim, eps);
      float* gp = g.data();
      const float* wp = w.data();
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) gp[i] = gp[i] * (1.f + wp[i]);
      through_rms(h.data(), gp, dim, inv);
      from_float(gp, dx + r * dim, dim);
    }
  });
}

// a = T(w T(x r)), the gated norm before its gate; returns r
template <typename T>
float gated_norm(const float* h, const float* w, float* a, int64_t dim, float eps) {
  const float inv = inverse_rms(h, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) a[i] = in_dtype<T>(w[i] * in_dtype<T>(h[i] * inv));
  return inv;
}

template <typename T>
void gated_forward(const T* x, const T* gate, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), w(dim), z(dim), a(dim);
    to_float(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * dim, h.data(), dim);
      to_float(gate + r * dim, z.data(), dim);
      gated_norm<T>(h.data(), w.data(), a.data(), dim, eps);
      float* ap = a.data();
      const float* zp = z.data();
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) ap[i] = ap[i] * (zp[i] * sigmoid(zp[i]));
      from_float(ap, out + r * dim, dim);
    }
  });
}

template <typename T>
void gated_backward(const T* grad, const T* x, const T* gate, const T* weight, T* dx, T* dgate, int64_t rows,
                    int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), w(dim), z(dim), a(dim), g(dim), dz(dim);
    to_float(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * dim, h.data(), dim);
      to_float(gate + r * dim, z.data(), dim);
      to_float(grad + r * dim, g.data(), dim);
      const float inv = gated_norm<T>(h.data(), w.data(), a.data(), dim, eps);
      float *gp = g.data(), *dzp = dz.data();
      const float *ap = a.data(), *zp = z.data(), *wp = w.data();
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float sg = sigmoid(zp[i]), silu = zp[i] * sg;
        // y = a silu(z): dz = dy a silu'(z) (float32, rounded where the gate's cast back stores it);
        // da = T(dy silu(z)), then the norm's: T(da w)
        dzp[i] = in_dtype<T>(gp[i] * ap[i] * (sg * (1.f + zp[i] * (1.f - sg))));
        gp[i] = in_dtype<T>(in_dtype<T>(gp[i] * silu) * wp[i]);
      }
      through_rms(h.data(), gp, dim, inv);
      from_float(gp, dx + r * dim, dim);
      from_float(dzp, dgate + r * dim, dim);
    }
  });
}

void check_norm(const char* name, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2, name, ": x must be [rows, dim], got ", x.sizes());
  check_dense_rows(x, x.size(0), x.size(1), name);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be a contiguous [", x.size(1), "] of x's dtype");
}

void check_like(const char* name, const at::Tensor& t, const at::Tensor& x, const char* what) {
  TORCH_CHECK(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.is_contiguous() && t.device().is_cpu(),
              name, ": ", what, " must be a contiguous ", x.scalar_type(), " ", x.sizes(), ", got ", t.scalar_type(),
              " ", t.sizes());
}

}  // namespace

at::Tensor zero_centred_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm("zero_centred_rms_norm", x, weight);
  at::Tensor out = at::empty_like(x);
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "zero_centred_rms_norm", [&] {
    zero_centred_forward<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                   x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

std::vector<at::Tensor> add_zero_centred_norms(const at::Tensor& residual, const at::Tensor& x,
                                               const at::Tensor& post_weight, const at::Tensor& pre_weight, double eps) {
  check_norm("add_zero_centred_norms", residual, post_weight);
  check_norm("add_zero_centred_norms", residual, pre_weight);
  check_rows(x, residual.size(0), residual.size(1), "add_zero_centred_norms: x");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "add_zero_centred_norms: x and residual differ in dtype");
  auto hidden = at::empty_like(residual), out = at::empty_like(residual);
  DISPATCH_SAMPLER_TYPES(residual.scalar_type(), "add_zero_centred_norms", [&] {
    add_zero_centred_norms_impl<scalar_t>(residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0),
                                          post_weight.data_ptr<scalar_t>(), pre_weight.data_ptr<scalar_t>(),
                                          hidden.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), residual.size(0),
                                          residual.size(1), static_cast<float>(eps));
  });
  return {hidden, out};
}

at::Tensor zero_centred_rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                          double eps) {
  check_norm("zero_centred_rms_norm_backward", x, weight);
  check_like("zero_centred_rms_norm_backward", grad, x, "grad");
  at::Tensor dx = at::empty_like(x);
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "zero_centred_rms_norm_backward", [&] {
    zero_centred_backward<scalar_t>(grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                    dx.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return dx;
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  check_norm("gated_rms_norm", x, weight);
  check_like("gated_rms_norm", gate, x, "gate");
  at::Tensor out = at::empty_like(x);
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "gated_rms_norm", [&] {
    gated_forward<scalar_t>(x.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

std::vector<at::Tensor> gated_rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& gate,
                                                const at::Tensor& weight, double eps) {
  check_norm("gated_rms_norm_backward", x, weight);
  check_like("gated_rms_norm_backward", gate, x, "gate");
  check_like("gated_rms_norm_backward", grad, x, "grad");
  at::Tensor dx = at::empty_like(x), dgate = at::empty_like(x);
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "gated_rms_norm_backward", [&] {
    gated_backward<scalar_t>(grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                             weight.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), dgate.data_ptr<scalar_t>(),
                             x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {dx, dgate};
}

}  // namespace grpo_native
