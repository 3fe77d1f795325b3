// bfloat16 x bfloat16 -> float32 register tiles (AVX512-BF16), shared by the native matmuls.
//
// ``Panel<MR, NG>(x, M, K, w, N, out, n0, n1)`` computes columns [n0, n1) of every row of
// ``out[M, N] = x[M, K] @ w[K, N]`` (row-major, bfloat16 in, float32 out) in tiles of MR rows
// x NG groups of 32 columns. Every output element is one float32 accumulator, zeroed, then
// updated by one ``vdpbf16ps`` per pair of k (0-1, 2-3, ...) in increasing k, in one lane:
// which tile shape, row block, column range or thread computed it changes nothing, so a
// row's bits never depend on the rows beside it (``bf16_matmul.cc``, ``grouped_matmul.cc``).
// ``n0`` is a multiple of 32; ``n1`` a multiple of 32 or N.
//
// The functions are compiled for AVX512-BF16 by attribute (``BF16_TARGET``): callers check
// the CPU first (``__builtin_cpu_supports``), and the library builds on any x86-64.

#ifndef SUPERINFER_NATIVE_GROUPED_TILES_H_
#define SUPERINFER_NATIVE_GROUPED_TILES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define SUPERINFER_HAVE_BF16_KERNEL 1
#include <immintrin.h>
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define SUPERINFER_HAVE_BF16_KERNEL 0
#endif

#if SUPERINFER_HAVE_BF16_KERNEL
namespace superinfer {
namespace bf16_tiles {

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
template <int MR, int NG, bool kMasked>
BF16_TARGET inline void Step(__m512 (&acc)[MR][NG][2], const __m512i (&a)[MR], const uint16_t* r0,
                             const uint16_t* r1, __mmask32 tail) {
  for (int g = 0; g < NG; ++g) {
    __m512i w0, w1;
    if (kMasked && g == NG - 1) {
      w0 = _mm512_maskz_loadu_epi16(tail, r0 + 32 * g);
      w1 = r1 ? _mm512_maskz_loadu_epi16(tail, r1 + 32 * g) : _mm512_setzero_si512();
    } else {
      w0 = _mm512_loadu_si512(r0 + 32 * g);
      w1 = r1 ? _mm512_loadu_si512(r1 + 32 * g) : _mm512_setzero_si512();
    }
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(w0, w1);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(w0, w1);
    for (int m = 0; m < MR; ++m) {
      acc[m][g][0] = _mm512_dpbf16_ps(acc[m][g][0], lo, (__m512bh)a[m]);
      acc[m][g][1] = _mm512_dpbf16_ps(acc[m][g][1], hi, (__m512bh)a[m]);
    }
  }
}

// MR rows x NG groups of 32 columns, starting at column n0; ``last_valid`` columns of the
// last group exist (1-32). Accumulators stay in registers for the whole k loop.
template <int MR, int NG, bool kMasked>
BF16_TARGET void TileImpl(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N,
                          float* out, int64_t n0, int64_t last_valid) {
  __m512 acc[MR][NG][2];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) acc[m][g][0] = acc[m][g][1] = _mm512_setzero_ps();
  const __mmask32 tail = last_valid >= 32 ? ~0u : ((1u << last_valid) - 1);
  const uint16_t* r0 = w + n0;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2, r0 += 2 * N) {
    if (kPrefetchRows > 0 && k + kPrefetchRows + 1 < K) {
      // The tile reads 64-byte pieces of rows N elements apart, too short a run for the
      // hardware prefetchers to follow: ask for the rows a few k ahead.
      const uint16_t* ahead = r0 + kPrefetchRows * N;
      for (int g = 0; g < NG; ++g) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * g), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + N + 32 * g), _MM_HINT_T0);
      }
    }
    __m512i a[MR];
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof pair);
      a[m] = _mm512_set1_epi32(pair);
    }
    Step<MR, NG, kMasked>(acc, a, r0, r0 + N, tail);
  }
  if (k < K) {  // odd K: the last k pairs with a zero
    __m512i a[MR];
    for (int m = 0; m < MR; ++m) a[m] = _mm512_set1_epi32(x[m * K + k]);
    Step<MR, NG, kMasked>(acc, a, r0, nullptr, tail);
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g)
      StoreGroup(out + m * N + n0 + 32 * g, acc[m][g][0], acc[m][g][1],
                 g == NG - 1 ? last_valid : 32);
}

template <int MR, int NG>
BF16_TARGET void Tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, float* out,
                      int64_t n0, int64_t last_valid) {
  if (last_valid >= 32) {
    TileImpl<MR, NG, false>(x, K, w, N, out, n0, 32);
  } else {
    TileImpl<MR, NG, true>(x, K, w, N, out, n0, last_valid);
  }
}

// Rows [0, M) of one column tile (NG groups from n0): blocks of MR rows, then what is
// left in blocks of MR / 2, MR / 4, ... (the same NG), down to single rows.
template <int MR, int NG>
BF16_TARGET void Rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                      float* out, int64_t n0, int64_t last_valid) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) Tile<MR, NG>(x + m * K, K, w, N, out + m * N, n0, last_valid);
  if constexpr (MR > 1) {
    if (m < M) Rows<MR / 2, NG>(x + m * K, M - m, K, w, N, out + m * N, n0, last_valid);
  }
}

// Columns [n0, n1) of every row, in tiles of NG groups of 32 columns; a narrower last
// tile goes one group at a time. Each tile's slice of the weight is read by every row
// block in turn while it is still in cache.
template <int MR, int NG>
BF16_TARGET void Panel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                       float* out, int64_t n0, int64_t n1) {
  int64_t c = n0;
  for (; c + 32 * NG <= n1; c += 32 * NG) Rows<MR, NG>(x, M, K, w, N, out, c, 32);
  for (; c < n1; c += 32) Rows<MR, 1>(x, M, K, w, N, out, c, std::min<int64_t>(32, n1 - c));
}

// Columns [n0, n1) of every row, the tile shape by rows: wide for few rows (the weight
// streams in long runs, the bandwidth-bound decode), tall for many (each weight load feeds
// more rows).
BF16_TARGET inline void Columns(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                                int64_t N, float* out, int64_t n0, int64_t n1) {
  if (M == 1) {
    Panel<1, 8>(x, M, K, w, N, out, n0, n1);
  } else if (M <= 3) {
    Panel<2, 4>(x, M, K, w, N, out, n0, n1);
  } else if (M <= 7) {
    Panel<4, 2>(x, M, K, w, N, out, n0, n1);
  } else {
    Panel<8, 1>(x, M, K, w, N, out, n0, n1);
  }
}

}  // namespace bf16_tiles
}  // namespace superinfer
#endif  // SUPERINFER_HAVE_BF16_KERNEL

#endif  // SUPERINFER_NATIVE_GROUPED_TILES_H_
