// Collectives lockstep runs over Gloo's point-to-point transport (unbound buffers), where
// Gloo's collectives API has none or checks nothing: the signature exchange that precedes every
// collective, and a ring reduce-scatter.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/call_signature.h"
#include "distributed/gloo/reduce.h"

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

// Ring reduce-scatter (Note [Gloo ring reduce-scatter]): `input` holds size x `chunk_bytes`;
// `output` (chunk_bytes) receives the reduction of every rank's chunk `rank`. `reduce` works on
// elements of `element_size` bytes.
void ring_reduce_scatter(const std::shared_ptr<gloo::Context>& ctx, void* output, const void* input,
                         size_t chunk_bytes, size_t element_size, ReduceFn reduce, uint32_t tag,
                         std::chrono::milliseconds timeout);

}  // namespace lockstep::dist::detail
