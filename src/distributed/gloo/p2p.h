// Collectives lockstep runs over Gloo's point-to-point transport (unbound buffers), where
// Gloo's collectives API has none, checks nothing or adds in an order of its own: the signature
// exchange that precedes every collective, and the rank-order reduce-scatter and all_reduce.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/call_signature.h"
#include "lockstep/distributed/process_group.h"

namespace gloo {
class Context;
}

namespace lockstep::dist::detail {

// Ranks that disagree about a collective (Note [Gloo signature check]): every rank throws the
// same message, no data has moved, and the group can go on.
class CallMismatch : public Error {
 public:
  using Error::Error;
};

// Sends `mine` to every other rank and receives theirs; throws CallMismatch when they differ.
void check_signatures(const std::shared_ptr<gloo::Context>& ctx, const CallSignature& mine,
                      uint32_t tag, std::chrono::milliseconds timeout);

// Rank-order reduce-scatter (Note [Gloo rank-order reduction]): `input` holds size x `count`
// elements of `dtype`; `output` (`count` elements) receives x0 op x1 op ... op x(size-1) of every
// rank's chunk `rank`, as the shm backend computes it (avg: that sum divided by size).
// `scratch` holds what arrives; it grows to the largest collective's need and is kept, so that
// no call pays for fresh pages.
void rank_order_reduce_scatter(const std::shared_ptr<gloo::Context>& ctx, void* output,
                               const void* input, size_t count, DType dtype, ReduceOp op,
                               uint32_t tag, std::chrono::milliseconds timeout,
                               std::vector<uint8_t>& scratch);

// Rank-order all_reduce of `count` elements in place (Note [Gloo rank-order reduction]): a
// rank-order reduce-scatter of `size` contiguous chunks, then an all-gather of the reduced chunks;
// every element ends as the shm backend's all_reduce leaves it.
// `whole`: every rank sends the whole tensor to every other rank (one data round, (size - 1) x the
// bytes); else reduce-scatter then all-gather (two rounds, a ring's bytes). Two ranks always send
// whole tensors. The caller chooses (Note [Cost model] in src/distributed/cost_model.cpp), the
// same on every rank; both give the same bits.
void rank_order_all_reduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
                           DType dtype, ReduceOp op, bool whole, uint32_t tag,
                           std::chrono::milliseconds timeout, std::vector<uint8_t>& scratch);

}  // namespace lockstep::dist::detail
