// KV page gather for paged attention on XLA:CPU, as a typed XLA FFI custom call.
//
// Why this exists: XLA:CPU compiles the attention's page gather (pool[ids, layer, kv, :,
// heads]) to a loop of scalar moves, about 5 GB/s, and that gather was ~72 of the ~85 ms
// a SmolLM2 batch-32 decode step spends in attention. Here each (page, layer, K/V) block
// of the pool, S * K * D contiguous elements, is read front to back once (row s, head k
// in storage order: a sequential read the prefetchers follow) with one memcpy per
// head-row into the head-major output the attention's dots want. The rows are split over
// the calling thread and XLA's intra-op thread pool. Byte-exact by construction: no
// arithmetic touches the data.
//
//   pool  [N, L, 2, S, K, D] any dtype      ids [B, P] int32 (clamped to [0, N))
//   k_out [B, K, P, S, D] (pool dtype)      v_out [B, K, P, S, D]
//   attribute layer: int64 in [0, L)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct GatherJob {
  const char* pool;
  const int32_t* ids;
  char* out[2];
  int64_t num_pages, num_layers, page_size, kv_heads, batch, pages_per_row, layer;
  size_t row_bytes;  // head_dim * element size

  void CopyRows(int64_t b0, int64_t b1) const {
    const size_t block = static_cast<size_t>(page_size * kv_heads) * row_bytes;
    const size_t page_stride = static_cast<size_t>(num_layers) * 2 * block;
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t p = 0; p < pages_per_row; ++p) {
        int64_t page = ids[b * pages_per_row + p];
        page = std::clamp<int64_t>(page, 0, num_pages - 1);
        for (int kv = 0; kv < 2; ++kv) {
          const char* src = pool + page * page_stride + (layer * 2 + kv) * block;
          char* dst = out[kv] + static_cast<size_t>(b * kv_heads * pages_per_row + p) *
                                    page_size * row_bytes;
          const size_t head_stride = static_cast<size_t>(pages_per_row * page_size) * row_bytes;
          for (int64_t s = 0; s < page_size; ++s) {
            for (int64_t k = 0; k < kv_heads; ++k) {
              std::memcpy(dst + k * head_stride + s * row_bytes, src, row_bytes);
              src += row_bytes;
            }
          }
        }
      }
    }
  }
};

ffi::Error GatherKvImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer pool,
                        ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> k_out,
                        ffi::Result<ffi::AnyBuffer> v_out, int64_t layer) {
  auto pd = pool.dimensions();
  auto id = ids.dimensions();
  if (pd.size() != 6 || pd[2] != 2 || id.size() != 2) {
    return ffi::Error::InvalidArgument("kv_gather: pool must be [N, L, 2, S, K, D], ids [B, P]");
  }
  if (layer < 0 || layer >= pd[1]) return ffi::Error::InvalidArgument("kv_gather: layer out of range");
  auto job = std::make_shared<GatherJob>();
  job->pool = static_cast<const char*>(pool.untyped_data());
  job->ids = ids.typed_data();
  job->out[0] = static_cast<char*>(k_out->untyped_data());
  job->out[1] = static_cast<char*>(v_out->untyped_data());
  job->num_pages = pd[0];
  job->num_layers = pd[1];
  job->page_size = pd[3];
  job->kv_heads = pd[4];
  job->row_bytes = static_cast<size_t>(pd[5]) * ffi::ByteWidth(pool.element_type());
  job->batch = id[0];
  job->pages_per_row = id[1];
  job->layer = layer;
  if (job->batch == 0 || job->pages_per_row == 0 || job->num_pages == 0) return ffi::Error::Success();
  // One chunk of rows per worker (parallel_chunks.h).
  const int64_t chunks = std::min<int64_t>(job->batch, superinfer::Workers(thread_pool));
  superinfer::RunChunks(thread_pool, chunks, chunks, [job, chunks](int64_t c) {
    job->CopyRows(c * job->batch / chunks, (c + 1) * job->batch / chunks);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferKvGather, GatherKvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer"));
