// bf16 GEMM through oneDNN.
//
// Note [bf16 GEMM]
// Under autocast, matrix products take bf16 operands and accumulate in f32. OpenBLAS has
// cblas_sbgemm for that, but Debian 12's OpenBLAS 0.3.21 is built without it (the header
// declares it, the library does not export it), and converting both operands to f32 and
// calling sgemm is slower than f32 itself (bench/amp). oneDNN's matmul primitive (Debian's
// libdnnl-dev) runs bf16 x bf16 -> f32 with the AVX-512 BF16 instructions: 3.4-3.8x sgemm's
// throughput at the MLP's shapes on the 2-core EPYC (docs/PERFORMANCE.md). Primitives are
// created once per (shape, layout, output) and cached; oneDNN shares our OpenMP threads.
// Under autocast a product's f32 result is rounded to bf16 at once; oneDNN writes it as bf16
// itself (round to nearest even, as .to(kBFloat16)), the bias added in f32 before, so the f32
// result never goes through memory and no conversion pass follows.
#include "ops/cpu/bf16_gemm.h"

#ifdef LOCKSTEP_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#endif

namespace lockstep::cpu {

#ifdef LOCKSTEP_HAVE_ONEDNN

namespace {

// What the primitive writes: f32 (or adds to f32), or bf16 (with or without an f32 bias).
enum class Out { kF32, kF32Accumulate, kBf16, kBf16Bias };

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       Out>;  // m, n, k, a strides, b strides, ldc, output

// A primitive with its own descriptor. Scratchpads are the caller's (user mode), so one
// primitive may run on several threads at once (DataParallel's replicas): oneDNN's default,
// library-managed scratchpad would make concurrent executions of a primitive unsafe.
struct Entry {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};

// Primitives kept at most; shapes in training repeat, so this only bounds odd workloads.
constexpr size_t kMaxCachedPrimitives = 512;

struct Runtime {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mu;
  std::map<Key, std::shared_ptr<Entry>> cache;
  std::string impl;
};

Runtime* runtime() {
  // Created on first use; nullptr when oneDNN cannot make a bf16 matmul on this CPU (then it
  // would fall back to slow reference code, which the sgemm path beats).
  static Runtime* rt = []() -> Runtime* {
    try {
      auto r = std::make_unique<Runtime>();
      using dt = dnnl::memory::data_type;
      using tag = dnnl::memory::format_tag;
      dnnl::memory::desc a({64, 64}, dt::bf16, tag::ab), b({64, 64}, dt::bf16, tag::ab),
          c({64, 64}, dt::f32, tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), r->engine);
      r->impl = pd.impl_info_str();
      if (r->impl.find("ref") != std::string::npos) return nullptr;  // no bf16 hardware path
      return r.release();
    } catch (const dnnl::error&) {
      return nullptr;
    }
  }();
  return rt;
}

}  // namespace

bool bf16_gemm_available() { return runtime() != nullptr; }

const char* bf16_gemm_impl() {
  Runtime* rt = runtime();
  return rt ? rt->impl.c_str() : "";
}

namespace {

bool run_matmul(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b, Out out,
                void* c, int64_t ldc, const float* bias) {
  Runtime* rt = runtime();
  if (rt == nullptr || m <= 0 || n <= 0 || k <= 0) return false;
  using dt = dnnl::memory::data_type;
  const bool bf16_out = out == Out::kBf16 || out == Out::kBf16Bias;
  const Key key{m, n, k, a.rs, a.cs, b.rs, b.cs, ldc, out};
  const dnnl::memory::desc ad({m, k}, dt::bf16, {a.rs, a.cs});
  const dnnl::memory::desc bd({k, n}, dt::bf16, {b.rs, b.cs});
  const dnnl::memory::desc cd({m, n}, bf16_out ? dt::bf16 : dt::f32, {ldc, 1});
  const dnnl::memory::desc biasd({1, n}, dt::f32, {n, 1});
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(rt->mu);
    auto it = rt->cache.find(key);
    if (it != rt->cache.end()) {
      entry = it->second;
    } else {
      try {
        dnnl::primitive_attr attr;
        attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        if (out == Out::kF32Accumulate) {
          dnnl::post_ops ops;
          ops.append_sum(1.0f);
          attr.set_post_ops(ops);
        }
        const dnnl::matmul::desc desc = out == Out::kBf16Bias
                                            ? dnnl::matmul::desc(ad, bd, biasd, cd)
                                            : dnnl::matmul::desc(ad, bd, cd);
        dnnl::matmul::primitive_desc pd(desc, attr, rt->engine);
        entry = std::make_shared<Entry>(Entry{pd, dnnl::matmul(pd)});
      } catch (const dnnl::error&) {
        entry = nullptr;  // a layout it does not take: remembered, the caller falls back
      }
      if (rt->cache.size() >= kMaxCachedPrimitives) rt->cache.clear();
      rt->cache.emplace(key, entry);
    }
  }
  if (!entry) return false;
  dnnl::stream stream(rt->engine);
  dnnl::memory am(ad, rt->engine, const_cast<uint16_t*>(a.data));
  dnnl::memory bm(bd, rt->engine, const_cast<uint16_t*>(b.data));
  dnnl::memory cm(cd, rt->engine, c);
  dnnl::memory scratch(entry->pd.scratchpad_desc(), rt->engine);  // this call's own
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, am},
                                             {DNNL_ARG_WEIGHTS, bm},
                                             {DNNL_ARG_DST, cm},
                                             {DNNL_ARG_SCRATCHPAD, scratch}};
  if (out == Out::kBf16Bias)
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(biasd, rt->engine, const_cast<float*>(bias)));
  entry->prim.execute(stream, args);
  stream.wait();
  return true;
}

}  // namespace

bool bf16_gemm(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b, float* c,
               int64_t ldc, bool accumulate) {
  return run_matmul(m, n, k, a, b, accumulate ? Out::kF32Accumulate : Out::kF32, c, ldc, nullptr);
}

bool bf16_gemm_bf16_out(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b,
                        const float* bias, uint16_t* c, int64_t ldc) {
  return run_matmul(m, n, k, a, b, bias != nullptr ? Out::kBf16Bias : Out::kBf16, c, ldc, bias);
}

#else  // !LOCKSTEP_HAVE_ONEDNN

bool bf16_gemm_available() { return false; }
const char* bf16_gemm_impl() { return ""; }
bool bf16_gemm(int64_t, int64_t, int64_t, const Bf16Matrix&, const Bf16Matrix&, float*, int64_t,
               bool) {
  return false;
}
bool bf16_gemm_bf16_out(int64_t, int64_t, int64_t, const Bf16Matrix&, const Bf16Matrix&,
                        const float*, uint16_t*, int64_t) {
  return false;
}

#endif

}  // namespace lockstep::cpu
