#include "distributed/gloo/p2p.h"

#include <algorithm>
#include <cstring>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "distributed/deadline.h"
// The shm backend's rank-order kernel, so that both backends compute the same bits.
#include "distributed/shm/reduce.h"

namespace lockstep::dist::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Slot prefixes of lockstep's own point-to-point exchanges, beside Gloo's (gloo/types.h uses
// 0x01-0x08): a collective's tag then names a slot no Gloo collective uses.
constexpr uint8_t kSignatureSlotPrefix = 0x40;
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
constexpr uint8_t kAllGatherSlotPrefix = 0x42;

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

// Note [Gloo rank-order reduction]
// Gloo's own allreduce adds the ranks' values in an order set by its ring (each chunk starts at a
// different rank), and a ring reduce-scatter in yet another, so on three ranks or more an
// all_reduce, a reduce-scatter followed by an all-gather, and the shm backend gave three
// different roundings of one sum. Training that reduce-scatters its gradients (ZeRO-1 with
// ZeroOptions::reduce_scatter_gradients, Note [ZeRO-1]) then drifts from plain DDP. Here every
// element is reduced once, by one rank, as x0 op x1 op ... op x(size-1) with the shm backend's
// kernel (Note [Fixed sum order] in shm/reduce.h: halves accumulate in f32 and round once, avg
// divides the sum, integers wrap), and every other rank receives that result; so all_reduce,
// reduce_scatter + all_gather (any chunking) and shm agree bit for bit, at any world size.
//   reduce_scatter, direct: every rank sends its chunk c to rank c, all sends posted at once over
//     Gloo's full mesh of pairs; rank c receives the size - 1 chunks into scratch and reduces
//     them with its own in rank order. Each rank sends and receives (size - 1) / size of the data,
//     as a ring would, in one network latency instead of size - 1. Chunks travel in pieces of
//     kPieceBytes, each reduced as soon as every rank's copy has arrived, so the reduction
//     overlaps the arrival of the next piece (a pair delivers its messages in order).
//   all_reduce: the tensor is split into size contiguous chunks (64-byte multiples; the last ones
//     short or empty), reduce-scattered in place as above, and every reduced piece is sent to
//     every other rank as soon as it is reduced (the all-gather). Two latencies. A rank posts the
//     all-gather's receives into the other ranks' chunks at the start, before its reduce-scatter
//     sends of those chunks: piece p of chunk c can only arrive once rank c has received this
//     rank's piece p of it, that is once this rank's send of those bytes is done, so a received
//     piece never overwrites bytes still being sent. Posted late (after this rank's sends), the
//     notice that a receive is posted, which a Gloo sender waits for, queued behind this rank's
//     outgoing data: between machines at 1 Gbit/s, 4 ranks, a 16 MiB all_reduce took 0.71 of
//     the time a ring needs on that link, and 0.90 with the receives posted first.
//   all_reduce with two ranks, or of a tensor small enough that rounds cost more than bytes
//     (the caller's choice, Note [Cost model] in src/distributed/cost_model.cpp): every rank
//     sends the whole tensor to every other rank and reduces all of it itself, in the same rank
//     order: one latency instead of two, and with two ranks the same bytes on the wire (as the
//     shm backend does, Note [Two ranks reduce whole pieces]). The tensor is both sent and reduced
//     in place, so piece p is overwritten only once it has been sent to every rank (a pair also
//     completes its sends in order).
// The price against Gloo's ring: scratch of size - 1 chunks ((size - 1) / size of the tensor, the
// whole tensor with two ranks) instead of a few segments, kept by the group at the largest size
// seen (fresh pages on every call, a page fault each, made a 64 MiB all_reduce twice as slow),
// and every message of a collective posted at once. Two ranks split into halves instead of
// reducing whole tensors measured the same (bench/allreduce, within this VM's noise); speeds
// against Gloo's own allreduce are in docs/PERFORMANCE.md (2026-12-04).

namespace {

// One message's payload: small enough that reducing a piece overlaps the next one's arrival,
// large enough that per-message costs (a preamble, a wake-up) stay small. 1 MiB pieces made the
// 2-rank 4-64 MiB all_reduce 5-20% faster than 256 KiB ones (bench/allreduce, 2026-12-04).
constexpr size_t kPieceBytes = 1024 * 1024;
// All-reduce chunks start on cache-line boundaries.
constexpr size_t kChunkAlignBytes = 64;

// A buffer of `total` elements seen as one chunk per rank: chunk c starts at c x `stride` and has
// `per` elements, cut at `total` (the last chunks short or empty). stride 0: every chunk is the
// whole buffer.
struct Chunks {
  size_t stride = 0;
  size_t per = 0;
  size_t total = 0;
  size_t begin(int c) const { return std::min(stride * static_cast<size_t>(c), total); }
  size_t size(int c) const { return std::min(begin(c) + per, total) - begin(c); }
};

// What one rank-order reduce-scatter works on.
struct Exchange {
  gloo::Context& ctx;
  const uint8_t* in;  // this rank's input: every rank's chunk
  uint8_t* out;       // where this rank's reduced chunk goes (may be its own chunk of `in`)
  Chunks chunks;
  size_t element_size;
  DType dtype;
  ReduceOp op;
  uint64_t slot;
  Clock::time_point deadline;
  const char* what;               // names the collective in errors
  std::vector<uint8_t>& scratch;  // grown as needed, kept between calls
};

// The direct reduce-scatter of Note [Gloo rank-order reduction]: sends chunk c of `in` to rank c,
// reduces every rank's chunk `rank` in rank order into `out`, piece by piece, and calls
// on_piece(offset, count) (elements into the chunk) after each. Returns once this rank's sends
// are done, so that `in` may be overwritten.
template <typename OnPiece>
void reduce_scatter_pieces(const Exchange& x, OnPiece&& on_piece) {
  gloo::Context& ctx = x.ctx;
  const int size = ctx.size;
  const int me = ctx.rank;
  const size_t es = x.element_size;
  const size_t piece = std::max<size_t>(1, kPieceBytes / es);
  const size_t mine = x.chunks.size(me);
  const auto row = [&](int r) { return static_cast<size_t>(r < me ? r : r - 1); };

  // Every other rank's copy of chunk `me`, a row of scratch each; all receives posted now.
  // Scratch is kept between calls: fresh pages (a page fault each) cost more than the copy.
  const size_t scratch_bytes = static_cast<size_t>(size - 1) * mine * es;
  if (x.scratch.size() < scratch_bytes) x.scratch.resize(scratch_bytes);
  uint8_t* const scratch = x.scratch.data();
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> rows(static_cast<size_t>(size));
  if (mine > 0) {
    for (int r = 0; r < size; ++r) {
      if (r == me) continue;
      auto& b = rows[static_cast<size_t>(r)];
      b = ctx.createUnboundBuffer(scratch + row(r) * mine * es, mine * es);
      for (size_t off = 0; off < mine; off += piece) {
        b->recv(r, x.slot, off * es, std::min(piece, mine - off) * es);
      }
    }
  }
  // Chunk c to rank c, piece p to every rank before piece p + 1. One buffer per destination: a
  // pair completes its sends in order, so n completions there mean its first n pieces are sent.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> dests(static_cast<size_t>(size));
  std::vector<size_t> posted(static_cast<size_t>(size), 0), done(static_cast<size_t>(size), 0);
  for (int c = 0; c < size; ++c) {
    if (c == me || x.chunks.size(c) == 0) continue;
    // Only sent from, never written.
    dests[static_cast<size_t>(c)] =
        ctx.createUnboundBuffer(const_cast<uint8_t*>(x.in), x.chunks.total * es);
  }
  for (size_t off = 0; off < x.chunks.per; off += piece) {
    for (int c = 0; c < size; ++c) {
      if (c == me || off >= x.chunks.size(c)) continue;
      dests[static_cast<size_t>(c)]->send(c, x.slot, (x.chunks.begin(c) + off) * es,
                                          std::min(piece, x.chunks.size(c) - off) * es);
      ++posted[static_cast<size_t>(c)];
    }
  }
  const auto wait_sends = [&](int c, size_t until) {
    const auto i = static_cast<size_t>(c);
    for (; done[i] < until; ++done[i]) wait_send(*dests[i], x.deadline, x.what);
  };
  std::vector<const void*> srcs(static_cast<size_t>(size));
  for (size_t off = 0, p = 0; off < mine; off += piece, ++p) {
    const size_t len = std::min(piece, mine - off);
    for (int r = 0; r < size; ++r) {
      if (r == me) {
        srcs[static_cast<size_t>(r)] = x.in + (x.chunks.begin(me) + off) * es;
      } else {
        wait_recv(*rows[static_cast<size_t>(r)], x.deadline, x.what);
        srcs[static_cast<size_t>(r)] = scratch + (row(r) * mine + off) * es;
      }
    }
    // Every chunk is the whole buffer and reduced in place: piece p of it is overwritten only
    // once every rank has been sent it.
    if (x.chunks.stride == 0 && x.out == x.in) {
      for (int c = 0; c < size; ++c) {
        if (c != me) wait_sends(c, p + 1);
      }
    }
    shm::reduce(x.dtype, x.op, x.out + off * es, srcs.data(), size, len);
    on_piece(off, len);
  }
  for (int c = 0; c < size; ++c) {
    if (c != me) wait_sends(c, posted[static_cast<size_t>(c)]);
  }
}

}  // namespace

void rank_order_reduce_scatter(const std::shared_ptr<gloo::Context>& ctx, void* output,
                               const void* input, size_t count, DType dtype, ReduceOp op,
                               uint32_t tag, std::chrono::milliseconds timeout,
                               std::vector<uint8_t>& scratch) {
  const int size = ctx->size;
  const auto es = static_cast<size_t>(dtype_size(dtype));
  if (count == 0) return;
  if (size == 1) {
    // avg over one rank: the value itself (already there in place).
    if (output != input) std::memcpy(output, input, count * es);
    return;
  }
  const Exchange x{.ctx = *ctx,
                   .in = static_cast<const uint8_t*>(input),
                   .out = static_cast<uint8_t*>(output),
                   .chunks = {.stride = count, .per = count, .total = count * size},
                   .element_size = es,
                   .dtype = dtype,
                   .op = op,
                   .slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag),
                   .deadline = Clock::now() + timeout,
                   .what = "reduce_scatter",
                   .scratch = scratch};
  reduce_scatter_pieces(x, [](size_t, size_t) {});
}

void rank_order_all_reduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
                           DType dtype, ReduceOp op, bool whole, uint32_t tag,
                           std::chrono::milliseconds timeout, std::vector<uint8_t>& scratch) {
  const int size = ctx->size;
  const int me = ctx->rank;
  if (size == 1 || count == 0) return;  // every op of one value is that value
  const auto es = static_cast<size_t>(dtype_size(dtype));
  auto* bytes = static_cast<uint8_t*>(data);
  const auto deadline = Clock::now() + timeout;
  const uint64_t rs_slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  // Whole tensors: every rank receives all of every peer's and reduces it in place.
  Exchange x{.ctx = *ctx,
             .in = bytes,
             .out = bytes,
             .chunks = {.stride = 0, .per = count, .total = count},
             .element_size = es,
             .dtype = dtype,
             .op = op,
             .slot = rs_slot,
             .deadline = deadline,
             .what = "all_reduce",
             .scratch = scratch};
  if (size == 2 || whole) {
    reduce_scatter_pieces(x, [](size_t, size_t) {});
    return;
  }
  const size_t align = std::max<size_t>(1, kChunkAlignBytes / es);
  size_t per = (count + static_cast<size_t>(size) - 1) / static_cast<size_t>(size);
  per = (per + align - 1) / align * align;
  const Chunks chunks{.stride = per, .per = per, .total = count};
  const size_t my_begin = chunks.begin(me);
  x.chunks = chunks;
  x.out = bytes + my_begin * es;
  const uint64_t ag_slot = gloo::Slot::build(kAllGatherSlotPrefix, tag);
  auto gather_buf = ctx->createUnboundBuffer(bytes, count * es);
  // The all-gather's receives are posted first, before any byte of the reduce-scatter moves:
  // a Gloo sender waits for the receiver's notice that a receive is posted, and a notice posted
  // late travels behind whatever this rank has queued by then (Note [Gloo rank-order reduction]).
  const size_t piece = std::max<size_t>(1, kPieceBytes / es);
  size_t recvs = 0;
  for (int c = 0; c < size; ++c) {
    if (c == me) continue;
    for (size_t off = 0; off < chunks.size(c); off += piece) {
      gather_buf->recv(c, ag_slot, (chunks.begin(c) + off) * es,
                       std::min(piece, chunks.size(c) - off) * es);
      ++recvs;
    }
  }
  size_t sends = 0;
  reduce_scatter_pieces(x, [&](size_t off, size_t len) {
    for (int r = 0; r < size; ++r) {
      if (r == me) continue;
      gather_buf->send(r, ag_slot, (my_begin + off) * es, len * es);
      ++sends;
    }
  });
  for (size_t i = 0; i < recvs; ++i) wait_recv(*gather_buf, deadline, "all_reduce");
  for (size_t i = 0; i < sends; ++i) wait_send(*gather_buf, deadline, "all_reduce");
}

}  // namespace lockstep::dist::detail
