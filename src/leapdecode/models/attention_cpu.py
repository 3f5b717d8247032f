"""Attention over the KV cache that reads each row's own context only (CPU, float32): the
compiled forward's attention (models/compiled.py) when the C++ extension builds.

A batched decode step is bound by streaming the cached keys and values (docs/batched_step.md):
one attention call over a batch pads every row to the longest, so 16 serve rows of mean
context 370 and longest 826 read 216 MB where 97 MB are theirs, and the fused loop inductor
makes of it streams about a third of the machine's bandwidth. This kernel walks each row's
cache slot up to its own length, then the step's own new tokens under their mask (causal, or
a draft tree's), in one of two ways by how many queries share a key/value head:

- one or two (a decode step): the past in blocks of positions that stay in L1, dot products
  and an online softmax, one pass over the keys and values;
- three or more (a verify or tree step; grouped heads): the past's scores and values as two
  matrix products on the cache in place, through the BLAS torch links (`sgemm_`). A product
  per query (the first way) paid one reduction per key and query: 16 rows x 3 tokens cost
  4.5x a decode step; padded to the longest row, the graph's own attention read 2.2x the
  bytes a batch of serve rows needs.

    leapdecode::cached_attention(q [B, T, H, D], k_cache, v_cache [slots, H_kv, L, D],
        slots [B], lens [B], new_k, new_v [B, T, H_kv, D], new_bias [B, T, T], scale)
        -> [B, T, H, D]
    leapdecode::cached_attention_ragged(q [N, H, D], k_cache, v_cache, slots [B], lens [B],
        cu [B + 1], new_k, new_v [N, H_kv, D], scale) -> [N, H, D]

The second is a chain verify step without padding: row b's new tokens are the packed
q[cu[b] : cu[b + 1]], causal among themselves, so a row that drafted nothing costs one token
of the step, not the longest row's count.

It is built once with the compiler torch.compile already needs (cached under
~/.cache/leapdecode/extensions); where it cannot be built, the compiled forward keeps its own
attention and says so once.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

from ..cache import cache_dir

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // cached positions per block (keys and values stay in L1)
// queries per key/value head from which the past goes through matrix products (gemm_head);
// fewer (a decode step) stream the cache once through the dot-product loop below
constexpr int64_t GEMM_ROWS = 3;
// built with -ffast-math (vectorised exp): no infinities in the arithmetic, LOW stands in
// for -inf as a running maximum's start and a hidden token's score; a bias below HIDDEN (its
// -inf) hides a token
constexpr float LOW = -1e30f, HIDDEN = -1e29f;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_vec(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// The BLAS torch links (MKL on x86, OpenBLAS elsewhere), called directly: at::mm_out on
// views of the cache cost more in dispatch than the product itself at these sizes.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

inline void blas_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                      float* c, int64_t ldc) {
  const int m_ = m, n_ = n, k_ = k, lda_ = lda, ldb_ = ldb, ldc_ = ldc;
  sgemm_(&ta, &tb, &m_, &n_, &k_, &alpha, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

// Working memory of one thread, reused from head to head.
struct Scratch {
  std::vector<float> m, l, acc, s, scores, out;
};

// A key/value head with `rows` queries (T new tokens x `group` query heads, row t * group + j):
// the scores over the cached past as one matrix product [rows, D] x [D, len], a softmax that
// also takes the step's own tokens (new_k, new_v rows of stride `new_stride`, under `bias`
// [T, T] of row stride `bias_stride`), and the past's values as a second product
// [rows, len] x [len, D]. The products go to BLAS on the cache in place (no copies).
void gemm_head(const std::vector<const float*>& qp, const std::vector<float*>& op, int64_t rows,
               int64_t D, float sc, const float* K, int64_t k_stride, const float* V,
               int64_t v_stride, int64_t len, const float* NK, const float* NV,
               int64_t new_stride, const float* bias, int64_t bias_stride, int64_t T,
               int64_t group, Scratch& w) {
  const int64_t width = len + T;  // a row's scores: the past, then the new tokens
  w.scores.resize(rows * (D + width));
  w.out.resize(rows * D);
  float* qb = w.scores.data();  // [rows, D] the queries, scaled
  float* sc_all = qb + rows * D;  // [rows, width]
  float* out = w.out.data();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) qb[r * D + d] = qp[r][d] * sc;
  if (len > 0)  // scores^T [len, rows] = K [len, D] . Q^T (column-major BLAS)
    blas_gemm('T', 'N', len, rows, D, 1.f, K, k_stride, qb, D, 0.f, sc_all, width);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / group;
    float* sr = sc_all + r * width;
    for (int64_t u = 0; u < T; ++u) {
      const float b = bias[t * bias_stride + u];
      sr[len + u] = b < HIDDEN ? LOW : dot(qb + r * D, NK + u * new_stride, D) + b;
    }
    float mx = LOW;
    for (int64_t i = 0; i < width; ++i) mx = std::max(mx, sr[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) {
      const float e = std::exp(sr[i] - mx);  // vectorised (libmvec); LOW -> 0
      sr[i] = e;
      sum += e;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    scale_vec(sr, inv, width);
  }
  if (len > 0) {  // out^T [D, rows] = V^T [D, len] . P^T
    blas_gemm('N', 'N', D, rows, len, 1.f, V, v_stride, sc_all, width, 0.f, out, D);
  } else {
    std::fill(out, out + rows * D, 0.f);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = sc_all + r * width + len;
    for (int64_t u = 0; u < T; ++u)
      if (pr[u] > 0.f) axpy(out + r * D, pr[u], NV + u * new_stride, D);
    std::copy_n(out + r * D, D, op[r]);
  }
}

// The same with one or two queries (a decode step): the past in blocks of BLOCK positions,
// dot products and an online softmax, one pass over the keys and values.
void stream_head(const std::vector<const float*>& qp, const std::vector<float*>& op,
                 int64_t rows, int64_t D, float sc, const float* K, int64_t ks, const float* V,
                 int64_t vs, int64_t len, const float* NK, const float* NV, int64_t new_stride,
                 const float* bias, int64_t bias_stride, int64_t T, int64_t group, Scratch& w) {
  w.m.assign(rows, LOW);
  w.l.assign(rows, 0.f);
  w.acc.assign(rows * D, 0.f);
  w.s.resize(rows * BLOCK);
  float *m = w.m.data(), *l = w.l.data(), *acc = w.acc.data();
  for (int64_t p0 = 0; p0 < len; p0 += BLOCK) {
    const int64_t n = std::min(BLOCK, len - p0);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = w.s.data() + r * BLOCK;
      for (int64_t i = 0; i < n; ++i) sr[i] = dot(qp[r], K + (p0 + i) * ks, D) * sc;
      float mx = m[r];
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sr[i] = std::exp(sr[i] - mx);  // vectorised (libmvec)
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum += sr[i];
      const float corr = std::exp(m[r] - mx);  // 0 on the first block (m = LOW)
      float* ar = acc + r * D;
      scale_vec(ar, corr, D);
      l[r] = l[r] * corr + sum;
      m[r] = mx;
      for (int64_t i = 0; i < n; ++i) axpy(ar, sr[i], V + (p0 + i) * vs, D);
    }
  }
  // the step's own tokens, under the bias (0 where a query sees a token, -inf elsewhere)
  for (int64_t r = 0; r < rows; ++r) {
    const float* brow = bias + (r / group) * bias_stride;
    float* ar = acc + r * D;
    for (int64_t u = 0; u < T; ++u) {
      if (brow[u] < HIDDEN) continue;
      const float x = dot(qp[r], NK + u * new_stride, D) * sc + brow[u];
      if (x > m[r]) {
        const float corr = std::exp(m[r] - x);
        scale_vec(ar, corr, D);
        l[r] *= corr;
        m[r] = x;
      }
      const float p = std::exp(x - m[r]);
      l[r] += p;
      axpy(ar, p, NV + u * new_stride, D);
    }
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) op[r][d] = ar[d] * inv;
  }
}

// One row's key/value head g: T new tokens starting at flat token `first` of Q / O
// ([tokens, H, D]) and of NK / NV ([tokens, H_kv, D]), over `len` cached positions.
void row_head(const float* Q, float* O, const float* NK, const float* NV, int64_t first,
              int64_t T, int64_t H, int64_t Hkv, int64_t g, int64_t D, float sc, const float* K,
              int64_t ks, const float* V, int64_t vs, int64_t len, const float* bias,
              int64_t bias_stride, std::vector<const float*>& qp, std::vector<float*>& op,
              Scratch& w) {
  const int64_t group = H / Hkv, rows = T * group;  // the queries that share this head
  qp.resize(rows);
  op.resize(rows);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < group; ++j) {
      qp[t * group + j] = Q + ((first + t) * H + g * group + j) * D;
      op[t * group + j] = O + ((first + t) * H + g * group + j) * D;
    }
  const float* nk = NK + (first * Hkv + g) * D;
  const float* nv = NV + (first * Hkv + g) * D;
  if (rows >= GEMM_ROWS)  // several queries: the past's scores and values as GEMMs
    gemm_head(qp, op, rows, D, sc, K, ks, V, vs, len, nk, nv, Hkv * D, bias, bias_stride, T,
              group, w);
  else
    stream_head(qp, op, rows, D, sc, K, ks, V, vs, len, nk, nv, Hkv * D, bias, bias_stride, T,
                group, w);
}

void check_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat,
              "cached_attention: float32 only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "cached_attention: cache rows");
}

at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& lens, const at::Tensor& new_k,
                            const at::Tensor& new_v, const at::Tensor& new_bias, double scale) {
  TORCH_CHECK(q.dim() == 4 && new_k.dim() == 4, "cached_attention: shapes");
  check_cache(q, k_cache, v_cache);
  auto qc = q.contiguous();
  auto nk = new_k.contiguous();
  auto nv = new_v.contiguous();
  auto bias = new_bias.contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  auto ln = lens.to(at::kLong).contiguous();
  const int64_t B = qc.size(0), T = qc.size(1), H = qc.size(2), D = qc.size(3);
  const int64_t Hkv = k_cache.size(1);
  auto out = at::empty_like(qc);
  const float *Q = qc.data_ptr<float>(), *KC = k_cache.data_ptr<float>();
  const float *VC = v_cache.data_ptr<float>(), *BI = bias.data_ptr<float>();
  const float *NK = nk.data_ptr<float>(), *NV = nv.data_ptr<float>();
  const int64_t *S = sl.data_ptr<int64_t>(), *LN = ln.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    std::vector<const float*> qp;
    std::vector<float*> op;
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      row_head(Q, O, NK, NV, b * T, T, H, Hkv, g, D, static_cast<float>(scale),
               KC + S[b] * k_cache.stride(0) + g * k_cache.stride(1), k_cache.stride(2),
               VC + S[b] * v_cache.stride(0) + g * v_cache.stride(1), v_cache.stride(2), LN[b],
               BI + b * T * T, T, qp, op, w);
    }
  });
  return out;
}

// Rows of different lengths, packed: row b's new tokens are q[cu[b] : cu[b + 1]], causal
// among themselves after the row's cached past (a chain's verify step, without padding).
at::Tensor cached_attention_ragged(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& slots,
                                   const at::Tensor& lens, const at::Tensor& cu,
                                   const at::Tensor& new_k, const at::Tensor& new_v,
                                   double scale) {
  TORCH_CHECK(q.dim() == 3 && new_k.dim() == 3, "cached_attention_ragged: shapes");
  check_cache(q, k_cache, v_cache);
  auto qc = q.contiguous();
  auto nk = new_k.contiguous();
  auto nv = new_v.contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  auto ln = lens.to(at::kLong).contiguous();
  auto cc = cu.to(at::kLong).contiguous();
  const int64_t B = sl.size(0), H = qc.size(1), D = qc.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(cc.size(0) == B + 1, "cached_attention_ragged: cu has one more entry than slots");
  const int64_t *S = sl.data_ptr<int64_t>(), *LN = ln.data_ptr<int64_t>();
  const int64_t* CU = cc.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, CU[b + 1] - CU[b]);
  TORCH_CHECK(CU[B] == qc.size(0), "cached_attention_ragged: cu[-1] is not the token count");
  std::vector<float> causal(longest * longest, 0.f);  // [T, T] 0 at or below the diagonal
  for (int64_t t = 0; t < longest; ++t)
    for (int64_t u = t + 1; u < longest; ++u) causal[t * longest + u] = LOW;
  auto out = at::empty_like(qc);
  const float *Q = qc.data_ptr<float>(), *KC = k_cache.data_ptr<float>();
  const float* VC = v_cache.data_ptr<float>();
  const float *NK = nk.data_ptr<float>(), *NV = nv.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    std::vector<const float*> qp;
    std::vector<float*> op;
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      if (CU[b + 1] == CU[b]) continue;
      row_head(Q, O, NK, NV, CU[b], CU[b + 1] - CU[b], H, Hkv, g, D, static_cast<float>(scale),
               KC + S[b] * k_cache.stride(0) + g * k_cache.stride(1), k_cache.stride(2),
               VC + S[b] * v_cache.stride(0) + g * v_cache.stride(1), v_cache.stride(2), LN[b],
               causal.data(), longest, qp, op, w);
    }
  });
  return out;
}


// A fresh prompt's causal attention over its own tokens (prefill; nothing cached before it):
// q [B, T, H, D], k, v [B, T, H_kv, D]. Per row, key/value head and block of QBLOCK queries,
// the scores over the keys up to the block's last query as one matrix product, a softmax
// that stops at each query's own position, and the values as a second product, straight
// into the output rows. Only the diagonal block's upper half is computed and discarded;
// SDPA's flash path on this CPU ran the same at about half the arithmetic rate.
constexpr int64_t QBLOCK = 64;

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "causal_attention: q [B, T, H, D], k and v [B, T, H_kv, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "causal_attention: float32 only");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3) && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
              "causal_attention: k and v must be [B, T, H_kv, D] with H a multiple of H_kv");
  // rows and heads may be strided (slices of the fused projection); each head's D contiguous
  // (BLAS wants a leading dimension of at least D: a single token's stride may be anything)
  auto rows = [](const at::Tensor& x) {
    const bool ok = x.stride(3) == 1 && x.size(1) > 1 && x.stride(1) >= x.size(3);
    return ok ? x : x.contiguous();
  };
  auto qc = rows(q);
  auto kc = rows(k);
  auto vc = rows(v);
  const int64_t B = qc.size(0), T = qc.size(1), H = qc.size(2), D = qc.size(3);
  const int64_t Hkv = kc.size(2), group = H / Hkv;
  const int64_t blocks = (T + QBLOCK - 1) / QBLOCK;
  auto out = at::empty({B, T, H, D}, qc.options());
  const float *Q = qc.data_ptr<float>(), *K = kc.data_ptr<float>(), *V = vc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(std::min(QBLOCK, T) * T);
    std::vector<float> inv(QBLOCK);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t blk = item % blocks, bh = item / blocks;
      const int64_t b = bh / H, h = bh % H, g = h / group;
      const int64_t t0 = blk * QBLOCK, n = std::min(QBLOCK, T - t0), width = t0 + n;
      // n queries, qc.stride(1) apart; keys and values 0 .. width - 1, k/v.stride(1) apart
      const float* qb = Q + b * qc.stride(0) + t0 * qc.stride(1) + h * qc.stride(2);
      const float* kb = K + b * kc.stride(0) + g * kc.stride(2);
      const float* vb = V + b * vc.stride(0) + g * vc.stride(2);
      float* ob = O + ((b * T + t0) * H + h) * D;
      float* s = scores.data();  // [n, width]
      // scores^T [width, n] = K [width, D] . Q^T (column-major BLAS), scaled
      blas_gemm('T', 'N', width, n, D, sc, kb, kc.stride(1), qb, qc.stride(1), 0.f, s, width);
      for (int64_t r = 0; r < n; ++r) {
        float* sr = s + r * width;
        const int64_t seen = t0 + r + 1;  // keys 0 .. t0 + r
        float mx = LOW;
        for (int64_t i = 0; i < seen; ++i) mx = std::max(mx, sr[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < seen; ++i) {
          const float e = std::exp(sr[i] - mx);  // vectorised (libmvec)
          sr[i] = e;
          sum += e;
        }
        std::fill(sr + seen, sr + width, 0.f);
        inv[r] = 1.f / sum;
      }
      // out^T [D, n] = V^T [D, width] . P^T, written into the output rows (H * D apart)
      blas_gemm('N', 'N', D, n, width, 1.f, vb, vc.stride(1), s, width, 0.f, ob, H * D);
      for (int64_t r = 0; r < n; ++r) scale_vec(ob + r * H * D, inv[r], D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(leapdecode, m) {
  m.def("cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, "
        "Tensor new_k, Tensor new_v, Tensor new_bias, float scale) -> Tensor");
  m.def("cached_attention_ragged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor lens, Tensor cu, Tensor new_k, Tensor new_v, float scale) -> Tensor");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(leapdecode, CPU, m) {
  m.impl("cached_attention", &cached_attention);
  m.impl("cached_attention_ragged", &cached_attention_ragged);
  m.impl("causal_attention", &causal_attention);
}
"""

BUILD_DIR = cache_dir("extensions")
_state: dict = {}


def available() -> bool:
    """Build (once; cached on disk) and load the kernel; False, with one warning saying why,
    where it cannot be built (no C++ compiler, say)."""
    if "ok" in _state:
        return _state["ok"]
    try:
        from torch.utils.cpp_extension import load_inline

        # named by its source, and built in a folder of its own: checkouts of different
        # versions share the cache, and a shared build folder (one main.cpp, one main.o) let
        # two of them building at once link one's object under the other's name
        name = "leapdecode_cached_attention_" + hashlib.sha1(_SOURCE.encode()).hexdigest()[:12]
        build = os.path.join(BUILD_DIR, name)
        os.makedirs(build, exist_ok=True)
        load_inline(
            name=name,
            cpp_sources=[_SOURCE],
            functions=None,
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"],
            build_directory=build,
            is_python_module=False,
            verbose=False,
        )

        @torch.library.register_fake("leapdecode::cached_attention")
        def _(q, k_cache, v_cache, slots, lens, new_k, new_v, new_bias, scale):
            return torch.empty_like(q, memory_format=torch.contiguous_format)

        @torch.library.register_fake("leapdecode::cached_attention_ragged")
        def _(q, k_cache, v_cache, slots, lens, cu, new_k, new_v, scale):
            return torch.empty_like(q, memory_format=torch.contiguous_format)

        @torch.library.register_fake("leapdecode::causal_attention")
        def _(q, k, v, scale):
            return torch.empty_like(q, memory_format=torch.contiguous_format)

        _state["ok"] = True
    except Exception as e:  # noqa: BLE001 - the compiled forward's own attention still works
        warnings.warn(
            f"leapdecode: the cached-attention kernel could not be built ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); the compiled forward uses its own "
            "attention, which reads every row padded to the longest",
            stacklevel=2,
        )
        _state["ok"] = False
    return _state["ok"]


def reference(q, k_cache, v_cache, slots, lens, new_k, new_v, new_bias, scale):
    """The same attention in plain PyTorch (the tests' reference): [B, T, H, D]."""
    b, t, h, d = q.shape
    h_kv = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(lens[i])
        keys = torch.cat([k_cache[int(slots[i]), :, :n], new_k[i].transpose(0, 1)], 1)
        values = torch.cat([v_cache[int(slots[i]), :, :n], new_v[i].transpose(0, 1)], 1)
        keys = keys.repeat_interleave(h // h_kv, 0)  # [H, n + T, D]
        values = values.repeat_interleave(h // h_kv, 0)
        bias = torch.cat([torch.zeros(t, n), new_bias[i]], 1)  # [T, n + T]
        scores = q[i].transpose(0, 1) @ keys.transpose(1, 2) * scale + bias  # [H, T, n + T]
        out[i] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def reference_ragged(q, k_cache, v_cache, slots, lens, cu, new_k, new_v, scale):
    """cached_attention_ragged in plain PyTorch (the tests' reference): [N, H, D]."""
    out = torch.empty_like(q)
    for i in range(len(slots)):
        a, b = int(cu[i]), int(cu[i + 1])
        if a == b:
            continue
        t = b - a
        bias = torch.zeros(t, t).masked_fill_(
            ~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")
        )
        out[a:b] = reference(
            q[None, a:b],
            k_cache,
            v_cache,
            slots[i : i + 1],
            lens[i : i + 1],
            new_k[None, a:b],
            new_v[None, a:b],
            bias[None],
            scale,
        )[0]
    return out
