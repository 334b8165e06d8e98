#include "distributed/call_signature.h"

#include "lockstep/base/error.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/dtype.h"

namespace lockstep::dist::detail {

using lockstep::detail::str_cat;

std::string_view call_kind_name(uint32_t kind) {
  switch (static_cast<CallKind>(kind)) {
    case CallKind::all_reduce:
      return "all_reduce";
    case CallKind::broadcast:
      return "broadcast";
    case CallKind::all_gather:
      return "all_gather";
    case CallKind::reduce_scatter:
      return "reduce_scatter";
    case CallKind::barrier:
      return "barrier";
  }
  return "?";
}

CallSignature signature(CallKind kind, const Tensor* t, ReduceOp op, int root) {
  CallSignature s;
  s.kind = static_cast<uint32_t>(kind);
  if (t != nullptr) {
    s.dtype = static_cast<uint32_t>(t->dtype());
    s.numel = t->numel();
  }
  s.op = static_cast<uint32_t>(op);
  s.root = root;
  return s;
}

std::string call_mismatch(const std::vector<CallSignature>& by_rank) {
  if (by_rank.empty()) return "";
  const CallSignature& h0 = by_rank[0];
  const auto op = call_kind_name(h0.kind);
  for (size_t r = 1; r < by_rank.size(); ++r) {
    const CallSignature& h = by_rank[r];
    if (h.kind != h0.kind) {
      return str_cat("rank ", r, " called ", call_kind_name(h.kind), ", rank 0 called ", op,
                     ": every rank must issue the same collectives in the same order");
    }
    if (h.dtype != h0.dtype) {
      return str_cat(op, ": rank ", r, " has ", dtype_name(static_cast<DType>(h.dtype)),
                     " tensors, rank 0 has ", dtype_name(static_cast<DType>(h0.dtype)));
    }
    if (h.numel != h0.numel) {
      return str_cat(op, ": rank ", r, " has ", h.numel, " elements, rank 0 has ", h0.numel);
    }
    if (h.op != h0.op) {
      return str_cat(op, ": rank ", r, " reduces with ",
                     reduce_op_name(static_cast<ReduceOp>(h.op)), ", rank 0 with ",
                     reduce_op_name(static_cast<ReduceOp>(h0.op)));
    }
    if (h.root != h0.root) {
      return str_cat(op, ": rank ", r, " has root ", h.root, ", rank 0 has root ", h0.root);
    }
  }
  return "";
}

}  // namespace lockstep::dist::detail
