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
//   x   [M, K] bf16 (or f32, rounded to bf16 in the call, as XLA's convert rounds)
//                       w_i [K, N_i] bf16 (row-major, as the checkpoint stores [in, out]),
//                       1 to 4 of them (a layer's q, k, v in one call)
//   out_i [M, N_i] f32
//
// With ``SUPERINFER_NATIVE_AMX=1`` on a CPU with AMX-BF16 (Sapphire Rapids and later)
// every call takes the AMX tiles instead (``amx_tiles.h``: the same guarantee, other bits),
// for every M.
//
// Only CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later) run it:
// ``SuperinferBf16MatmulSupported`` says whether this one does, and callers fall back to
// XLA's dot where it does not. The functions are compiled for that ISA by attribute, so
// the library itself builds and loads on any x86-64 (and elsewhere, without them).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "bf16_tiles.h"
#include "column_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxWeights = superinfer::kMaxSplitWeights;

#if SUPERINFER_HAVE_BF16_KERNEL

struct MatmulJob : superinfer::ColumnSplit {
  const uint16_t* w[kMaxWeights];

  // Unit u's columns (tile shapes: ``tiles::PanelForRows``, or the AMX tiles).
  BF16_TARGET void Unit(int64_t u) const {
#if SUPERINFER_HAVE_AMX_KERNEL
    if (on_amx) {
      ForUnit(u, [this](int i, int64_t n0, int64_t n1) { AmxColumns(i, n0, n1); });
      return;
    }
#endif
    ForUnit(u, [this](int i, int64_t n0, int64_t n1) { Columns(i, n0, n1); });
  }

#if SUPERINFER_HAVE_AMX_KERNEL
  AMX_TARGET void AmxColumns(int i, int64_t n0, int64_t n1) const {
    superinfer::amx::Panel<superinfer::tiles::Bf16Weights>(
        spread, M, K, w[i], N[i], out[i], N[i], n0, n1, [](int64_t, int64_t) {});
  }
#endif

  BF16_TARGET void Columns(int i, int64_t n0, int64_t n1) const {
    superinfer::tiles::PanelForRows<superinfer::tiles::Bf16Weights>(x, M, K, w[i], N[i], out[i],
                                                                   N[i], n0, n1);
  }
};

#endif  // SUPERINFER_HAVE_BF16_KERNEL

bool CpuSupported() { return superinfer::Bf16CpuSupported(); }

// x [M, K] times each of the weights w_i [K, N_i], into out_i [M, N_i]: one call for the
// weights that read the same x, so the threads split all their columns at once (one wait
// instead of one per weight, and small weights no longer run on half the threads).
ffi::Error Bf16MatmulImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x,
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
  if (!job->SetRows(x)) {
    return ffi::Error::InvalidArgument("bf16_matmul: x must be bfloat16 or float32 [M, K]");
  }
  for (int i = 0; i < static_cast<int>(weights.size()); ++i) {
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
    job->Add(wd[1], (*o)->typed_data());
  }
  superinfer::RunColumnSplit(thread_pool, job);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("bf16_matmul: built without the AVX512-BF16 kernel");
#endif
}

}  // namespace

// 1 where this CPU can run the kernel, else 0 (ctypes, before any program is traced).
extern "C" int SuperinferBf16MatmulSupported() { return CpuSupported() ? 1 : 0; }

// 1 where the matmuls (bfloat16, int8, fp8) take the AMX tiles in this process, else 0.
extern "C" int SuperinferMatmulUsesAmx() { return superinfer::amx::Supported() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());
