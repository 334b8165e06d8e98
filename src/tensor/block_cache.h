// The caching core of the CUDA device allocator: segments reserved from a device, cut into blocks
// and merged again (Note [Block cache] in block_cache.cpp). It knows no CUDA: the device is a
// pair of functions, so that the cache is built and tested without a GPU; the CUDA allocator
// (src/tensor/cuda/allocator.cpp) adds streams' fences and the device's out-of-memory message.
// Not thread-safe: its owner locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <unordered_map>

namespace lockstep::detail {

class BlockCache {
 public:
  // A stream as the cache sees it: blocks are cut from segments of one stream and handed out
  // again only to requests on that stream.
  using Stream = const void*;

  struct Device {
    // `bytes` of device memory, or nullptr when the device has none left.
    std::function<void*(size_t bytes)> reserve;
    // Gives back what reserve returned.
    std::function<void(void* segment)> release;
    // Optional: called once when reserve fails, before the free segments are released and the
    // reserve retried; it may free() blocks (the CUDA allocator frees those whose fences passed).
    std::function<void()> reclaim;
  };

  struct Stats {
    int64_t allocated_bytes = 0;  // in blocks handed out now
    int64_t reserved_bytes = 0;   // in segments reserved and not released
    int64_t peak_allocated_bytes = 0;
    int64_t peak_reserved_bytes = 0;
    int64_t allocations = 0;  // allocate() calls, ever
    int64_t reserves = 0;     // successful reserve() calls, ever
    int64_t releases = 0;     // release() calls, ever
    int64_t oom_retries = 0;  // reserve() failures retried after releasing the free segments
    int64_t splits = 0;       // blocks cut in two, ever
  };

  // Sizes (Note [Block cache]).
  static constexpr size_t kRound = 512;                  // every block is a multiple of this
  static constexpr size_t kSmallSize = size_t{1} << 20;  // requests up to this are small
  static constexpr size_t kSmallSegment = size_t{2} << 20;
  static constexpr size_t kLargeSegment = size_t{20} << 20;  // for large requests below 10 MiB
  static constexpr size_t kLargeRound = size_t{2} << 20;     // larger ones: their size, rounded
  static constexpr size_t kMaxBytes = size_t{1} << 52;       // larger requests fail at once

  explicit BlockCache(Device device);
  ~BlockCache();  // gives back every segment still reserved
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block of at least `bytes` (a multiple of kRound) for `stream`: the smallest free block of
  // the stream's pool that fits, cut to size, or one cut from a new segment. nullptr when the
  // device has no memory for a new segment even after reclaim() and every free segment was
  // released (or for more than kMaxBytes).
  void* allocate(size_t bytes, Stream stream);
  // Returns a block from allocate() to the cache, merged with its free neighbours. False (and
  // nothing changed) for a pointer that is not a block handed out.
  bool free(void* ptr);
  // Releases every segment that is one free block.
  void release_free_segments();

  bool owns(const void* ptr) const { return live_.count(const_cast<void*>(ptr)) != 0; }
  size_t size_of(const void* ptr) const;  // the block's size (0 when not handed out)
  Stream stream_of(const void* ptr) const;
  const Stats& stats() const { return stats_; }
  void reset_peak();
  // Segments reserved now, and free blocks in the cache now (for tests and reports).
  size_t segments() const { return segments_.size(); }
  size_t free_blocks() const { return small_.size() + large_.size(); }

  // The bytes a request of `bytes` takes: a multiple of kRound, at least kRound.
  static size_t round_size(size_t bytes);
  // The segment a request of `bytes` (rounded) reserves when no free block fits.
  static size_t segment_size(size_t bytes);

 private:
  struct Block {
    char* ptr;
    size_t size;
    Stream stream;
    bool small;  // of a small segment
    bool free = false;
    Block* prev = nullptr;  // neighbours in the segment, by address
    Block* next = nullptr;
  };
  struct BySize {  // the free pools' order: stream, then size, then address
    bool operator()(const Block* a, const Block* b) const;
  };
  using Pool = std::set<Block*, BySize>;

  Pool& pool_of(const Block* b) { return b->small ? small_ : large_; }
  Block* take_free(size_t size, Stream stream, bool small);
  // A new block, owned by blocks_; drop() ends one.
  Block* make(const Block& b);
  void drop(Block* b) { blocks_.erase(b->ptr); }
  void note_allocated(int64_t delta);

  Device device_;
  Pool small_, large_;
  std::unordered_map<void*, std::unique_ptr<Block>> blocks_;  // every block, by its address
  std::unordered_map<void*, Block*> live_;      // blocks handed out, by address
  std::unordered_map<void*, Block*> segments_;  // each segment's first block, by its address
  Stats stats_;
};

}  // namespace lockstep::detail
