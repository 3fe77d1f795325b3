// The register tiles of the int8-weight matmul (``quant_matmul.cc``): int16 activations
// times int8 weights widened to int16, ``vpdpwssd`` (AVX512-VNNI) into int32.
//
// Why: widening a one-byte weight to int16 is one instruction per 32 weights, where
// bfloat16 needs five (int8 -> int32 -> float32 -> bfloat16), which kept the batch-1
// decode step compute-bound below memory bandwidth.
//
// Every output element out[m, n] is one sum in a fixed order: int32 partial sums over
// chunks of ``kChunk`` k (exact: |x| <= 32767 and |w| <= 128 keep 512 products below
// 2^31), each converted to float32 and added, chunk after chunk, to one float32 total.
// Chunks depend on K only, so neither the row block, the column panel, the thread nor M
// changes a row's bits (batch invariance).
//
// ``x`` points at the tile's first row, rows ``ldx`` int16 apart (ldx >= K rounded up to
// even, zero-padded); ``w`` at the tile's first column of row k = 0, rows ``ldw``
// elements apart; ``out`` at the tile's first column of row m = 0, rows ``ldo`` apart.

#ifndef SUPERINFER_NATIVE_I16_TILES_H_
#define SUPERINFER_NATIVE_I16_TILES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_tiles.h"

#if SUPERINFER_HAVE_BF16_KERNEL
#define I16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,avx512vnni")))
#endif

namespace superinfer {

#if SUPERINFER_HAVE_BF16_KERNEL

inline bool I16CpuSupported() {
  return Bf16CpuSupported() && __builtin_cpu_supports("avx512vnni");
}

namespace i16tiles {

// k per int32 partial sum (see above).
constexpr int64_t kChunk = 512;

// 32 consecutive weights of one row as 32 int16 (a __m512i), exactly.
struct Int8AsI16 {
  using T = int8_t;
  I16_TARGET static inline __m512i Load(const T* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  I16_TARGET static inline __m512i LoadMasked(const T* p, __mmask32 tail) {
    return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail, p));
  }
};

struct I16 {
  using T = int16_t;
  I16_TARGET static inline __m512i Load(const T* p) { return _mm512_loadu_si512(p); }
  I16_TARGET static inline __m512i LoadMasked(const T* p, __mmask32 tail) {
    return _mm512_maskz_loadu_epi16(tail, p);
  }
};

// One k-pair step of an MR x NG tile (the layout of ``tiles::Step``, in integers).
template <int MR, int NG, bool kMasked, class W>
I16_TARGET inline void Step(__m512i (&acc)[MR][NG][2], const __m512i (&a)[MR],
                            const typename W::T* r0, const typename W::T* r1, __mmask32 tail) {
  for (int g = 0; g < NG; ++g) {
    __m512i w0, w1;
    if (kMasked && g == NG - 1) {
      w0 = W::LoadMasked(r0 + 32 * g, tail);
      w1 = r1 ? W::LoadMasked(r1 + 32 * g, tail) : _mm512_setzero_si512();
    } else {
      w0 = W::Load(r0 + 32 * g);
      w1 = r1 ? W::Load(r1 + 32 * g) : _mm512_setzero_si512();
    }
    const __m512i lo = _mm512_unpacklo_epi16(w0, w1);
    const __m512i hi = _mm512_unpackhi_epi16(w0, w1);
    for (int m = 0; m < MR; ++m) {
      acc[m][g][0] = _mm512_dpwssd_epi32(acc[m][g][0], lo, a[m]);
      acc[m][g][1] = _mm512_dpwssd_epi32(acc[m][g][1], hi, a[m]);
    }
  }
}

// MR rows x NG groups of 32 columns; ``last_valid`` columns of the last group exist.
template <int MR, int NG, bool kMasked, class W>
I16_TARGET void TileImpl(const int16_t* x, int64_t ldx, int64_t K, const typename W::T* w,
                         int64_t ldw, float* out, int64_t ldo, int64_t last_valid) {
  __m512 total[MR][NG][2];
  const __mmask32 tail = last_valid >= 32 ? ~0u : ((1u << last_valid) - 1);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    __m512i acc[MR][NG][2];
    for (int m = 0; m < MR; ++m)
      for (int g = 0; g < NG; ++g) acc[m][g][0] = acc[m][g][1] = _mm512_setzero_si512();
    const typename W::T* r0 = w + k0 * ldw;
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2, r0 += 2 * ldw) {
      if (k + tiles::kPrefetchRows + 1 < K) {
        const auto* ahead = reinterpret_cast<const char*>(r0 + tiles::kPrefetchRows * ldw);
        // One prefetch per 64-byte line of the tile's two rows.
        for (int b = 0; b < NG * 32 * static_cast<int>(sizeof(typename W::T)); b += 64) {
          _mm_prefetch(ahead + b, _MM_HINT_T0);
          _mm_prefetch(ahead + ldw * sizeof(typename W::T) + b, _MM_HINT_T0);
        }
      }
      __m512i a[MR];
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + k, sizeof pair);
        a[m] = _mm512_set1_epi32(pair);
      }
      Step<MR, NG, kMasked, W>(acc, a, r0, r0 + ldw, tail);
    }
    if (k < k1) {  // odd K: the last k pairs with a zero weight row (x is zero-padded)
      __m512i a[MR];
      for (int m = 0; m < MR; ++m) a[m] = _mm512_set1_epi32(static_cast<uint16_t>(x[m * ldx + k]));
      Step<MR, NG, kMasked, W>(acc, a, r0, nullptr, tail);
    }
    for (int m = 0; m < MR; ++m)
      for (int g = 0; g < NG; ++g)
        for (int h = 0; h < 2; ++h) {
          const __m512 part = _mm512_cvtepi32_ps(acc[m][g][h]);
          total[m][g][h] = k0 == 0 ? part : _mm512_add_ps(total[m][g][h], part);
        }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g)
      tiles::StoreGroup(out + m * ldo + 32 * g, total[m][g][0], total[m][g][1],
                        g == NG - 1 ? last_valid : 32);
}

template <int MR, int NG, class W>
I16_TARGET void Tile(const int16_t* x, int64_t ldx, int64_t K, const typename W::T* w,
                     int64_t ldw, float* out, int64_t ldo, int64_t last_valid) {
  if (last_valid >= 32) {
    TileImpl<MR, NG, false, W>(x, ldx, K, w, ldw, out, ldo, 32);
  } else {
    TileImpl<MR, NG, true, W>(x, ldx, K, w, ldw, out, ldo, last_valid);
  }
}

// Rows [0, M): blocks of MR rows, then MR / 2, MR / 4, ... down to single rows.
template <int MR, int NG, class W>
I16_TARGET void Rows(const int16_t* x, int64_t ldx, int64_t M, int64_t K,
                     const typename W::T* w, int64_t ldw, float* out, int64_t ldo,
                     int64_t last_valid) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    Tile<MR, NG, W>(x + m * ldx, ldx, K, w, ldw, out + m * ldo, ldo, last_valid);
  if constexpr (MR > 1) {
    if (m < M)
      Rows<MR / 2, NG, W>(x + m * ldx, ldx, M - m, K, w, ldw, out + m * ldo, ldo, last_valid);
  }
}

// Columns [n0, n1) of every row, in tiles of NG groups of 32 columns.
template <int MR, int NG, class W>
I16_TARGET void Panel(const int16_t* x, int64_t ldx, int64_t M, int64_t K,
                      const typename W::T* w, int64_t ldw, float* out, int64_t ldo, int64_t n0,
                      int64_t n1) {
  int64_t c = n0;
  for (; c + 32 * NG <= n1; c += 32 * NG)
    Rows<MR, NG, W>(x, ldx, M, K, w + c, ldw, out + c, ldo, 32);
  for (; c < n1; c += 32)
    Rows<MR, 1, W>(x, ldx, M, K, w + c, ldw, out + c, ldo, std::min<int64_t>(32, n1 - c));
}

// The tile shape by rows, as ``tiles::PanelForRows``.
template <class W>
I16_TARGET inline void PanelForRows(const int16_t* x, int64_t ldx, int64_t M, int64_t K,
                                    const typename W::T* w, int64_t ldw, float* out,
                                    int64_t ldo, int64_t n0, int64_t n1) {
  if (M == 1) {
    Panel<1, 8, W>(x, ldx, M, K, w, ldw, out, ldo, n0, n1);
  } else if (M <= 3) {
    Panel<2, 4, W>(x, ldx, M, K, w, ldw, out, ldo, n0, n1);
  } else if (M <= 7) {
    Panel<4, 2, W>(x, ldx, M, K, w, ldw, out, ldo, n0, n1);
  } else {
    Panel<8, 1, W>(x, ldx, M, K, w, ldw, out, ldo, n0, n1);
  }
}

// 16 bfloat16 values (the ``mask`` ones, zeros elsewhere) as float32.
I16_TARGET inline __m512 LoadBf16(const uint16_t* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Row m of x [M, K] bfloat16 -> xq [m, 0:ldx) int16 (zero-padded) and its scale:
// x ~= xq * scale, xq = round-to-nearest-even(x * 32767 / max|x|). Depends on the row
// alone, so a row's int16 values do not depend on M.
I16_TARGET inline float QuantizeRow(const uint16_t* x, int64_t K, int16_t* xq, int64_t ldx) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t j = 0; j < K; j += 16) {
    const __mmask16 mask = K - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - j)) - 1);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(LoadBf16(x + j, mask)));
  }
  const float top = _mm512_reduce_max_ps(amax);
  const float inv = top > 0 ? 32767.0f / top : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  std::memset(xq, 0, sizeof(int16_t) * ldx);
  for (int64_t j = 0; j < K; j += 16) {
    const __mmask16 mask = K - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - j)) - 1);
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(LoadBf16(x + j, mask), vinv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(xq + j, mask, _mm512_cvtsepi32_epi16(q));
  }
  return top / 32767.0f;
}

}  // namespace i16tiles

#else

inline bool I16CpuSupported() { return false; }

#endif  // SUPERINFER_HAVE_BF16_KERNEL

}  // namespace superinfer

#endif  // SUPERINFER_NATIVE_I16_TILES_H_
