// A zero-filled buffer without writing it, for the KV pool on XLA:CPU, as a typed XLA
// FFI custom call.
//
// Why this exists: the default pool is ~2 GiB. XLA:CPU fills jnp.zeros on one thread,
// and every 4 KiB page of it is a page fault before it is a memset: 1.5-3.5 s of CPU at
// start-up, on the path to ready. Linux already knows how to hand out zeros for free: a
// private anonymous page released with madvise(MADV_DONTNEED) reads as zero again, and
// is backed by memory only when first written (which the step's KV writes then pay, page
// by page, as the pool fills: about 0.3 ms per MiB on this machine, the cost XLA's fill
// paid up front). No MADV_HUGEPAGE: with THP's default ``defrag=madvise`` a huge-page
// fault compacts memory synchronously (2.9 s to populate 2 GiB here once, against
// 0.65 s in 4 KiB pages), a stall that would land in a step. Backing the pool from a
// background thread (MADV_POPULATE_WRITE) was tried: started with the pool it took
// 0.5-1 s from a warm start's ready, started at ready it slowed the first request
// 1.5x, so the steps pay as they go.
//
// Memory is committed as the pool fills, not at start-up: on a machine short of memory
// a pool too large for it fails then (the kernel's OOM), where XLA's fill failed at
// start. The CPU pool has a fixed default size (2 GiB, ``num_device_pages`` overrides
// it), so size it for the machine.
//
// Safety: DONTNEED zeroes only private anonymous memory; a file-backed or shared mapping
// would re-read its file. Every heap allocator XLA uses hands out private anonymous
// memory, and this is checked on the buffer itself: its first and last whole pages are
// dirtied, released, and must read back as zero, else the whole buffer is memset (the
// plain path, same result). Elsewhere than Linux it is always the memset.
//
//   out: any shape and dtype, every byte 0 on return.
//   args: none, or one buffer the output aliases (input_output_aliases): its memory is
//         reused, whatever it held (the tests pass a dirty buffer this way).

#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__linux__)
// Releases [lo, hi) (page aligned) so that it reads as zero; false if the mapping does
// not behave that way (then nothing is promised about its contents).
bool ReleaseToZeroPages(char* lo, char* hi, size_t page) {
  lo[0] = 1;
  hi[-1] = 1;
  if (madvise(lo, hi - lo, MADV_DONTNEED) != 0) return false;
  return lo[0] == 0 && hi[-1] == 0 && lo[page - 1] == 0;
}
#endif

ffi::Error LazyZerosImpl(ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out) {
  char* data = static_cast<char*>(out->untyped_data());
  const size_t bytes = out->size_bytes();
#if defined(__linux__)
  const long page_or_error = sysconf(_SC_PAGESIZE);
  const size_t page = page_or_error > 0 ? static_cast<size_t>(page_or_error) : 4096;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t lo = (begin + page - 1) / page * page;
  const uintptr_t hi = (begin + bytes) / page * page;
  // Below a few pages the memset is cheaper than the system calls.
  if (hi > lo && hi - lo >= 16 * page &&
      ReleaseToZeroPages(reinterpret_cast<char*>(lo), reinterpret_cast<char*>(hi), page)) {
    std::memset(data, 0, lo - begin);
    std::memset(reinterpret_cast<char*>(hi), 0, begin + bytes - hi);
    return ffi::Error::Success();
  }
#endif
  std::memset(data, 0, bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferLazyZeros, LazyZerosImpl,
                              ffi::Ffi::Bind().RemainingArgs().Ret<ffi::AnyBuffer>());
