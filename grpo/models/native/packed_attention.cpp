// The trainer's attention over packed sequences (packed_attention.py), forward and backward.
//
// A training pass holds every sequence's tokens back to back in one row; sequence s has its queries at rows
// q_start..q_start+q_len and sees key_rows[key_offset..key_offset+prefix+q_len] (the rows of the sequences it
// continues, then its own), query j the first prefix + j + 1 of them: causal within its own tokens. PyTorch's
// SDPA took this as padded blocks gathered per call, with an explicit mask (no block skipped), each
// (sequence, head) a few small GEMM calls: ~87 GFLOP/s padded over SmolLM2's bench pass on an AMD EPYC, 2
// cores, forward + backward 0.22 s of a 2.1 s training call. Here a task is up to 64-256 queries of one
// sequence through one key head: the keys and values they see gathered once into float32 panels shared by the
// query heads reading them, scores for four queries by sixty-four keys in registers (avx512), no padding and
// nothing past a query's last key. float32 sums, q/k/v widened from bf16 as read, outputs rounded once to
// their dtype (as SDPA over float32 copies, the path it replaces; with `dot`, below, bf16 weights). The
// backward recomputes the weights from the saved log-sum-exp (as flash attention does) and sums the key and
// value gradients of the rows that several tasks see (a shared prompt, a long sequence's first tokens) in
// one float32 buffer, each task's added in the tasks' order (the same bits every run; a buffer per thread
// would also be threads x the keys' and values' size: gigabytes for a 16k-token pass on 16 cores). On the
// AMD EPYC (2 cores, bf16) it runs at 85-110 GFLOP/s of useful work over the bench's pass and 145-165 at
// 512-token answers, against float32 multiply-adds' 235 (scripts/attention_rate.py).
//
// GPT-OSS's sinks (a learned logit a query head) add their exponential to each softmax's denominator and
// weigh no value; the backward recomputes the weights from the log-sum-exp that counts them.
//
// A sliding-window layer's query sees only its last `window` keys (Mistral's, Gemma's every other layer): a task
// gathers, scores and sums the keys from its first query's window on, and each query's softmax runs over its own
// window (the keys before it weighted by zero). Gemma 2's scores are capped before the softmax (`softcap`:
// softcap * tanh(score / softcap)); the backward recomputes the capped scores and takes the cap's derivative.
//
// With `dot` (bf16, a head dimension of 64, 128 or 256, a build with avx512_bf16) all seven products are that
// instruction's dot products, two values a multiply-add: the scores -- queries by keys, forward and
// backward, and output gradients by values -- over pairs of dims from bf16 panels (exact products, sums in
// another order); the weighted sums (outputs, query gradients) over pairs of keys and the key and value
// gradients over pairs of queries, from the softmax's weights and their gradients rounded to bf16, as
// PyTorch's CPU flash attention does for bf16 (no longer float32 attention rounded once: outputs and
// gradients within bf16's rounding of it, tests/test_packed_attention.py). The trainer passes it where
// kernel_probe.py measured it faster.

#include "ops.h"
#include "simd.h"

namespace grpo_native {

// seqs: [S, 4] int64 rows (q_start, q_len, prefix, key_offset)
struct PackedSeq {
  int64_t q_start, q_len, prefix, key_offset;
};

constexpr int64_t PA_ROWS = 4;   // queries whose scores are taken together
// queries whose key and value gradients are summed together (in registers) before they are added to
// the task's: added every PA_ROWS queries, the adds to memory took a third of the gradients' time
constexpr int64_t PA_GRAD_ROWS = 16;
// finished tasks' key/value sums the backward keeps while they wait for their turn (then they wait)
constexpr int64_t PA_KEPT_BYTES = int64_t{256} << 20;
constexpr int64_t PA_KEYS = 16;  // keys a score block covers (one avx512 register of floats)

inline int64_t pa_round(int64_t n) { return (n + PA_KEYS - 1) / PA_KEYS * PA_KEYS; }

// The panels of one (sequence, key head): keys row-major [kl][dim] and transposed [dim][klp]
// (klp: kl rounded up to PA_KEYS, zeros past kl), values the same; all float32. For the scores by
// avx512_bf16's dot product (pa_dot_scores), bf16 keys and values also in pairs of dims: word
// [j][t] the two bf16 values of dims 2j, 2j + 1 of key t ([dim / 2][klp], zeros past kl).
// With `dot` the weighted sums also take that instruction, over pairs of keys: word [u][d] the two
// bf16 values of dim d of keys 2u, 2u + 1 (keys_in_twos, values_in_twos: [klp / 2][dim], zeros past kl).
struct KeyPanels {
  std::vector<float> keys, keys_t, values, values_t;
  std::vector<uint32_t> key_pairs, value_pairs, rows;  // (rows: the pairs gathered, before transposing)
  std::vector<uint32_t> keys_in_twos, values_in_twos;
};

#if defined(__AVX512F__)
// r[c] = column c of the 16 x 16 block whose row i is r[i] (unpacks within 128-bit lanes, then the
// lanes themselves moved across registers)
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i+e], 128-bit lane L: element 4L+e of rows 4i..4i+3
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int e = 0; e < 4; ++e) {  // column 4L+e: lane L of u[e], u[4+e], u[8+e], u[12+e]
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xee);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xee);
    r[e] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
    r[8 + e] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
  }
}
#endif

// out[d][t] = rows[t][d] for t < n, zeros for n <= t < pa_round(n); rows [n][dim], out [dim][ldo]
inline void pa_transpose(const float* rows, int64_t n, int64_t dim, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {  // sixteen by sixteen blocks (a value at a time wrote 16 cache lines a key)
    __m512 r[16];
    for (int64_t t0 = 0; t0 < n; t0 += PA_KEYS)
      for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        for (int64_t i = 0; i < 16; ++i)
          r[i] = t0 + i < n ? _mm512_loadu_ps(rows + (t0 + i) * dim + d0) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t j = 0; j < 16; ++j) _mm512_storeu_ps(out + (d0 + j) * ldo + t0, r[j]);
      }
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) {
    for (int64_t t = 0; t < n; ++t) out[d * ldo + t] = rows[t * dim + d];
    std::fill(out + d * ldo + n, out + d * ldo + pa_round(n), 0.f);
  }
}

// x's rows (key_rows of the task) as bf16 pairs of dims, transposed: out[j][t] (32-bit words) for
// t < kl, zeros to klp
template <typename T>
void gather_pairs(const T* x, int64_t k_stride, const int64_t* rows, int64_t kl, int64_t head, int64_t dim,
                  KeyPanels& p, std::vector<uint32_t>& out) {
  static_assert(sizeof(T) == 2, "pairs of bf16 values");
  const int64_t words = dim / 2, klp = pa_round(kl);
  p.rows.resize(kl * words);
  for (int64_t t = 0; t < kl; ++t) std::memcpy(p.rows.data() + t * words, x + rows[t] * k_stride + head * dim, dim * 2);
  out.resize(words * klp);
  // (a transpose of 32-bit words: moved as floats, never computed with, so the bits are kept)
  pa_transpose(reinterpret_cast<const float*>(p.rows.data()), kl, words, reinterpret_cast<float*>(out.data()), klp);
}

// out[t / 2][d] = (dim d of row t, dim d of row t + 1) for even t < n, row t at x + rows[t] * stride, the
// high half zero past an odd n's last row (bf16 bits side by side: moved, never computed with)
template <typename T>
void pa_twos(const T* x, int64_t stride, const int64_t* rows, int64_t n, int64_t dim, uint32_t* out) {
  static_assert(sizeof(T) == 2, "pairs of bf16 values");
  for (int64_t t = 0; t < n; t += 2) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(x + rows[t] * stride);
    const uint16_t* b = t + 1 < n ? reinterpret_cast<const uint16_t*>(x + rows[t + 1] * stride) : nullptr;
    uint32_t* o = out + t / 2 * dim;
    if (b) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = uint32_t{a[d]} | uint32_t{b[d]} << 16;
    } else {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = a[d];
    }
  }
}

// x's rows (key_rows of the task) two keys a word (KeyPanels' keys_in_twos): [klp / 2][dim], zeros past kl
template <typename T>
void gather_twos(const T* x, int64_t k_stride, const int64_t* rows, int64_t kl, int64_t head, int64_t dim,
                 std::vector<uint32_t>& out) {
  const int64_t klp = pa_round(kl);
  out.resize(klp / 2 * dim);
  pa_twos(x + head * dim, k_stride, rows, kl, dim, out.data());
  std::fill(out.begin() + (kl + 1) / 2 * dim, out.end(), 0u);
}

// The panels a task reads: forward (backward = false) the keys transposed and the values row-major;
// backward the keys row-major and transposed, the values transposed. Where `pairs`, bf16 only: the
// keys (forward and backward) and values (backward) in pairs of dims for the scores, the values
// (forward) and keys (backward) in twos for the weighted sums.
template <typename T>
void gather_panels(const T* k, const T* v, int64_t k_stride, const int64_t* rows, int64_t kl, int64_t head,
                   int64_t dim, bool backward, bool pairs, KeyPanels& p) {
  if constexpr (sizeof(T) == 2) {
    if (pairs) {
      gather_pairs(k, k_stride, rows, kl, head, dim, p, p.key_pairs);
      if (backward) gather_pairs(v, k_stride, rows, kl, head, dim, p, p.value_pairs);
      gather_twos(backward ? k : v, k_stride, rows, kl, head, dim, backward ? p.keys_in_twos : p.values_in_twos);
      return;
    }
  }
  const int64_t klp = pa_round(kl);
  p.keys.resize(kl * dim);  // (row-major: the backward's, and what the transposed are made from)
  p.values.resize(kl * dim);
  for (int64_t t = 0; t < kl; ++t) {
    to_float(k + rows[t] * k_stride + head * dim, p.keys.data() + t * dim, dim);
    to_float(v + rows[t] * k_stride + head * dim, p.values.data() + t * dim, dim);
  }
  p.keys_t.resize(dim * klp);
  pa_transpose(p.keys.data(), kl, dim, p.keys_t.data(), klp);
  if (backward) {
    p.values_t.resize(dim * klp);
    pa_transpose(p.values.data(), kl, dim, p.values_t.data(), klp);
  }
}

#if defined(FLOAT_LANES)
// every sum of acc zero
template <int M, int C>
inline void pa_zero(typename FloatLanes::reg (&acc)[M][C]) {
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[m][c] = FloatLanes::zero();
}

// acc[m][c] += s[m * s_m + k * s_k] (times factor where SCALED) * x[k][c] for k0 <= k < k1: M sums of
// C registers each, built a row of x at a time, the row loaded once for all M (x: rows of ldx
// floats, the registers' columns from x[k]). The loop of every float32 block: the scores (k a dim,
// m a query, c sixteen keys), the weighted sums (k a key, m a query, c sixteen dims) and the key
// and value gradients (k a query, m a key, c sixteen dims); each sum runs over k in order.
template <int M, int C, bool SCALED>
inline void pa_outer_sums(typename FloatLanes::reg (&acc)[M][C], const float* s, int64_t s_m, int64_t s_k,
                          float factor, const float* x, int64_t ldx, int64_t k0, int64_t k1) {
  using V = FloatLanes;
  for (int64_t k = k0; k < k1; ++k) {
    typename V::reg row[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) row[c] = V::held(x + k * ldx + V::W * c);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float w = s[m * s_m + k * s_k];
      const typename V::reg y = V::set1(SCALED ? w * factor : w);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[m][c] = V::fma(y, row[c], acc[m][c]);
    }
  }
}

// pa_scores with a head dimension known when compiling: KEY_BLOCKS x sixteen keys by four queries
// in registers (each query's value broadcast once for all of them), sixteen where fewer are left
template <int64_t DIM, int BLOCKS>
inline void pa_scores_block(const float* rows, int64_t nr, const float* bt, int64_t ldb, int64_t t0, float* out,
                            int64_t ldo) {
  using V = FloatLanes;
  constexpr int R = BLOCKS * PA_KEYS / V::W;  // registers a query's sums take
  typename V::reg acc[PA_ROWS][R];
  pa_zero(acc);
  pa_outer_sums<PA_ROWS, R, false>(acc, rows, DIM, 1, 1.f, bt + t0, ldb, 0, DIM);
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

// The loop frame of the key and value gradients (pa_key_grads_vec, pa_dot_key_grads): for each block of
// GRAD_KEYS keys and each stretch of C registers of the head dimension, `block_sums(part, acc, t0, h)` sums
// the queries' contributions to those keys in registers (part 0 the keys' gradients, 1 the values'), and
// `add(part, out, sums)` adds a register of them to memory: one add to memory a key and stretch.
template <int64_t DIM, class BlockSums, class Add>
inline void pa_key_grad_blocks(int64_t keys, float* dk, float* dv, BlockSums block_sums, Add add) {
  using V = FloatLanes;
  constexpr int C = DIM / V::W < 4 ? DIM / V::W : 4, KB = V::GRAD_KEYS;
  static_assert(PA_KEYS % KB == 0, "a block of keys must not run past a row's zeros");
  for (int part = 0; part < 2; ++part) {
    float* sums = part ? dv : dk;
    for (int64_t t0 = 0; t0 < keys; t0 += KB)
      for (int64_t h = 0; h < DIM; h += C * V::W) {
        typename V::reg acc[KB][C];
        pa_zero(acc);
        block_sums(part, acc, t0, h);
#pragma GCC unroll 16
        for (int u = 0; u < KB; ++u)  // (u a constant in each copy: the sums stay in registers)
          if (t0 + u < keys)
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) add(part, sums + (t0 + u) * DIM + h + V::W * c, acc[u][c]);
      }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PA_DOT 1
// acc[m][c] += the dot product of s's word for (m, u) (s[m * s_m + u * s_k]: two values of the summed
// index) with x's words [u][16c .. 16c + 15] (x: rows of ldx words, each two values side by side) for
// u0 <= u < u1: pa_outer_sums two at a time. The loop of every dot-product block: the scores (u a pair of
// dims, m a query, c sixteen keys), the weighted sums (u a pair of keys, m a query, c sixteen dims) and the
// key and value gradients (u a pair of queries, m a key, c sixteen dims).
template <int M, int C>
inline void pa_dot_outer_sums(__m512 (&acc)[M][C], const uint32_t* s, int64_t s_m, int64_t s_k, const uint32_t* x,
                              int64_t ldx, int64_t u0, int64_t u1) {
  for (int64_t u = u0; u < u1; ++u) {
    __m512bh row[C];  // (loaded once for all M, as float lanes: the pairs' bits moved, not computed with)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
      row[c] = (__m512bh)FloatLanes::held(reinterpret_cast<const float*>(x + u * ldx + 16 * c));
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m512bh y = (__m512bh)_mm512_set1_epi32(static_cast<int>(s[m * s_m + u * s_k]));
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], y, row[c]);
    }
  }
}

// pa_scores_block by avx512_bf16's dot product: rows and keys bf16 in pairs of dims (rows [PA_ROWS][DIM / 2]
// words, bt [DIM / 2][ldb] words), a register sixteen keys by one pair, so half the instructions of
// float32's multiply-adds for the same scores. The products are exact either way (two bf16 values'
// product is exact in float32); the sums differ in their order (a pair of dims at a time), and the
// instruction takes denormal inputs as zero.
template <int64_t DIM, int BLOCKS>
inline void pa_dot_scores_block(const uint32_t* rows, int64_t nr, const uint32_t* bt, int64_t ldb, int64_t t0,
                                float* out, int64_t ldo) {
  __m512 acc[PA_ROWS][BLOCKS];
  pa_zero(acc);
  pa_dot_outer_sums(acc, rows, DIM / 2, 1, bt + t0, ldb, 0, DIM / 2);
  for (int64_t i = 0; i < nr; ++i)
    for (int r = 0; r < BLOCKS; ++r) _mm512_storeu_ps(out + i * ldo + t0 + r * PA_KEYS, acc[i][r]);
}

// out[i][t] = sum_d a[i][d] * b[t][d] for nr <= PA_ROWS bf16 rows a (DIM values each, row i at a[i *
// a_stride]) and t < keys (a multiple of PA_KEYS), b's keys in pairs (bt [DIM / 2][ldb] words)
template <int64_t DIM>
inline void pa_dot_scores(const c10::BFloat16* a, int64_t a_stride, int64_t nr, const uint32_t* bt, int64_t ldb,
                          int64_t keys, float* out, int64_t ldo) {
  static_assert(DIM % 2 == 0, "pairs of dims");
  uint32_t rows[PA_ROWS * (DIM / 2)] = {};  // (absent rows as zeros: one loop of fixed shape)
  for (int64_t i = 0; i < nr; ++i) std::memcpy(rows + i * (DIM / 2), a + i * a_stride, DIM * 2);
  constexpr int64_t SPAN = FloatLanes::KEY_BLOCKS * PA_KEYS;
  int64_t t0 = 0;
  for (; t0 + SPAN <= keys; t0 += SPAN) pa_dot_scores_block<DIM, FloatLanes::KEY_BLOCKS>(rows, nr, bt, ldb, t0, out, ldo);
  for (; t0 < keys; t0 += PA_KEYS) pa_dot_scores_block<DIM, 1>(rows, nr, bt, ldb, t0, out, ldo);
}

// The weighted sums and the key/value gradients by the dot product, over pairs of the summed index (keys
// for a query's weighted sums, queries for a key's gradients): the weights -- the softmax's and their
// gradients -- rounded to bf16 first, as PyTorch's CPU flash attention does for bf16 (its attn_reduced
// and grad_attn_reduced); sums in float32.

// out[i][t] = bf16(x[i][t]) for t < limit[i], zeros to keys (a multiple of sixteen), for nr rows of x
// (ldx apart) and zero rows to PA_ROWS: the rows' weights for pa_dot_weighted_rows, two keys a word
inline void pa_round_rows(const float* x, int64_t ldx, int64_t nr, const int64_t* limit, int64_t keys,
                          c10::BFloat16* out) {
  for (int64_t i = 0; i < PA_ROWS; ++i)
    for (int64_t t = 0; t < keys; t += 16) {
      const __m512 w = i < nr ? FloatLanes::below(_mm512_loadu_ps(x + i * ldx + t), t, limit[i]) : _mm512_setzero_ps();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * keys + t), (__m256i)_mm512_cvtneps_pbh(w));
    }
}

// out[i] = scale * sum_t w[i][t] * b[t] for nr <= PA_ROWS rows of bf16 weights (w: [PA_ROWS][keys], zero
// past each row's last key), b two keys a word (bt [keys / 2][DIM]); keys a multiple of sixteen
template <int64_t DIM>
inline void pa_dot_weighted_rows(const c10::BFloat16* w, int64_t nr, int64_t keys, const uint32_t* bt, float scale,
                                 float* out) {
  constexpr int C = DIM / 16 < 4 ? DIM / 16 : 4;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(w);
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < DIM; h += C * 16) {
    __m512 acc[PA_ROWS][C];
    pa_zero(acc);
    pa_dot_outer_sums(acc, words, keys / 2, 1, bt + h, DIM, 0, keys / 2);
    for (int64_t i = 0; i < nr; ++i)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + i * DIM + h + 16 * c, _mm512_mul_ps(acc[i][c], factor));
  }
}

// out[u][t] = (bf16(x[2u][t]), bf16(x[2u + 1][t])) for t < keys (a multiple of sixteen) and u < (nr + 1) / 2,
// an absent row 2u + 1 zeros: nr rows' weights (ldx apart, zero past each row's last key) two queries a word
inline void pa_round_twos(const float* x, int64_t ldx, int64_t nr, int64_t keys, uint32_t* out) {
  auto rounded = [&](int64_t i, int64_t t) {  // (sixteen values of row i as bf16 bits, each in a word's low half)
    return i < nr ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * ldx + t)))
                  : _mm512_setzero_si512();
  };
  for (int64_t u = 0; u < (nr + 1) / 2; ++u)
    for (int64_t t = 0; t < keys; t += 16)
      _mm512_storeu_si512(out + u * keys + t,
                          _mm512_or_si512(rounded(2 * u, t), _mm512_slli_epi32(rounded(2 * u + 1, t), 16)));
}

// dk[t] += scale * sum_i a[i][t] * q[i], dv[t] += sum_i bw[i][t] * g[i] for t < keys over `twos` pairs of
// queries: a, bw two queries a word ([twos][ldw]), q, g two queries a word ([twos][DIM]); pa_key_grads_vec's
// blocks of keys
template <int64_t DIM>
inline void pa_dot_key_grads(const uint32_t* a, const uint32_t* bw, int64_t ldw, int64_t twos, int64_t keys,
                             float scale, const uint32_t* q, const uint32_t* g, float* dk, float* dv) {
  const __m512 key_scale = _mm512_set1_ps(scale);  // (after the sums: the weights are bf16 words already)
  pa_key_grad_blocks<DIM>(
      keys, dk, dv,
      [&](int part, auto& acc, int64_t t0, int64_t h) {
        pa_dot_outer_sums(acc, (part ? bw : a) + t0, 1, ldw, (part ? g : q) + h, DIM, 0, twos);
      },
      [&](int part, float* out, __m512 sums) {
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), part ? sums : _mm512_mul_ps(sums, key_scale)));
      });
}
#endif

// out[i] = scale * sum_{t < limit[i]} w[i][t] * b[t] for M rows (i0..i0+M): their sums over 64 of the
// head's dimensions (avx2: 32) in registers, each of b's rows loaded once for all M; the keys past
// the rows' common limit then row by row. Each sum runs over t in order: the same bits whatever M.
template <int64_t DIM, int M>
inline void pa_weighted_block(const float* w, int64_t ldw, const int64_t* limit, const float* b, float scale,
                              float* out) {
  using V = FloatLanes;
  constexpr int C = DIM / V::W < 4 ? DIM / V::W : 4;
  int64_t common = limit[0];
  for (int r = 1; r < M; ++r) common = std::min(common, limit[r]);
  const typename V::reg factor = V::set1(scale);
  for (int64_t h = 0; h < DIM; h += C * V::W) {
    typename V::reg acc[M][C];
    pa_zero(acc);
    pa_outer_sums<M, C, false>(acc, w, ldw, 1, 1.f, b + h, DIM, 0, common);
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      for (int64_t t = common; t < limit[r]; ++t) {
        const typename V::reg x = V::set1(w[r * ldw + t]);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = V::fma(x, V::load(b + t * DIM + h + V::W * c), acc[r][c]);
      }
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) V::store(out + r * DIM + h + V::W * c, V::mul(acc[r][c], factor));
    }
  }
}

// out[i] = scale * sum_{t < limit[i]} w[i][t] * b[t] for nr <= PA_ROWS rows, WEIGHTED_ROWS at a time
// (avx512: four; avx2: two)
template <int64_t DIM>
inline void pa_weighted_rows_vec(const float* w, int64_t ldw, int64_t nr, const int64_t* limit, const float* b,
                                 float scale, float* out) {
  constexpr int M = FloatLanes::WEIGHTED_ROWS;
  int64_t i = 0;
  for (; i + M <= nr; i += M) pa_weighted_block<DIM, M>(w + i * ldw, ldw, limit + i, b, scale, out + i * DIM);
  for (; i + 2 <= nr; i += 2) pa_weighted_block<DIM, 2>(w + i * ldw, ldw, limit + i, b, scale, out + i * DIM);
  for (; i < nr; ++i) pa_weighted_block<DIM, 1>(w + i * ldw, ldw, limit + i, b, scale, out + i * DIM);
}

// dk[t] += sum_i scale * a[i][t] * q[i], then dv[t] += sum_i bw[i][t] * g[i], for t < keys: GRAD_KEYS
// keys' sums over the nr queries in registers (four registers of the head dimension each), each
// query's row loaded once for all of them, one add to memory a key. (A key at a time, keys' and
// values' together, loaded the rows once per key: the backward 1.1-1.25x slower.) Each key's sums run over the
// queries in order, as before: the same bits. Reads a and bw up to t0 + GRAD_KEYS past keys: the
// callers' rows run zeros to a multiple of sixteen.
template <int64_t DIM>
inline void pa_key_grads_vec(const float* a, const float* bw, int64_t ldw, int64_t nr, int64_t keys, float scale,
                             const float* q, const float* g, float* dk, float* dv) {
  using V = FloatLanes;
  constexpr int C = DIM / V::W < 4 ? DIM / V::W : 4, KB = V::GRAD_KEYS;
  pa_key_grad_blocks<DIM>(
      keys, dk, dv,
      [&](int part, auto& acc, int64_t t0, int64_t h) {
        if (part)  // (the keys' weights scaled before the sums, the values' not)
          pa_outer_sums<KB, C, false>(acc, bw + t0, 1, ldw, 1.f, g + h, DIM, 0, nr);
        else
          pa_outer_sums<KB, C, true>(acc, a + t0, 1, ldw, scale, q + h, DIM, 0, nr);
      },
      [](int, float* out, typename V::reg sums) { V::store(out, V::add(V::load(out), sums)); });
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

// The scores as the softmax takes them, for first <= t < n: times `scale`, then where softcap > 0
// capped as Gemma 2's attention caps them (softcap * tanh(score / softcap), simd.h's soft_cap: a value's
// result the same wherever it sits in the row, so the backward recomputes the forward's bits)
inline void pa_scaled_scores(float* x, int64_t first, int64_t n, float scale, float softcap) {
#pragma omp simd
  for (int64_t t = first; t < n; ++t) x[t] *= scale;
  if (softcap > 0.f) soft_cap(x + first, n - first, softcap);
}

// x[t] = exp(s[t] - lse), the weight, and dx[t] = x[t] * (dx[t] - delta), the score's gradient before
// the scale (and, where softcap > 0, through the cap: times 1 - tanh^2), for first <= t < n, s the
// scores as pa_scaled_scores makes them; both zero elsewhere below `keys` (whatever x and dx held there)
inline void pa_weights_backward(float* x, float* dx, int64_t first, int64_t n, int64_t keys, float scale,
                                float softcap, float lse, float delta) {
  float factor = scale;
  if (softcap > 0.f) {  // (the cap is not a product: the scores capped in place, then taken as they are)
    pa_scaled_scores(x, first, n, scale, softcap);
    factor = 1.f;
  }
  const float inverse_cap = softcap > 0.f ? 1.f / softcap : 0.f;
#if defined(FLOAT_LANES)
  using V = FloatLanes;
  const V::reg f = V::set1(factor), shift = V::set1(lse), d = V::set1(delta), one = V::set1(1.f);
  const V::reg inverse = V::set1(inverse_cap);
  for (int64_t t = 0; t < keys; t += V::W) {  // (keys: a multiple of sixteen, past n zero)
    const V::reg score = V::mul(V::load(x + t), f);
    const V::reg w = V::within(vexp_lanes(V::sub(score, shift)), t, first, n);
    V::reg grad = V::mul(w, V::sub(V::load(dx + t), d));
    if (softcap > 0.f) {
      const V::reg u = V::mul(score, inverse);  // tanh of the uncapped score
      grad = V::mul(grad, V::sub(one, V::mul(u, u)));
    }
    V::store(x + t, w);
    V::store(dx + t, V::within(grad, t, first, n));
  }
  return;
#endif
  for (int64_t t = 0; t < keys; ++t) {
    if (t < first || t >= n) {
      x[t] = dx[t] = 0.f;
      continue;
    }
    const float score = x[t] * factor, u = score * inverse_cap;
    x[t] = vexp(score - lse);
    dx[t] = x[t] * (dx[t] - delta);
    if (softcap > 0.f) dx[t] *= 1.f - u * u;
  }
}

// x[t] = exp(s[t] - top) for first <= t < n, s the scores as pa_scaled_scores makes them and top their
// largest; returns their sum. x below `first` is left for the caller (to zero).
inline float pa_softmax_numerators(float* x, int64_t first, int64_t n, float scale, float softcap, float& top) {
  pa_scaled_scores(x, first, n, scale, softcap);
  top = row_max(x + first, n - first);
#if defined(FLOAT_LANES) && !defined(__AVX512F__)
  // avx2: a register at a time, lanes outside first..n zero (x has room: a row's scores run to a
  // multiple of sixteen), where exp_shifted_total goes a value at a time
  using V = FloatLanes;
  const V::reg shift = V::set1(top);
  V::reg sums = V::zero();
  for (int64_t t = first / V::W * V::W; t < n; t += V::W) {
    const V::reg e = V::within(vexp_lanes(V::sub(V::load(x + t), shift)), t, first, n);
    V::store(x + t, e);
    sums = V::add(sums, e);
  }
  float lanes[V::W];
  V::store(lanes, sums);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
#else
  return exp_shifted_total(x + first, n - first, top);  // (simd.h: avx512's sixteen at a time, the last masked; else scalar)
#endif
}

// The keys query r of sequence s sees, as indices into its key rows: first..limit (its prefix and its
// own tokens up to itself; with a sliding window, only the last `window` of them, as transformers'
// sliding-window mask: a key at position p is seen from positions below p + window)
struct PaSpan {
  int64_t first, limit;
};

inline PaSpan pa_span(const PackedSeq& s, int64_t r, int64_t window) {
  const int64_t limit = s.prefix + r + 1;
  return {window > 0 ? std::max<int64_t>(0, limit - window) : 0, limit};
}

// A task: up to `chunk` queries of one sequence through one key head, and only the keys they see.
// A long sequence is then many tasks, not one per key head (a single 2,048-token sequence of a model
// with one key head would otherwise keep one thread busy). Each task gathers the keys it sees and
// adds its key and value gradients for all of them, so the longer its chunk the less of that per
// query: up to 256 queries took 0.91-0.94x the time of 64 at 2,048-token answers, 0.96-0.97x at 512
// (bf16, AMD EPYC, 2 cores; docs/benchmark.md). The longest of PA_CHUNKS that still makes
// PA_MIN_TASKS tasks, from the plan alone: never from the number of threads, so that the tasks, and
// the order of the gradients' sums, are the same on any machine's threads.
constexpr int64_t PA_CHUNKS[] = {256, 128, 64};
constexpr size_t PA_MIN_TASKS = 64;

struct PaTask {
  int64_t seq, head, first, count;  // queries first..first+count of sequence seq, key head `head`
  // the keys any of them sees: key rows lo..lo+keys of the sequence (lo past 0 only in a sliding
  // window, where the task's first query's window starts: its panels and sums begin there)
  int64_t lo, keys;
};

// the tasks, most work first: taken in turn by whichever thread is free
std::vector<PaTask> pa_tasks(const std::vector<PackedSeq>& seqs, int64_t kv_heads, int64_t window) {
  std::vector<PaTask> tasks;
  for (const int64_t chunk : PA_CHUNKS) {
    tasks.clear();
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int64_t first = 0; first < seqs[i].q_len; first += chunk) {
        const int64_t count = std::min(chunk, seqs[i].q_len - first);
        const int64_t lo = pa_span(seqs[i], first, window).first, end = pa_span(seqs[i], first + count - 1, window).limit;
        for (int64_t g = 0; g < kv_heads; ++g) tasks.push_back({static_cast<int64_t>(i), g, first, count, lo, end - lo});
      }
    if (tasks.size() >= PA_MIN_TASKS) break;  // (else shorter chunks, down to the last's)
  }
  auto cost = [](const PaTask& t) { return t.count * t.keys; };
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

// How a query's scores are taken: times `scale`; where softcap > 0, capped (Gemma 2's attention); where
// window > 0, over its last `window` keys only (a sliding-window layer's); where `sinks` (one float32 logit a
// query head: GPT-OSS's), the softmax's denominator has exp(sink) beside the keys' (a sink weighs no value)
struct PaScoring {
  float scale;
  int64_t window;
  float softcap;
  const float* sinks;
};

PaScoring pa_scoring(double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& sinks,
                     int64_t heads) {
  TORCH_CHECK(window >= 0, "packed_attention: window must be 0 (none) or the keys a query sees, got ", window);
  TORCH_CHECK(softcap >= 0, "packed_attention: softcap must be 0 (none) or the scores' cap, got ", softcap);
  TORCH_CHECK(!sinks.has_value() || (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                                     sinks->dim() == 1 && sinks->size(0) == heads && sinks->is_contiguous()),
              "packed_attention: sinks must be a contiguous float32 CPU [", heads, "] (one a query head)");
  return {static_cast<float>(scale), window, static_cast<float>(softcap),
          sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
}

PaShape pa_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "packed_attention: ", heads,
              " query heads are not a multiple of ", kv_heads, " key heads");
  TORCH_CHECK(q.dim() == 2 && q.size(1) % heads == 0, "packed_attention: q must be [rows, heads * dim], got ",
              q.sizes());
  const int64_t rows = q.size(0), dim = q.size(1) / heads;
  check_dense_rows(q, rows, heads * dim, "packed_attention: q");
  check_dense_rows(k, rows, kv_heads * dim, "packed_attention: k");
  check_dense_rows(v, rows, kv_heads * dim, "packed_attention: v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "packed_attention: q, k and v must share one dtype");
  return {rows, heads, kv_heads, dim};
}

// Whether the scores of T and DIM can be taken by avx512_bf16's dot product here: bf16, a head
// dimension known when compiling, a build with the instruction.
template <typename T, int64_t DIM>
constexpr bool pa_dot_built() {
#if defined(PA_DOT)
  return std::is_same_v<T, c10::BFloat16> && DIM > 0 && DIM % 32 == 0;
#else
  return false;
#endif
}

// scores[i][t] for nr rows of x (row i at x[i * x_stride], T) against the panels' keys (or, where
// `values`, the values): by the dot product over pairs where `pairs` (pa_dot_built), else from the
// rows as float32 (xf) by multiply-adds
template <typename T, int64_t DIM>
inline void pa_scores_of(bool pairs, const T* x, int64_t x_stride, const float* xf, int64_t nr, const KeyPanels& p,
                         bool values, int64_t klp, int64_t keys, int64_t dim, float* out) {
#if defined(PA_DOT)
  if constexpr (pa_dot_built<T, DIM>()) {
    if (pairs) return pa_dot_scores<DIM>(x, x_stride, nr, (values ? p.value_pairs : p.key_pairs).data(), klp, keys, out, klp);
  }
#endif
  pa_scores<DIM>(xf, nr, (values ? p.values_t : p.keys_t).data(), klp, keys, dim, out, klp);
}

// out[i] = scale * sum_{t < limit[i]} w[i][t] * b[t] for nr rows of float32 weights (klp apart): by the
// dot product over the weights rounded to bf16 where `pairs` (b two keys a word: twos), else by
// multiply-adds over b's float32 rows (b_rows)
template <typename T, int64_t DIM>
inline void pa_weighted_of(bool pairs, const float* w, int64_t klp, int64_t nr, const int64_t* limit,
                           const float* b_rows, const std::vector<uint32_t>& twos, int64_t dim, float scale,
                           float* out) {
#if defined(PA_DOT)
  if constexpr (pa_dot_built<T, DIM>()) {
    if (pairs) {
      thread_local std::vector<c10::BFloat16> rounded;
      const int64_t keys = pa_round(limit[nr - 1]);  // (the rows' limits rise: the last sees the most)
      rounded.resize(PA_ROWS * keys);
      pa_round_rows(w, klp, nr, limit, keys, rounded.data());
      return pa_dot_weighted_rows<DIM>(rounded.data(), nr, keys, twos.data(), scale, out);
    }
  }
#endif
  pa_weighted_rows<DIM>(w, klp, nr, limit, b_rows, dim, scale, out);
}

// dk[t] += scale * sum_i a[i][t] * q[i], dv[t] += sum_i bw[i][t] * g[i] for t < keys over nr queries (a
// and bw float32, ldw apart, zero past each query's last key to a multiple of sixteen): by the dot
// product where `pairs` (a and bw rounded to bf16, q and g read from the bf16 rows x + rows[i] * stride),
// else by multiply-adds over qf and gf, the same rows as float32
template <typename T, int64_t DIM>
inline void pa_key_grads_of(bool pairs, const float* a, const float* bw, int64_t ldw, int64_t nr, int64_t keys,
                            float scale, const float* qf, const float* gf, const T* q, const T* g,
                            const int64_t* rows, int64_t stride, int64_t dim, float* dk, float* dv) {
#if defined(PA_DOT)
  if constexpr (pa_dot_built<T, DIM>()) {
    if (pairs) {
      thread_local std::vector<uint32_t> a2, bw2, q2, g2;  // (two queries a word)
      const int64_t twos = (nr + 1) / 2, width = pa_round(keys);
      a2.resize(twos * width);
      bw2.resize(twos * width);
      q2.resize(twos * DIM);
      g2.resize(twos * DIM);
      pa_round_twos(a, ldw, nr, width, a2.data());
      pa_round_twos(bw, ldw, nr, width, bw2.data());
      pa_twos(q, stride, rows, nr, DIM, q2.data());
      pa_twos(g, stride, rows, nr, DIM, g2.data());
      return pa_dot_key_grads<DIM>(a2.data(), bw2.data(), width, twos, keys, scale, q2.data(), g2.data(), dk, dv);
    }
  }
#endif
  pa_key_grads<DIM>(a, bw, ldw, nr, keys, scale, qf, gf, dim, dk, dv);
}

// run(std::integral_constant<int64_t, D>{}) with D the head dimension where its loops are compiled for it
// (64, 128, 256: every Gemma's), else D = 0 (the generic loops, the dimension read at run time)
template <typename F>
void pa_with_head_dim(int64_t dim, F&& run) {
  if (dim == 64) return run(std::integral_constant<int64_t, 64>{});
  if (dim == 128) return run(std::integral_constant<int64_t, 128>{});
  if (dim == 256) return run(std::integral_constant<int64_t, 256>{});
  run(std::integral_constant<int64_t, 0>{});
}

template <typename T, int64_t DIM>
void packed_attention_impl(const T* q, const T* k, const T* v, const std::vector<PackedSeq>& seqs,
                           const int64_t* key_rows, PaShape sh, PaScoring sc, bool dot, T* out, float* lse) {
  const int64_t dim = DIM > 0 ? DIM : sh.dim, group = sh.heads / sh.kv_heads;
  const int64_t q_stride = sh.heads * dim, k_stride = sh.kv_heads * dim;
  const bool pairs = dot && pa_dot_built<T, DIM>();
  pa_run(pa_tasks(seqs, sh.kv_heads, sc.window), [&](const PaTask& task, int64_t) {
    const PackedSeq& s = seqs[task.seq];
    const int64_t g = task.head, end = task.first + task.count, kl = task.keys, klp = pa_round(kl);
    thread_local KeyPanels p;
    thread_local std::vector<float> qf, w, o;
    gather_panels(k, v, k_stride, key_rows + s.key_offset + task.lo, kl, g, dim, false, pairs, p);
    qf.resize(PA_ROWS * dim);
    w.resize(PA_ROWS * klp);
    o.resize(PA_ROWS * dim);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t r0 = task.first; r0 < end; r0 += PA_ROWS) {
        const int64_t nr = std::min(PA_ROWS, end - r0);
        int64_t first[PA_ROWS], limit[PA_ROWS];  // query r0 + i sees the task's keys first[i]..limit[i]
        for (int64_t i = 0; i < nr; ++i) {
          const PaSpan span = pa_span(s, r0 + i, sc.window);
          first[i] = span.first - task.lo;
          limit[i] = span.limit - task.lo;
          if (!pairs) to_float(q + (s.q_start + r0 + i) * q_stride + h * dim, qf.data() + i * dim, dim);
        }
        pa_scores_of<T, DIM>(pairs, q + (s.q_start + r0) * q_stride + h * dim, q_stride, qf.data(), nr, p, false, klp,
                             pa_round(limit[nr - 1]), dim, w.data());
        for (int64_t i = 0; i < nr; ++i) {
          float top;
          float* x = w.data() + i * klp;
          float total = pa_softmax_numerators(x, first[i], limit[i], sc.scale, sc.softcap, top);
          float shift = 1.f;  // (a sink above every score: the numerators, taken against `top`, rescaled to it)
          if (sc.sinks != nullptr) {
            const float sink = sc.sinks[h];
            if (sink > top) {
              shift = std::exp(top - sink);
              total = total * shift + 1.f;
              top = sink;
            } else {
              total += std::exp(sink - top);
            }
          }
          const float inverse = shift / total;
          std::fill(x, x + first[i], 0.f);  // (keys before its window: weighted by nothing)
#pragma omp simd
          for (int64_t t = first[i]; t < limit[i]; ++t) x[t] *= inverse;
          lse[(s.q_start + r0 + i) * sh.heads + h] = top + std::log(total);
        }
        pa_weighted_of<T, DIM>(pairs, w.data(), klp, nr, limit, p.values.data(), p.values_in_twos, dim, 1.f, o.data());
        for (int64_t i = 0; i < nr; ++i)
          from_float(o.data() + i * dim, out + (s.q_start + r0 + i) * q_stride + h * dim, dim);
      }
    }
  });
}

std::vector<at::Tensor> packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& seqs, const at::Tensor& key_rows, int64_t heads,
                                         int64_t kv_heads, double scale, bool dot, int64_t window, double softcap,
                                         const c10::optional<at::Tensor>& sinks) {
  const PaShape sh = pa_shape(q, k, v, heads, kv_heads);
  const PaScoring sc = pa_scoring(scale, window, softcap, sinks, heads);
  const auto list = pa_sequences(seqs, key_rows, sh.rows);
  auto out = at::zeros_like(q, at::MemoryFormat::Contiguous);
  auto lse = at::zeros({sh.rows, sh.heads}, q.options().dtype(at::kFloat));
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "packed_attention", [&] {
    auto run = [&](auto dim) {
      packed_attention_impl<scalar_t, decltype(dim)::value>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), list, key_rows.data_ptr<int64_t>(),
          sh, sc, dot, out.data_ptr<scalar_t>(), lse.data_ptr<float>());
    };
    pa_with_head_dim(sh.dim, run);
  });
  return {out, lse};
}

template <typename T, int64_t DIM>
void packed_attention_backward_impl(const T* grad, const T* q, const T* k, const T* v, const T* out, const float* lse,
                                    const std::vector<PackedSeq>& seqs, const int64_t* key_rows, PaShape sh,
                                    PaScoring sc, bool dot, T* dq, float* dkv) {
  const int64_t dim = DIM > 0 ? DIM : sh.dim, group = sh.heads / sh.kv_heads;
  const bool pairs = dot && pa_dot_built<T, DIM>();
  const int64_t q_stride = sh.heads * dim, k_stride = sh.kv_heads * dim;
  // dkv: the key gradients' float32 sums [rows, k_stride], then the values'; tasks add theirs in turn
  std::mutex turn_lock;
  std::condition_variable turn_changed;
  int64_t turn = 0;
  std::exception_ptr failure;
  const std::vector<PaTask> tasks = pa_tasks(seqs, sh.kv_heads, sc.window);
  // a finished task's sums, kept until its turn: (computed, key sums, value sums)
  struct Finished {
    bool ready = false, computed = false;
    std::vector<float> dk, dv;
  };
  std::vector<Finished> finished(tasks.size());
  std::vector<std::vector<float>> spare;  // buffers of sums already added, for the next to keep theirs
  spare.reserve(2 * tasks.size());        // (no allocation while a turn is taken: nothing to throw there)
  int64_t kept_bytes = 0;
  auto add_sums = [&](const PaTask& task, const float* dkl, const float* dvl) {
    const PackedSeq& s = seqs[task.seq];
    const int64_t* rows = key_rows + s.key_offset + task.lo;
    for (int64_t t = 0; t < task.keys; ++t) {
      float* dk = dkv + rows[t] * k_stride + task.head * dim;
      float* dv = dk + sh.rows * k_stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        dk[d] += dkl[t * dim + d];
        dv[d] += dvl[t * dim + d];
      }
    }
  };
  pa_run(tasks, [&](const PaTask& task, int64_t index) {
    const PackedSeq& s = seqs[task.seq];
    const int64_t g = task.head, end = task.first + task.count, kl = task.keys, klp = pa_round(kl);
    thread_local KeyPanels p;
    thread_local std::vector<float> qf, gf, of, w, dw, dqf, dkl, dvl;
    bool computed = false;
    try {  // (a task that fails, out of memory, still takes its turn below: the others wait for it)
      gather_panels(k, v, k_stride, key_rows + s.key_offset + task.lo, kl, g, dim, true, pairs, p);
      qf.resize(PA_GRAD_ROWS * dim);
      gf.resize(PA_GRAD_ROWS * dim);
      of.resize(dim);
      w.resize(PA_GRAD_ROWS * klp);
      dw.resize(PA_GRAD_ROWS * klp);
      dqf.resize(PA_ROWS * dim);
      dkl.assign(kl * dim, 0.f);  // this task's key and value gradients, added to the shared sums at the end
      dvl.assign(kl * dim, 0.f);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t b0 = task.first; b0 < end; b0 += PA_GRAD_ROWS) {
          // PA_GRAD_ROWS queries' weights and their gradients, PA_ROWS at a time, then their key and
          // value gradients at once; every row zero outside its keys up to the block's last's
          const int64_t nb = std::min(PA_GRAD_ROWS, end - b0);
          const int64_t block_end = pa_span(s, b0 + nb - 1, sc.window).limit - task.lo, block_keys = pa_round(block_end);
          for (int64_t r0 = b0; r0 < b0 + nb; r0 += PA_ROWS) {
            const int64_t nr = std::min(PA_ROWS, b0 + nb - r0), j = r0 - b0;  // (j: the rows' place in the block)
            float* qb = qf.data() + j * dim;
            float* gb = gf.data() + j * dim;
            float* wb = w.data() + j * klp;
            float* dwb = dw.data() + j * klp;
            int64_t first[PA_ROWS], limit[PA_ROWS];
            float delta[PA_ROWS];  // sum_d grad * out of each query: softmax's backward
            for (int64_t i = 0; i < nr; ++i) {
              const int64_t row = s.q_start + r0 + i;
              const PaSpan span = pa_span(s, r0 + i, sc.window);
              first[i] = span.first - task.lo;
              limit[i] = span.limit - task.lo;
              if (!pairs) to_float(q + row * q_stride + h * dim, qb + i * dim, dim);  // (pairs: read as bf16)
              to_float(grad + row * q_stride + h * dim, gb + i * dim, dim);
              to_float(out + row * q_stride + h * dim, of.data(), dim);
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < dim; ++d) dot += gb[i * dim + d] * of[d];
              delta[i] = dot;
            }
            const int64_t keys = pa_round(limit[nr - 1]);
            const int64_t first_row = (s.q_start + r0) * q_stride + h * dim;
            pa_scores_of<T, DIM>(pairs, q + first_row, q_stride, qb, nr, p, false, klp, keys, dim, wb);      // scores
            pa_scores_of<T, DIM>(pairs, grad + first_row, q_stride, gb, nr, p, true, klp, keys, dim, dwb);  // d weights
            for (int64_t i = 0; i < nr; ++i) {
              const float m = lse[(s.q_start + r0 + i) * sh.heads + h];
              pa_weights_backward(wb + i * klp, dwb + i * klp, first[i], limit[i], block_keys, sc.scale, sc.softcap, m,
                                  delta[i]);
            }
            pa_weighted_of<T, DIM>(pairs, dwb, klp, nr, limit, p.keys.data(), p.keys_in_twos, dim, sc.scale, dqf.data());
            for (int64_t i = 0; i < nr; ++i)
              from_float(dqf.data() + i * dim, dq + (s.q_start + r0 + i) * q_stride + h * dim, dim);
          }
          // dk[t] += scale * sum_i ds[i][t] q[i], dv[t] += sum_i w[i][t] g[i] over the block's queries
          int64_t block_rows[PA_GRAD_ROWS];
          for (int64_t i = 0; i < nb; ++i) block_rows[i] = s.q_start + b0 + i;
          pa_key_grads_of<T, DIM>(pairs, dw.data(), w.data(), klp, nb, block_end, sc.scale, qf.data(), gf.data(),
                                  q + h * dim, grad + h * dim, block_rows, q_stride, dim, dkl.data(), dvl.data());
        }
      }
      computed = true;
    } catch (...) {
      std::lock_guard<std::mutex> guard(turn_lock);
      if (!failure) failure = std::current_exception();
    }
    // into the shared sums in the tasks' order, whichever thread finished first: float sums in an
    // order set by the tasks alone, so that a run's gradients are the same bits every time (runs
    // resume and repeat bit for bit, tests/test_reproducibility.py). A task finished before its turn
    // leaves its sums for the task before it to add after its own, and goes on to the next task:
    // waiting instead cost ~20% of the backward where tasks are many and small (a key head per query
    // head, short answers). Past PA_KEPT_BYTES of such sums it waits (task i was started before task
    // i + 1: the wait is for a task under way).
    std::unique_lock<std::mutex> held(turn_lock);
    const int64_t bytes = computed ? 2 * kl * dim * static_cast<int64_t>(sizeof(float)) : 0;
    if (turn != index && kept_bytes + bytes <= PA_KEPT_BYTES) {
      Finished& f = finished[index];
      f.computed = computed;
      if (computed) {  // (the thread's buffers go with them; it takes spare ones, else allocates)
        f.dk.swap(dkl);
        f.dv.swap(dvl);
        for (std::vector<float>* mine : {&dkl, &dvl})
          if (!spare.empty()) {
            mine->swap(spare.back());
            spare.pop_back();
          }
      }
      kept_bytes += bytes;
      f.ready = true;
      return;
    }
    turn_changed.wait(held, [&] { return turn == index; });
    if (computed) add_sums(task, dkl.data(), dvl.data());
    for (++turn; turn < static_cast<int64_t>(tasks.size()) && finished[turn].ready; ++turn) {
      Finished& f = finished[turn];
      if (f.computed) {
        add_sums(tasks[turn], f.dk.data(), f.dv.data());
        kept_bytes -= 2 * static_cast<int64_t>(f.dk.size() * sizeof(float));
        spare.push_back(std::move(f.dk));
        spare.push_back(std::move(f.dv));
      }
      f.ready = false;
    }
    held.unlock();
    turn_changed.notify_all();
  });
  if (failure) std::rethrow_exception(failure);
}

std::vector<at::Tensor> packed_attention_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                  const at::Tensor& seqs, const at::Tensor& key_rows, int64_t heads,
                                                  int64_t kv_heads, double scale, bool dot, int64_t window,
                                                  double softcap) {
  const PaShape sh = pa_shape(q, k, v, heads, kv_heads);
  // (a sink's share is in lse, from which the weights are recomputed: it weighs no value and takes no
  // gradient here; the sinks' own gradient is packed_attention.py's)
  const PaScoring sc = pa_scoring(scale, window, softcap, c10::nullopt, heads);
  check_dense_rows(grad, sh.rows, heads * sh.dim, "packed_attention_backward: grad");
  check_dense_rows(out, sh.rows, heads * sh.dim, "packed_attention_backward: out");
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
          sc, dot, dq.data_ptr<scalar_t>(), dkv.data_ptr<float>());
    };
    pa_with_head_dim(sh.dim, run);
  });
  return {dq, dkv[0].to(q.scalar_type()), dkv[1].to(q.scalar_type())};
}


}  // namespace grpo_native
