// Whole-page copies between the KV pool and separate page arrays on XLA:CPU (DuplexKV's
// fused-mode gather and scatter), as typed XLA FFI custom calls.
//
// Why this exists: XLA:CPU compiles every page copy to a loop kernel (no memcpy; dynamic
// slices to scalar moves), and a rotation's pages are cold after a step that streamed the
// weights through the caches, so even glibc's memcpy copies them with regular stores, each
// destination line read before it is written (about 7 GB/s on the 2-core box, against 13
// with non-temporal stores). A page of the block-first pool is one contiguous run, so each
// page here is one copy with non-temporal stores (the destination is not read again
// soon: the host tier, or a pool page the next step reads once), split over the caller and
// XLA's intra-op threads. Byte-exact by construction.
//
//   gather:  pool [N, ...] (any dtype), ids [B] int32 (clamped) -> B pages [...]
//   scatter: pool [N, ...], ids [B] int32 (clamped), B pages [...] -> pool, in place (the
//            output aliases the pool operand; later pages win on repeated ids)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PAGE_COPY_SSE2 1
#else
#define PAGE_COPY_SSE2 0
#endif

namespace {

// dst <- src, n bytes, with streaming stores where the destination is 16-byte aligned
// (the rest by memcpy).
void StreamCopy(char* dst, const char* src, size_t n) {
#if PAGE_COPY_SSE2
  const size_t head = std::min(n, static_cast<size_t>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16));
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const size_t body = n / 64 * 64;
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

struct CopyJob {
  std::vector<char*> dst;
  std::vector<const char*> src;
  size_t page_bytes = 0;
  size_t piece_bytes = 0;  // pages are split into pieces this large, for the threads
  int64_t pieces_per_page = 1;

  // Unit u: piece u % pieces_per_page of page u / pieces_per_page.
  void Copy(int64_t u) const {
    const int64_t page = u / pieces_per_page, piece = u % pieces_per_page;
    const size_t off = piece * piece_bytes;
    StreamCopy(dst[page] + off, src[page] + off, std::min(piece_bytes, page_bytes - off));
  }
};

// Runs the job's copies on the caller and up to one pool thread per core
// (parallel_chunks.h). A later page of the same destination (a repeated id in a scatter)
// must land after an earlier one: such batches run on the caller alone, in order.
void Run(const std::shared_ptr<CopyJob>& job, ffi::ThreadPool& pool, bool ordered) {
  if (job->page_bytes == 0) return;  // empty pages: nothing to copy
  const int64_t workers = ordered ? 1 : superinfer::Workers(pool);
  const int64_t pages = static_cast<int64_t>(job->dst.size());
  job->pieces_per_page = 1;
  job->piece_bytes = job->page_bytes;
  if (workers > 1 && pages < 4 * workers) {  // few pages: split each into pieces
    const int64_t want = (4 * workers + pages - 1) / pages;
    job->piece_bytes = ((job->page_bytes + want - 1) / want + 63) / 64 * 64;
    job->pieces_per_page =
        static_cast<int64_t>((job->page_bytes + job->piece_bytes - 1) / job->piece_bytes);
  }
  superinfer::RunChunks(pool, pages * job->pieces_per_page, workers,
                        [job](int64_t u) { job->Copy(u); });
}

size_t PageBytes(const ffi::AnyBuffer& pool) {
  auto d = pool.dimensions();
  size_t n = ffi::ByteWidth(pool.element_type());
  for (size_t i = 1; i < d.size(); ++i) n *= static_cast<size_t>(d[i]);
  return n;
}

ffi::Error GatherImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> ids,
                      ffi::RemainingRets pages) {
  const int64_t num_pages = pool.dimensions().size() ? pool.dimensions()[0] : 0;
  if (pool.dimensions().size() < 2 || num_pages == 0 || ids.dimensions().size() != 1 ||
      static_cast<size_t>(ids.dimensions()[0]) != pages.size()) {
    return ffi::Error::InvalidArgument("page_gather: pool [N, ...], ids [B], B page outputs");
  }
  auto job = std::make_shared<CopyJob>();
  job->page_bytes = PageBytes(pool);
  const char* base = static_cast<const char*>(pool.untyped_data());
  for (size_t i = 0; i < pages.size(); ++i) {
    auto out = pages.get<ffi::AnyBuffer>(i);
    if (!out.has_value() || (*out)->size_bytes() != job->page_bytes) {
      return ffi::Error::InvalidArgument("page_gather: every output must be one page");
    }
    const int64_t id = std::clamp<int64_t>(ids.typed_data()[i], 0, num_pages - 1);
    job->src.push_back(base + id * job->page_bytes);
    job->dst.push_back(static_cast<char*>((*out)->untyped_data()));
  }
  if (!job->dst.empty()) Run(job, thread_pool, /*ordered=*/false);
  return ffi::Error::Success();
}

ffi::Error ScatterImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> ids,
                       ffi::RemainingArgs pages, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t num_pages = pool.dimensions().size() ? pool.dimensions()[0] : 0;
  if (pool.dimensions().size() < 2 || num_pages == 0 || ids.dimensions().size() != 1 ||
      static_cast<size_t>(ids.dimensions()[0]) != pages.size()) {
    return ffi::Error::InvalidArgument("page_scatter: pool [N, ...], ids [B], B pages");
  }
  if (out->untyped_data() != pool.untyped_data()) {
    return ffi::Error::InvalidArgument("page_scatter: the output must alias the pool");
  }
  auto job = std::make_shared<CopyJob>();
  job->page_bytes = PageBytes(pool);
  char* base = static_cast<char*>(out->untyped_data());
  std::vector<int64_t> seen;
  bool repeated = false;
  for (size_t i = 0; i < pages.size(); ++i) {
    auto page = pages.get<ffi::AnyBuffer>(i);
    if (!page.has_value() || page->size_bytes() != job->page_bytes) {
      return ffi::Error::InvalidArgument("page_scatter: every page operand must be one page");
    }
    const int64_t id = std::clamp<int64_t>(ids.typed_data()[i], 0, num_pages - 1);
    repeated = repeated || std::find(seen.begin(), seen.end(), id) != seen.end();
    seen.push_back(id);
    job->src.push_back(static_cast<const char*>(page->untyped_data()));
    job->dst.push_back(base + id * job->page_bytes);
  }
  if (!job->dst.empty()) Run(job, thread_pool, /*ordered=*/repeated);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferPageGather, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferPageScatter, ScatterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());
