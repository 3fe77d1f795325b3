// The AMX path of the bfloat16 matmul, shared by ``bf16_matmul.cc`` (bfloat16 weights) and
// ``quant_matmul.cc`` (int8 and fp8 e4m3 weights, converted to bfloat16 exactly): with
// ``SUPERINFER_NATIVE_AMX=1`` on a CPU with AMX-BF16 (Sapphire Rapids and later) every call
// takes it, whatever M.
//
// Opt-in, since at one row it is slower than the register tiles: a 64-column pass reads
// each weight row in runs of 128 bytes (a page walk per row of a wide weight) where the
// register tiles read 512, and int8 weights go through an L1 buffer where the register
// tiles convert them in registers. From a few rows it is faster (docs/results/amx_matmul.md).
//
// Why: ``vdpbf16ps`` retires 32 multiply-adds per instruction, so from a few rows the
// register tiles are bound by arithmetic; one ``tdpbf16ps`` does 16 x 16 x 32.
//
// How: ``tdpbf16ps`` multiplies pairs of k side by side in its B operand, where a
// row-major [K, N] weight holds pairs of columns. So the weight is read as it is stored,
// 16 rows k by 32 columns n per B tile (pair j of row k = columns 2j and 2j + 1), against
// two copies of x's rows spread over pairs, (x[m, k], 0) and (0, x[m, k]): the first
// accumulates the even columns, the second the odd ones. Half the products are zeros, but
// no weight is rearranged (a rearranging pass cost more than the arithmetic at few rows).
// A thread walks its columns 64 at a time (two B tiles, four accumulator tiles) and all K,
// each block of up to 16 rows in turn. bfloat16 weights are read in place; other formats,
// and columns or K that do not fill whole tiles, are converted to zero-padded bfloat16
// first: up to 16 rows one block of 16 k x 256 columns at a time (the accumulators in
// memory between blocks), above that a [K16, up to 256] panel that every row block reads.
// Column n's sum includes 0 * w[k, n ^ 1], so an Inf or NaN weight makes its pair
// partner's output NaN too (the register tiles keep it to its own column); the finite
// weights that checkpoints and quantization give are unaffected.
//
// Batch invariance, by construction: out[m, n] is one accumulator of a tile, zeroed, then
// updated by one ``tdpbf16ps`` per block of 16 k in increasing k, which reads only row m
// of x. The rows beside it, the row block, the pass and the thread change nothing, so a
// row's bits do not depend on M. AMX sums a block's products in its own order, so its bits
// differ from the register tiles': a process uses one path for every call
// (``Supported()`` is fixed per process), never AMX for some M only.
//
// Without ``SUPERINFER_NATIVE_AMX=1`` (and on every other CPU) the register tiles run.

#ifndef SUPERINFER_NATIVE_AMX_TILES_H_
#define SUPERINFER_NATIVE_AMX_TILES_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"

#if SUPERINFER_HAVE_BF16_KERNEL && defined(__linux__)
#define SUPERINFER_HAVE_AMX_KERNEL 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET                                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,amx-tile," \
                        "amx-bf16")))
#else
#define SUPERINFER_HAVE_AMX_KERNEL 0
#endif

namespace superinfer::amx {

#if SUPERINFER_HAVE_AMX_KERNEL

// AMX-TILE and the AMX unit at CPUID leaf 7 EDX bit ``unit`` (22: AMX-BF16, 25: AMX-INT8),
// and the kernel's permission to use the tile state (Linux asks each process to request
// it; asking again is harmless).
inline bool CpuHasAmx(int unit) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << unit))) return false;
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// Asked for (``SUPERINFER_NATIVE_AMX=1``), the register tiles' ISA and AMX-BF16.
inline bool Supported() {
  static const bool supported = [] {
    const char* env = std::getenv("SUPERINFER_NATIVE_AMX");
    if (env == nullptr || std::strcmp(env, "1") != 0) return false;
    return Bf16CpuSupported() && CpuHasAmx(22);
  }();
  return supported;
}

constexpr int64_t kBlockK = 16;   // k per ``tdpbf16ps`` (B tile rows)
constexpr int64_t kPass = 64;     // columns per pass: two B tiles of 32
constexpr int64_t kBlockM = 16;   // rows per accumulator tile
// B rows requested this many k ahead when read in place (runs of 128 bytes, rows apart).
constexpr int64_t kPrefetchK = 32;

inline int64_t PaddedK(int64_t K) { return (K + kBlockK - 1) / kBlockK * kBlockK; }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm that names no memory beyond a pointer: between plain
// stores and a tile load of what they wrote (or a tile store and plain loads of it), this
// keeps the compiler from reordering the two.
inline void CompilerBarrier() { asm volatile("" ::: "memory"); }

// tmm0-3: accumulators (even and odd columns of B tile 0, then of B tile 1), ``rows``
// rows; tmm4-5: x's rows spread as (x, 0) and (0, x); tmm6-7: the B tiles, 16 rows.
AMX_TARGET inline void Configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
  }
  CompilerBarrier();
  _tile_loadconfig(&cfg);
}

// x [M, K] bfloat16 spread over pairs, K padded to K16 with zeros: ``even(m)`` holds
// (x[m, k], 0) at pair k, ``odd(m)`` (0, x[m, k]); rows ``ld`` = 2 * K16 elements apart.
// One buffer serves both: the odd row is the even row one element earlier (a leading
// zero, then each row's last element, always a pair's zero).
struct SpreadRows {
  std::vector<uint16_t> data;
  int64_t ld = 0;

  const uint16_t* even(int64_t m) const { return data.data() + 1 + m * ld; }
  const uint16_t* odd(int64_t m) const { return data.data() + m * ld; }

  AMX_TARGET void Set(const uint16_t* x, int64_t M, int64_t K) {
    ld = 2 * PaddedK(K);
    data.resize(1 + M * ld);
    data[0] = 0;
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* row = data.data() + 1 + m * ld;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)  // 16 bfloat16 values -> 16 (x, 0) pairs
        _mm512_storeu_si512(row + 2 * k, _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(x + m * K + k))));
      for (; k < ld / 2; ++k) {
        row[2 * k] = k < K ? x[m * K + k] : 0;
        row[2 * k + 1] = 0;
      }
    }
  }
};

// Columns converted to bfloat16 at a time, where the weights are not read in place, and
// the most bytes such a buffer takes above 16 rows.
constexpr int64_t kConvertColumns = 256;
constexpr int64_t kScratchBytes = 768 * 1024;

// Rows [k0, k1) of ``cols`` columns of w (rows ``ldw`` apart, format W) -> ``dst``
// [k1 - k0, width] bfloat16 (width >= cols, a multiple of 32), zeros past K and past
// ``cols``.
template <class W>
AMX_TARGET void ConvertColumns(const typename W::T* w, int64_t K, int64_t ldw, int64_t cols,
                               int64_t width, int64_t k0, int64_t k1, uint16_t* dst) {
  for (int64_t k = k0; k < k1; ++k, dst += width) {
    if (k + tiles::kPrefetchRows < K) {
      for (int64_t j = 0; j < cols; j += 64 / sizeof(typename W::T))
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + tiles::kPrefetchRows) * ldw + j),
                     _MM_HINT_T0);
    }
    for (int64_t j = 0; j < width; j += 32) {
      __m512i v = _mm512_setzero_si512();
      const int64_t valid = cols - j;
      if (k < K && valid >= 32) {
        v = W::Load(w + k * ldw + j);
      } else if (k < K && valid > 0) {
        v = W::LoadMasked(w + k * ldw + j, static_cast<__mmask32>((1ull << valid) - 1));
      }
      _mm512_storeu_si512(dst + j, v);
    }
  }
}

// The even and odd accumulator tiles of 16 output pairs (``rows`` rows, 16 floats each)
// -> out columns [0, valid) of each row, interleaved back into column order.
AMX_TARGET inline void StorePairs(const float* even, const float* odd, int rows, float* out,
                                  int64_t ldo, int64_t valid) {
  if (valid <= 0) return;
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __mmask16 ma = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 mb = valid >= 32 ? 0xFFFF
                       : valid <= 16 ? 0
                                     : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  for (int r = 0; r < rows; ++r) {
    const __m512 e = _mm512_load_ps(even + 16 * r), o = _mm512_load_ps(odd + 16 * r);
    _mm512_mask_storeu_ps(out + r * ldo, ma, _mm512_permutex2var_ps(e, first, o));
    _mm512_mask_storeu_ps(out + r * ldo + 16, mb, _mm512_permutex2var_ps(e, second, o));
  }
}

// out[m, n] for rows [0, M) and columns [0, cols) (cols <= 64) of one pass, B read from
// ``b`` [K16, ...] bfloat16 (rows ``ldb`` elements apart; its first 64 columns).
AMX_TARGET inline void Pass(const SpreadRows& x, int64_t M, int64_t K16, const uint16_t* b,
                            int64_t ldb, bool prefetch, int64_t cols, float* out, int64_t ldo,
                            int& configured) {
  alignas(64) float part[4][kBlockM * 16];
  for (int64_t m = 0; m < M; m += kBlockM) {
    const int rows = static_cast<int>(std::min(kBlockM, M - m));
    if (rows != configured) {
      Configure(rows);
      configured = rows;
    }
    const uint16_t* xe = x.even(m);
    const uint16_t* xo = x.odd(m);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* bk = b;
    for (int64_t k = 0; k < K16; k += kBlockK, bk += kBlockK * ldb) {
      if (prefetch && k + kBlockK + kPrefetchK <= K16) {
        for (int64_t r = 0; r < kBlockK; ++r) {
          const char* ahead = reinterpret_cast<const char*>(bk + (kPrefetchK + r) * ldb);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, xe + 2 * k, x.ld * 2);
      _tile_loadd(5, xo + 2 * k, x.ld * 2);
      _tile_loadd(6, bk, ldb * 2);
      _tile_loadd(7, bk + 32, ldb * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, part[0], 64);
    _tile_stored(1, part[1], 64);
    _tile_stored(2, part[2], 64);
    _tile_stored(3, part[3], 64);
    CompilerBarrier();
    float* o = out + m * ldo;
    StorePairs(part[0], part[1], rows, o, ldo, cols);
    StorePairs(part[2], part[3], rows, o + 32, ldo, cols - 32);
  }
}

// Rows [0, M) (M <= 16) of ``cols`` (<= kConvertColumns) columns of weights not read in
// place, where converting them all first would cost a round trip through L2: each block
// of 16 k is converted into ``block`` [16, width] and the accumulators of its
// width / 16 tiles live in ``acc`` between blocks (exact float32 round trips, the same
// ``tdpbf16ps`` on the same operands: the bits equal ``Pass``'s).
template <class W>
AMX_TARGET void ConvertedRows(const SpreadRows& x, int64_t M, int64_t K, const typename W::T* w,
                              int64_t ldw, int64_t cols, uint16_t* block, float* acc,
                              float* out, int64_t ldo, int& configured) {
  const int rows = static_cast<int>(M);
  if (rows != configured) {
    Configure(rows);
    configured = rows;
  }
  const int64_t width = (cols + 31) / 32 * 32, tiles = width / 32, K16 = PaddedK(K);
  const int64_t tile_floats = M * 16;
  std::memset(acc, 0, sizeof(float) * 2 * tiles * tile_floats);
  for (int64_t k = 0; k < K16; k += kBlockK) {
    ConvertColumns<W>(w, K, ldw, cols, width, k, k + kBlockK, block);
    CompilerBarrier();  // the block (and, first, the accumulators' memset) before the tiles
    _tile_loadd(4, x.even(0) + 2 * k, x.ld * 2);
    _tile_loadd(5, x.odd(0) + 2 * k, x.ld * 2);
    for (int64_t t = 0; t < tiles; ++t) {
      float* even = acc + 2 * t * tile_floats;
      float* odd = even + tile_floats;
      _tile_loadd(6, block + 32 * t, width * 2);
      _tile_loadd(0, even, 64);
      _tile_loadd(1, odd, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_stored(0, even, 64);
      _tile_stored(1, odd, 64);
    }
  }
  CompilerBarrier();
  for (int64_t t = 0; t < tiles; ++t)
    StorePairs(acc + 2 * t * tile_floats, acc + (2 * t + 1) * tile_floats, rows, out + 32 * t,
               ldo, cols - 32 * t);
}

// A thread's scratch, 64-byte aligned, of at least ``elements`` bfloat16 values.
inline uint16_t* ThreadScratch(int64_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < elements + 32) buffer.resize(elements + 32);
  auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<uint16_t*>((address + 63) & ~uintptr_t{63});
}

// Columns [n0, n1) of every row: x spread (``SpreadRows``), w [K, ...] in format W (rows
// ``ldw`` apart), out rows ``ldo`` apart. ``after(c, cols)`` runs once a pass's columns
// [c, c + cols) are written (the quantized weights' scales). Releases the tiles before it
// returns.
template <class W, class After>
AMX_TARGET void Panel(const SpreadRows& x, int64_t M, int64_t K, const typename W::T* w,
                      int64_t ldw, float* out, int64_t ldo, int64_t n0, int64_t n1,
                      After after) {
  constexpr bool kInPlace = std::is_same_v<W, tiles::Bf16Weights>;
  const int64_t K16 = PaddedK(K);
  // Above 16 rows, converted columns per buffer: whole passes within kScratchBytes (every
  // row block rereads it, so it should stay in L2), at most kConvertColumns.
  const int64_t panel =
      kPass * std::clamp<int64_t>(kScratchBytes / (2 * K16) / kPass, 1, kConvertColumns / kPass);
  uint16_t* buffer = nullptr;
  int configured = -1;
  for (int64_t c = n0; c < n1;) {
    if (kInPlace && n1 - c >= kPass && K16 == K) {  // bfloat16 weights only
      Pass(x, M, K16, reinterpret_cast<const uint16_t*>(w + c), ldw, true, kPass, out + c, ldo,
           configured);
      after(c, kPass);
      c += kPass;
      continue;
    }
    const int64_t cols = std::min(kConvertColumns, n1 - c);
    if (M <= kBlockM) {
      if (buffer == nullptr) buffer = ThreadScratch(kBlockK * kConvertColumns +
                                                    2 * kConvertColumns * kBlockM);
      ConvertedRows<W>(x, M, K, w + c, ldw, cols, buffer,
                       reinterpret_cast<float*>(buffer + kBlockK * kConvertColumns),
                       out + c, ldo, configured);
      after(c, cols);
      c += cols;
      continue;
    }
    if (buffer == nullptr) buffer = ThreadScratch(K16 * panel);
    for (int64_t d = 0; d < cols; d += panel) {
      const int64_t part = std::min(panel, cols - d);
      const int64_t width = (part + kPass - 1) / kPass * kPass;
      ConvertColumns<W>(w + c + d, K, ldw, part, width, 0, K16, buffer);
      CompilerBarrier();
      for (int64_t e = 0; e < part; e += kPass)
        Pass(x, M, K16, buffer + e, width, false, std::min(kPass, part - e), out + c + d + e,
             ldo, configured);
    }
    after(c, cols);
    c += cols;
  }
  _tile_release();
}

#else

inline bool Supported() { return false; }

#endif  // SUPERINFER_HAVE_AMX_KERNEL

}  // namespace superinfer::amx

#endif  // SUPERINFER_NATIVE_AMX_TILES_H_
