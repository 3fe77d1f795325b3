// bfloat16 x (int8 | fp8 e4m3) -> float32 matmul with per-output-channel scales, for
// XLA:CPU, as a typed XLA FFI custom call (weight-only quantization, W8A16).
//
// Why this exists: a decode step on CPU streams every weight once, so its floor is the
// weights' bytes over memory bandwidth; one-byte weights halve the bfloat16 step's bytes.
// XLA's dot would first convert the whole weight to a wider type on every step.
//
// How: each thread takes a contiguous range of output columns. The bfloat16 kernel's
// register tiles (``bf16_tiles.h``) read the one-byte weights and convert them to
// bfloat16 as they load them (exact: every int8 and every e4m3 value is a bfloat16);
// above a few rows, a panel of a few dozen to a few hundred columns is converted once
// into a per-thread scratch that every row block then reads from cache. Last, the
// outputs are multiplied by their columns' scales.
//
// Batch invariance, by construction: out[m, n] = (one float32 accumulator, updated by one
// ``vdpbf16ps`` per pair of k in increasing k) * scale[n]. Neither the panel width, the
// thread, nor M changes that, so a row's bits do not depend on the rows beside it.
//
//   x     [M, K] bf16 (or f32, rounded to bf16 in the call, as XLA's convert rounds)
//   w_i   [K, N_i] int8 or f8E4M3FN, 1 to 4 of them: row-major [in, out] (panel = 0), or
//         packed in panels of ``panel`` columns (a multiple of 32): panel p holds columns
//         [p * panel, p * panel + w_p), w_p = min(panel, N_i - p * panel), as its own
//         row-major [K, w_p] block at element offset p * panel * K. A tile then streams one
//         contiguous block instead of K short runs ``N_i`` apart, which the hardware
//         prefetchers follow (a decode step's weights are read once, so the run length
//         sets the bandwidth it gets).
//   s_i   [N_i] f32 (the dequantized weight is w_i * s_i, column by column)
//   out_i [M, N_i] f32
//
// With ``SUPERINFER_NATIVE_AMX=1`` on a CPU with AMX-BF16 every call takes the AMX tiles
// instead (``amx_tiles.h``): the weights are converted to bfloat16 the same way, a block
// of 16 k at a time below 17 rows, and the same guarantee holds (other bits).
//
// Only CPUs with AVX512-BF16 and AVX512-VBMI run it (``SuperinferQuantMatmulSupported``);
// callers fall back to XLA's dot of the dequantized weight elsewhere.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16_tiles.h"
#include "column_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxWeights = superinfer::kMaxSplitWeights;

// A panel's bfloat16 scratch stays within this many bytes (it is reread by every row
// block, so it should stay in the core's L2).
constexpr int64_t kScratchBytes = 192 * 1024;

// Up to this many rows, the tiles convert weights in registers (no scratch).
constexpr int64_t kDirectRows = 8;

enum class Kind { kInt8, kFp8 };

#if SUPERINFER_HAVE_BF16_KERNEL

namespace tiles = superinfer::tiles;

// Weight rows [0, K) of columns [c, c + cols) of ``w`` (rows ``ldw`` apart) -> scratch
// [K, ldp] bfloat16, through the format's own exact conversion (``bf16_tiles.h``).
template <class W>
BF16_TARGET void Convert(const typename W::T* w, int64_t K, int64_t ldw, int64_t c,
                         int64_t cols, uint16_t* scratch, int64_t ldp) {
  for (int64_t k = 0; k < K; ++k) {
    const typename W::T* src = w + k * ldw + c;
    if (k + tiles::kPrefetchRows < K) {
      const typename W::T* ahead = src + tiles::kPrefetchRows * ldw;
      for (int64_t j = 0; j < cols; j += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j), _MM_HINT_T0);
    }
    uint16_t* dst = scratch + k * ldp;
    int64_t j = 0;
    for (; j + 32 <= cols; j += 32) _mm512_storeu_si512(dst + j, W::Load(src + j));
    if (j < cols) {
      const __mmask32 tail = static_cast<__mmask32>((1ull << (cols - j)) - 1);
      _mm512_mask_storeu_epi16(dst + j, tail, W::LoadMasked(src + j, tail));
    }
  }
}

// out[m, c] *= scale[c] for columns [0, cols) of M rows.
BF16_TARGET void Scale(float* out, int64_t M, int64_t ldo, const float* scale, int64_t cols) {
  for (int64_t m = 0; m < M; ++m) {
    float* o = out + m * ldo;
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16)
      _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_loadu_ps(o + j), _mm512_loadu_ps(scale + j)));
    if (j < cols) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (cols - j)) - 1);
      _mm512_mask_storeu_ps(o + j, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, o + j),
                                                       _mm512_maskz_loadu_ps(mask, scale + j)));
    }
  }
}

struct QuantJob : superinfer::ColumnSplit {
  Kind kind;
  const void* w[kMaxWeights];
  const float* scale[kMaxWeights];
  int64_t panel;  // columns per converted panel, a multiple of 32
  int64_t packed = 0;  // the weights' storage panel (0: row-major), see the header

  // Columns [n0, n1) of weight i: of each storage block they touch, the block's own
  // columns (row-major weights are one block of N[i] columns).
  template <class W>
  BF16_TARGET void Columns(int i, int64_t n0, int64_t n1, uint16_t* scratch) const {
    const auto* wi = static_cast<const typename W::T*>(w[i]);
    if (packed == 0) {
      Block<W>(wi, N[i], 0, n0, n1, i, scratch);
      return;
    }
    for (int64_t b = n0 / packed * packed; b < n1; b += packed) {
      const int64_t width = std::min(packed, N[i] - b);
      Block<W>(wi + b * K, width, b, std::max(n0, b) - b, std::min(n1, b + width) - b, i,
               scratch);
    }
  }

  // Local columns [c0, c1) of a block: ``wb`` [K, ldw] row-major, its column 0 being
  // output column ``first``. Up to kDirectRows rows the tiles convert the weights as
  // they load them; more rows convert a panel into scratch once and every row block
  // reads it from cache. The tiles see the same bfloat16 values either way, so the bits
  // are the same.
  template <class W>
  BF16_TARGET void Block(const typename W::T* wb, int64_t ldw, int64_t first, int64_t c0,
                         int64_t c1, int i, uint16_t* scratch) const {
    float* o = out[i] + first;
    const float* s = scale[i] + first;
#if SUPERINFER_HAVE_AMX_KERNEL
    if (on_amx) {
      AmxBlock<W>(wb, ldw, c0, c1, o, s, N[i]);
      return;
    }
#endif
    if (M <= kDirectRows) {
      tiles::PanelForRows<W>(x, M, K, wb, ldw, o, N[i], c0, c1);
      Scale(o + c0, M, N[i], s + c0, c1 - c0);
      return;
    }
    for (int64_t c = c0; c < c1; c += panel) {
      const int64_t cols = std::min(panel, c1 - c);
      Convert<W>(wb, K, ldw, c, cols, scratch, panel);
      tiles::PanelForRows<tiles::Bf16Weights>(x, M, K, scratch, panel, o + c, N[i], 0, cols);
      Scale(o + c, M, N[i], s + c, cols);
    }
  }

#if SUPERINFER_HAVE_AMX_KERNEL
  template <class W>
  AMX_TARGET void AmxBlock(const typename W::T* wb, int64_t ldw, int64_t c0, int64_t c1,
                           float* o, const float* s, int64_t ldo) const {
    superinfer::amx::Panel<W>(spread, M, K, wb, ldw, o, ldo, c0, c1,
                              [&](int64_t c, int64_t cols) { Scale(o + c, M, ldo, s + c, cols); });
  }
#endif

  BF16_TARGET void Unit(int64_t u) const {
    thread_local std::vector<uint16_t> scratch;
    if (!on_amx && M > kDirectRows && static_cast<int64_t>(scratch.size()) < K * panel)
      scratch.resize(K * panel);
    ForUnit(u, [&](int i, int64_t n0, int64_t n1) {
      if (kind == Kind::kInt8) {
        Columns<tiles::Int8Weights>(i, n0, n1, scratch.data());
      } else {
        Columns<tiles::Fp8Weights>(i, n0, n1, scratch.data());
      }
    });
  }
};

#endif  // SUPERINFER_HAVE_BF16_KERNEL

// x [M, K] times each (w_i, s_i) pair, into out_i [M, N_i].
ffi::Error QuantMatmulImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x,
                           ffi::RemainingArgs args, ffi::RemainingRets outs, int64_t panel) {
  if (panel < 0 || panel % 32) {
    return ffi::Error::InvalidArgument("quant_matmul: panel must be 0 or a multiple of 32");
  }
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: x must be [M, K]");
  if (args.size() % 2 || args.size() == 0 || args.size() > 2 * kMaxWeights ||
      args.size() / 2 != outs.size()) {
    return ffi::Error::InvalidArgument("quant_matmul: 1-4 (weight, scale) pairs, one output each");
  }
#if SUPERINFER_HAVE_BF16_KERNEL
  static const bool supported = superinfer::Bf16CpuSupported();
  if (!supported) return ffi::Error::Internal("quant_matmul: this CPU lacks AVX512-BF16/VBMI");
  auto job = std::make_shared<QuantJob>();
  if (!job->SetRows(x)) {
    return ffi::Error::InvalidArgument("quant_matmul: x must be bfloat16 or float32 [M, K]");
  }
  for (int i = 0; i < static_cast<int>(outs.size()); ++i) {
    auto w = args.get<ffi::AnyBuffer>(2 * i);
    auto s = args.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto o = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !s.has_value() || !o.has_value()) {
      return ffi::Error::InvalidArgument("quant_matmul: scales and outputs must be float32");
    }
    const ffi::DataType type = w->element_type();
    const Kind kind = type == ffi::DataType::S8 ? Kind::kInt8 : Kind::kFp8;
    if (type != ffi::DataType::S8 && type != ffi::DataType::F8E4M3FN) {
      return ffi::Error::InvalidArgument("quant_matmul: weights must be int8 or f8E4M3FN");
    }
    if (i > 0 && kind != job->kind) {
      return ffi::Error::InvalidArgument("quant_matmul: weights of one call share a type");
    }
    job->kind = kind;
    auto wd = w->dimensions();
    auto sd = s->dimensions();
    auto od = (*o)->dimensions();
    if (wd.size() != 2 || wd[0] != job->K || sd.size() != 1 || sd[0] != wd[1] ||
        od.size() != 2 || od[0] != job->M || od[1] != wd[1]) {
      return ffi::Error::InvalidArgument("quant_matmul: w must be [K, N], s [N], out [M, N]");
    }
    job->w[i] = w->untyped_data();
    job->scale[i] = s->typed_data();
    job->Add(wd[1], (*o)->typed_data());
  }
  job->packed = panel;
  if (job->K > 0)
    job->panel = 32 * std::clamp<int64_t>(kScratchBytes / (2 * job->K) / 32, 1, 8);
  superinfer::RunColumnSplit(thread_pool, job);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("quant_matmul: built without the AVX512-BF16 kernel");
#endif
}

}  // namespace

// 1 where this CPU can run the kernel, else 0 (ctypes, before any program is traced).
extern "C" int SuperinferQuantMatmulSupported() { return superinfer::Bf16CpuSupported() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("panel"));
