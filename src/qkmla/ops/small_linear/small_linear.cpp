// x W^T for a few rows of bfloat16 x against a prepacked W: the decode step's new-token GEMMs
// (a unified QK norm's key scalars read every W_UK row for one to a few tokens), which are
// matrix-vector products where a GEMM library's blocking and call overhead do not pay.
//
//   y[t, n] = sum_k x[t, k] W[n, k]      x [T, K], W [N, K], y [T, N]
//
// W is packed once (interface.py, pack_weight) as [ceil(N / 64)][K / 2][64][2]: a tile of 64
// output columns, and for each pair of K the two values of each column side by side. A tile's
// 64 sums are the lanes of 4 zmm registers, and each pair of x's row is broadcast to all lanes
// for an AVX-512 BF16 dot product (vdpbf16ps: two bf16 products summed into a float32 lane), so
// no horizontal sums are needed, W is read once whatever T is, and a tile stays in L2 across the
// passes over x (4 rows of x at a time: 16 accumulators). Each output is summed in float32 and
// rounded to bf16 once, as PyTorch's bf16 GEMMs do.
//
// Past max_rows rows of x (a prefill) the product goes to at::linear on the unpacked weight,
// where a GEMM library has the better blocking and AMX tiles where the CPU has them.
//
// group_statistic serves a QK norm's key scalars: for W given group by group, [G, group, K] with
// contiguous rows and groups at any stride (vLLM's W_UK, a view of kv_b_proj's weight, is read in
// place: no copy, and the query absorption that reads the same rows next finds them in cache),
//
//   m[t, g] = sum_n |y[t, g, n]|^q,   y[t, g, n] = x[t] . W[g, n] rounded to bf16 (as a GEMM returns it),
//
// q = p for lp and 2 otherwise, then the norm's statistic of each group (rms: (m / group + eps)^-1/2,
// l2: (m + eps)^-1/2, lp: (m + eps)^-1/p; qkmla.ops.statistic.statistic_from_moment), float32. Each dot
// product runs along a row of W (vdpbf16ps over 32 values of K at a time, then one horizontal sum),
// four rows of W against up to four rows of x at once, so each row of W is read once.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../bf16.h"

namespace {

constexpr int64_t TILE = 64;  // output columns per tile: 4 zmm of float32 sums
constexpr int64_t ROWS = 4;   // rows of x per pass over a tile: 16 accumulators, 4 registers for W

// y[t0 .. t0 + R, tile columns] for one tile of packed W, [K / 2][TILE][2].
template <int R>
void tile_rows(const uint16_t* x, int64_t sx, const uint16_t* wt, int64_t pairs, uint16_t* y, int64_t sy,
               int64_t cols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = wt + p * 2 * TILE;
    const __m512bh w0 = as_bh(_mm512_loadu_si512(wp)), w1 = as_bh(_mm512_loadu_si512(wp + 32)),
                   w2 = as_bh(_mm512_loadu_si512(wp + 64)), w3 = as_bh(_mm512_loadu_si512(wp + 96));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = as_bh(_mm512_set1_epi32(pair_at(x + r * sx, p)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xv);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xv);
    }
  }
  alignas(64) float out[TILE];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) _mm512_store_ps(out + 16 * c, acc[r][c]);
    for (int64_t j = 0; j < cols; ++j) y[r * sy + j] = to_bf16(out[j]);
  }
}

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x: bf16 [T, K] with contiguous rows, K even");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(1) * 2 == x.size(1) && packed.size(2) == TILE && packed.size(3) == 2 &&
              N > (packed.size(0) - 1) * TILE && N <= packed.size(0) * TILE,
              "packed: contiguous bf16 [ceil(N / 64), K / 2, 64, 2] (pack_weight)");
  if (max_rows >= 0 && x.size(0) > max_rows)
    return at::linear(x, packed.permute({0, 2, 1, 3}).reshape({-1, x.size(1)}).narrow(0, 0, N));
  const int64_t T = x.size(0), pairs = packed.size(1), tiles = packed.size(0);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t sx = x.stride(0);
  // a thread's share is worth the fork only past ~256k products
  const int64_t grain = std::max<int64_t>(1, 262144 / (TILE * std::max<int64_t>(pairs, 1) * 2 * T));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const uint16_t* wt = wp + tile * pairs * 2 * TILE;
      const int64_t cols = std::min(TILE, N - tile * TILE);
      for (int64_t t = 0; t < T; t += ROWS) {
        const uint16_t* xt = xp + t * sx;
        uint16_t* yt = yp + t * N + tile * TILE;
        switch (std::min(ROWS, T - t)) {
          case 1: tile_rows<1>(xt, sx, wt, pairs, yt, N, cols); break;
          case 2: tile_rows<2>(xt, sx, wt, pairs, yt, N, cols); break;
          case 3: tile_rows<3>(xt, sx, wt, pairs, yt, N, cols); break;
          default: tile_rows<4>(xt, sx, wt, pairs, yt, N, cols); break;
        }
      }
    }
  });
  return y;
}

// A norm's statistic of each group from its moment m, in place (float32 throughout, as the torch
// reference computes it on float32 moments): rms (m / group + eps)^-1/2, l2 (m + eps)^-1/2, lp (m + eps)^-1/p.
void statistic_from_moment(at::Tensor& m, int64_t group, bool rms, bool lp, double p, double eps) {
  float* mp = m.data_ptr<float>();
  const float n = static_cast<float>(group), e = static_cast<float>(eps), inv_p = static_cast<float>(-1.0 / p);
  for (int64_t i = 0; i < m.numel(); ++i) {
    const float v = mp[i];
    mp[i] = lp ? std::pow(v + e, inv_p) : 1.0f / std::sqrt(rms ? v / n + e : v + e);
  }
}

struct Kind {
  bool rms, lp;
  double q;  // the moment's power
};

Kind parse_kind(c10::string_view kind, double p) {
  const bool rms = kind == "rms", l2 = kind == "l2" || (kind == "lp" && p == 2.0), lp = kind == "lp" && !l2;
  TORCH_CHECK(rms || l2 || lp, "kind: expected 'rms', 'l2' or 'lp', got '", std::string(kind), "'");
  TORCH_CHECK(p > 0, "p: expected p > 0, got ", p);
  return {rms, lp, lp ? p : 2.0};
}

// |v|^q summed, v rounded to bf16 first (as a bf16 GEMM returns it).
inline float rounded_power(float v, bool square, float q) {
  const uint32_t bits = static_cast<uint32_t>(to_bf16(v)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return square ? f * f : std::pow(std::fabs(f), q);
}

// acc[r][t] += the products of w's row r and x's row t over 32 values of K from k (MASKED: the
// values of mask only, for the last K % 32).
template <int R, int TT, bool MASKED>
inline void dot_chunk(__m512 (&acc)[R][TT], const uint16_t* x, int64_t sx, const uint16_t* w, int64_t sw, int64_t k,
                      __mmask32 mask) {
  auto load = [&](const uint16_t* p) {
    if constexpr (MASKED) return as_bh(_mm512_maskz_loadu_epi16(mask, p));
    else return as_bh(_mm512_loadu_si512(p));
  };
  __m512bh wv[R];
  for (int r = 0; r < R; ++r) wv[r] = load(w + r * sw + k);
  for (int t = 0; t < TT; ++t) {
    const __m512bh xv = load(x + t * sx + k);
    for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
  }
}

// sums[t] += sum over R rows of w of |x[t] . w[n]|^q, for TT rows of x from x. Each row of w is
// read once for the TT rows of x; K in chunks of 32, plain loads but for the last (masked).
template <int R, int TT>
void group_rows(const uint16_t* x, int64_t sx, const uint16_t* w, int64_t sw, int64_t K, float* sums, bool square,
                float q) {
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) dot_chunk<R, TT, false>(acc, x, sx, w, sw, k, 0);
  if (k < K) dot_chunk<R, TT, true>(acc, x, sx, w, sw, k, static_cast<__mmask32>((1ull << (K - k)) - 1));
  for (int t = 0; t < TT; ++t) {
    float sum = 0.0f;
    for (int r = 0; r < R; ++r) sum += rounded_power(_mm512_reduce_add_ps(acc[r][t]), square, q);
    sums[t] += sum;
  }
}

// The moments of groups g0 .. g1 for every row of x: m [T, G]. Each group's are summed in a
// buffer of the thread's own and written once: threads that shared the cache lines of m's rows
// while summing would take turns owning them.
template <int R>
void group_moments(const uint16_t* x, int64_t sx, int64_t T, const uint16_t* w, int64_t sg, int64_t sw,
                   int64_t group, int64_t K, float* m, int64_t G, int64_t g0, int64_t g1, bool square, float q) {
  std::vector<float> sums(static_cast<size_t>(T));
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (int64_t n = 0; n < group; n += R) {
      const uint16_t* wn = w + g * sg + n * sw;
      for (int64_t t = 0; t < T; t += 4) {
        const uint16_t* xt = x + t * sx;
        float* st = sums.data() + t;
        switch (std::min<int64_t>(4, T - t)) {
          case 1: group_rows<R, 1>(xt, sx, wn, sw, K, st, square, q); break;
          case 2: group_rows<R, 2>(xt, sx, wn, sw, K, st, square, q); break;
          case 3: group_rows<R, 3>(xt, sx, wn, sw, K, st, square, q); break;
          default: group_rows<R, 4>(xt, sx, wn, sw, K, st, square, q); break;
        }
      }
    }
    for (int64_t t = 0; t < T; ++t) m[t * G + g] = sums[t];
  }
}

at::Tensor group_statistic_cpu(const at::Tensor& x, const at::Tensor& w, c10::string_view kind, double p,
                               double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x: bf16 [T, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.stride(2) == 1 && w.size(2) == x.size(1),
              "w: bf16 [G, group, K] with contiguous rows, K as x's");
  const Kind k = parse_kind(kind, p);
  const int64_t T = x.size(0), G = w.size(0), group = w.size(1), K = w.size(2);
  at::Tensor m = at::empty({T, G}, x.options().dtype(at::kFloat));
  if (T == 0 || G == 0) return m;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* mp = m.data_ptr<float>();
  const bool square = k.q == 2.0;
  const float q = static_cast<float>(k.q);
  // a thread's share is worth the fork only past ~256k products
  const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, group * K * T));
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
    if (group % 4 == 0)
      group_moments<4>(xp, x.stride(0), T, wp, w.stride(0), w.stride(1), group, K, mp, G, g0, g1, square, q);
    else
      group_moments<1>(xp, x.stride(0), T, wp, w.stride(0), w.stride(1), group, K, mp, G, g0, g1, square, q);
  });
  statistic_from_moment(m, group, k.rms, k.lp, p, eps);
  return m;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qkmla_cpu, m) {
  m.def("small_linear(Tensor x, Tensor packed, int N, int max_rows) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(small_linear_cpu));
  m.def("group_statistic(Tensor x, Tensor w, str kind, float p, float eps) -> Tensor");
  m.impl("group_statistic", c10::DispatchKey::CPU, TORCH_FN(group_statistic_cpu));
}
