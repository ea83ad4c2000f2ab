// The sampler's token choice (sampler.py): one pass over a row's logits where PyTorch takes five.

#include "ops.h"

namespace grpo_native {

constexpr int64_t BLOCK = 512;  // tokens per block of sample_tokens' CDF

// Each row's next token and its logprob under the untempered policy (log_softmax at the token), in
// one pass over the row's logits where the sampler's PyTorch operators take five (log_softmax,
// softmax, a float64 copy, its cumsum, searchsorted). temperatures[r] == 0 takes the argmax (the
// first of equal maxima, as torch.argmax); otherwise the token is drawn by inverting the CDF of
// softmax(logits / temperature) at uniforms[r], as sampler._draw does: the first index whose
// cumulative probability, summed in float64, exceeds u * total (kept below total), so that a token
// of probability 0 is never taken. bf16 logits (a bf16 model's unembedding) are widened a row at a
// time as read: the same values as a float32 copy of them, without writing the copy (32 rows of a
// 262,144-token vocabulary: 34 MB a decoding step).
template <typename T>
void sample_tokens_impl(const T* base, int64_t stride, int64_t rows, int64_t vocab, const double* tp,
                        const double* up, int64_t* tok, float* lp) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float* ep = row_buffer(vocab);
    thread_local std::vector<double> masses;
    thread_local std::vector<float> widened;  // (bf16 rows only)
    if constexpr (!std::is_same_v<T, float>) widened.resize(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = as_float(base + r * stride, widened.data(), vocab);
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
}

std::vector<at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& temperatures,
                                      const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.device().is_cpu() && logits.stride(1) == 1,
              "sample_tokens: logits must be float32 or bfloat16 [rows, vocab] with contiguous rows on the CPU, got ",
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
  auto logprobs = at::empty({rows}, logits.options().dtype(at::kFloat));
  DISPATCH_SAMPLER_TYPES(logits.scalar_type(), "sample_tokens", [&] {
    sample_tokens_impl(logits.data_ptr<scalar_t>(), logits.stride(0), rows, vocab, tp, up, tokens.data_ptr<int64_t>(),
                       logprobs.data_ptr<float>());
  });
  return {tokens, logprobs};
}

}  // namespace grpo_native
