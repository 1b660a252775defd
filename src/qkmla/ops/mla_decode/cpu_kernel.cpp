// The CPU kernel of the MLA decode op: one fused pass over a paged bfloat16 latent cache.
//
// For each (sequence, query token, split of the keys) it reads every visible row [c | k_rope]
// once, straight from its block (no gathered copy), and per chunk of keys, for every head:
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
//   * scores: 16 heads (a lane group) are the 16 lanes. The query is packed as [pair p][head] (two bf16 of
//     head i's query per lane), and each key's pair p is broadcast to all lanes.
//   * values: the lanes are 16 latent channels. Two keys' rows are interleaved channel by channel
//     (unpacklo/hi of 16-bit elements, which works within 128-bit lanes), and each head's two
//     softmax weights are broadcast. The output is therefore accumulated in a channel order
//     permuted within every 32 channels (see unpermute), restored once when it is written.
// p is rounded to bf16 for the value product, as the torch backend casts it for its value GEMM.
//
// A sparse (top-k) decode passes `slots` [B, T, topk]: key k of query (b, t) is then slot
// slots[b, t, k] of the sequence (its selected slots packed to the front, visible[b, t] of them),
// read through the block table like any slot, its key scalars from the same slot.

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

#include "../bf16.h"

namespace {

constexpr int LANES = 16;      // heads per work item (one zmm of float32 scores)
constexpr int CHUNK = 32;      // keys per softmax fold: their interleaved rows stay in L1/L2
constexpr int MODE_PLAIN = 0, MODE_BLOCKWISE = 1, MODE_UNIFIED = 2;

// exp(x) for 16 lanes: x = n ln2 + t with |t| <= ln2 / 2, exp(t) by a degree-6 polynomial,
// 2^n applied by scalef (which gives 0 below the float range, so exp(-inf) = 0; NaN stays NaN).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(88.7f);
  x = _mm512_max_ps(lo, _mm512_min_ps(hi, x));  // NaN kept: min/max return their second operand then
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
  const int64_t* slots;   // [B, T, topk] slot of each key of a query (sparse decode), or null: key k is slot k
  int64_t topk;
  int64_t B, T, H, G, d_c, d_r;
  float scale;
  int mode;
};

struct Partial {  // one work item's running softmax per head: max, sum, output (permuted channels)
  std::vector<float> m, l;  // [H rounded up to LANES]
  std::vector<float> o;     // [H][d_c]
};

// Lane group g of a query (heads 16 g .. 16 g + 15) packed as [pair][lane]: lanes past the last head are 0.
void pack_query(const Args& a, int64_t b, int64_t t, int64_t g, uint32_t* qp) {
  const int64_t width = a.d_c + a.d_r, pairs = width / 2, h0 = g * LANES;
  const int nh = static_cast<int>(std::min<int64_t>(LANES, a.H - h0));
  std::fill(qp, qp + pairs * LANES, 0u);
  for (int i = 0; i < nh; ++i) {
    const uint16_t* row = a.q + ((b * a.T + t) * a.H + h0 + i) * width;
    for (int64_t p = 0; p < pairs; ++p) qp[p * LANES + i] = static_cast<uint32_t>(pair_at(row, p));
  }
}

// Key scalars of one key (its row of G at base) for a lane group: lane i reads group
// idx[i] + g0 (head h reads group h / (H / G)); ng of them from g0 on cover the lane group.
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

// o[h] += sum over the chunk's key pairs of p[pair, h] . (c_j, c_j+1) for NH heads from h, ND zmm from z.
template <int NH, int ND>
inline void accumulate_values(float* o, int64_t d_c, const __m512i* rows, const uint32_t* pp, int64_t pp_stride,
                              int pairs, int64_t h, int64_t z) {
  const int64_t Z = d_c / 16;
  __m512 acc[NH][ND];
  for (int x = 0; x < NH; ++x)
    for (int y = 0; y < ND; ++y) acc[x][y] = _mm512_loadu_ps(o + (h + x) * d_c + (z + y) * 16);
  for (int pr = 0; pr < pairs; ++pr) {
    __m512i v[ND];
    for (int y = 0; y < ND; ++y) v[y] = _mm512_load_si512(rows + pr * Z + z + y);
    for (int x = 0; x < NH; ++x) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pp[pr * pp_stride + h + x]));
      for (int y = 0; y < ND; ++y) acc[x][y] = _mm512_dpbf16_ps(acc[x][y], as_bh(v[y]), as_bh(w));
    }
  }
  for (int x = 0; x < NH; ++x)
    for (int y = 0; y < ND; ++y) _mm512_storeu_ps(o + (h + x) * d_c + (z + y) * 16, acc[x][y]);
}

// One work item: keys [k0, k1) of query (b, t), every head. Each chunk of keys is read once for
// all heads: scored and folded lane group by lane group, then interleaved once for the values.
void attend(const Args& a, int64_t b, int64_t t, int64_t k0, int64_t k1, Partial& part) {
  const int64_t width = a.d_c + a.d_r, pc = a.d_c / 2, pairs = width / 2, Z = a.d_c / 16;
  const int64_t groups = (a.H + LANES - 1) / LANES, lanes = groups * LANES, per_group = a.H / a.G;
  std::vector<uint32_t> qp(static_cast<size_t>(groups * pairs * LANES));
  std::vector<__m512i> idx(static_cast<size_t>(groups));
  std::vector<int> g0(static_cast<size_t>(groups)), ng(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    pack_query(a, b, t, g, qp.data() + g * pairs * LANES);
    // Lane i of group g is head h = 16 g + i (the last head for lanes past it), reading scalar h / per_group.
    const int64_t h0 = g * LANES, last = std::min<int64_t>(a.H, h0 + LANES) - 1;
    g0[g] = static_cast<int>(h0 / per_group), ng[g] = static_cast<int>(last / per_group - g0[g] + 1);
    alignas(64) int32_t lane_group[LANES];
    for (int i = 0; i < LANES; ++i) lane_group[i] = static_cast<int32_t>(std::min(h0 + i, last) / per_group - g0[g]);
    idx[g] = _mm512_load_si512(lane_group);
  }

  std::vector<__m512i> rows_il(static_cast<size_t>(CHUNK / 2) * Z);  // interleaved pairs of rows
  std::vector<uint16_t> pb(static_cast<size_t>((CHUNK + 1) * lanes));  // softmax weights, bf16 [key][lane]
  std::vector<uint32_t> pp(static_cast<size_t>(CHUNK / 2 * lanes));    // two keys' weights per lane
  alignas(64) float s[CHUNK][LANES];
  part.m.assign(static_cast<size_t>(lanes), -std::numeric_limits<float>::infinity());
  part.l.assign(static_cast<size_t>(lanes), 0.0f);
  part.o.assign(static_cast<size_t>(a.H) * a.d_c, 0.0f);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int32_t* table = a.table + b * a.max_blocks;
  const int64_t* chosen = a.slots == nullptr ? nullptr : a.slots + (b * a.T + t) * a.topk;

  for (int64_t c0 = k0; c0 < k1; c0 += CHUNK) {
    const int n = static_cast<int>(std::min<int64_t>(CHUNK, k1 - c0));
    const uint16_t* key[CHUNK];
    const char* rsc[CHUNK];
    for (int j = 0; j < n; ++j) {
      const int64_t slot = chosen == nullptr ? c0 + j : chosen[c0 + j];
      const int64_t blk = table[slot / a.block_size], off = slot % a.block_size;
      key[j] = a.pool + blk * a.s_block + off * a.s_row;
      rsc[j] = a.scales == nullptr ? nullptr
               : static_cast<const char*>(a.scales) + (blk * a.r_block + off * a.r_row) * (a.scales_f32 ? 4 : 2);
    }
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t* q = qp.data() + g * pairs * LANES;
      // Scores, four keys at a time (four independent accumulators).
      for (int j = 0; j < n; j += 4) {
        const uint16_t* k[4];
        for (int u = 0; u < 4; ++u) k[u] = key[std::min(j + u, n - 1)];
        __m512 sc[4], sr[4];
        for (int u = 0; u < 4; ++u) sc[u] = sr[u] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pc; ++p) {
          const __m512bh qv = as_bh(_mm512_loadu_si512(q + p * LANES));
          for (int u = 0; u < 4; ++u)
            sc[u] = _mm512_dpbf16_ps(sc[u], qv, as_bh(_mm512_set1_epi32(pair_at(k[u], p))));
        }
        for (int64_t p = pc; p < pairs; ++p) {
          const __m512bh qv = as_bh(_mm512_loadu_si512(q + p * LANES));
          for (int u = 0; u < 4; ++u)
            sr[u] = _mm512_dpbf16_ps(sr[u], qv, as_bh(_mm512_set1_epi32(pair_at(k[u], p))));
        }
        for (int u = 0; u < 4 && j + u < n; ++u) {
          __m512 v;
          if (a.mode == MODE_PLAIN) {
            v = _mm512_add_ps(sc[u], sr[u]);
          } else {
            const __m512 rk = load_scales(a, rsc[j + u], idx[g], g0[g], ng[g]);
            v = a.mode == MODE_BLOCKWISE ? _mm512_fmadd_ps(rk, sc[u], sr[u])
                                         : _mm512_mul_ps(rk, _mm512_add_ps(sc[u], sr[u]));
          }
          _mm512_store_ps(s[j + u], _mm512_mul_ps(v, scale));
        }
      }
      // Online softmax of this lane group over the chunk.
      const __m512 m = _mm512_loadu_ps(part.m.data() + g * LANES);
      __m512 m_new = m;
      __mmask16 nan_lanes = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
      for (int j = 0; j < n; ++j) {
        const __m512 sj = _mm512_load_ps(s[j]);
        m_new = _mm512_max_ps(m_new, sj);
        nan_lanes |= _mm512_cmp_ps_mask(sj, sj, _CMP_UNORD_Q);
      }
      // max drops a NaN; the spec's softmax does not: a lane that saw one keeps NaN from here on.
      m_new = _mm512_mask_blend_ps(nan_lanes, m_new, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
      const __m512 alpha = exp16(_mm512_sub_ps(m, m_new));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < n; ++j) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s[j]), m_new));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + j * lanes + g * LANES),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
      }
      _mm512_storeu_ps(part.l.data() + g * LANES, _mm512_fmadd_ps(_mm512_loadu_ps(part.l.data() + g * LANES), alpha, sum));
      _mm512_storeu_ps(part.m.data() + g * LANES, m_new);
      alignas(64) float al[LANES];
      _mm512_store_ps(al, alpha);
      for (int64_t h = g * LANES; h < std::min<int64_t>(a.H, (g + 1) * LANES); ++h) {
        if (al[h - g * LANES] == 1.0f) continue;
        const __m512 f = _mm512_set1_ps(al[h - g * LANES]);
        float* oh = part.o.data() + h * a.d_c;
        for (int64_t z = 0; z < Z; ++z) _mm512_storeu_ps(oh + z * 16, _mm512_mul_ps(_mm512_loadu_ps(oh + z * 16), f));
      }
    }
    if (n % 2) std::fill(pb.begin() + n * lanes, pb.begin() + (n + 1) * lanes, 0);  // the last key's pair: weight 0
    // Values: interleave each pair of rows once, then o += p . c over the chunk's pairs, every head.
    const int npairs = (n + 1) / 2;
    for (int pr = 0; pr < npairs; ++pr) {
      const uint16_t* x = key[2 * pr];
      const uint16_t* y = 2 * pr + 1 < n ? key[2 * pr + 1] : key[2 * pr];
      for (int64_t c32 = 0; c32 < a.d_c / 32; ++c32) {
        const __m512i vx = _mm512_loadu_si512(x + c32 * 32), vy = _mm512_loadu_si512(y + c32 * 32);
        rows_il[pr * Z + 2 * c32] = _mm512_unpacklo_epi16(vx, vy);
        rows_il[pr * Z + 2 * c32 + 1] = _mm512_unpackhi_epi16(vx, vy);
      }
      for (int64_t h = 0; h < lanes; ++h)
        pp[pr * lanes + h] = static_cast<uint32_t>(pb[2 * pr * lanes + h]) |
                             (static_cast<uint32_t>(pb[(2 * pr + 1) * lanes + h]) << 16);
    }
    int64_t h = 0;
    for (; h + 4 <= a.H; h += 4) {
      int64_t z = 0;
      for (; z + 4 <= Z; z += 4) accumulate_values<4, 4>(part.o.data(), a.d_c, rows_il.data(), pp.data(), lanes, npairs, h, z);
      for (; z < Z; ++z) accumulate_values<4, 1>(part.o.data(), a.d_c, rows_il.data(), pp.data(), lanes, npairs, h, z);
    }
    for (; h < a.H; ++h) {
      int64_t z = 0;
      for (; z + 4 <= Z; z += 4) accumulate_values<1, 4>(part.o.data(), a.d_c, rows_il.data(), pp.data(), lanes, npairs, h, z);
      for (; z < Z; ++z) accumulate_values<1, 1>(part.o.data(), a.d_c, rows_il.data(), pp.data(), lanes, npairs, h, z);
    }
  }
}

// Output and log-sum-exp of one query (sequence b, token t: bt = b T + t) from its splits'
// partials, weighted by exp(m - M) (flash decoding's merge); NaN in any split's softmax gives NaN.
void finish(const Args& a, const Partial* parts, int64_t splits, int64_t bt, uint16_t* out, float* lse,
            std::vector<float>& acc) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < a.H; ++h) {
    float M = NEG_INF;
    bool nan = false;
    for (int64_t sp = 0; sp < splits; ++sp) {
      nan = nan || std::isnan(parts[sp].m[h]) || std::isnan(parts[sp].l[h]);
      M = std::max(M, parts[sp].m[h]);
    }
    float L = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t sp = 0; sp < splits && M > NEG_INF && !nan; ++sp) {
      const Partial& p = parts[sp];
      if (!(p.l[h] > 0.0f)) continue;  // an empty split
      const float w = std::exp(p.m[h] - M);
      L += p.l[h] * w;
      const float* o = p.o.data() + h * a.d_c;
      for (int64_t d = 0; d < a.d_c; ++d) acc[d] += w * o[d];
    }
    uint16_t* dst = out + (bt * a.H + h) * a.d_c;
    const float inv = nan ? std::numeric_limits<float>::quiet_NaN() : L > 0.0f ? 1.0f / L : 0.0f;
    for (int64_t z = 0; z < a.d_c / 16; ++z)
      for (int lane = 0; lane < LANES; ++lane) dst[unpermute(static_cast<int>(z), lane)] = to_bf16(acc[z * 16 + lane] * inv);
    lse[bt * a.H + h] = nan ? std::numeric_limits<float>::quiet_NaN() : L > 0.0f ? M + std::log(L) : NEG_INF;
  }
}

std::tuple<at::Tensor, at::Tensor> mla_decode_cpu(const at::Tensor& q, const at::Tensor& pool,
                                                  const c10::optional<at::Tensor>& scales,
                                                  const at::Tensor& block_table, const at::Tensor& visible,
                                                  int64_t d_c, double scale, int64_t mode, int64_t splits,
                                                  const c10::optional<at::Tensor>& slots) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == at::kBFloat16, "q: contiguous bf16 [B, T, H, d]");
  TORCH_CHECK(pool.dim() == 3 && pool.stride(2) == 1 && pool.scalar_type() == at::kBFloat16 &&
              pool.size(2) == q.size(3), "pool: bf16 [num_blocks, block, d_c + d_r] with contiguous rows");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B && block_table.scalar_type() == at::kInt &&
              block_table.is_contiguous(), "block_table: contiguous int32 [B, max_blocks]");
  TORCH_CHECK(visible.dim() == 2 && visible.size(0) == B && visible.size(1) == T &&
              visible.scalar_type() == at::kLong && visible.is_contiguous(), "visible: contiguous int64 [B, T]");
  TORCH_CHECK(d_c > 0 && d_c % 32 == 0 && (q.size(3) - d_c) % 2 == 0 && q.size(3) >= d_c,
              "d_c: a multiple of 32, with d_r = width - d_c even");
  Args a{};
  a.B = B, a.T = T, a.H = H, a.d_c = d_c, a.d_r = q.size(3) - d_c;
  a.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  a.pool = reinterpret_cast<const uint16_t*>(pool.data_ptr());
  a.s_block = pool.stride(0), a.s_row = pool.stride(1), a.block_size = pool.size(1);
  a.G = 1;
  if (scales.has_value()) {
    const at::Tensor& r = *scales;
    TORCH_CHECK(r.dim() == 3 && (r.stride(2) == 1 || r.size(2) == 1) && r.size(0) == pool.size(0) &&
                r.size(1) == pool.size(1) && r.size(2) >= 1 && H % r.size(2) == 0 &&
                (r.scalar_type() == at::kBFloat16 || r.scalar_type() == at::kFloat),
                "scales: bf16 or float32 [num_blocks, block, G] with contiguous rows and G dividing H");
    a.scales = r.data_ptr(), a.r_block = r.stride(0), a.r_row = r.stride(1), a.G = r.size(2);
    a.scales_f32 = r.scalar_type() == at::kFloat;
  }
  a.table = block_table.data_ptr<int32_t>(), a.max_blocks = block_table.size(1);
  a.visible = visible.data_ptr<int64_t>();
  // Every slot a query sees must lie in a block of the pool (the op checks this before the call).
  const int64_t* vis = a.visible;
  const int64_t capacity = a.max_blocks * a.block_size;
  if (slots.has_value()) {
    const at::Tensor& sl = *slots;
    TORCH_CHECK(sl.dim() == 3 && sl.size(0) == B && sl.size(1) == T && sl.scalar_type() == at::kLong &&
                sl.is_contiguous(), "slots: contiguous int64 [B, T, topk]");
    a.slots = sl.data_ptr<int64_t>(), a.topk = sl.size(2);
    for (int64_t bt = 0; bt < B * T; ++bt) {
      TORCH_CHECK(vis[bt] >= 0 && vis[bt] <= a.topk, "visible: counts of selected slots within topk");
      for (int64_t k = 0; k < vis[bt]; ++k)
        TORCH_CHECK(a.slots[bt * a.topk + k] >= 0 && a.slots[bt * a.topk + k] < capacity,
                    "slots: selected slots within the table");
    }
  } else {
    a.slots = nullptr, a.topk = 0;
    for (int64_t bt = 0; bt < B * T; ++bt)
      TORCH_CHECK(vis[bt] >= 0 && vis[bt] <= capacity, "visible: slot counts within the table");
  }
  a.scale = static_cast<float>(scale), a.mode = static_cast<int>(mode);
  TORCH_CHECK(a.mode == MODE_PLAIN || a.scales != nullptr, "scales: needed by the QK-normed modes");

  const int64_t queries = a.B * a.T;
  splits = std::max<int64_t>(1, splits);
  at::Tensor out = at::empty({a.B, a.T, a.H, a.d_c}, q.options());
  at::Tensor lse = at::empty({a.B, a.T, a.H}, q.options().dtype(at::kFloat));
  uint16_t* out_p = reinterpret_cast<uint16_t*>(out.data_ptr());
  float* lse_p = lse.data_ptr<float>();
  // Item i: query i / splits, its split i % splits of the keys, on whole chunks, so each split
  // folds the same chunks as one pass would.
  auto keys_of = [&](int64_t item, int64_t& k0, int64_t& k1) {
    const int64_t sp = item % splits, n = a.visible[item / splits];
    const int64_t per = ((n + splits - 1) / splits + CHUNK - 1) / CHUNK * CHUNK;
    k0 = std::min(n, sp * per), k1 = std::min(n, k0 + per);
  };
  if (splits == 1) {  // each item is a whole query: written as it ends, its partial reused
    at::parallel_for(0, queries, 1, [&](int64_t begin, int64_t end) {
      Partial part;
      std::vector<float> acc(static_cast<size_t>(a.d_c));
      for (int64_t bt = begin; bt < end; ++bt) {
        int64_t k0, k1;
        keys_of(bt, k0, k1);
        attend(a, bt / a.T, bt % a.T, k0, k1, part);
        finish(a, &part, 1, bt, out_p, lse_p, acc);
      }
    });
    return {out, lse};
  }
  std::vector<Partial> parts(static_cast<size_t>(queries * splits));
  at::parallel_for(0, queries * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      int64_t k0, k1;
      keys_of(item, k0, k1);
      const int64_t bt = item / splits;
      attend(a, bt / a.T, bt % a.T, k0, k1, parts[item]);
    }
  });
  at::parallel_for(0, queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(a.d_c));
    for (int64_t bt = begin; bt < end; ++bt) finish(a, parts.data() + bt * splits, splits, bt, out_p, lse_p, acc);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(qkmla_cpu, m) {
  m.def("mla_decode(Tensor q, Tensor pool, Tensor? scales, Tensor block_table, Tensor visible, int d_c, "
        "float scale, int mode, int splits, Tensor? slots=None) -> (Tensor, Tensor)");
  m.impl("mla_decode", c10::DispatchKey::CPU, TORCH_FN(mla_decode_cpu));
}
