// Decode attention (one query token per row) straight from the paged KV pool on XLA:CPU,
// as a typed XLA FFI custom call.
//
// Why this exists: XLA:CPU runs the paged attention as a loop over blocks of pages per
// layer: a page gather (``kv_gather.cc``), two batched dots, masks and the online softmax,
// a dozen thunks per block, every row padded to the longest context. At batch 32 (SmolLM2,
// contexts 128-256) that was about a third of a float32 decode step; at batch 1 it is
// mostly per-thunk overhead. Here each (row, KV head) reads its pages' keys and values once,
// in storage order, only up to its own context, and keeps the softmax state in registers.
//
//   q     [B, H, D] f32 (H = K * G query heads, G per KV head; D a multiple of 16)
//   pool  [N, L, 2, S, K, D] f32        tables [B, P] int32 (clamped to [0, N))
//   lens  [B] int32 (the row's context, its new token included; at most P * S)
//   out   [B, H, D] f32 (a row with no context gives zeros)
//   attributes: layer (int64 in [0, L)), scale (float32, applied to q)
//
// Each row is computed alone, so its result does not depend on the batch. Online softmax
// over chunks of up to 16 tokens (within a page), exp by a degree-6 polynomial after
// range reduction (about 2 ulp). AVX-512F only (``SuperinferDecodeAttentionSupported``);
// elsewhere the caller keeps XLA's attention.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__x86_64__) && defined(__GNUC__)
#define SUPERINFER_HAVE_ATTN_KERNEL 1
#include <immintrin.h>
#define ATTN_TARGET __attribute__((target("avx512f")))
#else
#define SUPERINFER_HAVE_ATTN_KERNEL 0
#endif

namespace {

#if SUPERINFER_HAVE_ATTN_KERNEL

// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to
// degree 6 (Horner), times 2^n by vscalefps. Inputs below -87.3 give about 1e-38, not 0:
// callers mask the lanes that must be zero.
ATTN_TARGET inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

ATTN_TARGET inline float ExpScalar(float x) {
  return _mm512_cvtss_f32(Exp(_mm512_set1_ps(x)));
}

struct AttnJob {
  const float* q;
  const float* pool;
  const int32_t* tables;
  const int32_t* lens;
  float* out;
  int64_t batch, heads, head_dim, num_pages, num_layers, page_size, kv_heads, pages_per_row;
  int64_t layer;
  float scale;
  int64_t num_units;  // (row, KV head) pairs

  // Row b, KV head kh: its G query heads against the row's keys and values.
  template <int DV>
  ATTN_TARGET void Unit(int64_t b, int64_t kh) const {
    constexpr int D = 16 * DV;
    const int64_t G = heads / kv_heads;
    const int64_t len = std::clamp<int64_t>(lens[b], 0, pages_per_row * page_size);
    float* o = out + (b * heads + kh * G) * D;
    const float* qrow = q + (b * heads + kh * G) * D;
    const size_t token_stride = static_cast<size_t>(kv_heads) * D;
    const size_t block = static_cast<size_t>(page_size) * token_stride;  // one of K or V
    const size_t page_stride = static_cast<size_t>(num_layers) * 2 * block;
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[DV], acc[DV];
      for (int i = 0; i < DV; ++i) {
        qv[i] = _mm512_mul_ps(_mm512_loadu_ps(qrow + g * D + 16 * i), _mm512_set1_ps(scale));
        acc[i] = _mm512_setzero_ps();
      }
      float m = -INFINITY, l = 0.0f;
      for (int64_t t0 = 0, n = 0; t0 < len; t0 += n) {
        // Tokens [t0, t0 + n): at most 16, within one page.
        const int64_t p = t0 / page_size;
        const int64_t s0 = t0 - p * page_size;
        n = std::min<int64_t>({16, len - t0, page_size - s0});
        const int64_t page = std::clamp<int64_t>(tables[b * pages_per_row + p], 0, num_pages - 1);
        const float* kbase = pool + page * page_stride + layer * 2 * block + s0 * token_stride +
                             kh * D;
        const float* vbase = kbase + block;
        alignas(64) float scores[16];
        for (int64_t j = 0; j < n; ++j) {
          const float* kr = kbase + j * token_stride;
          __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int i = 1; i < DV; ++i) d = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), d);
          scores[j] = _mm512_reduce_add_ps(d);
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores);
        const float m_new = std::max(m, _mm512_reduce_max_ps(s));
        const float corr = m == -INFINITY ? 0.0f : ExpScalar(m - m_new);
        const __m512 pr = _mm512_maskz_mov_ps(valid, Exp(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        l = l * corr + _mm512_reduce_add_ps(pr);
        m = m_new;
        const __m512 c = _mm512_set1_ps(corr);
        for (int i = 0; i < DV; ++i) acc[i] = _mm512_mul_ps(acc[i], c);
        alignas(64) float probs[16];
        _mm512_store_ps(probs, pr);
        for (int64_t j = 0; j < n; ++j) {
          const float* vr = vbase + j * token_stride;
          const __m512 pj = _mm512_set1_ps(probs[j]);
          for (int i = 0; i < DV; ++i) acc[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * i), acc[i]);
        }
      }
      const __m512 inv = _mm512_set1_ps(1.0f / std::max(l, 1e-30f));
      for (int i = 0; i < DV; ++i) _mm512_storeu_ps(o + g * D + 16 * i, _mm512_mul_ps(acc[i], inv));
    }
  }

  ATTN_TARGET void Range(int64_t u0, int64_t u1) const {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / kv_heads, kh = u % kv_heads;
      switch (head_dim / 16) {
        case 1: Unit<1>(b, kh); break;
        case 2: Unit<2>(b, kh); break;
        case 4: Unit<4>(b, kh); break;
        case 8: Unit<8>(b, kh); break;
        case 16: Unit<16>(b, kh); break;
        default: break;  // refused before the job starts
      }
    }
  }
};

#endif  // SUPERINFER_HAVE_ATTN_KERNEL

bool CpuSupported() {
#if SUPERINFER_HAVE_ATTN_KERNEL
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool HeadDimSupported(int64_t d) {
  return d == 16 || d == 32 || d == 64 || d == 128 || d == 256;
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> pool, ffi::Buffer<ffi::S32> tables,
                               ffi::Buffer<ffi::S32> lens, ffi::Result<ffi::Buffer<ffi::F32>> out,
                               int64_t layer, float scale) {
  auto qd = q.dimensions();
  auto pd = pool.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || pd.size() != 6 || pd[2] != 2 || td.size() != 2 ||
      lens.dimensions().size() != 1 || td[0] != qd[0] || lens.dimensions()[0] != qd[0] ||
      pd[5] != qd[2] || pd[4] == 0 || qd[1] % pd[4] != 0 || !HeadDimSupported(qd[2])) {
    return ffi::Error::InvalidArgument(
        "decode_attention: q [B, H, D], pool [N, L, 2, S, K, D], tables [B, P], lens [B], "
        "H a multiple of K, D in 16/32/64/128/256");
  }
  if (layer < 0 || layer >= pd[1]) {
    return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  }
#if SUPERINFER_HAVE_ATTN_KERNEL
  static const bool supported = CpuSupported();
  if (!supported) return ffi::Error::Internal("decode_attention: this CPU lacks AVX-512F");
  auto job = std::make_shared<AttnJob>();
  job->q = q.typed_data();
  job->pool = pool.typed_data();
  job->tables = tables.typed_data();
  job->lens = lens.typed_data();
  job->out = out->typed_data();
  job->batch = qd[0];
  job->heads = qd[1];
  job->head_dim = qd[2];
  job->num_pages = pd[0];
  job->num_layers = pd[1];
  job->page_size = pd[3];
  job->kv_heads = pd[4];
  job->pages_per_row = td[1];
  job->layer = layer;
  job->scale = scale;
  job->num_units = job->batch * job->kv_heads;
  if (job->num_units == 0) return ffi::Error::Success();
  if (job->num_pages == 0 || job->pages_per_row == 0 || job->page_size == 0) {
    std::memset(job->out, 0, sizeof(float) * job->batch * job->heads * job->head_dim);
    return ffi::Error::Success();
  }
  // The caller plus up to one pool thread per core, a few chunks each for balance (rows'
  // contexts differ).
  const int64_t workers = superinfer::Workers(thread_pool);
  const int64_t chunks = std::min<int64_t>(job->num_units, workers == 1 ? 1 : 4 * workers);
  superinfer::RunChunks(thread_pool, chunks, workers, [job, chunks](int64_t c) {
    job->Range(c * job->num_units / chunks, (c + 1) * job->num_units / chunks);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("decode_attention: built without the AVX-512 kernel");
#endif
}

}  // namespace

// 1 where this CPU can run the kernel, else 0 (ctypes, before any program is traced).
extern "C" int SuperinferDecodeAttentionSupported() { return CpuSupported() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("scale"));
