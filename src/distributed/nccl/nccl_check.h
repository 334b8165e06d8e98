// LS_NCCL_CHECK: every NCCL call checked, its failure an Error naming the call and NCCL's words.
#pragma once

#include <nccl.h>

#include "lockstep/base/error.h"

namespace lockstep::dist::detail {

// "ncclAllReduce(...) failed: unhandled system error (ncclSystemError): <NCCL's last error>".
[[noreturn]] void throw_nccl_error(ncclResult_t result, const char* call, const char* file,
                                   int line);

}  // namespace lockstep::dist::detail

#define LS_NCCL_CHECK(call)                                                                   \
  do {                                                                                        \
    ncclResult_t ls_nccl_result_ = (call);                                                    \
    if (ls_nccl_result_ != ncclSuccess) [[unlikely]]                                          \
      ::lockstep::dist::detail::throw_nccl_error(ls_nccl_result_, #call, __FILE__, __LINE__); \
  } while (0)
