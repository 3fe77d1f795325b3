// The column split and the dispatch that ``bf16_matmul.cc`` and ``quant_matmul.cc``
// share: 1-4 weights that read the same x [M, K] (bfloat16, or float32 rounded to it in
// the call), each into its own out_i [M, N_i].
//
// Their output columns are cut into 32-column groups, end to end over the weights, and
// the groups into one contiguous, balanced range per worker (the caller plus XLA's
// intra-op threads): one wait per call however many weights, and a small weight never
// runs on part of the threads only. Which worker computes a column changes none of its
// bits (each kernel's own guarantee), so the split is free to follow the thread count.

#ifndef SUPERINFER_NATIVE_COLUMN_SPLIT_H_
#define SUPERINFER_NATIVE_COLUMN_SPLIT_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "bf16_tiles.h"
#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace superinfer {

// Up to this many weights share one call (a layer's q, k and v; gate and up).
constexpr int kMaxSplitWeights = 4;

struct ColumnSplit {
  const uint16_t* x = nullptr;  // [M, K] bfloat16: the operand's, or ``x_bf16``'s
  std::vector<uint16_t> x_bf16;  // a float32 operand rounded to bfloat16 (``SetRows``)
  int64_t M = 0, K = 0;
  int num_weights = 0;
  float* out[kMaxSplitWeights] = {};
  int64_t N[kMaxSplitWeights] = {};
  int64_t first_group[kMaxSplitWeights + 1] = {};  // the weights' groups, end to end
  int64_t num_units = 0;
  // Whether this process's calls take the AMX tiles (``amx_tiles.h``), and x as they read it.
  bool on_amx = false;
#if SUPERINFER_HAVE_AMX_KERNEL
  amx::SpreadRows spread;
#endif

#if SUPERINFER_HAVE_BF16_KERNEL
  // x [M, K], bfloat16 or float32 (rounded here, once for every weight), and spread for
  // the AMX tiles where they run; false for any other operand.
  BF16_TARGET bool SetRows(const xla::ffi::AnyBuffer& operand) {
    auto d = operand.dimensions();
    if (d.size() != 2) return false;
    M = d[0];
    K = d[1];
    if (operand.element_type() == xla::ffi::DataType::BF16) {
      x = static_cast<const uint16_t*>(operand.untyped_data());
    } else if (operand.element_type() == xla::ffi::DataType::F32) {
      x_bf16.resize(M * K);
      ToBf16(static_cast<const float*>(operand.untyped_data()), M * K, x_bf16.data());
      x = x_bf16.data();
    } else {
      return false;
    }
#if SUPERINFER_HAVE_AMX_KERNEL
    static const bool amx_here = amx::Supported();
    on_amx = amx_here;
    if (on_amx) spread.Set(x, M, K);
#endif
    return true;
  }
#endif

  // Weight i (the next one) has N columns, written to ``o``.
  void Add(int64_t n, float* o) {
    N[num_weights] = n;
    out[num_weights] = o;
    first_group[num_weights + 1] = first_group[num_weights] + (n + 31) / 32;
    ++num_weights;
  }

  // ``body(i, n0, n1)`` for each weight i's columns [n0, n1) in unit u's range.
  template <class Body>
  void ForUnit(int64_t u, Body body) const {
    const int64_t total = first_group[num_weights];
    const int64_t g0 = u * total / num_units, g1 = (u + 1) * total / num_units;
    for (int i = 0; i < num_weights; ++i) {
      const int64_t lo = std::max(g0, first_group[i]), hi = std::min(g1, first_group[i + 1]);
      if (lo < hi) body(i, 32 * (lo - first_group[i]), std::min(N[i], 32 * (hi - first_group[i])));
    }
  }
};

// Runs ``job->Unit(u)`` for every worker's range (``Job`` derives from ColumnSplit, its
// weights added): nothing for M = 0 or no columns; zeros for K = 0.
template <class Job>
void RunColumnSplit(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job) {
  const int64_t total = job->first_group[job->num_weights];
  if (job->M == 0 || total == 0) return;
  if (job->K == 0) {
    for (int i = 0; i < job->num_weights; ++i)
      std::memset(job->out[i], 0, sizeof(float) * job->M * job->N[i]);
    return;
  }
  const int64_t workers = Workers(pool);
  job->num_units = std::min(total, workers);
  RunChunks(pool, job->num_units, workers, [job](int64_t u) { job->Unit(u); });
}

}  // namespace superinfer

#endif  // SUPERINFER_NATIVE_COLUMN_SPLIT_H_
