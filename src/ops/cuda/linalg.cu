// The CUDA linalg kernels: gemm through cuBLASLt (operands read in place through its transposes,
// the batch as its strided batch, the bias as its epilogue) and sum_rows (column sums).
#include <array>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>

#include "ops/cuda/channel_reduce.cuh"
#include "ops/cuda/handles.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"
#include "ops/gemm_layout.h"

namespace lockstep::cuda_ops {

namespace {

using detail::GemmPlan;
using detail::LtOperand;

// Note [cuBLASLt matmul]
// Each product is one cublasLtMatmul per call of its plan (Note [cuBLASLt layouts] in
// src/ops/gemm_layout.h) on the current stream: f32 in CUBLAS_COMPUTE_32F, or _FAST_TF32 when
// lockstep::cuda::allow_tf32(); f64 in CUBLAS_COMPUTE_64F; bf16 and f16 operands into an f32
// c with f32 accumulation. The bias rides the CUBLASLT_EPILOGUE_BIAS epilogue (a vector over
// D's rows, which are c's columns); where cuBLASLt has no algorithm with it for a layout, c is
// first filled with the bias rows and the product added with beta = 1. The heuristic's answer
// (algorithm and workspace size) is cached per shape key (dtype, layouts, batch, epilogue, TF32,
// pointer alignments, device), since asking costs about as much as a small product; the
// workspace comes from the caching allocator, on the stream the product runs on.
constexpr size_t kMaxWorkspaceBytes = size_t{32} << 20;
constexpr int64_t kMaxAlignment = 256;

template <typename T>
using Owned = std::unique_ptr<std::remove_pointer_t<T>, cublasStatus_t (*)(T)>;

Owned<cublasLtMatmulDesc_t> make_matmul_desc(cublasComputeType_t compute, cudaDataType_t scale) {
  cublasLtMatmulDesc_t d = nullptr;
  LS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, scale));
  return {d, cublasLtMatmulDescDestroy};
}

Owned<cublasLtMatrixLayout_t> make_layout(cudaDataType_t type, int64_t rows, int64_t cols,
                                          int64_t ld, int64_t batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  LS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  Owned<cublasLtMatrixLayout_t> owned(l, cublasLtMatrixLayoutDestroy);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    LS_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                     sizeof(count)));
    LS_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                     &batch_stride, sizeof(batch_stride)));
  }
  return owned;
}

Owned<cublasLtMatmulPreference_t> make_preference(const std::array<uint32_t, 4>& align) {
  cublasLtMatmulPreference_t p = nullptr;
  LS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p));
  Owned<cublasLtMatmulPreference_t> owned(p, cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = kMaxWorkspaceBytes;
  LS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &ws, sizeof(ws)));
  const cublasLtMatmulPreferenceAttributes_t attrs[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    LS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attrs[i], &align[i], sizeof(align[i])));
  return owned;
}

// The largest power of two (up to kMaxAlignment) dividing the address: cuBLASLt picks kernels
// for the alignment it is promised.
uint32_t alignment_of(uintptr_t a) {
  int64_t align = 1;
  while (align < kMaxAlignment && a % (2 * align) == 0) align *= 2;
  return static_cast<uint32_t>(align);
}

uint32_t alignment_of(const void* p) { return alignment_of(reinterpret_cast<uintptr_t>(p)); }

// The types of one product.
struct GemmTypes {
  cudaDataType_t ab, cd, scale;
  cublasComputeType_t compute;
};

GemmTypes gemm_types(DType dt) {
  switch (dt) {
    case DType::f32:
      return {CUDA_R_32F, CUDA_R_32F, CUDA_R_32F,
              cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::f64:
      return {CUDA_R_64F, CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::bf16:
      return {CUDA_R_16BF, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::f16:
      return {CUDA_R_16F, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    default:
      LS_THROW("matmul: dtype ", dtype_name(dt), " is not supported on cuda (expected f32, f64, ",
               "bf16 or f16)");
  }
}

// The heuristic's answer per shape key; nullopt: no algorithm for that key.
struct Heuristic {
  cublasLtMatmulAlgo_t algo;
  size_t workspace = 0;
};

class HeuristicCache {
 public:
  using Key = std::array<int64_t, 19>;

  // The cached answer for `key`, or ask(): called without the lock (two threads may both ask
  // for a new key; they get the same answer).
  template <typename Ask>
  std::optional<Heuristic> get(const Key& key, Ask ask) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) return it->second;
    }
    std::optional<Heuristic> h = ask();
    std::lock_guard<std::mutex> lock(mu_);
    cache_.emplace(key, h);
    return h;
  }

 private:
  std::mutex mu_;
  std::map<Key, std::optional<Heuristic>> cache_;
};

HeuristicCache& heuristic_cache() {
  static HeuristicCache cache;
  return cache;
}

// Every row of the contiguous c (rows x n) = bias (n, contiguous).
template <typename T>
__global__ void fill_bias_rows_kernel(int64_t total, int64_t n, const T* bias, T* c) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step)
    c[e] = bias[e % n];
}

void fill_bias_rows(const Tensor& c, const Tensor& bias) {
  const int64_t total = c.numel();
  dispatch_float(c.dtype(), "matmul", [&]<typename T>() {
    fill_bias_rows_kernel<T><<<grid_for(total), kBlock, 0, current_cuda_stream()>>>(
        total, c.size(-1), data_of<T>(bias), data_of<T>(c));
    check_launch("matmul", c);
  });
}

// The matmul descriptor of one product, with the epilogue when `bias` is given.
Owned<cublasLtMatmulDesc_t> matmul_desc(const GemmTypes& types, const GemmPlan& p,
                                        const void* bias) {
  auto desc = make_matmul_desc(types.compute, types.scale);
  // cuBLASLt's A is b's operand, its B is a's (Note [cuBLASLt layouts]).
  const cublasOperation_t ta = p.b_op.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.a_op.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  LS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    LS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                   &epilogue, sizeof(epilogue)));
    LS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &bias, sizeof(bias)));
  }
  return desc;
}

// The plan of c = a @ b with a and b expanded to c's batch dims; an operand cuBLASLt cannot read
// in place is made contiguous (Note [cuBLASLt layouts]).
GemmPlan plan_for(const Dims& batch, int64_t m, int64_t n, int64_t k, Tensor* a, Tensor* b) {
  GemmPlan plan;
  bool a_fits = false, b_fits = false;
  if (detail::plan_gemm(batch, m, n, k, a->strides(), b->strides(), &plan, &a_fits, &b_fits))
    return plan;
  Dims a_shape = batch, b_shape = batch;
  a_shape.push_back(m);
  a_shape.push_back(k);
  b_shape.push_back(k);
  b_shape.push_back(n);
  if (!a_fits) *a = a->contiguous().expand(a_shape);
  if (!b_fits) *b = b->contiguous().expand(b_shape);
  LS_CHECK(detail::plan_gemm(batch, m, n, k, a->strides(), b->strides(), &plan, &a_fits, &b_fits),
           "matmul: no cuBLASLt layout for operands of strides ", a->strides().str(), " and ",
           b->strides().str(), " after a contiguous copy");
  return plan;
}

void gemm_kernel(const Tensor& c, const Tensor& a_in, const Tensor& b_in, const Tensor& bias_in) {
  const int64_t m = c.size(-2), n = c.size(-1), k = a_in.size(-1);
  if (c.numel() == 0) return;
  TensorDeviceGuard guard(c);
  cudaStream_t stream = current_cuda_stream();
  const Tensor bias = bias_in.defined() ? bias_in.contiguous() : bias_in;
  if (k == 0) {  // an empty sum: c is the bias rows, or zeros
    if (bias.defined()) return fill_bias_rows(c, bias);
    LS_CUDA_CHECK(cudaMemsetAsync(c.data_ptr(), 0, static_cast<size_t>(c.nbytes()), stream));
    return;
  }
  Dims batch = c.shape();
  batch.resize(batch.size() - 2);
  Dims a_shape = batch, b_shape = batch;
  a_shape.push_back(m);
  a_shape.push_back(k);
  b_shape.push_back(k);
  b_shape.push_back(n);
  Tensor a = a_in.expand(a_shape), b = b_in.expand(b_shape);
  const GemmPlan p = plan_for(batch, m, n, k, &a, &b);
  const GemmTypes types = gemm_types(a.dtype());
  const int64_t ab_size = a.element_size(), cd_size = c.element_size();

  // The layouts of cuBLASLt's A (b), B (a) and C = D (c^T), see Note [cuBLASLt layouts].
  auto la = make_layout(types.ab, p.b_op.rows, p.b_op.cols, p.b_op.ld, p.batch, p.b_batch_stride);
  auto lb = make_layout(types.ab, p.a_op.rows, p.a_op.cols, p.a_op.ld, p.batch, p.a_batch_stride);
  auto lc = make_layout(types.cd, p.n, p.m, p.n, p.batch, p.c_batch_stride);

  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  auto* pc = static_cast<char*>(c.data_ptr());
  // The alignments every call of the plan can promise: the base pointers' and the offsets'.
  std::array<uint32_t, 4> align = {alignment_of(pb), alignment_of(pa), alignment_of(pc),
                                   alignment_of(pc)};
  // A strided batch steps each pointer by its batch stride.
  auto stride_alignment = [](int64_t stride_bytes) {
    return alignment_of(static_cast<uintptr_t>(stride_bytes));  // 0: kMaxAlignment
  };
  if (p.batch > 1) {
    align[0] = std::min(align[0], stride_alignment(p.b_batch_stride * ab_size));
    align[1] = std::min(align[1], stride_alignment(p.a_batch_stride * ab_size));
    align[2] = align[3] = std::min(align[2], stride_alignment(p.c_batch_stride * cd_size));
  }
  for (int64_t i = 1; i < p.calls(); ++i) {
    int64_t oa, ob, oc;
    p.offsets(i, &oa, &ob, &oc);
    align[0] = std::min(align[0], alignment_of(pb + ob * ab_size));
    align[1] = std::min(align[1], alignment_of(pa + oa * ab_size));
    align[2] = align[3] = std::min(align[2], alignment_of(pc + oc * cd_size));
  }
  const uint32_t bias_align = bias.defined() ? alignment_of(bias.data_ptr()) : 0;

  CublasLtLease handle;
  auto ask = [&](const void* bias_ptr) {
    return [&, bias_ptr]() -> std::optional<Heuristic> {
      auto desc = matmul_desc(types, p, bias_ptr);
      auto pref = make_preference(align);
      cublasLtMatmulHeuristicResult_t result = {};
      int found = 0;
      const cublasStatus_t status =
          cublasLtMatmulAlgoGetHeuristic(handle.get(), desc.get(), la.get(), lb.get(), lc.get(),
                                         lc.get(), pref.get(), 1, &result, &found);
      if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0))
        return std::nullopt;
      LS_CUBLAS_CHECK(status);
      return Heuristic{result.algo, result.workspaceSize};
    };
  };
  // The shape key; its last two entries say whether the epilogue (and its alignment) apply.
  // clang-format off
  HeuristicCache::Key key = {
      cuda::current_device(), static_cast<int64_t>(a.dtype()),
      static_cast<int64_t>(types.compute), p.m, p.n, p.k, p.a_op.trans, p.a_op.ld, p.b_op.trans,
      p.b_op.ld, p.batch, p.a_batch_stride, p.b_batch_stride, p.c_batch_stride, align[0],
      align[1], align[2], bias_align, bias.defined()};
  // clang-format on
  std::optional<Heuristic> h;
  const void* epilogue_bias = nullptr;
  if (bias.defined()) {
    h = heuristic_cache().get(key, ask(bias.data_ptr()));
    if (h) epilogue_bias = bias.data_ptr();
  }
  if (!h) {
    key[17] = key[18] = 0;  // the same product without the epilogue
    h = heuristic_cache().get(key, ask(nullptr));
    LS_CHECK(h.has_value(), "matmul: cuBLASLt has no algorithm for ", dtype_name(a.dtype()),
             " operands of shapes ", a_in.shape().str(), " and ", b_in.shape().str(), " (strides ",
             a.strides().str(), " and ", b.strides().str(), ")");
    if (bias.defined()) fill_bias_rows(c, bias);
  }
  auto desc = matmul_desc(types, p, epilogue_bias);
  Tensor workspace;
  void* ws = nullptr;
  if (h->workspace > 0) {
    workspace =
        empty({static_cast<int64_t>(h->workspace)}, TensorOptions(kUInt8).with_device(c.device()));
    ws = workspace.data_ptr();
  }
  // Bias rows already in c are kept: beta = 1.
  const bool accumulate = bias.defined() && epilogue_bias == nullptr;
  const double alpha_d = 1.0, beta_d = accumulate ? 1.0 : 0.0;
  const float alpha_f = 1.0f, beta_f = accumulate ? 1.0f : 0.0f;
  const bool f64 = types.scale == CUDA_R_64F;
  const void* alpha = f64 ? static_cast<const void*>(&alpha_d) : &alpha_f;
  const void* beta = f64 ? static_cast<const void*>(&beta_d) : &beta_f;
  for (int64_t i = 0; i < p.calls(); ++i) {
    int64_t oa, ob, oc;
    p.offsets(i, &oa, &ob, &oc);
    void* d = pc + oc * cd_size;
    LS_CUBLAS_CHECK(cublasLtMatmul(handle.get(), desc.get(), alpha, pb + ob * ab_size, la.get(),
                                   pa + oa * ab_size, lb.get(), beta, d, lc.get(), d, lc.get(),
                                   &h->algo, ws, h->workspace, stream));
  }
}

// ---- sum_rows ----

template <typename T>
struct ColumnValue {
  const T* g;
  int64_t rs, cs;
  __device__ Sums<1> operator()(int64_t c, int64_t r, int64_t) const {
    Sums<1> s;
    s.v[0] = static_cast<double>(g[r * rs + c * cs]);
    return s;
  }
};

template <typename T>
struct ColumnStore {
  T* out;
  __device__ void operator()(int64_t c, const Sums<1>& s) const { out[c] = static_cast<T>(s.v[0]); }
};

// Column sums in double, in an order fixed by the shape (Note [Deterministic CUDA reductions]).
void sum_rows_kernel(const Tensor& out, const Tensor& g) {
  TensorDeviceGuard guard(g);
  dispatch_float(g.dtype(), "linear backward", [&]<typename T>() {
    channel_reduce<Sums<1>>("linear backward", g.device(), g.size(0), g.size(1), 1,
                            ColumnValue<T>{data_of<T>(g), g.stride(0), g.stride(1)},
                            ColumnStore<T>{data_of<T>(out)});
  });
}

}  // namespace

void fill_linalg_kernels(Kernels& k) {
  k.gemm = gemm_kernel;
  k.sum_rows = sum_rows_kernel;
}

}  // namespace lockstep::cuda_ops
