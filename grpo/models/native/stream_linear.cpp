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

#include "ops.h"
#include "simd.h"

#include <ATen/ops/constant_pad_nd.h>

namespace grpo_native {

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

// `rows` rows in as few blocks of at most `most` rows as hold them, their rows as even as they
// divide (33 in blocks of 32: 16 + 17). The input blocks are of STREAM_ROWS rows: a block of one row
// after a full one re-read every panel from the cache for that one row's sums (33 rows of a
// Qwen3.5-0.8B-sized decoding step's products took 1.15x the time of 32: bf16 dot products, AMD
// EPYC; docs/benchmark.md).
struct EvenBlocks {
  int64_t rows, count;
  EvenBlocks(int64_t rows, int64_t most) : rows(rows), count((rows + most - 1) / most) {}
  int64_t start(int64_t block) const { return block * rows / count; }
  int64_t size(int64_t block) const { return start(block + 1) - start(block); }
};

// `rows` rows of k values (at a stride of ld) as float32 [block (EvenBlocks of STREAM_ROWS)][k][row in the block],
// each block in a slot of STREAM_ROWS rows: a k's inputs side by side, and each block read front to
// back (a block's rows at a stride of its own count: a decoding step's few rows then take a few KiB
// of cache beside the weights, not a whole block's)
template <typename T>
std::unique_ptr<float[]> stream_inputs(const T* src, int64_t ld, int64_t rows, int64_t k) {
  const EvenBlocks blocks(rows, STREAM_ROWS);
  std::unique_ptr<float[]> xp(new float[blocks.count * k * STREAM_ROWS]);  // (every value written below)
  // a prefill's hundreds of rows on every thread; a decoding step's block or two on this one
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (STREAM_ROWS * k));
  at::parallel_for(0, blocks.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      transpose_rows(src + blocks.start(block) * ld, ld, blocks.size(block), k, xp.get() + block * k * STREAM_ROWS);
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
  const int64_t n = panels * STREAM_COLUMNS;
  const EvenBlocks blocks(rows, STREAM_ROWS);
  // more rows than a block: panels in pairs (two threads' runs of them), a block's rows across both
  // panels of a pair at a time (half the broadcasts a multiply-add). Up to two blocks, the first
  // still one panel at a time, streaming it (its 17-32 multiply-adds a k hide the loads), the second
  // across the pair from the cache: 33-64 rows in 0.91-0.99x the time of both blocks one panel at a
  // time, whose second block had re-read each panel at fewer multiply-adds a k (Intel Xeon avx512).
  const int64_t step = rows > STREAM_ROWS && STREAM_WIDE ? 2 : 1;
  auto panel_at = [&](int64_t p) {
    return Panel<W>{wd + p * k * STREAM_COLUMNS, k, w2d ? w2d + p * k2 * STREAM_COLUMNS : nullptr, w2d ? k2 : 0};
  };
  at::parallel_for(0, (panels + step - 1) / step, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin * step; p < std::min(end * step, panels); p += step) {
      const bool pair = step == 2 && p + 1 < panels;
      for (int64_t block = 0; block < blocks.count; ++block) {
        const int64_t r = blocks.start(block), count = blocks.size(block);
        const float* x = xp + block * k * STREAM_ROWS;
        const float* x2 = xp2 ? xp2 + block * k2 * STREAM_ROWS : nullptr;
        if (pair && (block > 0 || rows > 2 * STREAM_ROWS)) {
          // in chunks of at most STREAM_WIDE_ROWS rows, as even as they divide (32: 10 + 11 + 11)
          const EvenBlocks chunks(count, STREAM_WIDE_ROWS);
          for (int64_t c = 0; c < chunks.count; ++c) {
            const int64_t at = chunks.start(c);
            stream_wide_tail<STREAM_WIDE_ROWS>(chunks.size(c), x + at, x2 ? x2 + at : nullptr, count, panel_at(p),
                                               panel_at(p + 1), bd ? bd + p * STREAM_COLUMNS : nullptr,
                                               yd + (r + at) * n + p * STREAM_COLUMNS, n);
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
  const int64_t n = panels * STREAM_COLUMNS;
  const EvenBlocks blocks(rows, STREAM_ROWS);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t block = 0; block < blocks.count; ++block) {
        const int64_t r = blocks.start(block), count = blocks.size(block);
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

}  // namespace grpo_native
