// bfloat16 x bfloat16 -> float32 matmul for XLA:CPU, as a typed XLA FFI custom call.
//
// Why this exists: a bfloat16 decode step on CPU streams every weight once per step, so
// its floor is the weights' bytes over memory bandwidth. XLA's bfloat16 dot at one or two
// rows ran the SmolLM2 step's 269 MB of weight matmuls in 23-26 ms on this project's
// 2-core box, against 11 ms to read the same bytes (about 2.2x): most of the bfloat16
// batch-1 step. This kernel streams the weight in wide column panels with AVX512-BF16
// ``vdpbf16ps`` and splits the columns over the caller and XLA's intra-op threads.
//
// Batch invariance, by construction: every output element out[m, n] is one float32
// accumulator, zeroed, then updated by one ``vdpbf16ps`` per pair of k (0-1, 2-3, ...)
// in increasing k, in one lane. Which row block, column panel, thread or tile shape
// computed it changes nothing, so a row's result is bit-identical whatever M is (decode
// batch size, prefill chunk, padding) and whatever the thread count. Mixing this kernel
// with XLA's dot for some M would break that, so where it is used it is used for every M.
//
//   x   [M, K] bf16     w_i [K, N_i] bf16 (row-major, as the checkpoint stores [in, out]),
//                       1 to 4 of them (a layer's q, k, v in one call)
//   out_i [M, N_i] f32
//
// Only CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later) run it:
// ``SuperinferBf16MatmulSupported`` says whether this one does, and callers fall back to
// XLA's dot where it does not. The functions are compiled for that ISA by attribute, so
// the library itself builds and loads on any x86-64 (and elsewhere, without them).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__x86_64__) && defined(__GNUC__)
#define SUPERINFER_HAVE_BF16_KERNEL 1
#include <immintrin.h>
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define SUPERINFER_HAVE_BF16_KERNEL 0
#endif

namespace {

// Up to this many weights share one call (a layer's q, k and v; gate and up).
constexpr int kMaxWeights = 4;

#if SUPERINFER_HAVE_BF16_KERNEL

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

struct MatmulJob {
  const uint16_t* x;
  int64_t M, K;
  int num_weights;
  const uint16_t* w[kMaxWeights];
  float* out[kMaxWeights];
  int64_t N[kMaxWeights];
  int64_t first_group[kMaxWeights + 1];  // the weights' 32-column groups, end to end
  int64_t num_units;                     // contiguous, balanced ranges of those groups

  // Columns [n0, n1) of weight i. The tile shape by rows: wide for few rows (the weight
  // streams in long runs, the bandwidth-bound decode), tall for many (each weight load
  // feeds more rows).
  BF16_TARGET void Columns(int i, int64_t n0, int64_t n1) const {
    if (M == 1) {
      Panel<1, 8>(x, M, K, w[i], N[i], out[i], n0, n1);
    } else if (M <= 3) {
      Panel<2, 4>(x, M, K, w[i], N[i], out[i], n0, n1);
    } else if (M <= 7) {
      Panel<4, 2>(x, M, K, w[i], N[i], out[i], n0, n1);
    } else {
      Panel<8, 1>(x, M, K, w[i], N[i], out[i], n0, n1);
    }
  }

  // Unit u: groups [g0, g1) of all weights' groups end to end, weight by weight.
  BF16_TARGET void Unit(int64_t u) const {
    const int64_t total = first_group[num_weights];
    const int64_t g0 = u * total / num_units, g1 = (u + 1) * total / num_units;
    for (int i = 0; i < num_weights; ++i) {
      const int64_t lo = std::max(g0, first_group[i]), hi = std::min(g1, first_group[i + 1]);
      if (lo < hi) {
        Columns(i, 32 * (lo - first_group[i]), std::min(N[i], 32 * (hi - first_group[i])));
      }
    }
  }
};

#endif  // SUPERINFER_HAVE_BF16_KERNEL

bool CpuSupported() {
#if SUPERINFER_HAVE_BF16_KERNEL
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// x [M, K] times each of the weights w_i [K, N_i], into out_i [M, N_i]: one call for the
// weights that read the same x, so the threads split all their columns at once (one wait
// instead of one per weight, and small weights no longer run on half the threads).
ffi::Error Bf16MatmulImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::BF16> x,
                          ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("bf16_matmul: x must be [M, K]");
  if (weights.size() == 0 || weights.size() > kMaxWeights || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument("bf16_matmul: 1-4 weights, one output each");
  }
#if SUPERINFER_HAVE_BF16_KERNEL
  static const bool supported = CpuSupported();
  if (!supported) return ffi::Error::Internal("bf16_matmul: this CPU lacks AVX512-BF16");
  auto job = std::make_shared<MatmulJob>();
  job->x = reinterpret_cast<const uint16_t*>(x.typed_data());
  job->M = xd[0];
  job->K = xd[1];
  job->num_weights = static_cast<int>(weights.size());
  job->first_group[0] = 0;
  for (int i = 0; i < job->num_weights; ++i) {
    auto w = weights.get<ffi::Buffer<ffi::BF16>>(i);
    auto o = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !o.has_value()) {
      return ffi::Error::InvalidArgument("bf16_matmul: weights must be bfloat16, outputs float32");
    }
    auto wd = w->dimensions();
    auto od = (*o)->dimensions();
    if (wd.size() != 2 || wd[0] != job->K || od.size() != 2 || od[0] != job->M ||
        od[1] != wd[1]) {
      return ffi::Error::InvalidArgument("bf16_matmul: w must be [K, N] and out [M, N]");
    }
    job->w[i] = reinterpret_cast<const uint16_t*>(w->typed_data());
    job->out[i] = (*o)->typed_data();
    job->N[i] = wd[1];
    job->first_group[i + 1] = job->first_group[i] + (wd[1] + 31) / 32;
  }
  const int64_t total = job->first_group[job->num_weights];
  if (job->M == 0 || total == 0) return ffi::Error::Success();
  if (job->K == 0) {
    for (int i = 0; i < job->num_weights; ++i)
      std::memset(job->out[i], 0, sizeof(float) * job->M * job->N[i]);
    return ffi::Error::Success();
  }
  // One unit per worker (the caller plus XLA's intra-op threads): equal column ranges.
  const int64_t workers = superinfer::Workers(thread_pool);
  job->num_units = std::min(total, workers);
  superinfer::RunChunks(thread_pool, job->num_units, workers, [job](int64_t u) { job->Unit(u); });
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("bf16_matmul: built without the AVX512-BF16 kernel");
#endif
}

}  // namespace

// 1 where this CPU can run the kernel, else 0 (ctypes, before any program is traced).
extern "C" int SuperinferBf16MatmulSupported() { return CpuSupported() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());
