// What each rank says about a collective before any data moves, and the one message every rank
// prints when the ranks disagree. Shared by the backends that check (shm, gloo).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/distributed/process_group.h"

namespace lockstep::dist::detail {

enum class CallKind : uint32_t { all_reduce = 1, broadcast, all_gather, reduce_scatter, barrier };

std::string_view call_kind_name(uint32_t kind);

// Plain data of a fixed size: it travels as bytes (a shared-memory slot, a Gloo message).
// numel is the per-rank element count (all_reduce and broadcast: the tensor; all_gather: the
// input; reduce_scatter: the output); dtype and op are DType and ReduceOp as integers.
struct CallSignature {
  uint32_t kind = 0;
  uint32_t dtype = 0;
  uint32_t op = 0;
  int32_t root = 0;
  int64_t numel = 0;
};
static_assert(sizeof(CallSignature) == 24, "CallSignature travels as 24 bytes");

// The signature of a collective on `t` (null: a barrier), with its op (reductions) and root
// (broadcast).
CallSignature signature(CallKind kind, const Tensor* t, ReduceOp op = ReduceOp::sum, int root = 0);

// "" when every rank's signature equals rank 0's; otherwise the first difference, naming both
// ranks and both values ("all_reduce: rank 1 has 512 elements, rank 0 has 1024"), so that every
// rank, reading the same signatures, reports the same thing.
std::string call_mismatch(const std::vector<CallSignature>& by_rank);

}  // namespace lockstep::dist::detail
