#include "tensor/block_cache.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace lockstep::detail {

// Note [Block cache]
// cudaMalloc and cudaFree synchronize the device and cost tens of microseconds to milliseconds,
// and a training step allocates hundreds of tensors, so the device allocator keeps what it got
// and hands it out again. It keeps segments (what it reserved from the device) cut into blocks,
// as PyTorch's caching allocator does:
// - A request is rounded up to 512 bytes. Requests up to 1 MiB are small and come from 2 MiB
//   segments; larger ones from segments of 20 MiB (requests below 10 MiB) or of their own size
//   rounded up to 2 MiB. Small and large blocks never share a segment, so a few small tensors
//   that live long cannot pin a large segment.
// - A request takes the smallest free block of its pool and stream that fits (ties: the lowest
//   address) and cuts it, when what is left is at least 512 bytes (small) or more than 1 MiB
//   (large; a smaller rest stays with the block); the rest is a free block of its own.
// - A freed block merges with the free blocks beside it in its segment, so the cache holds the
//   largest free runs it can, and a segment that is one free block again can be released
//   (release_free_segments: on empty_cache(), and before a reserve is retried when the device is
//   out of memory).
// So varying sizes reuse one memory: a request fits in any free run large enough instead of
// needing a cached block of nearly its own size, and reserved memory stays bounded by the peak
// of what is in use plus the fragmentation of a few segments (BlockCache tests in
// tests/tensor/block_cache_test.cpp). In a steady training loop every request finds its block
// again and nothing is reserved after the first step.
// - Blocks belong to the stream of their segment: kernels on one stream run in order, so a block
//   freed by the host can be reused at once on its stream even while earlier kernels still read
//   it. The CUDA allocator fences blocks used on other streams before it frees them here.

size_t BlockCache::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  return (bytes + kRound - 1) / kRound * kRound;
}

size_t BlockCache::segment_size(size_t bytes) {
  if (bytes <= kSmallSize) return kSmallSegment;
  if (bytes < kLargeSegment / 2) return kLargeSegment;
  return (bytes + kLargeRound - 1) / kLargeRound * kLargeRound;
}

bool BlockCache::BySize::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return std::less<Stream>()(a->stream, b->stream);
  if (a->size != b->size) return a->size < b->size;
  return std::less<char*>()(a->ptr, b->ptr);
}

BlockCache::BlockCache(Device device) : device_(std::move(device)) {}

BlockCache::~BlockCache() {
  for (auto& [base, first] : segments_) device_.release(base);
}

BlockCache::Block* BlockCache::make(const Block& b) {
  auto owned = std::make_unique<Block>(b);
  Block* raw = owned.get();
  blocks_[raw->ptr] = std::move(owned);
  return raw;
}

void BlockCache::note_allocated(int64_t delta) {
  stats_.allocated_bytes += delta;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
}

BlockCache::Block* BlockCache::take_free(size_t size, Stream stream, bool small) {
  Pool& pool = small ? small_ : large_;
  Block key{nullptr, size, stream, small};
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

void* BlockCache::allocate(size_t bytes, Stream stream) {
  ++stats_.allocations;
  if (bytes > kMaxBytes) return nullptr;
  const size_t size = round_size(bytes);
  const bool small = size <= kSmallSize;
  Block* b = take_free(size, stream, small);
  void* p = nullptr;
  const size_t seg = segment_size(size);
  if (b == nullptr && (p = device_.reserve(seg)) == nullptr) {
    ++stats_.oom_retries;
    if (device_.reclaim) device_.reclaim();
    b = take_free(size, stream, small);
    if (b == nullptr) {
      release_free_segments();
      p = device_.reserve(seg);
      if (p == nullptr) return nullptr;
    }
  }
  if (b == nullptr) {
    ++stats_.reserves;
    stats_.reserved_bytes += static_cast<int64_t>(seg);
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    b = make(Block{static_cast<char*>(p), seg, stream, small});
    segments_.emplace(p, b);
  }
  const size_t rest = b->size - size;
  if (small ? rest >= kRound : rest > kSmallSize) {
    Block* r = make(Block{b->ptr + size, rest, stream, small, true, b, b->next});
    if (b->next != nullptr) b->next->prev = r;
    b->next = r;
    b->size = size;
    pool_of(r).insert(r);
    ++stats_.splits;
  }
  b->free = false;
  live_.emplace(b->ptr, b);
  note_allocated(static_cast<int64_t>(b->size));
  return b->ptr;
}

bool BlockCache::free(void* ptr) {
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block* b = it->second;
  live_.erase(it);
  note_allocated(-static_cast<int64_t>(b->size));
  b->free = true;
  Pool& pool = pool_of(b);
  if (Block* n = b->next; n != nullptr && n->free) {  // b takes in its free successor
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (b->next != nullptr) b->next->prev = b;
    drop(n);
  }
  if (Block* p = b->prev; p != nullptr && p->free) {  // its free predecessor takes in b
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (p->next != nullptr) p->next->prev = p;
    drop(b);
    b = p;
  }
  pool.insert(b);
  return true;
}

void BlockCache::release_free_segments() {
  for (Pool* pool : {&small_, &large_}) {
    std::vector<Block*> whole;
    for (Block* b : *pool)
      if (b->prev == nullptr && b->next == nullptr) whole.push_back(b);
    for (Block* b : whole) {
      pool->erase(b);
      segments_.erase(b->ptr);
      device_.release(b->ptr);
      ++stats_.releases;
      stats_.reserved_bytes -= static_cast<int64_t>(b->size);
      drop(b);
    }
  }
}

size_t BlockCache::size_of(const void* ptr) const {
  auto it = live_.find(const_cast<void*>(ptr));
  return it == live_.end() ? 0 : it->second->size;
}

BlockCache::Stream BlockCache::stream_of(const void* ptr) const {
  auto it = live_.find(const_cast<void*>(ptr));
  return it == live_.end() ? nullptr : it->second->stream;
}

void BlockCache::reset_peak() {
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

}  // namespace lockstep::detail
