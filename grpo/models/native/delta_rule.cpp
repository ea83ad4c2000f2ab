// A decoding step of the gated delta rule (Qwen3.5's linear-attention layers; delta_rule.py calls it):
// each row's recurrent state updated in place, in one call; and of the short convolution before it.
//
// transformers' CPU path (torch_recurrent_gated_delta_rule) takes a step as a dozen operators, four
// of them over the whole float32 state (decayed, read against the key, updated, read against the
// query), each writing a state-sized temporary: at 32 rows of a Qwen3.5-0.8B-sized model those are
// 32 MiB tensors, 4 per layer and step, each a fresh mmap whose pages fault in. Here each head's
// state (128 x 128 floats: 64 KiB, in a core's L2) is read twice and written once, in place.

#include "ops.h"
#include "simd.h"

namespace grpo_native {

namespace {

// x / sqrt(sum(x^2) + 1e-6), as transformers' l2norm (rsqrt of the sum, times x); then divided by
// `divide` (the query's 1 / sqrt(head_dim) is a division there)
void l2_normalised(const float* x, float* y, int64_t n, float divide) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv / divide;
}

#if defined(__AVX512F__)
// delta_step's work on one head's state of 128 value columns: the loops below (the first pass only
// reads the state, against the key, decayed as read; the second decays each value again, updates it
// and reads it against the query), with a row of the state's sums in sixteen registers instead of
// memory. The same products and sums, in the same order (and their bits: -ffp-contract=off). Before,
// the first pass wrote the decayed state back for the second to read, and the sums lived in memory:
// on a Qwen3.5-0.8B-sized model's 18 layers at 32 rows (576 MiB of states) on an AMD EPYC (Zen 4),
// 2 cores, this took 0.75-0.88x the time (medians 32.7 -> 28.9 and 44.8 -> 33.4 ms in two sittings),
// where PyTorch's in-place multiply of those states takes 17-28 ms (docs/benchmark.md).
inline void delta_head_128(float* s, const float* ks, const float* qs, const float* vr, float decay, float b,
                           float* o, int64_t dk) {
  constexpr int CHUNKS = 128 / 16;
  const __m512 d = _mm512_set1_ps(decay);
  __m512 acc[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {  // kv[j] = sum_i (S[i][j] decay) k[i]
    const float* si = s + i * 128;
    const __m512 ki = _mm512_set1_ps(ks[i]);
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c)
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(si + 16 * c), d), ki));
  }
  __m512 delta[CHUNKS];  // (v - kv) * beta
  const __m512 strength = _mm512_set1_ps(b);
  for (int c = 0; c < CHUNKS; ++c) {
    delta[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(vr + 16 * c), acc[c]), strength);
    acc[c] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < dk; ++i) {  // S[i][j] = S[i][j] decay + k[i] delta[j]; out[j] = sum_i S[i][j] q[i]
    float* si = s + i * 128;
    const __m512 ki = _mm512_set1_ps(ks[i]), qi = _mm512_set1_ps(qs[i]);
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512 updated = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(si + 16 * c), d), _mm512_mul_ps(ki, delta[c]));
      _mm512_storeu_ps(si + 16 * c, updated);
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(updated, qi));
    }
  }
  for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
}
#endif

template <typename T>
void delta_step(float* state, const T* q, const T* k, const T* v, const float* g, const float* beta, float* out,
                int64_t rows, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, int64_t qk_stride,
                int64_t v_stride) {
  const int64_t group = v_heads / k_heads;  // value heads a query/key head serves, consecutive
  const float q_divide = std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, rows * v_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(dk), ks(dk), raw(std::max(dk, dv)), vs(dv), kv(dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / v_heads, h = item % v_heads, kh = h / group;
      l2_normalised(as_float(q + r * qk_stride + kh * dk, raw.data(), dk), qs.data(), dk, q_divide);
      l2_normalised(as_float(k + r * qk_stride + kh * dk, raw.data(), dk), ks.data(), dk, 1.f);
      const float* vr = as_float(v + r * v_stride + h * dv, vs.data(), dv);
      const float decay = std::exp(g[item]), b = beta[item];
      float* s = state + item * dk * dv;
      float* o = out + item * dv;
#if defined(__AVX512F__)
      if (dv == 128) {
        delta_head_128(s, ks.data(), qs.data(), vr, decay, b, o, dk);
        continue;
      }
#endif
      // the state decayed, read against the key (only read: the second pass decays it again, the
      // same product): kv[j] = sum_i (S[i][j] decay) k[i]
      std::fill(kv.begin(), kv.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float* si = s + i * dv;
        const float ki = ks[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) kv[j] = kv[j] + si[j] * decay * ki;
      }
      // delta = (v - kv) * beta; S = S decay + k delta^T; out[j] = sum_i S[i][j] q[i]
      float* delta = kv.data();
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) delta[j] = (vr[j] - kv[j]) * b;
      std::fill(o, o + dv, 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* si = s + i * dv;
        const float ki = ks[i], qi = qs[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          si[j] = si[j] * decay + ki * delta[j];
          o[j] = o[j] + si[j] * qi;
        }
      }
    }
  });
}

}  // namespace

at::Tensor gated_delta_step_(at::Tensor& state, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous() && state.device().is_cpu(),
              "gated_delta_step_: state must be a contiguous float32 [rows, value heads, key dim, value dim] CPU "
              "tensor, got ", state.scalar_type(), " ", state.sizes());
  const int64_t rows = state.size(0), v_heads = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && q.size(0) == rows && q.size(2) == dk,
              "gated_delta_step_: q and k must be [", rows, ", key heads, ", dk, "], got ", q.sizes(), " and ", k.sizes());
  const int64_t k_heads = q.size(1);
  TORCH_CHECK(k_heads > 0 && v_heads % k_heads == 0, "gated_delta_step_: ", v_heads, " value heads over ", k_heads,
              " key heads");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == rows && v.size(1) == v_heads && v.size(2) == dv,
              "gated_delta_step_: v must be [", rows, ", ", v_heads, ", ", dv, "], got ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gated_delta_step_: q, k and v differ in dtype");
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->numel() == rows * v_heads && t->device().is_cpu(), "gated_delta_step_: g and beta must hold ",
                rows * v_heads, " values, got ", t->sizes());
  // each head's vectors contiguous, rows at any stride (q, k and v are views of one conv output)
  auto heads_dense = [](const at::Tensor& t) {
    return t.stride(2) == 1 && (t.size(1) < 2 || t.stride(1) == t.size(2)) ? t : t.contiguous();
  };
  const at::Tensor qd = heads_dense(q), kd = heads_dense(k), vd = heads_dense(v);
  TORCH_CHECK(qd.stride(0) == kd.stride(0), "gated_delta_step_: q and k at different row strides");
  const at::Tensor gf = g.to(at::kFloat).contiguous(), bf = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, v_heads, dv}, state.options());
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "gated_delta_step_", [&] {
    delta_step<scalar_t>(state.data_ptr<float>(), qd.data_ptr<scalar_t>(), kd.data_ptr<scalar_t>(),
                         vd.data_ptr<scalar_t>(), gf.data_ptr<float>(), bf.data_ptr<float>(), out.data_ptr<float>(),
                         rows, k_heads, v_heads, dk, dv, qd.stride(0), vd.stride(0));
  });
  return out;
}

namespace {

// One row's step, the general way: each channel's window shifted by the new input, its taps summed into y
template <typename T>
void conv_row(T* state, const T* x, const T* weight, const T* bias, float* y, int64_t channels, int64_t kernel) {
  for (int64_t c = 0; c < channels; ++c) {
    T* window = state + c * kernel;
    const T* taps = weight + c * kernel;
    for (int64_t j = 0; j + 1 < kernel; ++j) window[j] = window[j + 1];
    window[kernel - 1] = x[c];
    float sum = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
    for (int64_t j = 0; j < kernel; ++j) sum += static_cast<float>(taps[j]) * static_cast<float>(window[j]);
    y[c] = in_dtype<T>(sum);
  }
}

#if defined(__AVX512F__)
// floats rounded to bf16 and back, eight at a time: in_dtype<c10::BFloat16>'s rounding (to nearest even,
// NaN to bf16's quiet NaN), so that the vector channels and the scalar ones round alike
inline __m256 round_bf16_8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_slli_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, odd), _mm256_set1_epi32(0x7FFF)), 16), 16);
  const __mmask8 nan = _mm256_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm256_castsi256_ps(_mm256_mask_mov_epi32(rounded, nan, _mm256_set1_epi32(0x7FC00000)));
}

// the j-th bf16 value of each of eight 64-bit words, as floats
inline __m256 word_part(__m512i words, int j) {
  const __m512i part = _mm512_and_si512(_mm512_srli_epi64(words, 16 * j), _mm512_set1_epi64(0xffff));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm512_cvtepi64_epi32(part), 16));
}
#endif

// conv_row for Qwen3.5's bf16 kernel of 4: a channel's window is 64 bits, shifted as one word. With
// avx512, eight channels at a time (their windows one register; the scalar channels' steps, in their
// order: the same bits), where the loop below ran a channel at a time: 0.31 ms a call at 32 rows of
// Qwen3.5-0.8B's 6,144 channels on the AMD EPYC (Zen 5), 8% of a decoding step (docs/benchmark.md)
void conv_row_words(c10::BFloat16* state, const c10::BFloat16* x, const c10::BFloat16* weight,
                    const c10::BFloat16* bias, float* y, int64_t channels) {
  uint64_t* windows = reinterpret_cast<uint64_t*>(state);
  const uint64_t* tap_words = reinterpret_cast<const uint64_t*>(weight);
  int64_t first = 0;
#if defined(__AVX512F__)
  for (; first + 8 <= channels; first += 8) {
    const __m512i xs = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + first)));
    const __m512i w = _mm512_or_si512(_mm512_srli_epi64(_mm512_loadu_si512(windows + first), 16),
                                      _mm512_slli_epi64(xs, 48));
    _mm512_storeu_si512(windows + first, w);
    const __m512i t = _mm512_loadu_si512(tap_words + first);
    __m256 sum = bias != nullptr ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                       _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bias + first))), 16))
                                 : _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) sum = _mm256_add_ps(sum, _mm256_mul_ps(word_part(w, j), word_part(t, j)));
    _mm256_storeu_ps(y + first, round_bf16_8(sum));
  }
#endif
  for (int64_t c = first; c < channels; ++c) {
    const uint64_t w = (windows[c] >> 16) | (static_cast<uint64_t>(x[c].x) << 48);
    windows[c] = w;
    const uint64_t t = tap_words[c];
    float sum = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
    for (int j = 0; j < 4; ++j) {
      const float tj = std::bit_cast<float>(static_cast<uint32_t>((t >> (16 * j)) & 0xffff) << 16);
      const float sj = std::bit_cast<float>(static_cast<uint32_t>((w >> (16 * j)) & 0xffff) << 16);
      sum += tj * sj;
    }
    y[c] = in_dtype<c10::BFloat16>(sum);
  }
}

}  // namespace

// A decoding step of a depthwise causal convolution (the short convolution before Qwen3.5's delta rule), as
// transformers' causal_conv1d_update computes it: each channel's window of the last kernel inputs shifted by the new
// one, summed against its taps (in float, rounded to T as the convolution's output is), then SiLU (rounded to T).
// One pass over [rows, channels] where PyTorch concatenates, copies, convolves and activates: four operators and a
// copy of the window a step.
template <typename T>
void conv_step(T* state, const T* x, const T* weight, const T* bias, T* out, int64_t rows, int64_t channels,
               int64_t kernel, int64_t x_stride, bool silu) {
  const bool words = kernel == 4 && reinterpret_cast<uintptr_t>(state) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(weight) % 8 == 0;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* y = row_buffer(channels);
    for (int64_t r = begin; r < end; ++r) {
      T* row_state = state + r * channels * kernel;
      const T* xr = x + r * x_stride;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (words) conv_row_words(row_state, xr, weight, bias, y, channels);
        else conv_row(row_state, xr, weight, bias, y, channels, kernel);
      } else {
        conv_row(row_state, xr, weight, bias, y, channels, kernel);
      }
      if (silu) {  // (a pass of its own, where the exponentials vectorize: a libm call each was most of the step)
#pragma omp simd
        for (int64_t c = 0; c < channels; ++c) y[c] = y[c] / (1.f + vexp(-y[c]));
      }
      from_float(y, out + r * channels, channels);
    }
  });
}

at::Tensor causal_conv_step_(at::Tensor& state, const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, bool silu) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && state.device().is_cpu(),
              "causal_conv_step_: state must be a contiguous [rows, channels, kernel] CPU tensor, got ", state.sizes());
  const int64_t rows = state.size(0), channels = state.size(1), kernel = state.size(2);
  check_rows(x, rows, channels, "causal_conv_step_: x");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && weight.size(1) == kernel && weight.is_contiguous(),
              "causal_conv_step_: weight must be a contiguous [", channels, ", ", kernel, "], got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == state.scalar_type() && weight.scalar_type() == state.scalar_type(),
              "causal_conv_step_: state, x and weight differ in dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == channels && bias->is_contiguous() &&
                    bias->scalar_type() == state.scalar_type(),
                "causal_conv_step_: bias must be a contiguous [", channels, "] of the state's dtype");
  at::Tensor out = at::empty({rows, channels}, state.options());
  DISPATCH_SAMPLER_TYPES(state.scalar_type(), "causal_conv_step_", [&] {
    conv_step<scalar_t>(state.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                        bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), rows,
                        channels, kernel, x.stride(0), silu);
  });
  return out;
}

}  // namespace grpo_native
