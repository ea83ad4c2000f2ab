// The gated delta rule over a sequence (Qwen3.5's linear-attention layers in a prefill and in a training
// pass; delta_rule.py calls it), forward and backward, in chunks: each row's and value head's chunks in
// turn, in one call per layer. Or over segments of the rows (packed_recurrence.py: a training pass's
// sequences back to back in one row), each from its own initial state, in chunks of its own.
//
// transformers' CPU path (torch_chunk_gated_delta_rule, the fallback for flash-linear-attention's GPU
// kernel) computes the same chunked form as ~40 operators over all rows and heads at once, and autograd
// keeps their float32 results for a backward of ~80 more: at a GRPO step's shapes (chunks of 32-64
// positions, 128-wide heads) each pass over those tensors costs more than its arithmetic, and the
// recurrence was 5.4 s of a 19 s forward_backward (docs/benchmark.md). Here one chunk of one head --
// its queries, keys and values (16 KiB each at 32 positions), its 64 KiB state -- stays in a core's
// cache while its products run, as BLAS calls on those small matrices; the backward recomputes the
// chunk's products from the inputs instead of keeping them (the state at each chunk's start too, where
// a sequence has several).
//
// The chunked form, per chunk of c positions, with g's cumulative sum gamma inside the chunk,
// D[i][j] = exp(gamma_i - gamma_j) and S the state (key dim x value dim) at the chunk's start:
//   A = strictly lower (beta_i k_i.k_j D[i][j]);  (I + A) U = beta v;  (I + A) W = beta exp(gamma) k
//   V' = U - W S;  P = lower, diagonal included (q_i.k_j D[i][j]);  O = (q exp(gamma)) S + P V'
//   S <- exp(gamma_last) S + (k exp(gamma_last - gamma))^T V'
// with q and k L2-normalised first (where asked) and q divided by sqrt(key dim), as the reference
// does. The backward is this, differentiated by hand (each step's comment names its equation);
// tests/test_delta_rule.py checks every gradient against autograd through transformers' reference.

#include "ops.h"

// The BLAS that PyTorch links (MKL on x86, OpenBLAS elsewhere) exports the Fortran sgemm; declared weak,
// so that a build of PyTorch without it leaves it null and the loops below take its place. Its integer
// arguments are passed as pointers to 64-bit integers: on a little-endian machine both a 32-bit
// interface (which reads their low half) and a 64-bit one (ILP64) read the right values.
extern "C" void sgemm_(const char* transa, const char* transb, const int64_t* m, const int64_t* n, const int64_t* k,
                       const float* alpha, const float* a, const int64_t* lda, const float* b, const int64_t* ldb,
                       const float* beta, float* c, const int64_t* ldc) __attribute__((weak));

namespace grpo_native {

namespace {

// whether the products go to BLAS (where it is linked; chunk_delta_rule_blas turns it off, for a test of the loops)
std::atomic<bool> use_blas{sgemm_ != nullptr && std::endian::native == std::endian::little};

// C = alpha op(A) op(B) + beta C on row-major matrices (op: transposed where asked), C m x n, the
// inner dimension k. As BLAS is column-major, it computes C^T = op(B)^T op(A)^T.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k > 0 && use_blas.load(std::memory_order_relaxed)) {
    sgemm_(trans_b ? "T" : "N", trans_a ? "T" : "N", &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (beta == 0.f) std::fill(ci, ci + n, 0.f);
    else if (beta != 1.f)
      for (int64_t j = 0; j < n; ++j) ci[j] *= beta;
    for (int64_t p = 0; p < k; ++p) {
      const float aip = alpha * (trans_a ? a[p * lda + i] : a[i * lda + p]);
      if (trans_b) {
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * b[j * ldb + p];
      } else {
        const float* bp = b + p * ldb;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
      }
    }
  }
}

inline float dot(const float* x, const float* y, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// y += a x
inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One sequence the rule runs over: `length` positions of row `row` from position `start`, in chunks of
// `chunk`, from initial state `state` (an index into the initial states; -1: zeros). A call without
// segments runs one per row, over all its positions.
struct Segment {
  int64_t row, start, length, chunk, state;
  int64_t chunks() const { return (length + chunk - 1) / chunk; }
};

struct Shape {
  int64_t rows, positions, k_heads, v_heads, dk, dv;
  float scale;  // the query's 1 / sqrt(key dim)
  bool l2norm;  // q and k L2-normalised first
  std::vector<Segment> segments;
  int64_t most_chunk = 0, most_chunks = 0;  // over the segments: the largest chunk, the most chunks
  int64_t items() const { return static_cast<int64_t>(segments.size()) * v_heads; }
};

// One chunk of one segment's value head: its inputs as floats, and the chunked form's products. Sized
// once for the largest chunk; c is this chunk's positions.
struct Chunk {
  int64_t c = 0, dk, dv, most;
  std::vector<float> q, k, v, beta, gamma, inv_q, inv_k;  // q, k as used (normalised, q scaled); 1/norms
  std::vector<float> grown, to_last;                      // exp(gamma_i), exp(gamma_last - gamma_i)
  float carried = 1.f;                                    // exp(gamma_last): the state's decay over the chunk
  std::vector<float> decay, kk, a, p, u, w, vnew;        // D, K K^T, A, P, U, W, V'

  Chunk(const Shape& s) : dk(s.dk), dv(s.dv), most(s.most_chunk) {
    for (auto* x : {&q, &k, &w}) x->resize(most * dk);
    for (auto* x : {&v, &u, &vnew}) x->resize(most * dv);
    for (auto* x : {&beta, &gamma, &inv_q, &inv_k, &grown, &to_last}) x->resize(most);
    for (auto* x : {&decay, &kk, &a, &p}) x->resize(most * most);
  }
  float* row(std::vector<float>& x, int64_t i, int64_t width) { return x.data() + i * width; }
};

// q, k, v: [rows, positions, heads, dim] with each position's heads back to back, rows and positions
// at any stride (views of the layer's convolution output); g, beta: [rows, positions, value heads]
template <typename T>
struct Inputs {
  const T *q, *k, *v;
  const float *g, *beta;
  int64_t qk_row, qk_pos, v_row, v_pos;  // strides, in elements (q's and k's the same)
};

// A vector of `n` raw values as floats in y, L2-normalised (x * rsqrt(sum(x^2) + 1e-6), as transformers'
// l2norm) where asked, then times `scale`; returns the norm's inverse (1 where not normalised).
template <typename T>
float load_vector(const T* x, float* y, int64_t n, bool l2norm, float scale) {
  to_float(x, y, n);
  float inv = 1.f;
  if (l2norm) inv = 1.f / std::sqrt(dot(y, y, n) + 1e-6f);
  if (l2norm || scale != 1.f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = y[i] * inv * scale;
  }
  return inv;
}

// The flat index (row x positions) of position i of segment `seg`'s chunk n: where g, beta, the output
// and the gradients lie
inline int64_t flat_position(const Shape& s, const Segment& seg, int64_t n, int64_t i) {
  return seg.row * s.positions + seg.start + n * seg.chunk + i;
}

// Chunk n of segment `seg`'s value head h: its inputs, D, A, U and W (and P where `attend`)
template <typename T>
void prepare(Chunk& ch, const Shape& s, const Inputs<T>& in, const Segment& seg, int64_t h, int64_t n, bool attend) {
  const int64_t t0 = seg.start + n * seg.chunk, c = std::min(seg.chunk, seg.length - n * seg.chunk);
  const int64_t kh = h / (s.v_heads / s.k_heads), dk = s.dk, dv = s.dv, r = seg.row;
  ch.c = c;
  float gamma = 0.f;
  for (int64_t i = 0; i < c; ++i) {
    const int64_t pos = flat_position(s, seg, n, i), qk = r * in.qk_row + (t0 + i) * in.qk_pos + kh * dk;
    ch.inv_q[i] = load_vector(in.q + qk, ch.row(ch.q, i, dk), dk, s.l2norm, s.scale);
    ch.inv_k[i] = load_vector(in.k + qk, ch.row(ch.k, i, dk), dk, s.l2norm, 1.f);
    to_float(in.v + r * in.v_row + (t0 + i) * in.v_pos + h * dv, ch.row(ch.v, i, dv), dv);
    ch.beta[i] = in.beta[pos * s.v_heads + h];
    gamma += in.g[pos * s.v_heads + h];
    ch.gamma[i] = gamma;
  }
  ch.carried = std::exp(gamma);
  for (int64_t i = 0; i < c; ++i) {
    ch.grown[i] = std::exp(ch.gamma[i]);
    ch.to_last[i] = std::exp(gamma - ch.gamma[i]);
  }
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < c; ++j) ch.decay[i * c + j] = j <= i ? std::exp(ch.gamma[i] - ch.gamma[j]) : 0.f;
  // A[i][j] = beta_i k_i.k_j D[i][j], j < i
  gemm(false, true, c, c, dk, 1.f, ch.k.data(), dk, ch.k.data(), dk, 0.f, ch.kk.data(), c);
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < c; ++j) ch.a[i * c + j] = j < i ? ch.beta[i] * ch.kk[i * c + j] * ch.decay[i * c + j] : 0.f;
  // (I + A) U = beta v, (I + A) W = beta exp(gamma) k: forward substitution, row by row
  for (int64_t i = 0; i < c; ++i) {
    float* ui = ch.row(ch.u, i, dv);
    float* wi = ch.row(ch.w, i, dk);
    const float* vi = ch.row(ch.v, i, dv);
    const float* ki = ch.row(ch.k, i, dk);
    const float bk = ch.beta[i] * ch.grown[i];
#pragma omp simd
    for (int64_t x = 0; x < dv; ++x) ui[x] = vi[x] * ch.beta[i];
#pragma omp simd
    for (int64_t x = 0; x < dk; ++x) wi[x] = ki[x] * bk;
    for (int64_t j = 0; j < i; ++j) {
      const float aij = ch.a[i * c + j];
      axpy(-aij, ch.row(ch.u, j, dv), ui, dv);
      axpy(-aij, ch.row(ch.w, j, dk), wi, dk);
    }
  }
  if (attend) {  // P[i][j] = q_i.k_j D[i][j], j <= i
    gemm(false, true, c, c, dk, 1.f, ch.q.data(), dk, ch.k.data(), dk, 0.f, ch.p.data(), c);
    for (int64_t i = 0; i < c * c; ++i) ch.p[i] *= ch.decay[i];
  }
}

// V' = U - W S
void new_values(Chunk& ch, const float* state) {
  std::copy(ch.u.begin(), ch.u.begin() + ch.c * ch.dv, ch.vnew.begin());
  gemm(false, false, ch.c, ch.dv, ch.dk, -1.f, ch.w.data(), ch.dk, state, ch.dv, 1.f, ch.vnew.data(), ch.dv);
}

// out[i] = rows[i] * factor[i] for the chunk's positions (rows of ch.dk): the queries grown to where they
// read the state (q exp(gamma)), the keys decayed to the chunk's end (k exp(gamma_last - gamma))
void scaled_rows(const Chunk& ch, const std::vector<float>& rows, const std::vector<float>& factor, float* out) {
  for (int64_t i = 0; i < ch.c; ++i) {
    const float* ri = rows.data() + i * ch.dk;
    const float f = factor[i];
#pragma omp simd
    for (int64_t x = 0; x < ch.dk; ++x) out[i * ch.dk + x] = ri[x] * f;
  }
}

// S <- exp(gamma_last) S + (k exp(gamma_last - gamma))^T V'; `kd` takes the decayed keys
void advance(Chunk& ch, float* state, float* kd) {
  for (int64_t i = 0; i < ch.dk * ch.dv; ++i) state[i] *= ch.carried;
  scaled_rows(ch, ch.k, ch.to_last, kd);
  gemm(true, false, ch.dk, ch.dv, ch.c, 1.f, kd, ch.dk, ch.vnew.data(), ch.dv, 1.f, state, ch.dv);
}

// The initial state of segment `seg`'s value head h: null for zeros
inline const float* initial_of(const Shape& s, const float* initial, const Segment& seg, int64_t h) {
  return initial != nullptr && seg.state >= 0 ? initial + (seg.state * s.v_heads + h) * s.dk * s.dv : nullptr;
}

template <typename T>
void forward(const Shape& s, const Inputs<T>& in, const float* initial, T* out, float* final_state) {
  const int64_t dk = s.dk, dv = s.dv;
  at::parallel_for(0, s.items(), 1, [&](int64_t begin, int64_t end) {
    Chunk ch(s);
    std::vector<float> state(dk * dv), qg(s.most_chunk * dk), o(s.most_chunk * dv);
    for (int64_t item = begin; item < end; ++item) {
      const Segment& seg = s.segments[item / s.v_heads];
      const int64_t h = item % s.v_heads, chunks = seg.chunks();
      if (const float* from = initial_of(s, initial, seg, h)) std::copy(from, from + dk * dv, state.begin());
      else std::fill(state.begin(), state.end(), 0.f);
      for (int64_t n = 0; n < chunks; ++n) {
        prepare(ch, s, in, seg, h, n, true);
        const int64_t c = ch.c;
        new_values(ch, state.data());
        // O = (q exp(gamma)) S + P V'
        scaled_rows(ch, ch.q, ch.grown, qg.data());
        gemm(false, false, c, dv, dk, 1.f, qg.data(), dk, state.data(), dv, 0.f, o.data(), dv);
        gemm(false, false, c, dv, c, 1.f, ch.p.data(), c, ch.vnew.data(), dv, 1.f, o.data(), dv);
        for (int64_t i = 0; i < c; ++i) from_float(o.data() + i * dv, out + (flat_position(s, seg, n, i) * s.v_heads + h) * dv, dv);
        if (n + 1 < chunks || final_state != nullptr) advance(ch, state.data(), qg.data());
      }
      if (final_state != nullptr) std::copy(state.begin(), state.end(), final_state + item * dk * dv);
    }
  });
}

// The gradients of one row's value head, per position: written to the outputs after each chunk
struct Grads {
  float *q, *k, *v, *g, *beta;  // [rows, positions, value heads, dk | dv | 1], float32
};

template <typename T>
void backward(const Shape& s, const Inputs<T>& in, const float* initial, const T* grad_out, const float* grad_final,
              const Grads& out, float* grad_initial) {
  const int64_t dk = s.dk, dv = s.dv, c_most = s.most_chunk;
  at::parallel_for(0, s.items(), 1, [&](int64_t begin, int64_t end) {
    Chunk ch(s);
    // states[n]: the state at chunk n's start (recomputed: a sequence's forward is run again first)
    std::vector<float> states(s.most_chunks * dk * dv), ds(dk * dv), ds_next(dk * dv);
    std::vector<float> qg(c_most * dk), kd(c_most * dk), d_o(c_most * dv), d_vnew(c_most * dv), d_w(c_most * dk);
    std::vector<float> d_qg(c_most * dk), d_kd(c_most * dk), d_p(c_most * c_most), d_a(c_most * c_most);
    std::vector<float> gq(c_most * dk), gk(c_most * dk), d_gamma(c_most), d_beta(c_most);
    for (int64_t item = begin; item < end; ++item) {
      const Segment& seg = s.segments[item / s.v_heads];
      const int64_t h = item % s.v_heads, chunks = seg.chunks();
      float* s0 = states.data();
      if (const float* from = initial_of(s, initial, seg, h)) std::copy(from, from + dk * dv, s0);
      else std::fill(s0, s0 + dk * dv, 0.f);
      for (int64_t n = 0; n + 1 < chunks; ++n) {
        prepare(ch, s, in, seg, h, n, false);
        float* next = states.data() + (n + 1) * dk * dv;
        std::copy(states.data() + n * dk * dv, next, next);
        new_values(ch, next - dk * dv);
        advance(ch, next, kd.data());
      }
      if (grad_final != nullptr) std::copy(grad_final + item * dk * dv, grad_final + (item + 1) * dk * dv, ds.begin());
      else std::fill(ds.begin(), ds.end(), 0.f);
      for (int64_t n = chunks - 1; n >= 0; --n) {
        const float* state = states.data() + n * dk * dv;
        prepare(ch, s, in, seg, h, n, true);
        const int64_t c = ch.c;
        new_values(ch, state);
        scaled_rows(ch, ch.q, ch.grown, qg.data());
        scaled_rows(ch, ch.k, ch.to_last, kd.data());
        for (int64_t i = 0; i < c; ++i)
          to_float(grad_out + (flat_position(s, seg, n, i) * s.v_heads + h) * dv, d_o.data() + i * dv, dv);
        // dV' = P^T dO + kd dS (O = ... + P V'; S' = ... + kd^T V')
        gemm(true, false, c, dv, c, 1.f, ch.p.data(), c, d_o.data(), dv, 0.f, d_vnew.data(), dv);
        gemm(false, false, c, dv, dk, 1.f, kd.data(), dk, ds.data(), dv, 1.f, d_vnew.data(), dv);
        // dP = dO V'^T; d(q exp(gamma)) = dO S^T; dkd = V' dS^T
        gemm(false, true, c, c, dv, 1.f, d_o.data(), dv, ch.vnew.data(), dv, 0.f, d_p.data(), c);
        gemm(false, true, c, dk, dv, 1.f, d_o.data(), dv, state, dv, 0.f, d_qg.data(), dk);
        gemm(false, true, c, dk, dv, 1.f, ch.vnew.data(), dv, ds.data(), dv, 0.f, d_kd.data(), dk);
        // d exp(gamma_last), through S' = exp(gamma_last) S + ...: sum(S * dS')
        const float d_carried = dot(state, ds.data(), dk * dv);
        // dW = -dV' S^T (V' = U - W S); the state's gradient before the chunk:
        // dS = exp(gamma_last) dS' + (q exp(gamma))^T dO - W^T dV'
        gemm(false, true, c, dk, dv, -1.f, d_vnew.data(), dv, state, dv, 0.f, d_w.data(), dk);
        for (int64_t i = 0; i < dk * dv; ++i) ds_next[i] = ds[i] * ch.carried;
        gemm(true, false, dk, dv, c, 1.f, qg.data(), dk, d_o.data(), dv, 1.f, ds_next.data(), dv);
        gemm(true, false, dk, dv, c, -1.f, ch.w.data(), dk, d_vnew.data(), dv, 1.f, ds_next.data(), dv);
        std::swap(ds, ds_next);
        // (I + A)^T X = dU (= dV'), (I + A)^T Y = dW: back substitution, in place (d_vnew becomes X, d_w Y)
        for (int64_t j = c - 1; j >= 0; --j)
          for (int64_t i = 0; i < j; ++i) {
            const float aji = ch.a[j * c + i];
            axpy(-aji, d_vnew.data() + j * dv, d_vnew.data() + i * dv, dv);
            axpy(-aji, d_w.data() + j * dk, d_w.data() + i * dk, dk);
          }
        // dA = -(X U^T + Y W^T), its strictly lower part read
        gemm(false, true, c, c, dv, -1.f, d_vnew.data(), dv, ch.u.data(), dv, 0.f, d_a.data(), c);
        gemm(false, true, c, c, dk, -1.f, d_w.data(), dk, ch.w.data(), dk, 1.f, d_a.data(), c);
        std::fill(gq.begin(), gq.begin() + c * dk, 0.f);
        std::fill(gk.begin(), gk.begin() + c * dk, 0.f);
        std::fill(d_gamma.begin(), d_gamma.begin() + c, 0.f);
        for (int64_t i = 0; i < c; ++i) {
          const float *xi = d_vnew.data() + i * dv, *yi = d_w.data() + i * dk, *ki = ch.row(ch.k, i, dk);
          const float e = ch.grown[i], bi = ch.beta[i];
          // U = (I + A)^-1 (beta v): dv = beta X, dbeta = v.X
          float* gv = out.v + (flat_position(s, seg, n, i) * s.v_heads + h) * dv;
#pragma omp simd
          for (int64_t x = 0; x < dv; ++x) gv[x] = bi * xi[x];
          float db = dot(ch.row(ch.v, i, dv), xi, dv);
          // W = (I + A)^-1 (beta exp(gamma) k): dk += beta exp(gamma) Y, dbeta += exp(gamma) k.Y, dgamma += beta exp(gamma) k.Y
          const float ky = dot(ki, yi, dk);
          axpy(bi * e, yi, gk.data() + i * dk, dk);
          db += e * ky;
          d_gamma[i] += bi * e * ky;
          // A[i][j] = beta_i k_i.k_j D[i][j]: dbeta_i += sum_j dA k_i.k_j D; dgamma_i += dA A, dgamma_j -= dA A;
          // d_a becomes G = dA beta_i D (for dk: G K + G^T K). P's: dgamma_i += dP P, dgamma_j -= dP P;
          // d_p becomes H = dP D (dq += H K, dk += H^T q)
          for (int64_t j = 0; j < c; ++j) {
            const float d = ch.decay[i * c + j];
            if (j < i) {
              const float da = d_a[i * c + j], z = da * ch.a[i * c + j];
              db += da * ch.kk[i * c + j] * d;
              d_gamma[i] += z;
              d_gamma[j] -= z;
              d_a[i * c + j] = da * bi * d;
            } else {
              d_a[i * c + j] = 0.f;
            }
            if (j <= i) {
              const float z = d_p[i * c + j] * ch.p[i * c + j];
              d_gamma[i] += z;
              d_gamma[j] -= z;
              d_p[i * c + j] *= d;
            } else {
              d_p[i * c + j] = 0.f;
            }
          }
          d_beta[i] = db;
        }
        gemm(false, false, c, dk, c, 1.f, d_a.data(), c, ch.k.data(), dk, 1.f, gk.data(), dk);
        gemm(true, false, c, dk, c, 1.f, d_a.data(), c, ch.k.data(), dk, 1.f, gk.data(), dk);
        gemm(false, false, c, dk, c, 1.f, d_p.data(), c, ch.k.data(), dk, 1.f, gq.data(), dk);
        gemm(true, false, c, dk, c, 1.f, d_p.data(), c, ch.q.data(), dk, 1.f, gk.data(), dk);
        float d_last = ch.carried * d_carried;
        for (int64_t i = 0; i < c; ++i) {
          // q exp(gamma): dq += exp(gamma) d(q exp(gamma)), dgamma += (q exp(gamma)).d(...)
          axpy(ch.grown[i], d_qg.data() + i * dk, gq.data() + i * dk, dk);
          d_gamma[i] += dot(qg.data() + i * dk, d_qg.data() + i * dk, dk);
          // k exp(gamma_last - gamma): dk += decay dkd, dgamma -= kd.dkd, dgamma_last += kd.dkd
          axpy(ch.to_last[i], d_kd.data() + i * dk, gk.data() + i * dk, dk);
          const float z = dot(kd.data() + i * dk, d_kd.data() + i * dk, dk);
          d_gamma[i] -= z;
          d_last += z;
        }
        d_gamma[c - 1] += d_last;
        // gamma = cumsum(g): dg = the reverse cumulative sum of dgamma
        float running = 0.f;
        for (int64_t i = c - 1; i >= 0; --i) {
          running += d_gamma[i];
          const int64_t pos = flat_position(s, seg, n, i) * s.v_heads + h;
          out.g[pos] = running;
          out.beta[pos] = d_beta[i];
        }
        // q = x r scale, k = x r (r = 1 / |x|): dx = r (dy - y (y.dy)) with y = x r, dy its gradient
        for (int64_t i = 0; i < c; ++i) {
          const int64_t pos = flat_position(s, seg, n, i) * s.v_heads + h;
          float* gqi = gq.data() + i * dk;
          float* gki = gk.data() + i * dk;
          float* dq = out.q + pos * dk;
          float* dkk = out.k + pos * dk;
          if (s.l2norm) {
            const float* qi = ch.row(ch.q, i, dk);  // (y scale)
            const float qdot = dot(qi, gqi, dk);     // = y.dy (dy = scale gq, y = q / scale)
            const float kdot = dot(ch.row(ch.k, i, dk), gki, dk);
            const float* ki = ch.row(ch.k, i, dk);
#pragma omp simd
            for (int64_t x = 0; x < dk; ++x) {
              dq[x] = ch.inv_q[i] * (s.scale * gqi[x] - qi[x] * qdot / s.scale);
              dkk[x] = ch.inv_k[i] * (gki[x] - ki[x] * kdot);
            }
          } else {
#pragma omp simd
            for (int64_t x = 0; x < dk; ++x) {
              dq[x] = s.scale * gqi[x];
              dkk[x] = gki[x];
            }
          }
        }
      }
      if (grad_initial != nullptr) std::copy(ds.begin(), ds.end(), grad_initial + item * dk * dv);
    }
  });
}

// q, k, v, g and beta as the kernels read them: [rows, positions, heads, dim] (g, beta: no dim), contiguous;
// the segments (`segments`: [count, 5] int64 of row, start, length, chunk and initial state, the state -1 for
// zeros; else each row's positions in chunks of `chunk`, from its own state)
Shape check_inputs(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const c10::optional<at::Tensor>& state, int64_t chunk, bool l2norm,
                   const c10::optional<at::Tensor>& segments) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) TORCH_CHECK(t->device().is_cpu(), name, ": CPU tensors expected");
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->is_contiguous(), name, ": g and beta must be contiguous, got strides ", t->strides());
  // q, k, v: each position's heads back to back (rows and positions at any stride)
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1 && (t->size(2) < 2 || t->stride(2) == t->size(3)), name,
                ": q, k and v must hold each position's heads back to back, got ", t->sizes(), " strides ",
                t->strides());
  TORCH_CHECK(q.strides() == k.strides(), name, ": q and k at different strides");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1),
              name, ": q and k must be [rows, positions, key heads, key dim] and v [rows, positions, value heads, "
              "value dim], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  Shape s{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3),
          1.f / std::sqrt(static_cast<float>(q.size(3))), l2norm};
  TORCH_CHECK(s.k_heads > 0 && s.v_heads % s.k_heads == 0, name, ": ", s.v_heads, " value heads over ", s.k_heads,
              " key heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), name,
              ": q, k and v differ in dtype");
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == s.rows && t->size(1) == s.positions &&
                    t->size(2) == s.v_heads,
                name, ": g and beta must be float32 [", s.rows, ", ", s.positions, ", ", s.v_heads, "], got ",
                t->scalar_type(), " ", t->sizes());
  const int64_t states = state.has_value() ? state->size(0) : 0;
  if (segments.has_value()) {
    const at::Tensor& table = *segments;
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 5 && table.is_contiguous() &&
                    table.device().is_cpu(),
                name, ": segments must be a contiguous int64 [count, 5] (row, start, length, chunk, state), got ",
                table.scalar_type(), " ", table.sizes());
    const int64_t* row = table.data_ptr<int64_t>();
    for (int64_t i = 0; i < table.size(0); ++i, row += 5) {
      const Segment seg{row[0], row[1], row[2], row[3], row[4]};
      TORCH_CHECK(seg.row >= 0 && seg.row < s.rows && seg.start >= 0 && seg.length > 0 &&
                      seg.start + seg.length <= s.positions && seg.chunk > 0 && seg.state >= -1 && seg.state < states,
                  name, ": segment ", i, " (row ", seg.row, ", start ", seg.start, ", length ", seg.length, ", chunk ",
                  seg.chunk, ", state ", seg.state, ") is outside ", s.rows, " rows of ", s.positions, " positions and ",
                  states, " initial states");
      s.segments.push_back(seg);
    }
  } else {
    TORCH_CHECK(chunk > 0, name, ": a chunk of ", chunk, " positions");
    TORCH_CHECK(!state.has_value() || states == s.rows, name, ": ", states, " initial states for ", s.rows, " rows");
    if (s.positions > 0)
      for (int64_t r = 0; r < s.rows; ++r) s.segments.push_back({r, 0, s.positions, chunk, state.has_value() ? r : -1});
  }
  for (const Segment& seg : s.segments) {
    s.most_chunk = std::max(s.most_chunk, std::min(seg.chunk, seg.length));
    s.most_chunks = std::max(s.most_chunks, seg.chunks());
  }
  if (state.has_value())
    TORCH_CHECK(state->scalar_type() == at::kFloat && state->is_contiguous() && state->device().is_cpu() && state->dim() == 4 &&
                    state->sizes().slice(1) == at::IntArrayRef({s.v_heads, s.dk, s.dv}),
                name, ": initial states must be a contiguous float32 [states, ", s.v_heads, ", ", s.dk, ", ", s.dv,
                "], got ", state->scalar_type(), " ", state->sizes());
  return s;
}

}  // namespace

bool chunk_delta_rule_blas(bool on) {
  const bool linked = sgemm_ != nullptr && std::endian::native == std::endian::little;
  use_blas = on && linked;
  return use_blas;
}

// Each segment's final state ([segments, value heads, dk, dv]) where `final_state`; with segments, positions
// outside every segment are zeros in the output.
std::vector<at::Tensor> chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta,
                                         const c10::optional<at::Tensor>& initial_state, int64_t chunk,
                                         bool final_state, bool l2norm, const c10::optional<at::Tensor>& segments) {
  const Shape s = check_inputs("chunk_delta_rule", q, k, v, g, beta, initial_state, chunk, l2norm, segments);
  const int64_t count = static_cast<int64_t>(s.segments.size());
  at::Tensor out = segments.has_value() ? at::zeros({s.rows, s.positions, s.v_heads, s.dv}, v.options())
                                        : at::empty({s.rows, s.positions, s.v_heads, s.dv}, v.options());
  at::Tensor last = at::empty({final_state ? (segments.has_value() ? count : s.rows) : 0, s.v_heads, s.dk, s.dv},
                              g.options());
  if (count == 0) {  // (no positions: a row's final state is its initial one)
    if (final_state && !segments.has_value())
      last.copy_(initial_state.has_value() ? *initial_state : at::zeros_like(last));
    return {out, last};
  }
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "chunk_delta_rule", [&] {
    const Inputs<scalar_t> in{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              g.data_ptr<float>(),   beta.data_ptr<float>(),  q.stride(0),
                              q.stride(1),           v.stride(0),             v.stride(1)};
    forward<scalar_t>(s, in, initial_state.has_value() ? initial_state->data_ptr<float>() : nullptr,
                      out.data_ptr<scalar_t>(), final_state ? last.data_ptr<float>() : nullptr);
  });
  return {out, last};
}

// The gradients of q, k, v (per value head), g, beta and of each segment's initial state ([segments, ...],
// where there are initial states: the caller sums those of segments that share one)
std::vector<at::Tensor> chunk_delta_rule_backward(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final,
                                                  const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta,
                                                  const c10::optional<at::Tensor>& initial_state, int64_t chunk,
                                                  bool l2norm, const c10::optional<at::Tensor>& segments) {
  const Shape s = check_inputs("chunk_delta_rule_backward", q, k, v, g, beta, initial_state, chunk, l2norm, segments);
  const int64_t count = static_cast<int64_t>(s.segments.size());
  TORCH_CHECK(grad_out.sizes() == v.sizes() && grad_out.scalar_type() == v.scalar_type() && grad_out.is_contiguous(),
              "chunk_delta_rule_backward: grad_out must be a contiguous ", v.scalar_type(), " ", v.sizes(), ", got ",
              grad_out.scalar_type(), " ", grad_out.sizes());
  const int64_t finals = segments.has_value() ? count : s.rows;
  if (grad_final.has_value())
    TORCH_CHECK(grad_final->scalar_type() == at::kFloat && grad_final->is_contiguous() &&
                    grad_final->sizes() == at::IntArrayRef({finals, s.v_heads, s.dk, s.dv}),
                "chunk_delta_rule_backward: grad_final must be a contiguous float32 [", finals, ", ", s.v_heads, ", ",
                s.dk, ", ", s.dv, "]");
  // q's and k's gradients per value head (a key head's value heads summed by the caller)
  const auto f = g.options();
  auto make = [&](at::IntArrayRef sizes) { return segments.has_value() ? at::zeros(sizes, f) : at::empty(sizes, f); };
  at::Tensor dq = make({s.rows, s.positions, s.v_heads, s.dk}), dk = make({s.rows, s.positions, s.v_heads, s.dk});
  at::Tensor dv = make({s.rows, s.positions, s.v_heads, s.dv});
  at::Tensor dg = make(g.sizes()), dbeta = make(beta.sizes());
  at::Tensor d_initial = at::empty({initial_state.has_value() ? finals : 0, s.v_heads, s.dk, s.dv}, f);
  if (count == 0) {
    if (initial_state.has_value() && !segments.has_value())
      d_initial.copy_(grad_final.has_value() ? *grad_final : at::zeros_like(d_initial));
    return {dq, dk, dv, dg, dbeta, d_initial};
  }
  DISPATCH_SAMPLER_TYPES(q.scalar_type(), "chunk_delta_rule_backward", [&] {
    const Inputs<scalar_t> in{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              g.data_ptr<float>(),   beta.data_ptr<float>(),  q.stride(0),
                              q.stride(1),           v.stride(0),             v.stride(1)};
    const Grads out{dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), dg.data_ptr<float>(),
                    dbeta.data_ptr<float>()};
    backward<scalar_t>(s, in, initial_state.has_value() ? initial_state->data_ptr<float>() : nullptr,
                       grad_out.data_ptr<scalar_t>(), grad_final.has_value() ? grad_final->data_ptr<float>() : nullptr,
                       out, initial_state.has_value() ? d_initial.data_ptr<float>() : nullptr);
  });
  return {dq, dk, dv, dg, dbeta, d_initial};
}

}  // namespace grpo_native
