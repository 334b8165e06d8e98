// Matrix products through oneDNN: bf16 x bf16 (Note [bf16 GEMM]) and f32 x f32 (Note [f32 GEMM]).
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
//
// Note [f32 GEMM]
// f32 products go to oneDNN too where its matmul is its brgemm kernel (the AVX-512 CPUs):
// train_gpt's products are small-K or small-N (n_embd 128: K or N of 128-512 against 2048
// rows), where OpenBLAS 0.3.21's Cooperlake sgemm reaches 84-94% of oneDNN's rate at each of
// its 15 shapes (forward, input and weight gradients; docs/PERFORMANCE.md, 2026-12-04 15:00),
// its operand packing included (7% of the step). The bias rides along as oneDNN's bias
// argument instead of a pass that first fills the output with it. Elsewhere (AVX2 only, where
// oneDNN would use its own jit sgemm, not measured) and for f64, OpenBLAS stays. The sums are
// ordered differently from OpenBLAS's, so results differ from it in the last bits.
// set_f32_gemm_onednn(false) sends f32 back to OpenBLAS (tests reach both paths).
#include "ops/cpu/bf16_gemm.h"

#include <atomic>
#include <vector>

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

// What the primitive writes: f32 (or adds to f32, or with an f32 bias), or bf16 (with or without
// an f32 bias).
enum class Out { kF32, kF32Accumulate, kF32Bias, kBf16, kBf16Bias };

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, Out,
                       bool>;  // m, n, k, a strides, b strides, ldc, output, f32 operands

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
  bool f32 = false;  // f32 products run oneDNN's brgemm here (Note [f32 GEMM])
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
      dnnl::memory::desc af({64, 64}, dt::f32, tag::ab), bf({64, 64}, dt::f32, tag::ab);
      dnnl::matmul::primitive_desc pdf(dnnl::matmul::desc(af, bf, c), r->engine);
      r->f32 = std::string(pdf.impl_info_str()).find("brg") != std::string::npos;
      return r.release();
    } catch (const dnnl::error&) {
      return nullptr;
    }
  }();
  return rt;
}

std::atomic<bool> g_f32_enabled{true};

}  // namespace

bool bf16_gemm_available() { return runtime() != nullptr; }

bool f32_gemm_onednn_enabled() {
  const Runtime* rt = runtime();
  return rt != nullptr && rt->f32 && g_f32_enabled.load(std::memory_order_relaxed);
}

void set_f32_gemm_onednn(bool enabled) { g_f32_enabled.store(enabled, std::memory_order_relaxed); }

const char* bf16_gemm_impl() {
  Runtime* rt = runtime();
  return rt ? rt->impl.c_str() : "";
}

namespace {

// A row-major operand at `data` (bf16 or f32), element (i, j) at i * rs + j * cs.
struct Operand {
  const void* data = nullptr;
  int64_t rs = 0, cs = 1;
};

Operand operand(const Bf16Matrix& m) { return {m.data, m.rs, m.cs}; }
Operand operand(const F32Matrix& m) { return {m.data, m.rs, m.cs}; }

// This thread's scratchpad, grown to the largest a primitive asked for and kept: a call's own
// (see Entry), without an allocation per call.
void* scratchpad(size_t bytes) {
  thread_local std::vector<unsigned char> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

bool run_matmul(int64_t m, int64_t n, int64_t k, const Operand& a, const Operand& b, bool f32_in,
                Out out, void* c, int64_t ldc, const float* bias) {
  Runtime* rt = runtime();
  if (rt == nullptr || m <= 0 || n <= 0 || k <= 0) return false;
  using dt = dnnl::memory::data_type;
  const bool bf16_out = out == Out::kBf16 || out == Out::kBf16Bias;
  const bool has_bias = out == Out::kBf16Bias || out == Out::kF32Bias;
  const dt in = f32_in ? dt::f32 : dt::bf16;
  const Key key{m, n, k, a.rs, a.cs, b.rs, b.cs, ldc, out, f32_in};
  const dnnl::memory::desc ad({m, k}, in, {a.rs, a.cs});
  const dnnl::memory::desc bd({k, n}, in, {b.rs, b.cs});
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
        const dnnl::matmul::desc desc =
            has_bias ? dnnl::matmul::desc(ad, bd, biasd, cd) : dnnl::matmul::desc(ad, bd, cd);
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
  dnnl::memory am(ad, rt->engine, const_cast<void*>(a.data));
  dnnl::memory bm(bd, rt->engine, const_cast<void*>(b.data));
  dnnl::memory cm(cd, rt->engine, c);
  const dnnl::memory::desc sd = entry->pd.scratchpad_desc();
  dnnl::memory scratch(sd, rt->engine, scratchpad(sd.get_size()));
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, am},
                                             {DNNL_ARG_WEIGHTS, bm},
                                             {DNNL_ARG_DST, cm},
                                             {DNNL_ARG_SCRATCHPAD, scratch}};
  if (has_bias)
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(biasd, rt->engine, const_cast<float*>(bias)));
  entry->prim.execute(stream, args);
  stream.wait();
  return true;
}

}  // namespace

bool bf16_gemm(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b, float* c,
               int64_t ldc, bool accumulate) {
  return run_matmul(m, n, k, operand(a), operand(b), false,
                    accumulate ? Out::kF32Accumulate : Out::kF32, c, ldc, nullptr);
}

bool bf16_gemm_bf16_out(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b,
                        const float* bias, uint16_t* c, int64_t ldc) {
  return run_matmul(m, n, k, operand(a), operand(b), false,
                    bias != nullptr ? Out::kBf16Bias : Out::kBf16, c, ldc, bias);
}

bool f32_gemm_onednn(int64_t m, int64_t n, int64_t k, const F32Matrix& a, const F32Matrix& b,
                     const float* bias, float* c, int64_t ldc) {
  if (!f32_gemm_onednn_enabled()) return false;
  return run_matmul(m, n, k, operand(a), operand(b), true,
                    bias != nullptr ? Out::kF32Bias : Out::kF32, c, ldc, bias);
}

#else  // !LOCKSTEP_HAVE_ONEDNN

bool bf16_gemm_available() { return false; }
const char* bf16_gemm_impl() { return ""; }
bool f32_gemm_onednn_enabled() { return false; }
void set_f32_gemm_onednn(bool) {}
bool f32_gemm_onednn(int64_t, int64_t, int64_t, const F32Matrix&, const F32Matrix&, const float*,
                     float*, int64_t) {
  return false;
}
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
