// A decoding step's attention: over grpo's slot caches, the new keys and values rotated into them
// (rope_attend); over the caches transformers keeps, through its attention interface (cached_attend).

#include "ops.h"
#include "simd.h"

#include <limits>

namespace grpo_native {

#if defined(__AVX512F__)
// t[col] = lanes(key col) for the block's keys col < m, zeros after
template <int64_t DIM, typename T, typename Lanes>
inline void each_key(const T* block, int64_t m, __m512 (&t)[16], Lanes lanes) {
  for (int col = 0; col < 16; ++col) t[col] = col < m ? lanes(block + col * DIM) : _mm512_setzero_ps();
}

// t[col] for the block's keys col < m (zeros after): sixteen lanes whose sum is the query's dot product with key
// col, DIM floats of the query against keys widened to float32 as loaded
template <int64_t DIM, typename T>
inline void score_lanes(const float* query, const T* block, int64_t m, __m512 (&t)[16]) {
  constexpr int CHUNKS = DIM / 16;
  __m512 q[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) q[c] = _mm512_loadu_ps(query + 16 * c);
  each_key<DIM>(block, m, t, [&](const T* key) {
    __m512 sum = _mm512_mul_ps(q[0], load_columns(key));
    for (int c = 1; c < CHUNKS; ++c) sum = _mm512_fmadd_ps(q[c], load_columns(key + 16 * c), sum);
    return sum;
  });
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
  each_key<DIM>(block, m, t, [&](const c10::BFloat16* key) {
    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(key));
    for (int c = 1; c < CHUNKS; ++c) sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    return sum;
  });
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

// out = acc / total rounded to T: a query's weighted sum of values over its softmax's total (acc scaled in place)
template <typename T>
inline void write_normalised(float* acc, float total, T* out, int64_t dim) {
  const float inverse = 1.f / total;
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) acc[i] *= inverse;
  from_float(acc, out, dim);
}

// One decoding step's attention in a layer: q and k rotated (rotate_half convention, each product
// and the sum rounded to T, as transformers' apply_rotary_pos_emb), the new key and value written
// to each row's next cache column (lengths[r]), then each query head attends over its row's
// columns 0..lengths[r] (with a sliding `window`, its last `window` of them) through key head
// h / (heads / kv_heads), in float32, output rounded to T.
// HEAD_DIM: the head dimension known when compiling (64, 80, 96, 128, 256: loops of fixed length, unrolled
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

//
// The model's own variations, as its forward computes them: a soft-cap on the scores (`softcap` > 0:
// cap * tanh(score / cap), Gemma 2's, before the softmax); q's and k's norms (`norms` their kind: NormKind)
// of each head (Qwen3's, Gemma 3's) or of all heads together (`wide_norms`: OLMo2's, whose q_norm spans
// every head of q); cos and sin `rotary` wide (fewer than the head's dims: Phi-4-mini's partial rotary) and
// of T (each product rounded, as Llama's) or float32 (C: OLMo2's, the sum rounded once).
template <typename T, typename C, int64_t HEAD_DIM>
void rope_attend_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                      const C* cos, int64_t cos_stride, const C* sin, int64_t sin_stride, int64_t rotary, T* k_cache,
                      T* v_cache, int64_t slot_stride, int64_t head_stride, const int64_t* lengths,
                      const int64_t* from, const int64_t* shared, T* out, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, float scale, bool dot, const T* q_norm, const T* k_norm,
                      float norm_eps, NormKind norms, bool wide_norms, int64_t window, float softcap) {
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = heads / kv_heads;
  constexpr bool round_each = std::is_same_v<C, T>;  // (cos and sin of T: each product rounded)
  // with norms over all of a row's heads, each row's scales first (q's, k's)
  std::vector<float> wide_scales(wide_norms ? 2 * rows : 0);
  if (wide_norms) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xf(heads * dim);
      for (int64_t r = begin; r < end; ++r) {
        to_float(q + r * q_stride, xf.data(), heads * dim);
        wide_scales[2 * r] = inverse_rms(xf.data(), heads * dim, norm_eps);
        to_float(k + r * k_stride, xf.data(), kv_heads * dim);
        wide_scales[2 * r + 1] = inverse_rms(xf.data(), kv_heads * dim, norm_eps);
      }
    });
  }
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
  // a head of q or k widened, normalised where the model normalises it (`norm` its weight as floats, else
  // null; `wide_scale` the scale of all the row's heads where the norm spans them), rotated
  auto rotate_row = [&](const T* x, const float* norm, float wide_scale, const float* c, const float* s, float* xf,
                        float* y) {
    to_float(x, xf, dim);
    if (norm != nullptr)
      norm_row_scaled<T>(xf, norm, xf, dim, wide_norms ? wide_scale : inverse_rms(xf, dim, norm_eps), norms);
    rotate_part<T>(xf, c, s, y, dim, rotary, round_each);
  };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), xf(dim), rotated(dim), queries(ROPE_SHARERS * group * dim),
        acc(ROPE_SHARERS * group * dim), widened(dim), scores, totals(ROPE_SHARERS * group);
    std::vector<c10::BFloat16> query_pairs(dot && std::is_same_v<T, c10::BFloat16> ? ROPE_SHARERS * group * dim : 0);
    std::vector<float*> weights(ROPE_SHARERS * group);  // (query i's scores, then softmax numerators)
    std::vector<T*> outs(ROPE_SHARERS * group);
    // the norms' weights: a head's, or every head's where they span the row
    const int64_t q_width = wide_norms ? heads * dim : dim, k_width = wide_norms ? kv_heads * dim : dim;
    std::vector<float> qn(q_norm != nullptr ? q_width : 0), kn(k_norm != nullptr ? k_width : 0);
    if (q_norm != nullptr) to_float(q_norm, qn.data(), q_width);
    if (k_norm != nullptr) to_float(k_norm, kn.data(), k_width);
    // head h's weights
    auto q_weights = [&](int64_t h) { return q_norm == nullptr ? nullptr : qn.data() + (wide_norms ? h * dim : 0); };
    auto k_weights = [&](int64_t h) { return k_norm == nullptr ? nullptr : kn.data() + (wide_norms ? h * dim : 0); };
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
        to_float(cos + r * cos_stride, c.data(), rotary);
        to_float(sin + r * sin_stride, s.data(), rotary);
        const float q_scale = wide_norms ? wide_scales[2 * r] : 0.f, k_scale = wide_norms ? wide_scales[2 * r + 1] : 0.f;
        T* row_keys = k_cache + r * slot_stride + g * head_stride;
        T* row_values = v_cache + r * slot_stride + g * head_stride;
        rotate_row(k + r * k_stride + g * dim, k_weights(g), k_scale, c.data(), s.data(), xf.data(), rotated.data());
        from_float(rotated.data(), row_keys + lengths[r] * dim, dim);
        std::memcpy(row_values + lengths[r] * dim, v + r * v_stride + g * dim, dim * sizeof(T));
        for (int64_t j = 0; j < group; ++j)
          rotate_row(q + r * q_stride + (g * group + j) * dim, q_weights(g * group + j), q_scale, c.data(), s.data(),
                     xf.data(), queries.data() + (u * group + j) * dim);
      }
      // query i (row i / group's head g * group + i % group): its scores, by column, and its output
      scores.resize(offsets[count]);
      const int64_t nq = count * group;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t u = i / group, j = i % group;
        weights[i] = scores.data() + offsets[u] + j * columns(u);
        outs[i] = out + members[u] * heads * dim + (g * group + j) * dim;
      }
      // each query's scores -> softmax's numerators, exp(score - the largest), and their totals; with a
      // sliding window, a row's columns before its last `window` weigh nothing (scored, then dropped:
      // the shared columns are scored for the run's rows together, and the values' sums run over them)
      auto numerators = [&] {
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t n = columns(i / group), outside = window > 0 ? std::max<int64_t>(0, n - window) : 0;
          float* sp = weights[i];
          std::fill(sp, sp + outside, 0.f);
          if (softcap > 0.f) soft_cap(sp + outside, n - outside, softcap);
          const float top = row_max(sp + outside, n - outside);
          totals[i] = exp_shifted_total(sp + outside, n - outside, top);
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
      for (int64_t i = 0; i < nq; ++i) write_normalised(acc.data() + i * dim, totals[i], outs[i], dim);
    }
  });
}

at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lengths,
                       int64_t heads, double scale, const c10::optional<at::Tensor>& shared_from,
                       const c10::optional<at::Tensor>& shared, bool dot, const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, double norm_eps, c10::string_view norms,
                       int64_t window, double softcap) {
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
  // cos and sin: a head's width, or fewer (an even number: partial rotary; none: a layer that rotates nothing,
  // SmolLM3's every fourth), in the caches' dtype or float32
  const int64_t rotary = cos.dim() == 2 ? cos.size(1) : -1;
  TORCH_CHECK(rotary >= 0 && rotary <= dim && rotary % 2 == 0 && sin.dim() == 2 && sin.size(1) == rotary,
              "rope_attend: cos and sin must be [rows, r] with r even and at most the head's ", dim,
              " dims, got ", cos.sizes(), " and ", sin.sizes());
  check_rows(cos, rows, rotary, "rope_attend: cos");
  check_rows(sin, rows, rotary, "rope_attend: sin");
  const auto dtype = k_cache.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype, "rope_attend: q, k, v and the caches must have one dtype, ", dtype);
  TORCH_CHECK(sin.scalar_type() == cos.scalar_type() && (cos.scalar_type() == dtype || cos.scalar_type() == at::kFloat),
              "rope_attend: cos and sin must both be ", dtype, " or both float32, got ", cos.scalar_type(), " and ",
              sin.scalar_type());
  TORCH_CHECK(softcap >= 0, "rope_attend: softcap must be 0 (none) or the scores' cap, got ", softcap);
  const NormKind kind = norm_kind(norms, "rope_attend");
  TORCH_CHECK(window >= 0, "rope_attend: window must be 0 (none) or the number of columns a row sees, got ", window);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rope_attend: q_norm and k_norm go together");
  // each head's norm ([dim] both), or one over all of a row's heads ([heads * dim] and [kv_heads * dim])
  const bool wide_norms = q_norm.has_value() && q_norm->dim() == 1 && q_norm->size(0) == heads * dim && heads > 1;
  for (const auto* norm : {&q_norm, &k_norm}) {
    const int64_t width = !wide_norms ? dim : norm == &q_norm ? heads * dim : kv_heads * dim;
    TORCH_CHECK(!norm->has_value() || ((*norm)->dim() == 1 && (*norm)->size(0) == width && (*norm)->is_contiguous() &&
                                       (*norm)->scalar_type() == dtype && (*norm)->device().is_cpu()),
                "rope_attend: q_norm and k_norm must be contiguous CPU tensors of the caches' dtype ", dtype,
                ", both a head's [", dim, "] or q's [", heads * dim, "] and k's [", kv_heads * dim, "]; got ",
                (*norm)->scalar_type(), " ", (*norm)->sizes());
  }
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
    auto by_cos = [&](auto* cos_type) {
      using C = std::remove_pointer_t<decltype(cos_type)>;
      auto run = [&](auto impl) {
        impl(q.data_ptr<scalar_t>(), q.stride(0), k.data_ptr<scalar_t>(), k.stride(0), v.data_ptr<scalar_t>(),
             v.stride(0), cos.data_ptr<C>(), cos.stride(0), sin.data_ptr<C>(), sin.stride(0), rotary,
             k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k_cache.stride(0), k_cache.stride(1), lp, fp,
             sp, out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, static_cast<float>(scale), dot,
             q_norm.has_value() ? q_norm->data_ptr<scalar_t>() : nullptr,
             k_norm.has_value() ? k_norm->data_ptr<scalar_t>() : nullptr, static_cast<float>(norm_eps), kind,
             wide_norms, window, static_cast<float>(softcap));
      };
      if (dim == 64) run(rope_attend_impl<scalar_t, C, 64>);
      else if (dim == 80) run(rope_attend_impl<scalar_t, C, 80>);
      else if (dim == 96) run(rope_attend_impl<scalar_t, C, 96>);
      else if (dim == 128) run(rope_attend_impl<scalar_t, C, 128>);
      else if (dim == 256) run(rope_attend_impl<scalar_t, C, 256>);  // (Gemma's)
      else run(rope_attend_impl<scalar_t, C, 0>);
    };
    // cos and sin of the caches' dtype, or float32 (where that is another type: bf16 caches)
    if constexpr (std::is_same_v<scalar_t, float>) by_cos(static_cast<float*>(nullptr));
    else if (cos.scalar_type() == at::kFloat) by_cos(static_cast<float*>(nullptr));
    else by_cos(static_cast<scalar_t*>(nullptr));
  });
  return out;
}

// A decoding step's attention over keys and values a model's own cache keeps (cached_attention.py: a
// hybrid's attention layers in the lockstep sampler, and any decoder sampled through its own forward):
// each row's query heads over the columns its mask keeps, through key head h / (heads / kv_heads), in
// float32 (keys and values widened as read), the output rounded to T once. PyTorch's CPU SDPA takes a
// single query position through its flash kernel, blocked for long queries: 3.4-17 ms a call at 32 rows
// of 60-300 columns (8 heads over 2, 256 dims, bf16; AMD EPYC Zen 4, 2 cores), where the arithmetic is a
// few tenths of a millisecond (docs/benchmark.md). The kept columns are taken in runs (a left-padded
// batch's row: one; a prompt restored from the prefix cache behind padding: two), the masked ones
// never read.
template <typename T, int64_t HEAD_DIM>
void cached_attend_impl(const T* q, int64_t q_row, int64_t q_head, const T* k, int64_t k_row, int64_t k_head,
                        const T* v, int64_t v_row, int64_t v_head, const bool* mask, int64_t mask_row,
                        int64_t mask_col, T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t columns,
                        int64_t head_dim, float scale) {
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * dim), scores(group * columns), acc(group * dim), widened(dim), totals(group);
    std::vector<float*> weights(group);
    std::vector<int64_t> runs;  // [first, last) pairs of kept columns
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      runs.clear();
      for (int64_t p = 0; p < columns;) {
        if (mask != nullptr && !mask[r * mask_row + p * mask_col]) {
          ++p;
          continue;
        }
        const int64_t first = p;
        while (p < columns && (mask == nullptr || mask[r * mask_row + p * mask_col])) ++p;
        runs.insert(runs.end(), {first, p});
      }
      T* outs = out + (r * heads + g * group) * dim;
      if (runs.empty()) {  // (no column to attend to: zeros, where SDPA's softmax gives NaN)
        std::fill(outs, outs + group * dim, static_cast<T>(0.f));
        continue;
      }
      const T* keys = k + r * k_row + g * k_head;
      const T* values = v + r * v_row + g * v_head;
      for (int64_t j = 0; j < group; ++j) {
        to_float(q + r * q_row + (g * group + j) * q_head, queries.data() + j * dim, dim);
        weights[j] = scores.data() + j * columns;
      }
      bool done = false;
#if defined(ATTEND_AVX512)
      if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
        for (size_t u = 0; u < runs.size(); u += 2)
          attend_scores<HEAD_DIM>(queries.data(), group, keys, runs[u], runs[u + 1], weights.data(), scale);
        done = true;
      }
#endif
      if (!done)
        for (size_t u = 0; u < runs.size(); u += 2)
          for (int64_t p = runs[u]; p < runs[u + 1]; ++p) {
            const float* kp = as_float(keys + p * dim, widened.data(), dim);
            for (int64_t j = 0; j < group; ++j) {
              const float* qj = queries.data() + j * dim;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t i = 0; i < dim; ++i) dot += qj[i] * kp[i];
              weights[j][p] = dot * scale;
            }
          }
      // softmax's numerators over the kept columns, exp(score - the largest), and their totals
      for (int64_t j = 0; j < group; ++j) {
        float top = -std::numeric_limits<float>::infinity();
        for (size_t u = 0; u < runs.size(); u += 2)
          top = std::max(top, row_max(weights[j] + runs[u], runs[u + 1] - runs[u]));
        totals[j] = 0.f;
        for (size_t u = 0; u < runs.size(); u += 2)
          totals[j] += exp_shifted_total(weights[j] + runs[u], runs[u + 1] - runs[u], top);
      }
      done = false;
#if defined(ATTEND_AVX512)
      if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
        constexpr int CHUNKS = static_cast<int>(HEAD_DIM / 16);
        constexpr int NQ = CHUNKS >= 24 ? 1 : 24 / CHUNKS;  // (24 accumulators: 6 queries of 64 dims, 1 of 256)
        float buffer[HEAD_DIM];
        for (int64_t qa = 0; qa < group; qa += NQ) {
          const int hi = static_cast<int>(std::min<int64_t>(NQ, group - qa));
          __m512 sums[NQ][CHUNKS];
          for (int i = 0; i < NQ; ++i)
            for (int c = 0; c < CHUNKS; ++c) sums[i][c] = _mm512_setzero_ps();
          for (size_t u = 0; u < runs.size(); u += 2)
            attend_values<HEAD_DIM, NQ>(sums, 0, hi, weights.data() + qa, values, runs[u], runs[u + 1]);
          for (int i = 0; i < hi; ++i) {
            const __m512 inverse = _mm512_set1_ps(1.f / totals[qa + i]);
            for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(buffer + 16 * c, _mm512_mul_ps(sums[i][c], inverse));
            from_float(buffer, outs + (qa + i) * dim, dim);
          }
        }
        done = true;
      }
#endif
      if (done) continue;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (size_t u = 0; u < runs.size(); u += 2)
        for (int64_t p = runs[u]; p < runs[u + 1]; ++p) {
          const float* vp = as_float(values + p * dim, widened.data(), dim);
          for (int64_t j = 0; j < group; ++j) {
            float* a = acc.data() + j * dim;
            const float weight = weights[j][p];
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) a[i] += weight * vp[i];
          }
        }
      for (int64_t j = 0; j < group; ++j) write_normalised(acc.data() + j * dim, totals[j], outs + j * dim, dim);
    }
  });
}

at::Tensor cached_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "cached_attend: q must be [rows, heads, dim] and k, v [rows, kv_heads, columns, dim] of one shape, "
              "heads a multiple of kv_heads; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "cached_attend: CPU tensors only");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "cached_attend: q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1), columns = k.size(2);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && (columns <= 1 || (k.stride(2) == dim &&
                  v.stride(2) == dim)),
              "cached_attend: each head's values must be contiguous and a head's columns back to back, got strides ",
              q.strides(), ", ", k.strides(), ", ", v.strides());
  const bool* mp = nullptr;
  int64_t mask_row = 0, mask_col = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == rows && mask->size(1) == columns &&
                    mask->scalar_type() == at::kBool && mask->device().is_cpu(),
                "cached_attend: mask must be a bool CPU [rows, columns] tensor ([", rows, ", ", columns, "]), got ",
                mask->scalar_type(), " ", mask->sizes());
    mp = mask->data_ptr<bool>(), mask_row = mask->stride(0), mask_col = mask->stride(1);
  }
  auto out = at::empty({rows, heads, dim}, q.options());
  if (rows == 0 || heads == 0 || dim == 0) return out;
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "cached_attend", [&] {
    auto run = [&](auto impl) {
      impl(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k.data_ptr<scalar_t>(), k.stride(0), k.stride(1),
           v.data_ptr<scalar_t>(), v.stride(0), v.stride(1), mp, mask_row, mask_col, out.data_ptr<scalar_t>(), rows,
           heads, kv_heads, columns, dim, static_cast<float>(scale));
    };
    // (the head widths of the families that decode through their own forward: Phi-2's 80, Phi-3-mini's 96,
    // Gemma's and Qwen3.5's 256; any other through the loops of a width known at run time, ~3x slower)
    if (dim == 64) run(cached_attend_impl<scalar_t, 64>);
    else if (dim == 80) run(cached_attend_impl<scalar_t, 80>);
    else if (dim == 96) run(cached_attend_impl<scalar_t, 96>);
    else if (dim == 128) run(cached_attend_impl<scalar_t, 128>);
    else if (dim == 256) run(cached_attend_impl<scalar_t, 256>);
    else run(cached_attend_impl<scalar_t, 0>);
  });
  return out;
}

}  // namespace grpo_native
