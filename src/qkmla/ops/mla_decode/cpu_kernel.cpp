// The CPU kernel of the MLA decode op: one fused pass over a paged bfloat16 latent cache.
//
// For each (sequence, query token, group of 16 heads, split of the keys) it reads every visible
// row [c | k_rope] once, straight from its block (no gathered copy), and per chunk of keys:
//
//   scores    s[j, i] = scale * (r[j, g(i)] * (q_c[i] . c_j) + q_r[i] . k_rope_j)   (blockwise)
//                     = scale * r[j, g(i)] * (q_c[i] . c_j + q_r[i] . k_rope_j)     (unified)
//                     = scale * (q_c[i] . c_j + q_r[i] . k_rope_j)                  (plain MLA)
//   softmax   m, l, o folded over the chunk (online softmax, as flash decoding)
//   values    o[i] += p[j, i] c_j
//
// so the key scalars r are read from their own columns of the same rows and multiplied into the
// chunk's score tile before the softmax, as the Triton kernel does. The splits of one query are
// merged at the end (log-sum-exp weights). The specification is naive.py beside this file.
//
// Both products run on AVX-512 BF16 dot products (vdpbf16ps: two bf16 products summed into a
// float32 lane):
//   * scores: the 16 heads are the 16 lanes. The query is packed as [pair p][head] (two bf16 of
//     head i's query per lane), and each key's pair p is broadcast to all lanes.
//   * values: the lanes are 16 latent channels. Two keys' rows are interleaved channel by channel
//     (unpacklo/hi of 16-bit elements, which works within 128-bit lanes), and each head's two
//     softmax weights are broadcast. The output is therefore accumulated in a channel order
//     permuted within every 32 channels (see unpermute), restored once when it is written.
// p is rounded to bf16 for the value product, as the torch backend casts it for its value GEMM.

#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;      // heads per work item (one zmm of float32 scores)
constexpr int CHUNK = 32;      // keys per softmax fold: their interleaved rows stay in L1/L2
constexpr int MODE_PLAIN = 0, MODE_BLOCKWISE = 1, MODE_UNIFIED = 2;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// exp(x) for 16 lanes: x = n ln2 + t with |t| <= ln2 / 2, exp(t) by a degree-6 polynomial,
// 2^n applied by scalef (which gives 0 below the float range, so exp(-inf) = 0).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(88.7f);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 t = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  t = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), t);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(t, t), _mm512_add_ps(t, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Channel d of the output accumulated in lane `lane` of zmm z (z = 2 * (d / 32) + half).
inline int unpermute(int z, int lane) { return 32 * (z / 2) + 8 * (lane / 4) + 4 * (z % 2) + lane % 4; }

struct Args {
  const uint16_t* q;      // [B, T, H, d_c + d_r] bf16 (q_lat and q_rope side by side)
  const uint16_t* pool;   // rows [c | k_rope] at pool + block * s_block + slot * s_row
  int64_t s_block, s_row;
  const void* scales;     // key scalars at scales + block * r_block + slot * r_row, or null
  int64_t r_block, r_row;
  bool scales_f32;
  const int32_t* table;   // [B, max_blocks]
  int64_t max_blocks, block_size;
  const int64_t* visible; // [B, T] keys seen by each query (already capped at its length)
  int64_t B, T, H, G, d_c, d_r;
  float scale;
  int mode;
};

struct Partial {  // one work item's running softmax: max, sum, output (permuted channels)
  float m[LANES], l[LANES];
  std::vector<float> o;  // [LANES][d_c]
};

// Query of one (sequence, token, head group) packed as [pair][lane]: lanes past the last head are 0.
void pack_query(const Args& a, int64_t b, int64_t t, int64_t h0, int nh, std::vector<uint32_t>& qp) {
  const int64_t width = a.d_c + a.d_r, pairs = width / 2;
  qp.assign(pairs * LANES, 0u);
  for (int i = 0; i < nh; ++i) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(a.q + ((b * a.T + t) * a.H + h0 + i) * width);
    for (int64_t p = 0; p < pairs; ++p) qp[p * LANES + i] = row[p];
  }
}

// Key scalars of one key (its row of G at base) for the item's lanes: lane i reads group (h0 + i) / (H / G).
inline __m512 load_scales(const Args& a, const char* base, const __m512i& idx, int g0, int ng) {
  const __mmask16 k = static_cast<__mmask16>((1u << ng) - 1u);
  __m512 r;
  if (a.scales_f32) {
    r = _mm512_maskz_loadu_ps(k, reinterpret_cast<const float*>(base) + g0);
  } else {
    __m256i h = _mm256_maskz_loadu_epi16(k, reinterpret_cast<const uint16_t*>(base) + g0);
    r = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_permutexvar_ps(idx, r);
}

// o[i] += sum over the chunk's key pairs of p[pair, i] . (c_j, c_j+1) for NH heads from h, ND zmm from z.
template <int NH, int ND>
inline void accumulate_values(float* o, int64_t d_c, const __m512i* rows, const uint32_t* pp, int pairs, int h,
                              int z) {
  const int64_t Z = d_c / 16;
  __m512 acc[NH][ND];
  for (int x = 0; x < NH; ++x)
    for (int y = 0; y < ND; ++y) acc[x][y] = _mm512_loadu_ps(o + (h + x) * d_c + (z + y) * 16);
  for (int pr = 0; pr < pairs; ++pr) {
    __m512i v[ND];
    for (int y = 0; y < ND; ++y) v[y] = _mm512_load_si512(rows + pr * Z + z + y);
    for (int x = 0; x < NH; ++x) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pp[pr * LANES + h + x]));
      for (int y = 0; y < ND; ++y) acc[x][y] = _mm512_dpbf16_ps(acc[x][y], as_bh(v[y]), as_bh(w));
    }
  }
  for (int x = 0; x < NH; ++x)
    for (int y = 0; y < ND; ++y) _mm512_storeu_ps(o + (h + x) * d_c + (z + y) * 16, acc[x][y]);
}

// One work item: keys [k0, k1) of query (b, t) for heads h0 .. h0 + nh - 1.
void attend(const Args& a, int64_t b, int64_t t, int64_t h0, int nh, int64_t k0, int64_t k1, Partial& part) {
  const int64_t width = a.d_c + a.d_r, pc = a.d_c / 2, pairs = width / 2, Z = a.d_c / 16;
  std::vector<uint32_t> qp;
  pack_query(a, b, t, h0, nh, qp);
  // Scalars' lanes: head h0 + i reads group (h0 + i) / (H / G); the item's groups start at g0.
  const int64_t per_group = a.H / a.G, g0 = h0 / per_group;
  const int ng = static_cast<int>(std::min<int64_t>(LANES, (h0 + nh - 1) / per_group - g0 + 1));
  alignas(64) int32_t idx_arr[LANES];
  for (int i = 0; i < LANES; ++i) idx_arr[i] = static_cast<int32_t>(std::min<int64_t>(h0 + i, h0 + nh - 1) / per_group - g0);
  const __m512i idx = _mm512_load_si512(idx_arr);

  std::vector<__m512i> rows_il(static_cast<size_t>(CHUNK / 2) * Z);  // interleaved pairs of rows
  alignas(64) float s[CHUNK][LANES];
  alignas(64) uint32_t pp[CHUNK / 2][LANES];
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), l = _mm512_setzero_ps();
  part.o.assign(static_cast<size_t>(LANES) * a.d_c, 0.0f);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int32_t* table = a.table + b * a.max_blocks;

  for (int64_t c0 = k0; c0 < k1; c0 += CHUNK) {
    const int n = static_cast<int>(std::min<int64_t>(CHUNK, k1 - c0));
    const uint16_t* key[CHUNK];
    const char* rsc[CHUNK];
    for (int j = 0; j < n; ++j) {
      const int64_t slot = c0 + j, blk = table[slot / a.block_size], off = slot % a.block_size;
      key[j] = a.pool + blk * a.s_block + off * a.s_row;
      rsc[j] = a.scales == nullptr ? nullptr
               : static_cast<const char*>(a.scales) + (blk * a.r_block + off * a.r_row) * (a.scales_f32 ? 4 : 2);
    }
    // Scores, four keys at a time (four independent accumulators).
    for (int j = 0; j < n; j += 4) {
      const uint32_t* k[4];
      for (int u = 0; u < 4; ++u) k[u] = reinterpret_cast<const uint32_t*>(key[std::min(j + u, n - 1)]);
      __m512 sc[4], sr[4];
      for (int u = 0; u < 4; ++u) sc[u] = sr[u] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pc; ++p) {
        const __m512bh qv = as_bh(_mm512_loadu_si512(qp.data() + p * LANES));
        for (int u = 0; u < 4; ++u)
          sc[u] = _mm512_dpbf16_ps(sc[u], qv, as_bh(_mm512_set1_epi32(static_cast<int>(k[u][p]))));
      }
      for (int64_t p = pc; p < pairs; ++p) {
        const __m512bh qv = as_bh(_mm512_loadu_si512(qp.data() + p * LANES));
        for (int u = 0; u < 4; ++u)
          sr[u] = _mm512_dpbf16_ps(sr[u], qv, as_bh(_mm512_set1_epi32(static_cast<int>(k[u][p]))));
      }
      for (int u = 0; u < 4 && j + u < n; ++u) {
        __m512 v;
        if (a.mode == MODE_PLAIN) {
          v = _mm512_add_ps(sc[u], sr[u]);
        } else {
          const __m512 rk = load_scales(a, rsc[j + u], idx, static_cast<int>(g0), ng);
          v = a.mode == MODE_BLOCKWISE ? _mm512_fmadd_ps(rk, sc[u], sr[u]) : _mm512_mul_ps(rk, _mm512_add_ps(sc[u], sr[u]));
        }
        _mm512_store_ps(s[j + u], _mm512_mul_ps(v, scale));
      }
    }
    // Online softmax over the chunk.
    __m512 m_new = m;
    for (int j = 0; j < n; ++j) m_new = _mm512_max_ps(m_new, _mm512_load_ps(s[j]));
    const __m512 alpha = exp16(_mm512_sub_ps(m, m_new));
    __m512 sum = _mm512_setzero_ps();
    alignas(64) uint16_t pb[CHUNK + 1][LANES];
    for (int j = 0; j < n; ++j) {
      const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s[j]), m_new));
      sum = _mm512_add_ps(sum, p);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb[j]), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
    }
    if (n % 2) std::memset(pb[n], 0, sizeof(pb[n]));  // an odd chunk pairs its last key with weight 0
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = m_new;
    alignas(64) float al[LANES];
    _mm512_store_ps(al, alpha);
    for (int i = 0; i < nh; ++i) {
      if (al[i] == 1.0f) continue;
      const __m512 f = _mm512_set1_ps(al[i]);
      float* oi = part.o.data() + i * a.d_c;
      for (int64_t z = 0; z < Z; ++z) _mm512_storeu_ps(oi + z * 16, _mm512_mul_ps(_mm512_loadu_ps(oi + z * 16), f));
    }
    // Values: interleave each pair of rows, then o += p . c over the chunk's pairs.
    const int npairs = (n + 1) / 2;
    for (int pr = 0; pr < npairs; ++pr) {
      const uint16_t* x = key[2 * pr];
      const uint16_t* y = 2 * pr + 1 < n ? key[2 * pr + 1] : key[2 * pr];
      for (int64_t c32 = 0; c32 < a.d_c / 32; ++c32) {
        const __m512i vx = _mm512_loadu_si512(x + c32 * 32), vy = _mm512_loadu_si512(y + c32 * 32);
        rows_il[pr * Z + 2 * c32] = _mm512_unpacklo_epi16(vx, vy);
        rows_il[pr * Z + 2 * c32 + 1] = _mm512_unpackhi_epi16(vx, vy);
      }
      for (int i = 0; i < LANES; ++i)
        pp[pr][i] = static_cast<uint32_t>(pb[2 * pr][i]) | (static_cast<uint32_t>(pb[2 * pr + 1][i]) << 16);
    }
    int i = 0;
    for (; i + 4 <= nh; i += 4) {
      int64_t z = 0;
      for (; z + 4 <= Z; z += 4)
        accumulate_values<4, 4>(part.o.data(), a.d_c, rows_il.data(), &pp[0][0], npairs, i, static_cast<int>(z));
      for (; z < Z; ++z)
        accumulate_values<4, 1>(part.o.data(), a.d_c, rows_il.data(), &pp[0][0], npairs, i, static_cast<int>(z));
    }
    for (; i < nh; ++i) {
      int64_t z = 0;
      for (; z + 4 <= Z; z += 4)
        accumulate_values<1, 4>(part.o.data(), a.d_c, rows_il.data(), &pp[0][0], npairs, i, static_cast<int>(z));
      for (; z < Z; ++z)
        accumulate_values<1, 1>(part.o.data(), a.d_c, rows_il.data(), &pp[0][0], npairs, i, static_cast<int>(z));
    }
  }
  _mm512_storeu_ps(part.m, m);
  _mm512_storeu_ps(part.l, l);
}

std::tuple<at::Tensor, at::Tensor> mla_decode_cpu(const at::Tensor& q, const at::Tensor& pool,
                                                  const c10::optional<at::Tensor>& scales,
                                                  const at::Tensor& block_table, const at::Tensor& visible,
                                                  int64_t d_c, double scale, int64_t mode, int64_t splits) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == at::kBFloat16, "q: contiguous bf16 [B, T, H, d]");
  TORCH_CHECK(pool.dim() == 3 && pool.stride(2) == 1 && pool.scalar_type() == at::kBFloat16,
              "pool: bf16 [num_blocks, block, width] with contiguous rows");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table: contiguous int32");
  TORCH_CHECK(visible.scalar_type() == at::kLong && visible.is_contiguous(), "visible: contiguous int64");
  Args a{};
  a.B = q.size(0), a.T = q.size(1), a.H = q.size(2), a.d_c = d_c, a.d_r = q.size(3) - d_c;
  TORCH_CHECK(a.d_c % 32 == 0 && a.d_r % 2 == 0 && a.d_r >= 0, "d_c a multiple of 32 and d_r even");
  a.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  a.pool = reinterpret_cast<const uint16_t*>(pool.data_ptr());
  a.s_block = pool.stride(0), a.s_row = pool.stride(1), a.block_size = pool.size(1);
  a.G = 1;
  if (scales.has_value()) {
    const at::Tensor& r = *scales;
    TORCH_CHECK(r.dim() == 3 && r.stride(2) == 1 && (r.scalar_type() == at::kBFloat16 || r.scalar_type() == at::kFloat),
                "scales: bf16 or float32 [num_blocks, block, G] with contiguous rows");
    a.scales = r.data_ptr(), a.r_block = r.stride(0), a.r_row = r.stride(1), a.G = r.size(2);
    a.scales_f32 = r.scalar_type() == at::kFloat;
  }
  a.table = block_table.data_ptr<int32_t>(), a.max_blocks = block_table.size(1);
  a.visible = visible.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale), a.mode = static_cast<int>(mode);
  TORCH_CHECK(a.mode == MODE_PLAIN || a.scales != nullptr, "scales: needed by the QK-normed modes");

  const int64_t groups = (a.H + LANES - 1) / LANES, queries = a.B * a.T * groups;
  splits = std::max<int64_t>(1, splits);
  std::vector<Partial> parts(static_cast<size_t>(queries * splits));
  at::parallel_for(0, queries * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t sp = item % splits, qi = item / splits, hg = qi % groups, bt = qi / groups;
      const int64_t b = bt / a.T, t = bt % a.T, h0 = hg * LANES;
      const int nh = static_cast<int>(std::min<int64_t>(LANES, a.H - h0));
      const int64_t n = a.visible[bt];
      // Split boundaries on whole chunks, so each split folds the same chunks as one pass would.
      const int64_t per = ((n + splits - 1) / splits + CHUNK - 1) / CHUNK * CHUNK;
      const int64_t k0 = std::min(n, sp * per), k1 = std::min(n, k0 + per);
      Partial& part = parts[item];
      attend(a, b, t, h0, nh, k0, k1, part);
    }
  });

  at::Tensor out = at::empty({a.B, a.T, a.H, a.d_c}, q.options());
  at::Tensor lse = at::empty({a.B, a.T, a.H}, q.options().dtype(at::kFloat));
  uint16_t* out_p = reinterpret_cast<uint16_t*>(out.data_ptr());
  float* lse_p = lse.data_ptr<float>();
  at::parallel_for(0, queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(a.d_c));
    for (int64_t qi = begin; qi < end; ++qi) {
      const int64_t hg = qi % groups, bt = qi / groups, h0 = hg * LANES;
      const int nh = static_cast<int>(std::min<int64_t>(LANES, a.H - h0));
      for (int i = 0; i < nh; ++i) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < splits; ++sp) M = std::max(M, parts[qi * splits + sp].m[i]);
        float L = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        if (M > -std::numeric_limits<float>::infinity()) {
          for (int64_t sp = 0; sp < splits; ++sp) {
            const Partial& p = parts[qi * splits + sp];
            if (!(p.l[i] > 0.0f)) continue;
            const float w = std::exp(p.m[i] - M);
            L += p.l[i] * w;
            const float* o = p.o.data() + i * a.d_c;
            for (int64_t d = 0; d < a.d_c; ++d) acc[d] += w * o[d];
          }
        }
        uint16_t* dst = out_p + (bt * a.H + h0 + i) * a.d_c;
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        for (int64_t z = 0; z < a.d_c / 16; ++z)
          for (int lane = 0; lane < LANES; ++lane) {
            const float v = acc[z * 16 + lane] * inv;
            uint32_t bits;
            std::memcpy(&bits, &v, 4);
            bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even (finite values)
            dst[unpermute(static_cast<int>(z), lane)] = static_cast<uint16_t>(bits >> 16);
          }
        lse_p[bt * a.H + h0 + i] = L > 0.0f ? M + std::log(L) : -std::numeric_limits<float>::infinity();
      }
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(qkmla_cpu, m) {
  m.def("mla_decode(Tensor q, Tensor pool, Tensor? scales, Tensor block_table, Tensor visible, int d_c, "
        "float scale, int mode, int splits) -> (Tensor, Tensor)");
  m.impl("mla_decode", c10::DispatchKey::CPU, TORCH_FN(mla_decode_cpu));
}
