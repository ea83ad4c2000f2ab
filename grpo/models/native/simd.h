// Vector registers of floats for the kernels written once over avx512's or avx2's width, and the
// register-level pieces several kernels share (bf16 widened as loaded, vexp over a register's lanes).
#pragma once

#include "common.h"

namespace grpo_native {

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
// vexp_lanes, and the packed-attention loops, whose KEY_BLOCKS (sixteen keys each), WEIGHTED_ROWS
// (queries whose weighted sums of values a pass keeps) and GRAD_KEYS (keys whose gradient sums a
// pass keeps; four registers of the head dimension each, as for a weighted row) say how many sums
// a loop keeps in registers: avx512 has 32 of them, avx2 16.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FLOAT_LANES 1
struct FloatLanes {
#if defined(__AVX512F__)
  using reg = __m512;
  static constexpr int W = 16, KEY_BLOCKS = 4, WEIGHTED_ROWS = 4, GRAD_KEYS = 4;
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
  // v's lanes t0 + i from `first` up to n, zeros elsewhere (a query's keys in a sliding window)
  static reg within(reg v, int64_t t0, int64_t first, int64_t n) {
    const reg kept = below(v, t0, n);
    if (first <= t0) return kept;
    const __mmask16 m = first - t0 >= 16 ? static_cast<__mmask16>(0) : static_cast<__mmask16>(0xffffu << (first - t0));
    return _mm512_maskz_mov_ps(m, kept);
  }
#else
  using reg = __m256;
  static constexpr int W = 8, KEY_BLOCKS = 1, WEIGHTED_ROWS = 2, GRAD_KEYS = 2;
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
  static reg within(reg v, int64_t t0, int64_t first, int64_t n) {
    const reg kept = below(v, t0, n);
    if (first <= t0) return kept;
    const __m256i index =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(first)), index);
    return _mm256_andnot_ps(_mm256_castsi256_ps(before), kept);
  }
#endif
  // p's lanes loaded once into a register for the several multiply-adds that read them: left to
  // itself GCC folds the load into each of them (a load per use, from L2 at long contexts), which
  // made the packed attention's loops wait on loads (1.1-1.4x slower, docs/benchmark.md)
  static reg held(const float* p) {
    reg v = load(p);
    asm("" : "+v"(v));  // (an opaque value: no load left to fold)
    return v;
  }
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

#endif  // __AVX512F__

// x[p] = cap * vtanh(x[p] * (1 / cap)) for p < n: a soft-cap on one query's scores (Gemma 2's), with avx512
// sixteen at a time, each lane the same steps in the same order as vtanh's (a score's value does not depend
// on where in a block it lies), else a value at a time
inline void soft_cap(float* x, int64_t n, float cap) {
  const float inverse = 1.f / cap;
  int64_t p = 0;
#if defined(__AVX512F__)
  const __m512 inv = _mm512_set1_ps(inverse), caps = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f),
               two = _mm512_set1_ps(2.f);
  for (; p + 16 <= n; p += 16) {
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + p), inv);
    const __m512 e = vexp_lanes(_mm512_mul_ps(two, _mm512_abs_ps(a)));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    // -t where a < 0 (vtanh's sign), then times the cap
    const __m512 signed_t = _mm512_mask_mul_ps(t, _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ), t,
                                               _mm512_set1_ps(-1.f));
    _mm512_storeu_ps(x + p, _mm512_mul_ps(caps, signed_t));
  }
#endif
  for (; p < n; ++p) x[p] = cap * vtanh(x[p] * inverse);
}

// x[p] = vexp(x[p] - top) for p < n; their total: softmax's numerators and denominator for one
// query's scores. With avx512 sixteen at a time (sixteen running sums, then added across; a loop of
// vexp stays scalar: its NaN test keeps GCC from vectorizing it), else a value at a time.
inline float exp_shifted_total(float* x, int64_t n, float top) {
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; p += 16) {
    const __mmask16 m = n - p >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - p)) - 1);
    const __m512 e = vexp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + p), shift));
    _mm512_mask_storeu_ps(x + p, m, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(total);
#else
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t p = 0; p < n; ++p) {
    x[p] = vexp(x[p] - top);
    total += x[p];
  }
  return total;
#endif
}

}  // namespace grpo_native
