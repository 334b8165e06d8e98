// CUDA benchmarks for the lent GPU (scripts/gpu-check.sh): GEMM TFLOP/s through lockstep::matmul
// against cuBLASLt called directly on the same buffers, device-to-device copy bandwidth, and the
// training-step throughput of the Fashion-MNIST MLP and CNN on synthetic batches. Plain C++ timed
// with CUDA events (the GPU machine has no Google Benchmark); writes one JSON object.
//
//   cuda_bench [--json FILE] [--quick] [--only gemm|copy|train]
//
// --only runs one section (the others come out empty), so that a crash in one (a sticky CUDA
// error poisons the process) leaves the others' numbers: scripts/gpu-check.sh runs each apart.
// bench/pytorch_cuda.py measures the same things in PyTorch eager; gpu-check.sh puts the ratios
// side by side. Each figure is the mean over timed repetitions after warm-up ones, all queued on
// lockstep's current stream between two events, so host overhead counts only where it would
// stall the GPU (as in a real training loop, which does not synchronize per step).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_models.h"
#include "lockstep/lockstep.h"
#include "lockstep/tensor/cuda.h"

using namespace lockstep;

namespace {

#define BENCH_CUDA(call)                                                                    \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess)                                                                  \
      throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_));         \
  } while (0)
#define BENCH_LT(call)                                                                      \
  do {                                                                                      \
    cublasStatus_t s_ = (call);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                        \
      throw std::runtime_error(std::string(#call) + ": cuBLAS status " + std::to_string(s_)); \
  } while (0)

cudaStream_t stream() { return static_cast<cudaStream_t>(cuda::current_stream().handle()); }

// Mean milliseconds of `fn` over `reps` runs after `warmup` ones, between two events.
double time_ms(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  cuda::Event start(true), stop(true);
  start.record();
  for (int i = 0; i < reps; ++i) fn();
  stop.record();
  stop.synchronize();
  return stop.elapsed_ms(start) / reps;
}

TensorOptions on_gpu(DType dt) { return TensorOptions(dt).with_device(cuda_device(0)); }

// Row-major C (m, n) = A (m, k) @ B (k, n) through cuBLASLt: column-major C^T = B^T A^T, so B
// goes first. bf16 in and out with f32 accumulation; f32 in TF32 when `tf32`.
class LtGemm {
 public:
  LtGemm(int64_t m, int64_t n, int64_t k, DType dt, bool tf32) {
    const cudaDataType_t t = dt == kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute =
        dt == kFloat32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    BENCH_LT(cublasLtCreate(&handle_));
    BENCH_LT(cublasLtMatmulDescCreate(&desc_, compute, CUDA_R_32F));
    const cublasOperation_t no = CUBLAS_OP_N;
    BENCH_LT(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &no, sizeof(no)));
    BENCH_LT(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &no, sizeof(no)));
    BENCH_LT(cublasLtMatrixLayoutCreate(&first_, t, n, k, n));   // B^T
    BENCH_LT(cublasLtMatrixLayoutCreate(&second_, t, k, m, k));  // A^T
    BENCH_LT(cublasLtMatrixLayoutCreate(&out_, t, n, m, n));     // C^T
    BENCH_LT(cublasLtMatmulPreferenceCreate(&pref_));
    BENCH_LT(cublasLtMatmulPreferenceSetAttribute(
        pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace, sizeof(kWorkspace)));
    int found = 0;
    BENCH_LT(cublasLtMatmulAlgoGetHeuristic(handle_, desc_, first_, second_, out_, out_, pref_, 1,
                                            &heur_, &found));
    if (found == 0) throw std::runtime_error("cuBLASLt found no algorithm");
    BENCH_CUDA(cudaMalloc(&workspace_, kWorkspace));
  }
  ~LtGemm() {
    cudaFree(workspace_);
    cublasLtMatmulPreferenceDestroy(pref_);
    cublasLtMatrixLayoutDestroy(out_);
    cublasLtMatrixLayoutDestroy(second_);
    cublasLtMatrixLayoutDestroy(first_);
    cublasLtMatmulDescDestroy(desc_);
    cublasLtDestroy(handle_);
  }
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const Tensor& a, const Tensor& b, const Tensor& c) const {
    const float alpha = 1, beta = 0;
    BENCH_LT(cublasLtMatmul(handle_, desc_, &alpha, b.data_ptr(), first_, a.data_ptr(), second_,
                            &beta, c.data_ptr(), out_, c.data_ptr(), out_, &heur_.algo,
                            workspace_, kWorkspace, stream()));
  }

 private:
  static constexpr size_t kWorkspace = size_t{32} << 20;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t first_ = nullptr, second_ = nullptr, out_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  cublasLtMatmulHeuristicResult_t heur_{};
  void* workspace_ = nullptr;
};

std::string num(double v) {
  std::ostringstream os;
  os.precision(6);
  os << v;
  return os.str();
}

std::string gemm_json(int64_t size, DType dt, bool quick) {
  const bool tf32 = dt == kFloat32;
  cuda::set_allow_tf32(tf32);
  Generator gen(size);
  const Tensor a = randn({size, size}, gen, on_gpu(dt));
  const Tensor b = randn({size, size}, gen, on_gpu(dt));
  const Tensor c = empty({size, size}, on_gpu(dt));
  const int warmup = 3, reps = quick ? 3 : 10;
  const double flops = 2.0 * size * size * size;
  Tensor keep;
  const double ls_ms = time_ms([&] { keep = matmul(a, b); }, warmup, reps);
  LtGemm lt(size, size, size, dt, tf32);
  const double lt_ms = time_ms([&] { lt.run(a, b, c); }, warmup, reps);
  // The two agree (a wrong fast GEMM is no result): the largest difference relative to the
  // largest magnitude.
  const double diff = max(abs(keep.to(kFloat32) - c.to(kFloat32))).to(kCPU).item();
  const double scale = max(abs(c.to(kFloat32))).to(kCPU).item();
  cuda::set_allow_tf32(false);
  const double ls_tflops = flops / (ls_ms * 1e-3) / 1e12;
  const double lt_tflops = flops / (lt_ms * 1e-3) / 1e12;
  std::cerr << "gemm " << size << "^3 " << dtype_name(dt) << (tf32 ? " (tf32)" : "")
            << ": lockstep " << ls_tflops << " TFLOP/s, cuBLASLt " << lt_tflops
            << " TFLOP/s, max rel diff " << diff / scale << "\n";
  return "{\"m\": " + std::to_string(size) + ", \"n\": " + std::to_string(size) +
         ", \"k\": " + std::to_string(size) + ", \"dtype\": \"" + std::string(dtype_name(dt)) +
         "\", \"tf32\": " + (tf32 ? "true" : "false") + ", \"lockstep_ms\": " + num(ls_ms) +
         ", \"cublaslt_ms\": " + num(lt_ms) + ", \"lockstep_tflops\": " + num(ls_tflops) +
         ", \"cublaslt_tflops\": " + num(lt_tflops) + ", \"ratio\": " + num(ls_tflops / lt_tflops) +
         ", \"max_rel_diff\": " + num(diff / scale) + "}";
}

std::string copy_json(bool quick) {
  const int64_t n = int64_t{1} << 28;  // 1 GiB of f32
  const Tensor src = zeros({n}, on_gpu(kFloat32));
  Tensor dst = empty({n}, on_gpu(kFloat32));
  const int reps = quick ? 5 : 20;
  const double ls_ms = time_ms([&] { dst.copy_(src); }, 3, reps);
  const double raw_ms = time_ms(
      [&] {
        BENCH_CUDA(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n * 4,
                                   cudaMemcpyDeviceToDevice, stream()));
      },
      3, reps);
  // Bytes read plus bytes written, as KINDS.md's 4.3 TB/s.
  const double bytes = 2.0 * n * 4;
  const double ls_gbs = bytes / (ls_ms * 1e-3) / 1e9, raw_gbs = bytes / (raw_ms * 1e-3) / 1e9;
  std::cerr << "copy 1 GiB: lockstep copy_ " << ls_gbs << " GB/s, cudaMemcpyAsync " << raw_gbs
            << " GB/s\n";
  return "{\"bytes\": " + std::to_string(n * 4) + ", \"lockstep_gbs\": " + num(ls_gbs) +
         ", \"cudamemcpy_gbs\": " + num(raw_gbs) + "}";
}

// SGD with momentum on synthetic Fashion-MNIST-shaped batches (the data loader is not measured:
// the batch already sits on the GPU, as in pytorch_cuda.py).
std::string train_json(const std::string& kind, int64_t batch, bool bf16, bool quick) {
  Generator gen(0);
  auto model = examples::build_fashion_mnist_model(kind, gen);
  model->to(cuda_device(0));
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  const Tensor x = randn({batch, 1, 28, 28}, gen, on_gpu(kFloat32));
  const Tensor y = randint(0, 10, {batch}, gen, on_gpu(kInt64));
  auto step = [&] {
    Tensor loss;
    {
      amp::autocast ac(kBFloat16, bf16);
      loss = cross_entropy(model->forward(x), y);
    }
    opt.zero_grad();
    loss.backward();
    opt.step();
  };
  const int reps = quick ? 20 : 200;
  const double ms = time_ms(step, 10, reps);
  const double sps = batch / (ms * 1e-3);
  std::cerr << "train " << kind << " batch " << batch << (bf16 ? " amp bf16" : " f32") << ": "
            << ms << " ms/step, " << sps << " samples/s\n";
  return "{\"model\": \"" + kind + "\", \"batch\": " + std::to_string(batch) +
         ", \"dtype\": \"" + (bf16 ? "amp_bf16" : "f32") + "\", \"ms_per_step\": " + num(ms) +
         ", \"samples_per_s\": " + num(sps) + "}";
}

// Runs one measurement; a failure (a missing kernel, say) is reported in the JSON, not fatal.
std::string guarded(const std::string& what, const std::function<std::string()>& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    std::cerr << what << " failed: " << e.what() << "\n";
    std::string msg = e.what();
    for (char& ch : msg)
      if (ch == '"' || ch == '\\' || ch == '\n') ch = ' ';
    return "{\"what\": \"" + what + "\", \"error\": \"" + msg + "\"}";
  }
}

std::string join(const std::vector<std::string>& items) {
  std::string s = "[";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ",\n    " : "\n    ") + items[i];
  return s + "\n  ]";
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, only;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (arg == "--quick") {
      quick = true;
    } else if (arg == "--only" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "gemm" || std::string(argv[i + 1]) == "copy" ||
                std::string(argv[i + 1]) == "train")) {
      only = argv[++i];
    } else {
      std::cerr << "usage: cuda_bench [--json FILE] [--quick] [--only gemm|copy|train]\n";
      return 2;
    }
  }
  auto wanted = [&](const char* section) { return only.empty() || only == section; };
  if (!cuda::is_available()) {
    std::cerr << "cuda_bench: no GPU visible (cuda::device_count() == 0)\n";
    return 3;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::vector<std::string> gemms, trains;
  if (wanted("gemm"))
    for (int64_t size : {int64_t{4096}, int64_t{8192}})
      for (DType dt : {kBFloat16, kFloat32})
        gemms.push_back(guarded("gemm " + std::to_string(size) + " " + std::string(dtype_name(dt)),
                                [&] { return gemm_json(size, dt, quick); }));
  const std::string copy = wanted("copy") ? guarded("copy", [&] { return copy_json(quick); })
                                          : std::string("null");
  if (wanted("train"))
    for (const char* kind : {"mlp", "cnn"})
      for (int64_t batch : {int64_t{64}, int64_t{512}})
        for (bool bf16 : {false, true})
          trains.push_back(guarded(std::string("train ") + kind,
                                   [&] { return train_json(kind, batch, bf16, quick); }));
  const cuda::MemoryStats mem = cuda::memory_stats();
  const std::string json =
      "{\n  \"device\": \"" + std::string(prop.name) + "\",\n  \"gemm\": " + join(gemms) +
      ",\n  \"copy\": " + copy + ",\n  \"train\": " + join(trains) +
      ",\n  \"memory\": {\"peak_allocated_bytes\": " + std::to_string(mem.peak_allocated_bytes) +
      ", \"cuda_mallocs\": " + std::to_string(mem.cuda_mallocs) + "}\n}\n";
  if (json_path.empty()) {
    std::cout << json;
  } else {
    std::ofstream(json_path) << json;
  }
  return 0;
}
