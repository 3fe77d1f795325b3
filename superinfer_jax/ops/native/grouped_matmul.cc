// Grouped matmul for mixture-of-experts layers on XLA:CPU, as a typed XLA FFI custom call.
//
// Why this exists: ``jax.lax.ragged_dot`` on XLA:CPU masks the rows into a dense
// [groups, M, K] operand and multiplies every group's weight, so a MoE decode step reads
// and multiplies every expert although a batch routes its rows to a few. This kernel walks
// the groups that have rows and streams only their weights, each once per call, the
// columns of all of them split over the caller and XLA's intra-op threads.
//
//   lhs [M, K]       rows sorted by group: group g owns the group_sizes[g] rows after
//                    those of groups < g (ragged_dot's contract)
//   rhs [G, K, N]    one [K, N] weight per group, the same dtype as lhs
//   group_sizes [G]  int32; a negative size counts as 0, and rows past M are dropped
//   out [M, N] f32   rows past sum(group_sizes) are zeros
//
// bfloat16 operands go through the AVX512-BF16 tiles of ``bf16_tiles.h``, float32 through
// the AVX-512F tiles below. Batch invariance, by construction, both ways: every output
// element is one float32 accumulator, zeroed, then updated in increasing k (one
// ``vdpbf16ps`` per pair of k; one fused multiply-add per k) in one lane, whatever the tile
// shape, the group's row count, the other groups or the thread. So a row's bits depend
// only on its own values and its group's weight, never on which rows share the call.
//
// ``SuperinferGroupedMatmulSupported(dtype)`` says whether this CPU runs the kernel for a
// dtype (0 bfloat16, 1 float32); callers take XLA where it does not.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16_tiles.h"
#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if SUPERINFER_HAVE_BF16_KERNEL
#define F32_TARGET __attribute__((target("avx512f")))
#endif

namespace {

#if SUPERINFER_HAVE_BF16_KERNEL

// float32 tiles: MR rows x NG groups of 16 columns, accumulators in registers for the
// whole k loop; ``last_valid`` columns of the last group exist (1-16).
constexpr int64_t kPrefetchRowsF32 = 8;

template <int MR, int NG, bool kMasked>
F32_TARGET void TileF32(const float* x, int64_t K, const float* w, int64_t N, float* out,
                        int64_t n0, int64_t last_valid) {
  __m512 acc[MR][NG];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  const __mmask16 tail =
      last_valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << last_valid) - 1);
  const float* r = w + n0;
  for (int64_t k = 0; k < K; ++k, r += N) {
    if (k + kPrefetchRowsF32 < K) {  // pieces of rows N apart: ask for them a few k ahead
      const float* ahead = r + kPrefetchRowsF32 * N;
      for (int g = 0; g < NG; ++g)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * g), _MM_HINT_T0);
    }
    __m512 wv[NG];
    for (int g = 0; g < NG; ++g) {
      wv[g] = (kMasked && g == NG - 1) ? _mm512_maskz_loadu_ps(tail, r + 16 * g)
                                       : _mm512_loadu_ps(r + 16 * g);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
      for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_fmadd_ps(a, wv[g], acc[m][g]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int g = 0; g < NG; ++g) {
      float* o = out + m * N + n0 + 16 * g;
      if (kMasked && g == NG - 1) {
        _mm512_mask_storeu_ps(o, tail, acc[m][g]);
      } else {
        _mm512_storeu_ps(o, acc[m][g]);
      }
    }
  }
}

// Rows [0, M) of one column tile: blocks of MR rows, then MR / 2, ..., down to one.
template <int MR, int NG>
F32_TARGET void RowsF32(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                        float* out, int64_t n0, int64_t last_valid) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    if (last_valid >= 16) {
      TileF32<MR, NG, false>(x + m * K, K, w, N, out + m * N, n0, 16);
    } else {
      TileF32<MR, NG, true>(x + m * K, K, w, N, out + m * N, n0, last_valid);
    }
  }
  if constexpr (MR > 1) {
    if (m < M) RowsF32<MR / 2, NG>(x + m * K, M - m, K, w, N, out + m * N, n0, last_valid);
  }
}

// Columns [n0, n1) of every row in tiles of NG groups of 16; a narrower rest one group at
// a time, so only the very last group of the weight is masked.
template <int MR, int NG>
F32_TARGET void PanelF32(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                         float* out, int64_t n0, int64_t n1) {
  int64_t c = n0;
  for (; c + 16 * NG <= n1; c += 16 * NG) RowsF32<MR, NG>(x, M, K, w, N, out, c, 16);
  for (; c < n1; c += 16) RowsF32<MR, 1>(x, M, K, w, N, out, c, std::min<int64_t>(16, n1 - c));
}

F32_TARGET void ColumnsF32(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                           float* out, int64_t n0, int64_t n1) {
  if (M == 1) {
    PanelF32<1, 8>(x, M, K, w, N, out, n0, n1);
  } else if (M <= 3) {
    PanelF32<2, 4>(x, M, K, w, N, out, n0, n1);
  } else if (M <= 7) {
    PanelF32<4, 4>(x, M, K, w, N, out, n0, n1);
  } else {
    PanelF32<8, 2>(x, M, K, w, N, out, n0, n1);
  }
}

// A weight read costs about as much as this many rows' multiplies on it: the work of a
// group's column range is (rows + kWeightCost) per 32 columns, and the threads split the
// summed work of all groups into equal, contiguous ranges.
constexpr int64_t kWeightCost = 8;

struct Group {
  int64_t row0, rows, index;
};

struct GroupedJob {
  bool bf16;
  const void* x;
  const void* w;
  float* out;
  int64_t K, N, column_groups;  // column_groups: the weights' 32-column groups
  std::vector<Group> groups;    // the groups with rows, in order
  std::vector<int64_t> first_cost;  // each group's work before it, end to end
  int64_t num_units;

  int64_t Cost(size_t i) const { return groups[i].rows + kWeightCost; }

  void Columns(const Group& g, int64_t n0, int64_t n1) const {
    const size_t elem = bf16 ? 2 : 4;
    const char* x0 = static_cast<const char*>(x) + elem * g.row0 * K;
    const char* w0 = static_cast<const char*>(w) + elem * g.index * K * N;
    float* o = out + g.row0 * N;
    if (bf16) {
      superinfer::tiles::PanelForRows<superinfer::tiles::Bf16Weights>(
          reinterpret_cast<const uint16_t*>(x0), g.rows, K,
          reinterpret_cast<const uint16_t*>(w0), N, o, N, n0, n1);
    } else {
      ColumnsF32(reinterpret_cast<const float*>(x0), g.rows, K,
                 reinterpret_cast<const float*>(w0), N, o, n0, n1);
    }
  }

  // Unit u: the work in [a, b) of the total; a 32-column group belongs to the unit its
  // work starts in.
  void Unit(int64_t u) const {
    const int64_t total = first_cost.back();
    const int64_t a = u * total / num_units, b = (u + 1) * total / num_units;
    auto first_at_or_after = [&](size_t i, int64_t v) -> int64_t {
      if (v <= first_cost[i]) return 0;
      return std::min(column_groups, (v - first_cost[i] + Cost(i) - 1) / Cost(i));
    };
    for (size_t i = 0; i < groups.size(); ++i) {
      const int64_t lo = first_at_or_after(i, a), hi = first_at_or_after(i, b);
      if (lo < hi) Columns(groups[i], 32 * lo, std::min(N, 32 * hi));
    }
  }
};

#endif  // SUPERINFER_HAVE_BF16_KERNEL

bool CpuSupported(bool bf16) {
#if SUPERINFER_HAVE_BF16_KERNEL
  if (bf16) return superinfer::Bf16CpuSupported();  // the shared tiles' own check
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  (void)bf16;
  return false;
#endif
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                             ffi::Buffer<ffi::S32> group_sizes,
                             ffi::ResultBuffer<ffi::F32> out) {
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  auto od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 3 || rd[1] != ld[1] || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] != rd[0] || od.size() != 2 || od[0] != ld[0] ||
      od[1] != rd[2]) {
    return ffi::Error::InvalidArgument(
        "grouped_matmul: lhs [M, K], rhs [G, K, N], group_sizes [G], out [M, N]");
  }
  const auto dtype = lhs.element_type();
  if (rhs.element_type() != dtype || (dtype != ffi::BF16 && dtype != ffi::F32)) {
    return ffi::Error::InvalidArgument(
        "grouped_matmul: lhs and rhs must both be bfloat16 or both float32");
  }
#if SUPERINFER_HAVE_BF16_KERNEL
  const bool bf16 = dtype == ffi::BF16;
  static const bool supported_bf16 = CpuSupported(true), supported_f32 = CpuSupported(false);
  if (!(bf16 ? supported_bf16 : supported_f32)) {
    return ffi::Error::Internal("grouped_matmul: this CPU lacks the AVX-512 kernel");
  }
  auto job = std::make_shared<GroupedJob>();
  job->bf16 = bf16;
  job->x = lhs.untyped_data();
  job->w = rhs.untyped_data();
  job->out = out->typed_data();
  const int64_t M = ld[0], G = rd[0];
  job->K = ld[1];
  job->N = rd[2];
  job->column_groups = (job->N + 31) / 32;
  const int32_t* sizes = group_sizes.typed_data();
  int64_t row = 0;
  job->first_cost.push_back(0);
  for (int64_t g = 0; g < G && row < M; ++g) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(sizes[g], 0), M - row);
    if (rows == 0) continue;
    job->groups.push_back({row, rows, g});
    job->first_cost.push_back(job->first_cost.back() + job->column_groups * job->Cost(job->groups.size() - 1));
    row += rows;
  }
  if (row < M) std::memset(job->out + row * job->N, 0, sizeof(float) * (M - row) * job->N);
  if (job->groups.empty() || job->N == 0) return ffi::Error::Success();
  if (job->K == 0) {
    std::memset(job->out, 0, sizeof(float) * row * job->N);
    return ffi::Error::Success();
  }
  const int64_t workers = superinfer::Workers(thread_pool);
  job->num_units = std::min<int64_t>(job->column_groups * job->groups.size(), workers);
  superinfer::RunChunks(thread_pool, job->num_units, workers, [job](int64_t u) { job->Unit(u); });
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("grouped_matmul: built without the AVX-512 kernel");
#endif
}

}  // namespace

// 1 where this CPU can run the kernel for ``dtype`` (0 bfloat16, 1 float32), else 0.
extern "C" int SuperinferGroupedMatmulSupported(int dtype) {
  return CpuSupported(dtype == 0) ? 1 : 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
