// The register tiles of the AVX512-BF16 matmul, shared by ``bf16_matmul.cc`` (bfloat16
// weights), ``quant_matmul.cc`` (int8 and fp8 e4m3 weights, converted to bfloat16
// exactly as they are loaded, or first into a bfloat16 panel) and ``grouped_matmul.cc``
// (each expert's rows against its bfloat16 weight).
//
// Every output element out[m, n] is one float32 accumulator, zeroed, then updated by one
// ``vdpbf16ps`` per pair of k (0-1, 2-3, ...) in increasing k, in one lane: which row
// block, column panel, thread or tile shape computed it changes nothing, so a row's bits
// never depend on M (the batch-invariance guarantee the kernels give).
//
// ``w`` points at the tile's first column of row k = 0, rows ``ldw`` elements apart;
// ``out`` at the tile's first column of row m = 0, rows ``ldo`` elements apart.

#ifndef SUPERINFER_NATIVE_BF16_TILES_H_
#define SUPERINFER_NATIVE_BF16_TILES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define SUPERINFER_HAVE_BF16_KERNEL 1
#include <immintrin.h>
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
#else
#define SUPERINFER_HAVE_BF16_KERNEL 0
#endif

namespace superinfer {

#if SUPERINFER_HAVE_BF16_KERNEL

// AVX512-BF16, and AVX512-VBMI (the fp8 tables' byte permutes; every AVX512-BF16 CPU
// but Intel's Cooper Lake has it), which every function built with BF16_TARGET may use.
inline bool Bf16CpuSupported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512vbmi");
}

// float32 activations -> bfloat16, rounded to nearest even as XLA's convert rounds (a
// subnormal goes to zero here, and ``vdpbf16ps`` reads a bfloat16 subnormal as zero, so the
// products are the same either way): the kernels take float32 rows themselves, one
// conversion in the call instead of an XLA op before it.
BF16_TARGET inline void ToBf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, tail,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, src + i)));
  }
}

namespace tiles {

// Weight formats a tile reads: 32 consecutive weights of one row as 32 bfloat16 values
// (a __m512i), exactly. ``Load`` reads all 32, ``LoadMasked`` the ``tail`` ones (zeros
// elsewhere). Every format gives the tile the same bfloat16 values for the same weights,
// so the accumulation, and its bits, do not depend on the format the weights came in.
struct Bf16Weights {
  using T = uint16_t;
  BF16_TARGET static inline __m512i Load(const T* p) { return _mm512_loadu_si512(p); }
  BF16_TARGET static inline __m512i LoadMasked(const T* p, __mmask32 tail) {
    return _mm512_maskz_loadu_epi16(tail, p);
  }
};

// int8 -> float32 -> bfloat16: exact (|v| <= 128 needs 8 significant bits).
struct Int8Weights {
  using T = int8_t;
  BF16_TARGET static inline __m512i Widen(__m128i lo, __m128i hi) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);
  }
  BF16_TARGET static inline __m512i Load(const T* p) {
    return Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  BF16_TARGET static inline __m512i LoadMasked(const T* p, __mmask32 tail) {
    const __m256i v = _mm256_maskz_loadu_epi8(tail, p);
    return Widen(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }
};

// The bfloat16 bits of e4m3 (fn) value i (0-127: exponent i >> 3, mantissa i & 7; 127 is
// NaN), split into low and high bytes: every e4m3 value, subnormals included, is a
// normal bfloat16 (``vdpbf16ps`` treats bfloat16 subnormals as zero).
constexpr uint16_t Fp8ToBf16Bits(int i) {
  const int e = i >> 3, m = i & 7;
  if (i == 127) return 0x7FC0;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));
  if (m == 0) return 0;
  const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m * 2^-9 = 2^(p - 9) * (m / 2^p)
  return static_cast<uint16_t>(((118 + p) << 7) | ((m - (1 << p)) << (7 - p)));
}

struct Fp8Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t interleave[64];  // byte 2j <- lo[j], 2j + 1 <- hi[j]
  constexpr Fp8Tables() : lo(), hi(), interleave() {
    for (int i = 0; i < 128; ++i) {
      lo[i] = static_cast<uint8_t>(Fp8ToBf16Bits(i) & 0xFF);
      hi[i] = static_cast<uint8_t>(Fp8ToBf16Bits(i) >> 8);
    }
    for (int j = 0; j < 32; ++j) {
      interleave[2 * j] = static_cast<uint8_t>(j);
      interleave[2 * j + 1] = static_cast<uint8_t>(64 + j);
    }
  }
};
inline constexpr Fp8Tables kFp8Tables{};

// fp8 e4m3 -> bfloat16, exact, by table: the low and high bytes of each value's bfloat16
// bits looked up by its low 7 bits (``vpermi2b``), the sign bit copied into the high
// byte, and the two bytes interleaved into words: four instructions per 32 weights.
struct Fp8Weights {
  using T = uint8_t;
  BF16_TARGET static inline __m512i Widen(__m256i bytes) {
    const auto* t = &kFp8Tables;
    const __m512i b = _mm512_castsi256_si512(bytes);
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t->lo), b,
                                                _mm512_load_si512(t->lo + 64));
    const __m512i hi = _mm512_ternarylogic_epi32(
        _mm512_permutex2var_epi8(_mm512_load_si512(t->hi), b, _mm512_load_si512(t->hi + 64)),
        b, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // table | (b & 0x80)
    return _mm512_permutex2var_epi8(lo, _mm512_load_si512(t->interleave), hi);
  }
  BF16_TARGET static inline __m512i Load(const T* p) {
    return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  BF16_TARGET static inline __m512i LoadMasked(const T* p, __mmask32 tail) {
    return Widen(_mm256_maskz_loadu_epi8(tail, p));
  }
};

// How many weight rows ahead a tile asks for: its 64-512-byte pieces of rows N elements
// apart are too short a run for the hardware prefetchers (about 5% at one row, measured).
constexpr int64_t kPrefetchRows = 8;

// Output columns of a 32-column group come out of the unpacks as lanes (0-3, 8-11, 16-19,
// 24-27) and (4-7, 12-15, 20-23, 28-31); these indices put them back in order.
BF16_TARGET inline void StoreGroup(float* out, __m512 lo, __m512 hi, int64_t valid) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 a = _mm512_permutex2var_ps(lo, first, hi);
  __m512 b = _mm512_permutex2var_ps(lo, second, hi);
  if (valid >= 32) {
    _mm512_storeu_ps(out, a);
    _mm512_storeu_ps(out + 16, b);
    return;
  }
  const __mmask16 ma = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 mb = valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  _mm512_mask_storeu_ps(out, ma, a);
  _mm512_mask_storeu_ps(out + 16, mb, b);
}

// One k-pair step of an MR x NG tile: the weight rows r0 (k) and r1 (k + 1) interleaved
// into pairs, times the rows' broadcast (x[m, k], x[m, k + 1]) pairs.
template <int MR, int NG, bool kMasked, class W>
BF16_TARGET inline void Step(__m512 (&acc)[MR][NG][2], const __m512i (&a)[MR],
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
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(w0, w1);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(w0, w1);
    for (int m = 0; m < MR; ++m) {
      acc[m][g][0] = _mm512_dpbf16_ps(acc[m][g][0], lo, (__m512bh)a[m]);
      acc[m][g][1] = _mm512_dpbf16_ps(acc[m][g][1], hi, (__m512bh)a[m]);
    }
  }
}

// MR rows x NG groups of 32 columns; ``last_valid`` columns of the last group exist
// (1-32). Accumulators stay in registers for the whole k loop.
template <int MR, int NG, bool kMasked, class W>
BF16_TARGET void TileImpl(const uint16_t* x, int64_t K, const typename W::T* w, int64_t ldw,
                          float* out, int64_t ldo, int64_t last_valid) {
  __m512 acc[MR][NG][2];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) acc[m][g][0] = acc[m][g][1] = _mm512_setzero_ps();
  const __mmask32 tail = last_valid >= 32 ? ~0u : ((1u << last_valid) - 1);
  const typename W::T* r0 = w;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2, r0 += 2 * ldw) {
    if (kPrefetchRows > 0 && k + kPrefetchRows + 1 < K) {
      // The tile reads 64-byte pieces of rows ldw elements apart, too short a run for the
      // hardware prefetchers to follow: ask for the rows a few k ahead.
      const typename W::T* ahead = r0 + kPrefetchRows * ldw;
      for (int g = 0; g < NG; ++g) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * g), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + ldw + 32 * g), _MM_HINT_T0);
      }
    }
    __m512i a[MR];
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof pair);
      a[m] = _mm512_set1_epi32(pair);
    }
    Step<MR, NG, kMasked, W>(acc, a, r0, r0 + ldw, tail);
  }
  if (k < K) {  // odd K: the last k pairs with a zero
    __m512i a[MR];
    for (int m = 0; m < MR; ++m) a[m] = _mm512_set1_epi32(x[m * K + k]);
    Step<MR, NG, kMasked, W>(acc, a, r0, nullptr, tail);
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g)
      StoreGroup(out + m * ldo + 32 * g, acc[m][g][0], acc[m][g][1],
                 g == NG - 1 ? last_valid : 32);
}

template <int MR, int NG, class W>
BF16_TARGET void Tile(const uint16_t* x, int64_t K, const typename W::T* w, int64_t ldw,
                      float* out, int64_t ldo, int64_t last_valid) {
  if (last_valid >= 32) {
    TileImpl<MR, NG, false, W>(x, K, w, ldw, out, ldo, 32);
  } else {
    TileImpl<MR, NG, true, W>(x, K, w, ldw, out, ldo, last_valid);
  }
}

// Rows [0, M) of one column tile: blocks of MR rows, then what is left in blocks of
// MR / 2, MR / 4, ... (the same NG), down to single rows.
template <int MR, int NG, class W>
BF16_TARGET void Rows(const uint16_t* x, int64_t M, int64_t K, const typename W::T* w,
                      int64_t ldw, float* out, int64_t ldo, int64_t last_valid) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    Tile<MR, NG, W>(x + m * K, K, w, ldw, out + m * ldo, ldo, last_valid);
  if constexpr (MR > 1) {
    if (m < M) Rows<MR / 2, NG, W>(x + m * K, M - m, K, w, ldw, out + m * ldo, ldo, last_valid);
  }
}

// ``Rows`` over ``groups`` (1 to G) groups of 32 columns in one tile, the last holding
// ``last_valid`` columns: one pass over the weight rows however narrow the remainder.
template <int MR, int G, class W>
BF16_TARGET void RowsOfGroups(int64_t groups, const uint16_t* x, int64_t M, int64_t K,
                              const typename W::T* w, int64_t ldw, float* out, int64_t ldo,
                              int64_t last_valid) {
  if (groups == G) {
    Rows<MR, G, W>(x, M, K, w, ldw, out, ldo, last_valid);
  } else if constexpr (G > 1) {
    RowsOfGroups<MR, G - 1, W>(groups, x, M, K, w, ldw, out, ldo, last_valid);
  }
}

// Columns [n0, n1) of every row, in tiles of NG groups of 32 columns, then what is left
// as one narrower tile. Each tile's slice of the weight is read by every row block in
// turn while it is still in cache.
template <int MR, int NG, class W>
BF16_TARGET void Panel(const uint16_t* x, int64_t M, int64_t K, const typename W::T* w,
                       int64_t ldw, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  int64_t c = n0;
  for (; c + 32 * NG <= n1; c += 32 * NG) Rows<MR, NG, W>(x, M, K, w + c, ldw, out + c, ldo, 32);
  if (c < n1) {
    const int64_t groups = (n1 - c + 31) / 32;
    RowsOfGroups<MR, NG, W>(groups, x, M, K, w + c, ldw, out + c, ldo, n1 - c - 32 * (groups - 1));
  }
}

// The tile shape by rows: wide for one row (the weight streams in long runs, the
// bandwidth-bound decode); from 4 rows, blocks of 3 or 4 rows over 3 or 4 groups, which
// still read each weight row in runs of 192-256 bytes while each load feeds 3-4 rows
// (24 accumulators). Runs of 64 bytes (one group, tall blocks) stream far slower on
// this machine's memory than the extra row-block passes over a cached tile cost.
template <class W>
BF16_TARGET inline void PanelForRows(const uint16_t* x, int64_t M, int64_t K,
                                     const typename W::T* w, int64_t ldw, float* out,
                                     int64_t ldo, int64_t n0, int64_t n1) {
  if (M == 1) {
    Panel<1, 8, W>(x, M, K, w, ldw, out, ldo, n0, n1);
  } else if (M <= 3) {
    Panel<2, 4, W>(x, M, K, w, ldw, out, ldo, n0, n1);
  } else if (M == 6 || M == 7) {
    Panel<3, 4, W>(x, M, K, w, ldw, out, ldo, n0, n1);
  } else {
    Panel<4, 3, W>(x, M, K, w, ldw, out, ldo, n0, n1);
  }
}

}  // namespace tiles

#else

inline bool Bf16CpuSupported() { return false; }

#endif  // SUPERINFER_HAVE_BF16_KERNEL

}  // namespace superinfer

#endif  // SUPERINFER_NATIVE_BF16_TILES_H_
