// Multi-tensor kernels: the GradScaler's unscale + inf check and the fused SGD and AdamW updates,
// each one launch over every tensor of a list.
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"
#include "ops/update_rule.h"

namespace lockstep::cuda_ops {

using namespace lockstep::cuda;
using detail::AdamWScalars;
using detail::AdamWStep;
using detail::SgdScalars;

namespace {

// Note [Multi-tensor kernels]
// A model has dozens to hundreds of parameters, most of them small; one launch per tensor
// costs more than the arithmetic (a launch is ~3-5 us, a 64x10 bias update is nothing). So the
// host writes a table of chunks, (tensor, first element, element count) with at most kChunk
// elements each, plus each tensor's pointers, into one pinned block, copies it to the device
// asynchronously on the current stream, and launches one block per chunk. The table lives in a
// device buffer from the caching allocator, freed right after the launch: the allocator reuses
// it only on the same stream, after this kernel. No host synchronisation anywhere: the
// GradScaler reads found_inf once per step, when it decides whether to step (PyTorch does the
// same).
constexpr int64_t kChunk = 65536;
constexpr int kMaxLists = 4;

struct TensorEntry {
  void* ptr[kMaxLists];
  int64_t numel;
  int dtype;  // DType as an int (unscale_check mixes dtypes)
  float step_size, bc2_sqrt;
  double step_size_d, bc2_sqrt_d;
  int first;  // SGD: momentum buffer is new
};

struct ChunkEntry {
  int32_t tensor;
  int64_t begin, count;
};

// The table on the device: n_tensors entries, then n_chunks chunks.
struct Table {
  const TensorEntry* tensors;
  const ChunkEntry* chunks;
};

struct Plan {
  std::vector<TensorEntry> tensors;
  std::vector<ChunkEntry> chunks;
};

void add_tensor(Plan& plan, TensorEntry e) {
  const int32_t index = static_cast<int32_t>(plan.tensors.size());
  for (int64_t b = 0; b < e.numel; b += kChunk) {
    plan.chunks.push_back({index, b, std::min(kChunk, e.numel - b)});
  }
  plan.tensors.push_back(e);
}

// Copies the plan to the device; the returned tensor holds the table (keep it until launched).
Tensor upload(const Plan& plan, const Device& device, Table* table) {
  const size_t tbytes = plan.tensors.size() * sizeof(TensorEntry);
  const size_t cbytes = plan.chunks.size() * sizeof(ChunkEntry);
  const size_t cstart = (tbytes + 15) / 16 * 16;
  const size_t total = cstart + cbytes;
  Tensor buf = empty({static_cast<int64_t>(total)}, TensorOptions(kUInt8).with_device(device));
  void* host = alloc_pinned(total);
  std::memcpy(host, plan.tensors.data(), tbytes);
  std::memcpy(static_cast<char*>(host) + cstart, plan.chunks.data(), cbytes);
  cudaStream_t stream = current_cuda_stream();
  cudaError_t err = cudaMemcpyAsync(buf.data_ptr(), host, total, cudaMemcpyHostToDevice, stream);
  free_pinned(host, stream);
  LS_CUDA_CHECK(err);
  table->tensors = static_cast<const TensorEntry*>(buf.data_ptr());
  table->chunks = reinterpret_cast<const ChunkEntry*>(static_cast<char*>(buf.data_ptr()) + cstart);
  return buf;
}

template <typename T>
__device__ inline float load_f(const void* p, int64_t i) {
  return static_cast<float>(static_cast<const T*>(p)[i]);
}

__device__ inline float load_any(int dtype, const void* p, int64_t i) {
  switch (static_cast<DType>(dtype)) {
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::bf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return 0.f;
  }
}

__device__ inline void store_any(int dtype, void* p, int64_t i, float v) {
  switch (static_cast<DType>(dtype)) {
    case DType::f32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::bf16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
      break;
    case DType::f16:
      static_cast<__half*>(p)[i] = __float2half(v);
      break;
    default:
      break;
  }
}

// g *= inv; found becomes 1 if any result is not finite. f64 gradients compute in double.
__global__ void unscale_check_kernel(Table table, double inv, float* found) {
  const ChunkEntry c = table.chunks[blockIdx.x];
  const TensorEntry& t = table.tensors[c.tensor];
  bool bad = false;
  if (static_cast<DType>(t.dtype) == DType::f64) {
    double* g = static_cast<double*>(t.ptr[0]);
    for (int64_t i = c.begin + threadIdx.x; i < c.begin + c.count; i += blockDim.x) {
      const double v = g[i] * inv;
      g[i] = v;
      bad |= !isfinite(v);
    }
  } else {
    const float f = static_cast<float>(inv);
    for (int64_t i = c.begin + threadIdx.x; i < c.begin + c.count; i += blockDim.x) {
      const float v = load_any(t.dtype, t.ptr[0], i) * f;
      store_any(t.dtype, t.ptr[0], i, v);
      // The stored value: a finite float can round to inf in f16/bf16 (as the CPU checks it).
      bad |= !isfinite(load_any(t.dtype, t.ptr[0], i));
    }
  }
  // One write per block at most; every writer writes the same 1, so the race is benign.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1.f;
}

// The formulas are update_rule::sgd and update_rule::adamw (src/ops/update_rule.h), as on the CPU.
template <typename T>
__global__ void sgd_kernel(Table table, SgdScalars o) {
  const ChunkEntry c = table.chunks[blockIdx.x];
  const TensorEntry& t = table.tensors[c.tensor];
  T* p = static_cast<T*>(t.ptr[0]);
  const T* g = static_cast<const T*>(t.ptr[1]);
  T* buf = static_cast<T*>(t.ptr[2]);
  const update_rule::Sgd<T> s =
      update_rule::sgd_scalars<T>(o.lr, o.weight_decay, o.momentum, o.dampening);
  const bool decay = o.weight_decay != 0, momentum = buf != nullptr;
  for (int64_t k = c.begin + threadIdx.x; k < c.begin + c.count; k += blockDim.x) {
    update_rule::sgd(p[k], g[k], momentum ? buf + k : nullptr, s, decay, momentum, t.first != 0,
                     o.nesterov);
  }
}

template <typename T>
__global__ void adamw_kernel(Table table, AdamWScalars o) {
  const ChunkEntry c = table.chunks[blockIdx.x];
  const TensorEntry& t = table.tensors[c.tensor];
  T* p = static_cast<T*>(t.ptr[0]);
  const T* g = static_cast<const T*>(t.ptr[1]);
  T* m = static_cast<T*>(t.ptr[2]);
  T* v = static_cast<T*>(t.ptr[3]);
  const update_rule::AdamW<T> s =
      update_rule::adamw_scalars<T>(o.lr, o.weight_decay, o.beta1, o.beta2, o.eps);
  T step_size, bc2_sqrt;
  if constexpr (std::is_same_v<T, double>) {
    step_size = t.step_size_d;
    bc2_sqrt = t.bc2_sqrt_d;
  } else {
    step_size = t.step_size;
    bc2_sqrt = t.bc2_sqrt;
  }
  for (int64_t k = c.begin + threadIdx.x; k < c.begin + c.count; k += blockDim.x) {
    update_rule::adamw(p[k], g[k], m[k], v[k], s, step_size, bc2_sqrt);
  }
}

void check_list(const char* op, const std::vector<Tensor>& ts, const Tensor& first) {
  for (const Tensor& t : ts) {
    LS_CHECK(t.device() == first.device(), op, ": every tensor must be on ", first.device().str(),
             ", got one on ", t.device().str());
    LS_CHECK(t.is_contiguous(), op, ": expected contiguous tensors, got shape ", t.shape().str(),
             " with strides ", t.strides().str());
  }
}

void launch_blocks(const char* op, size_t chunks, auto&& launch) {
  // A grid's x dimension holds 2^31 - 1 blocks: 2^47 elements in 64 Ki chunks.
  if (chunks == 0) return;
  launch(static_cast<unsigned>(chunks));
  check_launch(op);
}

void unscale_check(const std::vector<Tensor>& grads, double inv, const Tensor& found_inf) {
  if (grads.empty()) return;
  check_list("unscale_check", grads, found_inf);
  LS_CHECK(found_inf.dtype() == kFloat32 && found_inf.numel() == 1, "unscale_check: found_inf ",
           "must be one f32 element, got ", found_inf.shape().str(), " of ",
           dtype_name(found_inf.dtype()));
  Plan plan;
  for (const Tensor& g : grads) {
    LS_CHECK(is_floating(g.dtype()), "unscale_check: gradients must be floating, got ",
             dtype_name(g.dtype()));
    TensorEntry e{};
    e.ptr[0] = g.data_ptr();
    e.numel = g.numel();
    e.dtype = static_cast<int>(g.dtype());
    add_tensor(plan, e);
  }
  TensorDeviceGuard guard(found_inf);
  Table table{};
  Tensor keep = upload(plan, found_inf.device(), &table);
  float* found = static_cast<float*>(found_inf.data_ptr());
  launch_blocks("unscale_check", plan.chunks.size(), [&](unsigned n) {
    unscale_check_kernel<<<n, kBlock, 0, current_cuda_stream()>>>(table, inv, found);
  });
}

void sgd_update(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const std::vector<Tensor>& bufs, const std::vector<uint8_t>& first,
                const SgdScalars& o) {
  if (params.empty()) return;
  LS_CHECK(grads.size() == params.size() && (bufs.empty() || bufs.size() == params.size()) &&
               first.size() == params.size(),
           "sgd_update: ", params.size(), " params but ", grads.size(), " grads, ", bufs.size(),
           " buffers and ", first.size(), " flags");
  check_list("sgd_update", params, params[0]);
  check_list("sgd_update", grads, params[0]);
  check_list("sgd_update", bufs, params[0]);
  const DType dt = params[0].dtype();
  Plan plan;
  for (size_t i = 0; i < params.size(); ++i) {
    LS_CHECK(params[i].dtype() == dt && grads[i].dtype() == dt &&
                 grads[i].numel() == params[i].numel(),
             "sgd_update: parameter ", i, " and its gradient must be ", dtype_name(dt),
             " of one size");
    TensorEntry e{};
    e.ptr[0] = params[i].data_ptr();
    e.ptr[1] = grads[i].data_ptr();
    e.ptr[2] = bufs.empty() ? nullptr : bufs[i].data_ptr();
    e.numel = params[i].numel();
    e.first = first[i];
    add_tensor(plan, e);
  }
  TensorDeviceGuard guard(params[0]);
  Table table{};
  Tensor keep = upload(plan, params[0].device(), &table);
  dispatch_float(dt, "sgd_update", [&]<typename T>() {
    launch_blocks("sgd_update", plan.chunks.size(), [&](unsigned n) {
      sgd_kernel<T><<<n, kBlock, 0, current_cuda_stream()>>>(table, o);
    });
  });
}

void adamw_update(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                  const std::vector<AdamWStep>& steps, const AdamWScalars& o) {
  if (params.empty()) return;
  const size_t n = params.size();
  LS_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n &&
               steps.size() == n,
           "adamw_update: lists of different lengths (", n, " params, ", grads.size(),
           " grads, ", exp_avg.size(), " + ", exp_avg_sq.size(), " moments, ", steps.size(),
           " steps)");
  for (const auto* list : {&params, &grads, &exp_avg, &exp_avg_sq})
    check_list("adamw_update", *list, params[0]);
  const DType dt = params[0].dtype();
  Plan plan;
  for (size_t i = 0; i < n; ++i) {
    for (const auto* list : {&grads, &exp_avg, &exp_avg_sq}) {
      const Tensor& t = (*list)[i];
      LS_CHECK(t.dtype() == dt && t.numel() == params[i].numel(), "adamw_update: parameter ", i,
               " is ", params[i].numel(), " elements of ", dtype_name(dt), " but its state has ",
               t.numel(), " of ", dtype_name(t.dtype()));
    }
    TensorEntry e{};
    e.ptr[0] = params[i].data_ptr();
    e.ptr[1] = grads[i].data_ptr();
    e.ptr[2] = exp_avg[i].data_ptr();
    e.ptr[3] = exp_avg_sq[i].data_ptr();
    e.numel = params[i].numel();
    e.step_size = static_cast<float>(steps[i].step_size);
    e.bc2_sqrt = static_cast<float>(steps[i].bc2_sqrt);
    e.step_size_d = steps[i].step_size;
    e.bc2_sqrt_d = steps[i].bc2_sqrt;
    add_tensor(plan, e);
  }
  TensorDeviceGuard guard(params[0]);
  Table table{};
  Tensor keep = upload(plan, params[0].device(), &table);
  dispatch_float(dt, "adamw_update", [&]<typename T>() {
    launch_blocks("adamw_update", plan.chunks.size(), [&](unsigned nb) {
      adamw_kernel<T><<<nb, kBlock, 0, current_cuda_stream()>>>(table, o);
    });
  });
}

}  // namespace

void fill_multi_tensor_kernels(Kernels& k) {
  k.unscale_check = unscale_check;
  k.sgd_update = sgd_update;
  k.adamw_update = adamw_update;
}

}  // namespace lockstep::cuda_ops
