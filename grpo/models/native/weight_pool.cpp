// Memory for the packed weights a decoding step streams (weight_empty): 2 MiB-aligned chunks in
// 2 MiB pages, kept for the next pack.

#include "ops.h"

#include <ATen/ops/from_blob.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace grpo_native {

// Memory for the packed weights that a decoding step streams, in 2 MiB-aligned chunks the kernel
// is asked to back with 2 MiB pages (transparent huge pages, madvise). Streaming SmolLM2's 540 MB
// once a step touches ~130,000 4 KiB pages, each a TLB miss and a page walk beside its 64 loads; in
// 2 MiB pages a step's products alone took 0.80-0.84x the time and the fp32 sampler's decoding steps
// 0.94x (Intel Xeon, avx512, 2 cores, docs/benchmark.md). Weights of at least half a huge page are placed one after another in the
// chunk being filled (32 MiB, or one of their own when larger), each tensor holding its chunk.
// The sampler packs its weights anew at each optimizer step (folded_lora.py), freeing the last
// step's first, so a chunk whose last tensor goes is kept for the next pack rather than unmapped
// and faulted in again (~65 ms for SmolLM2's 540 MB here), up to as many bytes as were ever in use
// at once; beyond that it is unmapped. Where the kernel has no transparent huge pages the chunks
// keep 4 KiB pages; where a mapping fails, the weight is a plain tensor: the same bytes either way.
#if defined(__linux__) && defined(MADV_HUGEPAGE)
constexpr size_t HUGE_PAGE = size_t{2} << 20;
constexpr size_t HUGE_CHUNK = size_t{32} << 20;

inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct HugeChunk {
  char* base;
  size_t size;
  size_t used = 0;
};

// The chunks: the one being filled (weakly: it goes when its tensors do), those kept for reuse,
// and the bytes mapped. Never destroyed: a tensor freed late in the process's exit still finds it.
struct HugePool {
  std::mutex mutex;
  std::weak_ptr<HugeChunk> filling;
  std::vector<HugeChunk*> kept;
  size_t in_use = 0, most_in_use = 0, kept_bytes = 0;
};
HugePool& huge_pool() {
  static HugePool* pool = new HugePool();
  return *pool;
}

// the last tensor of a chunk went: keep it (within what was ever in use at once), or unmap it
void chunk_freed(HugeChunk* chunk) {
  HugePool& pool = huge_pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  pool.in_use -= chunk->size;
  if (pool.kept_bytes + chunk->size <= pool.most_in_use) {
    chunk->used = 0;
    pool.kept.push_back(chunk);
    pool.kept_bytes += chunk->size;
    return;
  }
  munmap(chunk->base, chunk->size);
  delete chunk;
}

// a chunk of at least `size` bytes (a multiple of HUGE_PAGE) at a HUGE_PAGE boundary, or nullptr;
// the pool's mutex held
std::shared_ptr<HugeChunk> take_chunk(HugePool& pool, size_t size) {
  HugeChunk* chunk = nullptr;
  for (size_t i = 0; i < pool.kept.size(); ++i)
    if (pool.kept[i]->size >= size) {
      chunk = pool.kept[i];
      pool.kept.erase(pool.kept.begin() + static_cast<int64_t>(i));
      pool.kept_bytes -= chunk->size;
      break;
    }
  if (chunk == nullptr) {
    void* mapped = mmap(nullptr, size + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return nullptr;
    char* start = static_cast<char*>(mapped);
    char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(start), HUGE_PAGE));
    const size_t head = static_cast<size_t>(base - start);  // the mapping's unaligned head and tail back
    if (head > 0) munmap(start, head);
    munmap(base + size, HUGE_PAGE - head);
    madvise(base, size, MADV_HUGEPAGE);  // (a request: refused, the chunk keeps 4 KiB pages)
    chunk = new HugeChunk{base, size};
  }
  pool.in_use += chunk->size;
  pool.most_in_use = std::max(pool.most_in_use, pool.in_use);
  return std::shared_ptr<HugeChunk>(chunk, chunk_freed);
}

// Unmaps the chunks kept for the next pack; the bytes given back. The engine calls it after each
// call (heap.py): a repack frees and reuses within one call, so what is still kept by then is
// memory nothing will pack into soon (a probe's weights, a sampler gone).
int64_t release_kept_chunks() {
  HugePool& pool = huge_pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  const auto released = static_cast<int64_t>(pool.kept_bytes);
  for (HugeChunk* chunk : pool.kept) {
    munmap(chunk->base, chunk->size);
    delete chunk;
  }
  pool.kept.clear();
  pool.kept_bytes = 0;
  return released;
}

at::Tensor weight_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                       c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (bytes < HUGE_PAGE / 2) return at::empty(sizes, options);
  const size_t need = round_up(bytes, 4096);
  HugePool& pool = huge_pool();
  std::shared_ptr<HugeChunk> chunk;
  char* data;
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    chunk = pool.filling.lock();
    if (!chunk || chunk->used + need > chunk->size) {
      chunk = take_chunk(pool, std::max(HUGE_CHUNK, round_up(need, HUGE_PAGE)));
      if (!chunk) return at::empty(sizes, options);
      if (need <= HUGE_CHUNK) pool.filling = chunk;  // (a weight larger than a chunk has one to itself)
    }
    data = chunk->base + chunk->used;
    chunk->used += need;
  }
  auto* keep = new std::shared_ptr<HugeChunk>(std::move(chunk));
  return at::from_blob(data, sizes, [keep](void*) { delete keep; }, options);
}
#else
at::Tensor weight_empty(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }
int64_t release_kept_chunks() { return 0; }
#endif

}  // namespace grpo_native
