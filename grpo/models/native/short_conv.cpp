// The short causal convolution before Qwen3.5's delta rule over a sequence (a prefill's and a training
// pass's; delta_rule.py calls it), forward and backward, SiLU after it fused in.
//
// The layer hands transformers' causal_conv1d_fn its projection's output as a [rows, channels, positions]
// view of [rows, positions, channels] memory. PyTorch's path copies it padded, convolves it (oneDNN's
// depthwise convolution), applies SiLU in a pass of its own and rounds in another, and the backward
// mirrors each. Here each position's channels are read where they lie, in one pass forward (the output
// written channels-last, as the layer transposes it back) and one backward.
//
// In float32 or bfloat16, rounding where the eager operators store the tensor's dtype: the convolution's
// output, SiLU's, SiLU's gradient and the input's gradient. Each output sums bias + taps in the order
// of the decoding step's kernel (causal_conv_step_ in delta_rule.cpp), oldest input first.

#include "ops.h"

namespace grpo_native {

namespace {

// channels a task takes in the backward (each task sums its channels' tap gradients over every position)
constexpr int64_t CHANNEL_BLOCK = 256;

struct ConvShape {
  int64_t rows, positions, channels, kernel;
  int64_t row_stride, pos_stride;  // x's and the gradient's, in elements (channels contiguous)
};

// the taps as floats, [kernel][channels]: tap j of every channel contiguous
template <typename T>
std::vector<float> taps_by_position(const T* weight, int64_t channels, int64_t kernel) {
  std::vector<float> taps(kernel * channels);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < kernel; ++j) taps[j * channels + c] = static_cast<float>(weight[c * kernel + j]);
  return taps;
}

// The inputs that position t of a row reads, oldest first: sources[j] = x[t - kernel + 1 + j], or
// `zeros` where that is left of the row (the left padding)
template <typename T>
void sources_of(const T* row, const ConvShape& s, int64_t t, const T* zeros, const T** sources) {
  for (int64_t j = 0; j < s.kernel; ++j) {
    const int64_t source = t - s.kernel + 1 + j;
    sources[j] = source < 0 ? zeros : row + source * s.pos_stride;
  }
}

// the convolution at channel c: T(bias[c] + sum_j tap_j[c] sources[j][c]), summed oldest first. KERNEL
// is the filter's length where known when compiling (Qwen3.5's 4: the taps unrolled, so that a loop
// over the channels vectorizes with its sums in registers), 0 where it is `kernel`.
template <typename T, int KERNEL>
inline float convolved(const T* const* sources, const float* taps, const float* bias, int64_t kernel,
                       int64_t channels, int64_t c) {
  float sum = bias[c];
  if constexpr (KERNEL > 0) {
#pragma GCC unroll 8
    for (int j = 0; j < KERNEL; ++j) sum = sum + taps[j * channels + c] * widen(sources[j][c]);
  } else {
    for (int64_t j = 0; j < kernel; ++j) sum = sum + taps[j * channels + c] * widen(sources[j][c]);
  }
  return in_dtype<T>(sum);
}

// y[c] for channels [0, n): the convolution, SiLU after where asked (not rounded: the caller stores it)
template <typename T, int KERNEL>
void convolve_row(const T* const* src, const float* taps, const float* bias, int64_t kernel, int64_t channels,
                  int64_t n, bool silu, float* y) {
  if (silu) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      const float pre = convolved<T, KERNEL>(src, taps, bias, kernel, channels, c);
      y[c] = pre * sigmoid(pre);
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) y[c] = convolved<T, KERNEL>(src, taps, bias, kernel, channels, c);
  }
}

// d_pre[c] = the gradient of the convolution's output (through SiLU: rounded to T, as silu_backward's)
template <typename T, int KERNEL>
void pre_gradient(const T* const* src, const float* taps, const float* bias, int64_t kernel, int64_t channels,
                  int64_t n, bool silu, const T* grad, float* d_pre) {
  if (silu) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      const float pre = convolved<T, KERNEL>(src, taps, bias, kernel, channels, c), sg = sigmoid(pre);
      d_pre[c] = in_dtype<T>(widen(grad[c]) * (sg * (1.f + pre * (1.f - sg))));
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) d_pre[c] = widen(grad[c]);
  }
}

template <typename T>
void conv_forward(const T* x, const float* taps, const float* bias, T* out, const ConvShape& s, bool silu) {
  const int64_t C = s.channels, K = s.kernel;
  at::parallel_for(0, s.rows * s.positions, 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> sources(K);
    std::vector<T> zeros(C, T(0.f));
    std::vector<float> y(C);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.positions, t = item % s.positions;
      sources_of(x + r * s.row_stride, s, t, zeros.data(), sources.data());
      if (K == 4) convolve_row<T, 4>(sources.data(), taps, bias, K, C, C, silu, y.data());
      else convolve_row<T, 0>(sources.data(), taps, bias, K, C, C, silu, y.data());
      from_float(y.data(), out + item * C, C);  // (rounded to T: SiLU's output, or the convolution's)
    }
  });
}

// dx, and where asked the taps' and bias's gradients (float32 sums, [channels][kernel] and [channels])
template <typename T>
void conv_backward(const T* grad, int64_t grad_row_stride, int64_t grad_pos_stride, const T* x, const float* taps,
                   const float* bias, T* dx, float* d_taps, float* d_bias, const ConvShape& s, bool silu) {
  const int64_t C = s.channels, K = s.kernel, P = s.positions;
  const int64_t blocks = (C + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> sources(K);
    std::vector<T> zeros(CHANNEL_BLOCK, T(0.f));
    std::vector<float> acc(CHANNEL_BLOCK);
    std::vector<float> d_pre(P * CHANNEL_BLOCK), tap_sums(K * CHANNEL_BLOCK), bias_sums(CHANNEL_BLOCK);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t c0 = block * CHANNEL_BLOCK, n = std::min(CHANNEL_BLOCK, C - c0);
      std::fill(tap_sums.begin(), tap_sums.end(), 0.f);
      std::fill(bias_sums.begin(), bias_sums.end(), 0.f);
      // (the block's channels: its taps and bias from c0, its inputs from c0)
      const float* block_taps = taps + c0;
      const float* block_bias = bias + c0;
      for (int64_t r = 0; r < s.rows; ++r) {
        const T* row = x + r * s.row_stride + c0;
        // the convolution's output's gradient, each position: through SiLU (rounded to T, as silu_backward's)
        for (int64_t t = 0; t < P; ++t) {
          float* dp = d_pre.data() + t * CHANNEL_BLOCK;
          const T* gs = grad + r * grad_row_stride + t * grad_pos_stride + c0;
          sources_of(row, s, t, zeros.data(), sources.data());
          const T* const* src = sources.data();
          if (K == 4) pre_gradient<T, 4>(src, block_taps, block_bias, K, C, n, silu, gs, dp);
          else pre_gradient<T, 0>(src, block_taps, block_bias, K, C, n, silu, gs, dp);
          if (d_taps != nullptr) {
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) bias_sums[c] += dp[c];
            for (int64_t j = K - std::min(K, t + 1); j < K; ++j) {  // (the sources right of the padding)
              const T* xs = src[j];
              float* sums = tap_sums.data() + j * CHANNEL_BLOCK;
#pragma omp simd
              for (int64_t c = 0; c < n; ++c) sums[c] += dp[c] * widen(xs[c]);
            }
          }
        }
        // dx[t] = T(sum_j tap_j d_pre[t + K - 1 - j])
        for (int64_t t = 0; t < P; ++t) {
          std::fill(acc.begin(), acc.begin() + n, 0.f);
          for (int64_t j = 0; j < K; ++j) {
            const int64_t target = t + K - 1 - j;
            if (target >= P) continue;
            const float* dp = d_pre.data() + target * CHANNEL_BLOCK;
            const float* tap = block_taps + j * C;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) acc[c] = acc[c] + tap[c] * dp[c];
          }
          from_float(acc.data(), dx + (r * P + t) * C + c0, n);
        }
      }
      if (d_taps != nullptr) {
        for (int64_t c = 0; c < n; ++c)
          for (int64_t j = 0; j < K; ++j) d_taps[(c0 + c) * K + j] = tap_sums[j * CHANNEL_BLOCK + c];
        if (d_bias != nullptr) std::copy(bias_sums.begin(), bias_sums.begin() + n, d_bias + c0);
      }
    }
  });
}

// x as [rows, positions, channels] with its channels contiguous (the layer's view is [rows, channels,
// positions] of such memory: transposed by the caller)
ConvShape check_conv(const char* name, const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, name,
              ": x must be a CPU [rows, positions, channels] tensor with its channels contiguous, got ", x.sizes(),
              " strides ", x.strides());
  const int64_t channels = x.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && weight.is_contiguous(), name,
              ": weight must be a contiguous [", channels, ", kernel], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": x and weight differ in dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == channels && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                name, ": bias must be a contiguous [", channels, "] of x's dtype");
  return ConvShape{x.size(0), x.size(1), channels, weight.size(1), x.stride(0), x.stride(1)};
}

// the bias as floats (zeros where there is none)
template <typename T>
std::vector<float> float_bias(const c10::optional<at::Tensor>& bias, int64_t channels) {
  if (!bias.has_value()) return std::vector<float>(channels, 0.f);
  const T* b = bias->data_ptr<T>();
  return std::vector<float>(b, b + channels);
}

}  // namespace

at::Tensor short_conv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool silu) {
  const ConvShape s = check_conv("short_conv", x, weight, bias);
  at::Tensor out = at::empty({s.rows, s.positions, s.channels}, x.options());
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "short_conv", [&] {
    const std::vector<float> taps = taps_by_position(weight.data_ptr<scalar_t>(), s.channels, s.kernel);
    const std::vector<float> b = float_bias<scalar_t>(bias, s.channels);
    conv_forward<scalar_t>(x.data_ptr<scalar_t>(), taps.data(), b.data(),
                           out.data_ptr<scalar_t>(), s, silu);
  });
  return out;
}

std::vector<at::Tensor> short_conv_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& bias, bool silu, bool weight_grads) {
  const ConvShape s = check_conv("short_conv_backward", x, weight, bias);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.stride(2) == 1 && grad.scalar_type() == x.scalar_type(),
              "short_conv_backward: grad must be a ", x.scalar_type(), " ", x.sizes(),
              " with its channels contiguous, got ", grad.scalar_type(), " ", grad.sizes(), " strides ", grad.strides());
  at::Tensor dx = at::empty({s.rows, s.positions, s.channels}, x.options());
  const auto f = x.options().dtype(at::kFloat);
  at::Tensor d_taps = at::empty({weight_grads ? s.channels : 0, s.kernel}, f);
  at::Tensor d_bias = at::empty({weight_grads && bias.has_value() ? s.channels : 0}, f);
  DISPATCH_SAMPLER_TYPES(x.scalar_type(), "short_conv_backward", [&] {
    const std::vector<float> taps = taps_by_position(weight.data_ptr<scalar_t>(), s.channels, s.kernel);
    const std::vector<float> b = float_bias<scalar_t>(bias, s.channels);
    conv_backward<scalar_t>(grad.data_ptr<scalar_t>(), grad.stride(0), grad.stride(1), x.data_ptr<scalar_t>(),
                            taps.data(), b.data(), dx.data_ptr<scalar_t>(),
                            weight_grads ? d_taps.data_ptr<float>() : nullptr,
                            weight_grads && bias.has_value() ? d_bias.data_ptr<float>() : nullptr, s, silu);
  });
  return {dx, d_taps, d_bias};
}

}  // namespace grpo_native
