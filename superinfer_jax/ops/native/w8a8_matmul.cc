// int8 activations x int8 weights -> float32 matmul (W8A8) for XLA:CPU, as a typed XLA
// FFI custom call: x is quantized per row (token) in the call, the weights carry one scale
// per output column.
//
// Why this exists: the weight-only int8 kernel (``quant_matmul.cc``) widens every weight to
// bfloat16 before it multiplies, five instructions per 32 weights, and from a few rows that
// widening, not memory, bounds it. Here one ``vpdpbusd`` (AVX512-VNNI) multiplies 64 pairs
// of bytes into int32 with no widening, and one AMX ``tdpbsud`` multiplies 16 x 16 x 64.
//
// What it computes, for each row m and column n:
//   r[m] = x[m] rotated: the fast Walsh-Hadamard transform in blocks of ``rotation`` k
//          (stages h = 1, 2, 4, ... < rotation, each pair (a, c) h apart -> (a + c, a - c)),
//   amax = max_k |r[m, k]|, s_x = amax * float32(1 / 127) (1 when amax = 0),
//   q[m, k] = clamp(round_half_even(r[m, k] * (1 / s_x)), -127, 127),
//   out[m, n] = (float(sum_k q[m, k] * w[k, n]) * s_x) * s_w[n],
// the float32 operations exactly in that order. ``models.quant`` computes the same with
// XLA (its reference and fallback), bit for bit.
//
// Batch invariance and path invariance, by construction: the sum is int32 and exact, so no
// summation order exists to depend on; the row's scale depends on its row only. So the AMX
// tiles (from ``kAmxRows`` rows, where the CPU has AMX-INT8) and the AVX512-VNNI register
// tiles (fewer rows, other CPUs, column tails) give the same bits, and a process may mix
// them by M (unlike the bfloat16 kernels). The int32 sums cannot overflow below K = 66,000
// (|q| <= 127, stored weights <= 255).
//
// Weight storage (``models.quant.pack_w8a8``): int8 w [K, N] stored as uint8 w + 128 (the
// unsigned operand both instructions take; the extra 128 * sum_k q[m, k] is subtracted
// per row), in blocks of 64 columns end to end: block b (width w_b = min(64, N - 64 b)) at
// byte offset 64 b K holds [K / 4, w_b, 4]: for each group of four k, each column's four
// bytes side by side. A 16-column slice of a group is then the 64 bytes one ``vpdpbusd``
// or one AMX B-tile row reads, and a block is one contiguous run of K * w_b bytes that a
// thread streams front to back (a decode step reads each weight once, so run length sets
// the bandwidth it gets). K must be a multiple of 4.
//
// The weights were rotated the same way before they were quantized (``models.quant``), so
// the rotation cancels in the product; it spreads an activation's outlier channels over
// the block, which one scale per row could not represent next to the small ones.
//
//   x     [M, K] float32 or bfloat16
//   w_i   [K, N_i] uint8, packed as above, 1 to 4 of them
//   s_i   [N_i] float32
//   out_i [M, N_i] float32
//
// Only CPUs with AVX512-VNNI (and AVX512-BW/VL) run it (``SuperinferW8a8MatmulSupported``);
// ``models.quant`` takes its XLA form elsewhere.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "column_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__x86_64__) && defined(__GNUC__)
#define SUPERINFER_HAVE_VNNI_KERNEL 1
#include <immintrin.h>
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
// The tile configuration, barrier and permission of ``amx_tiles.h``.
#define SUPERINFER_HAVE_AMX_INT8_KERNEL SUPERINFER_HAVE_AMX_KERNEL
#define AMX_INT8_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#else
#define SUPERINFER_HAVE_VNNI_KERNEL 0
#define SUPERINFER_HAVE_AMX_INT8_KERNEL 0
#endif

namespace {

constexpr int64_t kBlockColumns = 64;  // the storage block's width
constexpr int64_t kGranule = 16;       // columns per register (16 int32 lanes)
constexpr int64_t kMaxRows = 6;        // rows per register tile: 6 x 4 accumulators
// From this many rows the AMX tiles take the 64-column blocks (where the CPU has them).
constexpr int64_t kAmxRows = 8;
constexpr int64_t kAmxK = 64;          // k per ``tdpbsud``; x's rows are padded to it
constexpr int64_t kQuantizeChunk = 16;  // rows per worker task when x is quantized

#if SUPERINFER_HAVE_VNNI_KERNEL

bool VnniCpuSupported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// AMX-INT8 (``amx_tiles.h``'s check, CPUID leaf 7 EDX bit 25) with the tile state granted;
// ``SUPERINFER_NATIVE_AMX=0`` keeps every call on the register tiles (the same bits either
// way, so no opt-in is needed).
bool AmxInt8Supported() {
#if SUPERINFER_HAVE_AMX_INT8_KERNEL
  static const bool supported = [] {
    const char* env = std::getenv("SUPERINFER_NATIVE_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    return VnniCpuSupported() && superinfer::amx::CpuHasAmx(25);
  }();
  return supported;
#else
  return false;
#endif
}

// 16 elements of row m of x from k (``mask``'s lanes, zeros elsewhere) as float32.
template <bool kBf16>
VNNI_TARGET inline __m512 LoadRow(const void* x, int64_t K, int64_t m, int64_t k,
                                  __mmask16 mask) {
  if constexpr (kBf16) {
    const auto* p = static_cast<const uint16_t*>(x) + m * K + k;
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(x) + m * K + k);
  }
}

// ``v`` (16 consecutive k, the first a multiple of 16) after one Hadamard stage h < 16:
// lanes with bit h clear get a + c, lanes with it set a - c, (a, c) the pair h apart.
VNNI_TARGET inline __m512 InVectorStage(__m512 v, int h) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lanes, _mm512_set1_epi32(h)), v);
  const __mmask16 upper =
      _mm512_test_epi32_mask(lanes, _mm512_set1_epi32(h));  // bit h set: this is c
  return _mm512_mask_sub_ps(_mm512_add_ps(v, partner), upper, partner, v);
}

// ``row`` [K] rotated in place: the Hadamard stages h = 1, 2, ... < block (header).
VNNI_TARGET void Rotate(float* row, int64_t K, int64_t block) {
  if (K % 16) {  // plain stages, the same operations
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t g = 0; g < K; g += 2 * h)
        for (int64_t j = g; j < g + h; ++j) {
          const float a = row[j], c = row[j + h];
          row[j] = a + c;
          row[j + h] = a - c;
        }
    return;
  }
  const int64_t inner = std::min<int64_t>(block, 16);
  for (int64_t k = 0; k < K && inner > 1; k += 16) {
    __m512 v = _mm512_loadu_ps(row + k);
    for (int h = 1; h < inner; h *= 2) v = InVectorStage(v, h);
    _mm512_storeu_ps(row + k, v);
  }
  for (int64_t h = 16; h < block; h *= 2)
    for (int64_t g = 0; g < K; g += 2 * h)
      for (int64_t j = g; j < g + h; j += 16) {
        const __m512 a = _mm512_loadu_ps(row + j), c = _mm512_loadu_ps(row + j + h);
        _mm512_storeu_ps(row + j, _mm512_add_ps(a, c));
        _mm512_storeu_ps(row + j + h, _mm512_sub_ps(a, c));
      }
}

// float32 (or bfloat16) rows -> rotated int8 rows per the header's rule, zero-padded to
// ``ldq``; ``scale[m]`` the row's s_x and ``sum[m]`` its sum of q.
template <bool kBf16>
VNNI_TARGET void QuantizeRows(const void* x, int64_t M, int64_t K, int64_t block, int8_t* q,
                              int64_t ldq, float* scale, int32_t* sum) {
  std::vector<float> row(K + 16);
  const float kInv127 = static_cast<float>(1.0 / 127.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      _mm512_mask_storeu_ps(row.data() + k, mask, LoadRow<kBf16>(x, K, m, k, mask));
    }
    if (block > 1) Rotate(row.data(), K, block);
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, row.data() + k)));
    }
    const float a = _mm512_reduce_max_ps(amax);
    const float s = a > 0 ? a * kInv127 : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    __m512i total = _mm512_setzero_si512();
    int8_t* out = q + m * ldq;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 r = _mm512_roundscale_ps(
          _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row.data() + k), inv),
          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512i v = _mm512_cvtps_epi32(r);
      v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      v = _mm512_maskz_mov_epi32(mask, v);
      total = _mm512_add_epi32(total, v);
      _mm_mask_storeu_epi8(out + k, mask, _mm512_cvtepi32_epi8(v));
    }
    std::memset(out + K, 0, ldq - K);
    scale[m] = s;
    sum[m] = _mm512_reduce_add_epi32(total);
  }
}

// out = (float(acc - 128 * row_sum) * s_x) * s_w for one row's 16 columns (``mask``).
VNNI_TARGET inline void Finish(__m512i acc, int32_t row_sum, float row_scale, const float* s_w,
                               float* out, __mmask16 mask) {
  const __m512i exact = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * row_sum));
  const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(row_scale));
  _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(f, _mm512_maskz_loadu_ps(mask, s_w)));
}

struct W8a8Job : superinfer::ColumnSplit {
  std::vector<int8_t> xq;  // [rows padded to 16, ldq] int8
  int64_t ldq = 0;
  std::vector<float> x_scale;
  std::vector<int32_t> x_sum;
  const uint8_t* w[superinfer::kMaxSplitWeights] = {};
  const float* w_scale[superinfer::kMaxSplitWeights] = {};
  bool amx = false;

  // Rows [m0, m0 + R) x ``granules`` 16-column slices of one block (``wb``: its column c0's
  // first group, ``ldw`` bytes per group of four k), the last slice ``last_mask``'s lanes.
  template <int R, int G>
  VNNI_TARGET void Tile(int64_t m0, const uint8_t* wb, int64_t ldw, __mmask16 last_mask,
                        const float* s_w, float* o, int64_t ldo) const {
    __m512i acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_si512();
    const int8_t* xr = xq.data() + m0 * ldq;
    const int64_t groups = K / 4;
    for (int64_t k4 = 0; k4 < groups; ++k4, wb += ldw) {
      __m512i b[G];
      for (int g = 0; g < G; ++g)
        b[g] = g + 1 < G ? _mm512_loadu_si512(wb + 64 * g)
                         : _mm512_maskz_loadu_epi32(last_mask, wb + 64 * g);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xr + r * ldq + 4 * k4, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], b[g], a);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        Finish(acc[r][g], x_sum[m0 + r], x_scale[m0 + r], s_w + 16 * g,
               o + (m0 + r) * ldo + 16 * g, g + 1 < G ? 0xFFFF : last_mask);
  }

  template <int G>
  VNNI_TARGET void Rows(int64_t m0, int64_t rows, const uint8_t* wb, int64_t ldw,
                        __mmask16 last_mask, const float* s_w, float* o, int64_t ldo) const {
    switch (rows) {
      case 1: return Tile<1, G>(m0, wb, ldw, last_mask, s_w, o, ldo);
      case 2: return Tile<2, G>(m0, wb, ldw, last_mask, s_w, o, ldo);
      case 3: return Tile<3, G>(m0, wb, ldw, last_mask, s_w, o, ldo);
      case 4: return Tile<4, G>(m0, wb, ldw, last_mask, s_w, o, ldo);
      case 5: return Tile<5, G>(m0, wb, ldw, last_mask, s_w, o, ldo);
      default: return Tile<6, G>(m0, wb, ldw, last_mask, s_w, o, ldo);
    }
  }

  // Local columns [c0, c1) of one storage block, every row, on the register tiles.
  VNNI_TARGET void VnniColumns(const uint8_t* block, int64_t width, int64_t c0, int64_t c1,
                               const float* s_w, float* o, int64_t ldo) const {
    const int64_t ldw = 4 * width;
    const int64_t granules = (c1 - c0 + kGranule - 1) / kGranule;
    const int64_t tail = (c1 - c0) - (granules - 1) * kGranule;
    const __mmask16 last = tail == 16 ? 0xFFFF : static_cast<__mmask16>((1u << tail) - 1);
    const uint8_t* wb = block + 4 * c0;
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m);
      switch (granules) {
        case 1: Rows<1>(m, rows, wb, ldw, last, s_w + c0, o + c0, ldo); break;
        case 2: Rows<2>(m, rows, wb, ldw, last, s_w + c0, o + c0, ldo); break;
        case 3: Rows<3>(m, rows, wb, ldw, last, s_w + c0, o + c0, ldo); break;
        default: Rows<4>(m, rows, wb, ldw, last, s_w + c0, o + c0, ldo); break;
      }
    }
  }

#if SUPERINFER_HAVE_AMX_INT8_KERNEL
  // Local columns [c0, c0 + 16 G) of one block, every row, on the AMX tiles: tmm0-3 the
  // accumulators of G 16-column slices, tmm4 16 rows of x's 64 k, tmm5-6 B (16 groups of
  // four k by 16 columns). ``part`` receives the accumulators.
  template <int G>
  AMX_INT8_TARGET void AmxColumns(const uint8_t* block, int64_t width, int64_t c0,
                                  const float* s_w, float* o, int64_t ldo, int32_t* part) const {
    const int64_t ldw = 4 * width;
    const uint8_t* wb = block + 4 * c0;
    for (int64_t m = 0; m < M; m += 16) {
      _tile_zero(0);
      if constexpr (G > 1) _tile_zero(1);
      if constexpr (G > 2) _tile_zero(2);
      if constexpr (G > 3) _tile_zero(3);
      const int8_t* xr = xq.data() + m * ldq;
      const uint8_t* bk = wb;
      for (int64_t k = 0; k < K; k += kAmxK, bk += 16 * ldw) {
        _tile_loadd(4, xr + k, ldq);
        _tile_loadd(5, bk, ldw);
        _tile_dpbsud(0, 4, 5);
        if constexpr (G > 1) {
          _tile_loadd(6, bk + 64, ldw);
          _tile_dpbsud(1, 4, 6);
        }
        if constexpr (G > 2) {
          _tile_loadd(5, bk + 128, ldw);
          _tile_dpbsud(2, 4, 5);
        }
        if constexpr (G > 3) {
          _tile_loadd(6, bk + 192, ldw);
          _tile_dpbsud(3, 4, 6);
        }
      }
      _tile_stored(0, part, 64);
      if constexpr (G > 1) _tile_stored(1, part + 256, 64);
      if constexpr (G > 2) _tile_stored(2, part + 512, 64);
      if constexpr (G > 3) _tile_stored(3, part + 768, 64);
      superinfer::amx::CompilerBarrier();
      const int64_t rows = std::min<int64_t>(16, M - m);
      for (int g = 0; g < G; ++g)
        for (int64_t r = 0; r < rows; ++r)
          Finish(_mm512_loadu_si512(part + 256 * g + 16 * r), x_sum[m + r], x_scale[m + r],
                 s_w + c0 + 16 * g, o + (m + r) * ldo + c0 + 16 * g, 0xFFFF);
    }
  }

  AMX_INT8_TARGET static void Configure() {
    superinfer::amx::TileConfig cfg;
    for (int t = 0; t < 7; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    superinfer::amx::CompilerBarrier();
    _tile_loadconfig(&cfg);
  }

  AMX_INT8_TARGET static void Release() { _tile_release(); }
#endif

  // Local columns [c0, c1) of one block (``width`` columns stored at ``block``).
  VNNI_TARGET void Block(const uint8_t* block, int64_t width, int64_t c0, int64_t c1,
                         const float* s_w, float* o, int64_t ldo, int32_t* part,
                         bool& configured) const {
#if SUPERINFER_HAVE_AMX_INT8_KERNEL
    if (amx) {
      const int64_t whole = (c1 - c0) / kGranule;  // full 16-column slices
      if (whole > 0) {
        if (!configured) {
          Configure();
          configured = true;
        }
        switch (whole) {
          case 1: AmxColumns<1>(block, width, c0, s_w, o, ldo, part); break;
          case 2: AmxColumns<2>(block, width, c0, s_w, o, ldo, part); break;
          case 3: AmxColumns<3>(block, width, c0, s_w, o, ldo, part); break;
          default: AmxColumns<4>(block, width, c0, s_w, o, ldo, part); break;
        }
        c0 += kGranule * whole;
      }
      if (c0 >= c1) return;
    }
#endif
    VnniColumns(block, width, c0, c1, s_w, o, ldo);
  }

  VNNI_TARGET void Unit(int64_t u) const {
    alignas(64) int32_t part[4 * 256];
    bool configured = false;
    ForUnit(u, [&](int i, int64_t n0, int64_t n1) {
      for (int64_t b = n0 / kBlockColumns * kBlockColumns; b < n1; b += kBlockColumns) {
        const int64_t width = std::min(kBlockColumns, N[i] - b);
        Block(w[i] + b * K, width, std::max(n0, b) - b, std::min(n1, b + width) - b,
              w_scale[i] + b, out[i] + b, N[i], part, configured);
      }
    });
#if SUPERINFER_HAVE_AMX_INT8_KERNEL
    if (configured) Release();
#endif
  }
};

#endif  // SUPERINFER_HAVE_VNNI_KERNEL

ffi::Error W8a8MatmulImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::RemainingArgs args,
                          ffi::RemainingRets outs, int64_t rotation) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("w8a8_matmul: x must be [M, K]");
  if (args.size() % 2 || args.size() == 0 || args.size() > 2 * superinfer::kMaxSplitWeights ||
      args.size() / 2 != outs.size()) {
    return ffi::Error::InvalidArgument("w8a8_matmul: 1-4 (weight, scale) pairs, one output each");
  }
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (!bf16 && x.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("w8a8_matmul: x must be float32 or bfloat16");
  }
#if SUPERINFER_HAVE_VNNI_KERNEL
  static const bool supported = VnniCpuSupported();
  if (!supported) return ffi::Error::Internal("w8a8_matmul: this CPU lacks AVX512-VNNI");
  auto job = std::make_shared<W8a8Job>();
  job->M = xd[0];
  job->K = xd[1];
  if (job->K % 4) return ffi::Error::InvalidArgument("w8a8_matmul: K must be a multiple of 4");
  if (rotation < 1 || (rotation & (rotation - 1)) || job->K % rotation) {
    return ffi::Error::InvalidArgument("w8a8_matmul: rotation must be a power of two dividing K");
  }
  for (int i = 0; i < static_cast<int>(outs.size()); ++i) {
    auto w = args.get<ffi::Buffer<ffi::U8>>(2 * i);
    auto s = args.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto o = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !s.has_value() || !o.has_value()) {
      return ffi::Error::InvalidArgument(
          "w8a8_matmul: weights must be uint8, scales and outputs float32");
    }
    auto wd = w->dimensions();
    auto sd = s->dimensions();
    auto od = (*o)->dimensions();
    if (wd.size() != 2 || wd[0] != job->K || sd.size() != 1 || sd[0] != wd[1] ||
        od.size() != 2 || od[0] != job->M || od[1] != wd[1]) {
      return ffi::Error::InvalidArgument("w8a8_matmul: w must be [K, N], s [N], out [M, N]");
    }
    job->w[i] = w->typed_data();
    job->w_scale[i] = s->typed_data();
    job->Add(wd[1], (*o)->typed_data());
  }
  if (job->M == 0 || job->first_group[job->num_weights] == 0) return ffi::Error::Success();
  job->amx = job->M >= kAmxRows && job->K % kAmxK == 0 && AmxInt8Supported();
  job->ldq = (job->K + kAmxK - 1) / kAmxK * kAmxK;
  const int64_t padded_rows = (job->M + 15) / 16 * 16;  // whole AMX A tiles
  job->xq.assign(padded_rows * job->ldq, 0);
  job->x_scale.resize(job->M);
  job->x_sum.resize(job->M);
  // Rows are quantized in chunks over the same workers (each row on its own), then the
  // columns are split.
  const int64_t chunks = (job->M + kQuantizeChunk - 1) / kQuantizeChunk;
  auto* quantize = bf16 ? &QuantizeRows<true> : &QuantizeRows<false>;
  superinfer::RunChunks(thread_pool, chunks, superinfer::Workers(thread_pool), [&](int64_t c) {
    const int64_t m0 = c * kQuantizeChunk, rows = std::min(kQuantizeChunk, job->M - m0);
    const void* x0 = static_cast<const char*>(x.untyped_data()) +
                     m0 * job->K * (bf16 ? sizeof(uint16_t) : sizeof(float));
    quantize(x0, rows, job->K, rotation, job->xq.data() + m0 * job->ldq, job->ldq,
             job->x_scale.data() + m0, job->x_sum.data() + m0);
  });
  superinfer::RunColumnSplit(thread_pool, job);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("w8a8_matmul: built without the AVX512-VNNI kernel");
#endif
}

}  // namespace

// 1 where this CPU can run the kernel, else 0 (ctypes, before any program is traced).
extern "C" int SuperinferW8a8MatmulSupported() {
#if SUPERINFER_HAVE_VNNI_KERNEL
  return VnniCpuSupported() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 where calls of kAmxRows rows and more take the AMX-INT8 tiles (the same bits).
extern "C" int SuperinferW8a8UsesAmx() {
#if SUPERINFER_HAVE_VNNI_KERNEL
  return AmxInt8Supported() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferW8a8Matmul, W8a8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("rotation"));
