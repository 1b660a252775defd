// x W^T for a few rows of bfloat16 x against a prepacked W: the decode step's new-token GEMMs
// (a QK-normed layer's key scalars read every W_UK row for one to a few tokens), which are
// matrix-vector products where a GEMM library's blocking and call overhead do not pay.
//
//   y[t, n] = sum_k x[t, k] W[n, k]      x [T, K], W [N, K], y [T, N]
//
// W is packed once (small_linear.py, pack_weight) as [ceil(N / 64)][K / 2][64][2]: a tile of 64
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
// small_linear_moments reduces y further, to the moment of each group of consecutive outputs,
//
//   m[t, g] = sum_j |y[t, g group + j]|^p      (y as rounded to bf16; p = 2: y^2), float32,
//
// a QK norm's moment of each head's content key c W_UK^(g) (qkmla.norms.moment): the key
// scalars of a decode step's new tokens in one call, with y never leaving the kernel's buffer.
// small_linear_statistic takes the last step too, the norm's statistic of each group (rms:
// (m / group + eps)^-1/2, l2: (m + eps)^-1/2, lp: (m + eps)^-1/p; qkmla.norms.statistic_from_moment),
// so that a key scalar costs one op call where it runs outside a compiled graph.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "bf16.h"

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

at::Tensor small_linear_moments_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t max_rows,
                                    int64_t group, double p) {
  TORCH_CHECK(group > 0 && N % group == 0, "group: a positive divisor of N = ", N, ", got ", group);
  TORCH_CHECK(p > 0, "p: expected p > 0, got ", p);
  const at::Tensor y = small_linear_cpu(x, packed, N, max_rows).contiguous();
  const int64_t T = y.size(0), groups = N / group;
  at::Tensor m = at::empty({T, groups}, x.options().dtype(at::kFloat));
  const auto* yp = reinterpret_cast<const uint16_t*>(y.data_ptr());
  float* mp = m.data_ptr<float>();
  const bool square = p == 2.0;
  const float pf = static_cast<float>(p);
  for (int64_t i = 0; i < T * groups; ++i) {  // T N values: a pass over y in cache
    const uint16_t* v = yp + i * group;
    float sum = 0.0f;
    for (int64_t j = 0; j < group; ++j) {
      const uint32_t bits = static_cast<uint32_t>(v[j]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      sum += square ? f * f : std::pow(std::fabs(f), pf);
    }
    mp[i] = sum;
  }
  return m;
}

at::Tensor small_linear_statistic_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t max_rows,
                                      int64_t group, c10::string_view kind, double p, double eps) {
  const bool rms = kind == "rms", l2 = kind == "l2" || (kind == "lp" && p == 2.0), lp = kind == "lp" && !l2;
  TORCH_CHECK(rms || l2 || lp, "kind: expected 'rms', 'l2' or 'lp', got '", std::string(kind), "'");
  at::Tensor m = small_linear_moments_cpu(x, packed, N, max_rows, group, lp ? p : 2.0);
  float* mp = m.data_ptr<float>();
  // float32 throughout, as the torch reference computes it on float32 moments
  const float n = static_cast<float>(group), e = static_cast<float>(eps), inv_p = static_cast<float>(-1.0 / p);
  for (int64_t i = 0; i < m.numel(); ++i) {
    const float v = mp[i];
    mp[i] = lp ? std::pow(v + e, inv_p) : 1.0f / std::sqrt(rms ? v / n + e : v + e);
  }
  return m;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qkmla_cpu, m) {
  m.def("small_linear(Tensor x, Tensor packed, int N, int max_rows) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(small_linear_cpu));
  m.def("small_linear_moments(Tensor x, Tensor packed, int N, int max_rows, int group, float p) -> Tensor");
  m.impl("small_linear_moments", c10::DispatchKey::CPU, TORCH_FN(small_linear_moments_cpu));
  m.def("small_linear_statistic(Tensor x, Tensor packed, int N, int max_rows, int group, str kind, float p, "
        "float eps) -> Tensor");
  m.impl("small_linear_statistic", c10::DispatchKey::CPU, TORCH_FN(small_linear_statistic_cpu));
}
