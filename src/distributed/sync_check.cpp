// check_in_sync: parameters and buffers hashed and compared across ranks (Note [Sync check]).
#include "lockstep/distributed/sync_check.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "lockstep/base/error.h"

namespace lockstep::dist {

namespace {

using lockstep::detail::str_cat;

// A multiply-xorshift mix per 8-byte word (splitmix64's finalizer): several GB/s, so a check of
// a whole model costs a pass over its bytes, and any changed bit changes the result.
uint64_t mix(uint64_t h, uint64_t word) {
  h ^= word + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += str_cat(s.empty() ? "" : ", ", r);
  return str_cat(ranks.size() == 1 ? "rank " : "ranks ", s);
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

uint64_t tensor_hash(const Tensor& t) {
  const Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(kCPU).contiguous();
  uint64_t h = mix(0, static_cast<uint64_t>(c.dtype()));
  for (int64_t d : c.shape()) h = mix(h, static_cast<uint64_t>(d));
  const auto* bytes = static_cast<const uint8_t*>(c.data_ptr());
  const auto n = static_cast<size_t>(c.nbytes());
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, bytes + i, 8);
    h = mix(h, w);
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, bytes + i, n - i);
    h = mix(h, w ^ (static_cast<uint64_t>(n - i) << 56));
  }
  return h;
}

void check_in_sync(const nn::Module& module, ProcessGroup& pg) {
  nn::NamedTensors tensors = module.named_parameters();
  for (auto& b : module.named_buffers()) tensors.push_back(std::move(b));
  const auto count = static_cast<int64_t>(tensors.size());
  if (pg.size() == 1 || count == 0) return;
  std::vector<int64_t> mine(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    mine[static_cast<size_t>(i)] =
        static_cast<int64_t>(tensor_hash(tensors[static_cast<size_t>(i)].second));
  }
  Tensor all = empty({pg.size() * count}, kInt64);
  pg.all_gather_host(all, from_vector(mine, {count}));
  const auto* h = all.data<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    std::map<int64_t, std::vector<int>> holders;  // hash -> ranks
    for (int r = 0; r < pg.size(); ++r) holders[h[r * count + i]].push_back(r);
    if (holders.size() == 1) continue;
    // Rank 0's side first, then the others by their lowest rank.
    std::vector<std::pair<int64_t, std::vector<int>>> sides(holders.begin(), holders.end());
    std::sort(sides.begin(), sides.end(),
              [](const auto& a, const auto& b) { return a.second.front() < b.second.front(); });
    std::string what;
    for (size_t s = 0; s < sides.size(); ++s) {
      what += str_cat(
          s == 0 ? "" : (s + 1 == sides.size() ? ", and " : ", "), rank_list(sides[s].second),
          s == 0 ? (sides[s].second.size() == 1 ? " holds one value" : " hold one value")
                 : " another",
          " (hash ", hex(static_cast<uint64_t>(sides[s].first)), ")");
    }
    const bool is_param = i < static_cast<int64_t>(module.named_parameters().size());
    LS_THROW("parameters diverged: the ", is_param ? "parameter" : "buffer", " '",
             tensors[static_cast<size_t>(i)].first, "' differs between ranks: ", what,
             ". Every rank must apply the same updates (a rank-dependent branch, an optimizer "
             "stepped on some ranks only, or a buffer changed outside the forward makes them "
             "drift apart)");
  }
}

}  // namespace lockstep::dist
