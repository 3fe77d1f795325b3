// Work split over the calling thread and XLA's intra-op threads, shared by the native ops.
//
// ``RunChunks(pool, n, workers, body)`` runs ``body(c)`` once for each chunk c in [0, n):
// the caller and up to ``workers - 1`` pool threads claim chunks from a shared counter
// until none is left, and the caller returns once every claimed chunk is done. Helpers
// that start after the caller has claimed everything find nothing to do and return, so a
// busy pool never deadlocks the caller. The counters live in shared state each helper
// holds, so a helper still leaving after the caller returned touches no freed memory;
// ``body`` runs only for claimed chunks, all finished before the return, so it may refer
// to the caller's locals.

#ifndef SUPERINFER_NATIVE_PARALLEL_CHUNKS_H_
#define SUPERINFER_NATIVE_PARALLEL_CHUNKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace superinfer {

// The caller plus one pool thread per core beyond the first.
inline int64_t Workers(xla::ffi::ThreadPool& pool) {
  return 1 + std::max<int64_t>(0, pool.num_threads() - 1);
}

template <typename Body>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t num_chunks, int64_t workers, Body body) {
  if (num_chunks <= 0) return;
  struct State {
    State(Body b, int64_t n) : body(std::move(b)), num_chunks(n) {}
    Body body;
    int64_t num_chunks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void Work() {
      for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
        body(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(body), num_chunks);
  for (int64_t h = 0; h + 1 < std::min(workers, num_chunks); ++h) {
    pool.Schedule([state] { state->Work(); });
  }
  state->Work();
  while (state->done.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
}

}  // namespace superinfer

#endif  // SUPERINFER_NATIVE_PARALLEL_CHUNKS_H_
