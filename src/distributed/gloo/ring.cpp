#include "distributed/gloo/ring.h"

#include <cstring>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "distributed/deadline.h"

namespace lockstep::dist::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Slot prefixes of lockstep's own point-to-point exchanges, beside Gloo's (gloo/types.h uses
// 0x01-0x08): a collective's tag then names a slot no Gloo collective uses.
constexpr uint8_t kSignatureSlotPrefix = 0x40;
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;

// waitRecv/waitSend throw on a timeout or a failed peer; false means aborted, which lockstep
// never asks for, so it is reported as a failure too.
void wait_recv(gloo::transport::UnboundBuffer& b, Clock::time_point deadline, const char* what) {
  if (!b.waitRecv(time_left(deadline))) LS_THROW(what, ": the receive was aborted");
}
void wait_send(gloo::transport::UnboundBuffer& b, Clock::time_point deadline, const char* what) {
  if (!b.waitSend(time_left(deadline))) LS_THROW(what, ": the send was aborted");
}

}  // namespace

// Note [Gloo signature check]
// Gloo trusts its callers: a rank whose message is longer than the receiver posted trips an
// assertion on Gloo's event-loop thread, which kills the process (`op.preamble.length <=
// op.nbytes`), and shorter messages are taken as complete. So before any data moves, every rank
// sends its CallSignature (24 bytes) to every other rank and receives theirs, all at once: one
// network latency, not a ring's size - 1 of them. Every rank then holds the same signatures and
// either all go on or all throw the same CallMismatch. Since no data has moved, the group stays
// usable after a mismatch, as the shm backend's does. What it costs is measured by bench/allreduce
// (docs/PERFORMANCE.md).
void check_signatures(const std::shared_ptr<gloo::Context>& ctx, const CallSignature& mine,
                      uint32_t tag, std::chrono::milliseconds timeout) {
  const int size = ctx->size;
  const int rank = ctx->rank;
  if (size == 1) return;
  const auto deadline = Clock::now() + timeout;
  std::vector<CallSignature> all(static_cast<size_t>(size));
  all[static_cast<size_t>(rank)] = mine;
  CallSignature out = mine;
  auto in_buf = ctx->createUnboundBuffer(all.data(), all.size() * sizeof(CallSignature));
  auto out_buf = ctx->createUnboundBuffer(&out, sizeof(CallSignature));
  const uint64_t slot = gloo::Slot::build(kSignatureSlotPrefix, tag);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    in_buf->recv(r, slot, static_cast<size_t>(r) * sizeof(CallSignature), sizeof(CallSignature));
  }
  for (int r = 0; r < size; ++r) {
    if (r != rank) out_buf->send(r, slot);
  }
  for (int i = 0; i < size - 1; ++i) wait_recv(*in_buf, deadline, "the signature check");
  for (int i = 0; i < size - 1; ++i) wait_send(*out_buf, deadline, "the signature check");
  const std::string m = call_mismatch(all);
  if (!m.empty()) throw CallMismatch(m, __FILE__, __LINE__);
}

// Note [Gloo ring reduce-scatter]
// Gloo's collectives API has no reduce-scatter; an all_reduce of a copy moves twice the bytes.
// The ring: chunk c ends on rank c, and its partial sum travels c + 1 -> c + 2 -> ... -> c,
// each rank adding its own chunk c to what it receives. At step s (0 .. size - 2) rank r sends
// the partial of chunk r - 1 - s to r + 1 and receives that of chunk r - 2 - s from r - 1; the
// last step's chunk is r itself, reduced straight into the output. Every rank sends and receives
// (size - 1) chunks, the least any reduce-scatter can. Partials alternate between two scratch
// chunks, so the reduction of step s never writes the chunk step s - 1 may still be sending.
// The order of the sum of chunk c is ((x[c+1] + x[c+2]) + ...) + x[c]: fixed, so the same
// inputs give the same bits from run to run (an all_reduce adds in another order, so the two
// agree within rounding).
void ring_reduce_scatter(const std::shared_ptr<gloo::Context>& ctx, void* output, const void* input,
                         size_t chunk_bytes, size_t element_size, ReduceFn reduce, uint32_t tag,
                         std::chrono::milliseconds timeout) {
  const int size = ctx->size;
  const int rank = ctx->rank;
  const auto* in = static_cast<const uint8_t*>(input);
  if (size == 1) {
    std::memcpy(output, input, chunk_bytes);
    return;
  }
  if (chunk_bytes == 0) return;
  const auto deadline = Clock::now() + timeout;
  const size_t n = chunk_bytes / element_size;
  const auto chunk = [&](int c) { return static_cast<size_t>(((c % size) + size) % size); };
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;

  std::vector<uint8_t> scratch(3 * chunk_bytes);  // received, and two partials
  uint8_t* received = scratch.data();
  uint8_t* partial[2] = {scratch.data() + chunk_bytes, scratch.data() + 2 * chunk_bytes};
  // Gloo sends from registered buffers; the input is sent from where it lies at step 0.
  auto in_buf = ctx->createUnboundBuffer(const_cast<uint8_t*>(in), size * chunk_bytes);
  auto recv_buf = ctx->createUnboundBuffer(received, chunk_bytes);
  std::unique_ptr<gloo::transport::UnboundBuffer> partial_buf[2] = {
      ctx->createUnboundBuffer(partial[0], chunk_bytes),
      ctx->createUnboundBuffer(partial[1], chunk_bytes)};
  const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);

  for (int s = 0; s + 1 < size; ++s) {
    recv_buf->recv(prev, slot, 0, chunk_bytes);
    gloo::transport::UnboundBuffer* sending = nullptr;
    if (s == 0) {
      sending = in_buf.get();
      sending->send(next, slot, chunk(rank - 1) * chunk_bytes, chunk_bytes);
    } else {
      sending = partial_buf[(s - 1) % 2].get();
      sending->send(next, slot, 0, chunk_bytes);
    }
    wait_recv(*recv_buf, deadline, "reduce_scatter");
    const bool last = s + 2 == size;
    void* dst = last ? output : partial[s % 2];
    reduce(dst, received, in + chunk(rank - 2 - s) * chunk_bytes, n);
    wait_send(*sending, deadline, "reduce_scatter");
  }
}

}  // namespace lockstep::dist::detail
