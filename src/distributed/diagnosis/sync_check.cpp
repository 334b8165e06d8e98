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

namespace {

// A string's 64-bit hash (the same mix as tensor_hash, over its bytes and length).
uint64_t text_hash(uint64_t h, const std::string& s) {
  h = mix(h, s.size());
  for (size_t i = 0; i < s.size(); i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, s.data() + i, std::min<size_t>(8, s.size() - i));
    h = mix(h, w);
  }
  return h;
}

// Every rank's `text`, through two all-gathers (the lengths, then the bytes in int64 words).
std::vector<std::string> all_gather_text(ProcessGroup& pg, const std::string& text) {
  const int n = pg.size();
  Tensor lengths = empty({n}, kInt64);
  pg.all_gather_host(lengths, full({1}, static_cast<double>(text.size()), kInt64));
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) longest = std::max(longest, lengths.data<int64_t>()[r]);
  const int64_t words = (longest + 7) / 8;
  std::vector<int64_t> mine(static_cast<size_t>(std::max<int64_t>(words, 1)), 0);
  std::memcpy(mine.data(), text.data(), text.size());
  Tensor all = empty({n * static_cast<int64_t>(mine.size())}, kInt64);
  pg.all_gather_host(all, from_vector(mine, {static_cast<int64_t>(mine.size())}));
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    const auto* bytes = reinterpret_cast<const char*>(all.data<int64_t>() + r * mine.size());
    out.emplace_back(bytes, static_cast<size_t>(lengths.data<int64_t>()[r]));
  }
  return out;
}

}  // namespace

void check_same_settings(ProcessGroup& pg, const std::vector<Setting>& settings,
                         const std::string& why) {
  if (pg.size() == 1) return;
  // The count first, then a hash per setting; only a difference costs the values.
  const auto count = static_cast<int64_t>(settings.size());
  std::vector<int64_t> mine;
  for (const Setting& s : settings)
    mine.push_back(static_cast<int64_t>(text_hash(text_hash(0, s.name), s.value)));
  Tensor counts = empty({pg.size()}, kInt64);
  pg.all_gather_host(counts, full({1}, static_cast<double>(count), kInt64));
  const auto* c = counts.data<int64_t>();
  for (int r = 1; r < pg.size(); ++r) {
    LS_CHECK(c[r] == c[0], "ranks disagree on the settings they check: rank 0 checks ", c[0],
             ", rank ", r, " checks ", c[r], " (every rank must run the same program)");
  }
  if (count == 0) return;
  Tensor all = empty({pg.size() * count}, kInt64);
  pg.all_gather_host(all, from_vector(mine, {count}));
  const auto* h = all.data<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    bool same = true;
    for (int r = 1; r < pg.size(); ++r) same = same && h[r * count + i] == h[i];
    if (same) continue;
    const Setting& s = settings[static_cast<size_t>(i)];
    const std::vector<std::string> values = all_gather_text(pg, s.value);
    // The ranks of each value, rank 0's first.
    std::vector<std::pair<std::string, std::vector<int>>> sides;
    for (int r = 0; r < pg.size(); ++r) {
      auto it = std::find_if(sides.begin(), sides.end(),
                             [&](const auto& side) { return side.first == values[r]; });
      if (it == sides.end()) it = sides.insert(sides.end(), {values[r], {}});
      it->second.push_back(r);
    }
    std::string what;
    for (size_t k = 0; k < sides.size(); ++k) {
      what += str_cat(k == 0 ? "" : (k + 1 == sides.size() ? ", and " : ", "),
                      rank_list(sides[k].second), sides[k].second.size() == 1 ? " has " : " have ",
                      sides[k].first.empty() ? "nothing" : sides[k].first);
    }
    LS_THROW("ranks disagree on ", s.name, ": ", what, ". ", why);
  }
}

}  // namespace lockstep::dist
