// bfloat16 helpers shared by qkmla's CPU kernels (mla_decode/cpu_kernel.cpp, small_linear.cpp).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// Two bf16 values of a row as one 32-bit word (rows may start at any 2-byte boundary).
inline int32_t pair_at(const uint16_t* row, int64_t p) {
  int32_t v;
  std::memcpy(&v, row + 2 * p, 4);
  return v;
}

inline uint16_t to_bf16(float v) {  // round to nearest even; NaN stays a (quiet) NaN
  if (std::isnan(v)) return 0x7FC0u;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace
