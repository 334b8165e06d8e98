// CUDA kernels of scaled_dot_product_attention: the forward with an online softmax and the
// backward that recomputes the probabilities (Note [Fused attention] in src/ops/attention.cpp),
// one thread per query row (forward, dq) or key row (dk, dv), the other side's rows staged tile
// by tile in shared memory. f32 and f64; q, k, v and the results at the strides of Note [Strided
// attention inputs].
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

namespace {

// Note [CUDA attention]
// The (T, T) scores are never stored, as on the CPU. A block of kRows threads takes kRows
// consecutive rows of one head; each thread keeps its own row (q, or k and v) and its
// accumulators in registers, sized by the template's kMaxD >= the head dims (32, 64, 128 or
// 256; GPT-2's 64 keeps a forward thread at about 130 registers). The block walks the other
// side's rows in tiles of kCols that its threads load together into shared memory, where every
// thread reads the same row at once (a broadcast, no bank conflict). For each row pair a thread
// forms the dot product itself: no shuffles, no atomics, and every thread adds its terms in key
// order, so a run gives the same bits every time. The forward's online softmax rescales its
// accumulator only when a row's running max grows. The backward runs twice over the pairs
// rather than share partial sums between threads: the dq kernel (thread per query row, which
// also writes delta = rowsum(g * out) for the other), then the dk/dv kernel (thread per key
// row), each recomputing p = exp(s - lse). With a causal mask a block stops at the tile that
// holds its last row's diagonal (forward, dq) or starts at its first row's (dk, dv).
//
// Plain CUDA cores: no tensor cores, no cuDNN. This is the simple correct kernel that lets
// train_gpt run without the (T, T) memory; whether cuDNN's fused attention or a tensor-core
// kernel replaces it is decided by measuring on a GPU against PyTorch's SDPA
// (scripts/gpu-check.sh).
constexpr int kRows = 64;  // threads (rows) per block

// Rows of the other side staged per tile: two tiles of kCols x kMaxD elements of T in 32 KiB.
template <typename T, int kMaxD>
constexpr int tile_cols() {
  const int cols = 32768 / (2 * kMaxD * static_cast<int>(sizeof(T)));
  return cols > 64 ? 64 : cols;
}

// Where every head of a (..., T, D) tensor starts, and its row stride: row-major over the
// leading dims at the tensor's strides (as head_offsets in src/ops/cpu/attention.cpp).
struct HeadLayout {
  int nlead = 0;
  int64_t size[Dims::kMaxDims] = {};
  int64_t stride[Dims::kMaxDims] = {};
  int64_t ld = 0;  // row stride

  explicit HeadLayout(const Tensor& t) {
    nlead = static_cast<int>(t.dim() - 2);
    for (int d = 0; d < nlead; ++d) {
      size[d] = t.size(d);
      stride[d] = t.stride(d);
    }
    ld = t.size(-2) > 1 ? t.stride(-2) : std::max<int64_t>(1, t.size(-1));
  }

  // Where head h starts; its row r is r * ld further.
  __device__ int64_t head(int64_t h) const {
    int64_t off = 0;
    for (int d = nlead - 1; d >= 0; --d) {
      off += h % size[d] * stride[d];
      h /= size[d];
    }
    return off;
  }
};

struct Sizes {
  int64_t heads, tq, tk;
  int d, dv;
  bool causal;
};

template <typename T>
__device__ inline T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) return expf(x); else return ::exp(x);
}

template <typename T>
__device__ inline T log_of(T x) {
  if constexpr (std::is_same_v<T, float>) return logf(x); else return ::log(x);
}

// Loads rows [j0, j0 + cols) of a head's rows of `n` elements into `tile` (row-major, kMaxD
// apart), all threads of the block taking part. Rows past `rows` and columns past `n` are zeros:
// the threads' loops run over all kMaxD columns (so that their arrays stay in registers), and
// 0 * (whatever shared memory held) could be a NaN.
template <typename T, int kMaxD>
__device__ void load_tile(T* tile, const T* head, int64_t ld, int64_t j0, int cols, int64_t rows,
                          int n) {
  for (int e = threadIdx.x; e < cols * kMaxD; e += blockDim.x) {
    const int r = e / kMaxD, c = e % kMaxD;
    const int64_t j = j0 + r;
    tile[e] = j < rows && c < n ? head[j * ld + c] : T(0);
  }
}

template <typename T, int kMaxD>
__global__ void __launch_bounds__(kRows)
    attention_forward_kernel(T* out, T* lse, const T* q, const T* k, const T* v, HeadLayout lq,
                             HeadLayout lk, HeadLayout lv, HeadLayout lo, Sizes n, T scale) {
  constexpr int kCols = tile_cols<T, kMaxD>();
  __shared__ T ks[kCols * kMaxD];
  __shared__ T vs[kCols * kMaxD];
  const int64_t tiles = (n.tq + kRows - 1) / kRows;
  const int64_t h = blockIdx.x / tiles;
  const int64_t first = blockIdx.x % tiles * kRows, i = first + threadIdx.x;
  const bool live = i < n.tq;
  T qr[kMaxD], acc[kMaxD];
  const T* qi = q + lq.head(h) + i * lq.ld;
  for (int c = 0; c < kMaxD; ++c) {
    qr[c] = live && c < n.d ? qi[c] : T(0);
    acc[c] = T(0);
  }
  T m = -INFINITY, l = T(0);
  // Keys this block needs: up to its last row's diagonal under a causal mask.
  const int64_t end = n.causal ? std::min(n.tk, first + kRows) : n.tk;
  for (int64_t j0 = 0; j0 < end; j0 += kCols) {
    __syncthreads();
    load_tile<T, kMaxD>(ks, k + lk.head(h), lk.ld, j0, kCols, n.tk, n.d);
    load_tile<T, kMaxD>(vs, v + lv.head(h), lv.ld, j0, kCols, n.tk, n.dv);
    __syncthreads();
    if (!live) continue;
    const int64_t stop = std::min<int64_t>(kCols, (n.causal ? i + 1 : n.tk) - j0);
    for (int jj = 0; jj < stop; ++jj) {
      T s = T(0);
      for (int c = 0; c < kMaxD; ++c) s += qr[c] * ks[jj * kMaxD + c];
      s *= scale;
      if (s > m) {  // the running max grows: rescale what is summed so far
        const T corr = exp_of(m - s);
        l *= corr;
        for (int c = 0; c < kMaxD; ++c) acc[c] *= corr;
        m = s;
      }
      const T p = exp_of(s - m);
      l += p;
      for (int c = 0; c < kMaxD; ++c) acc[c] += p * vs[jj * kMaxD + c];
    }
  }
  if (!live) return;
  const T inv = T(1) / l;
  T* o = out + lo.head(h) + i * lo.ld;
  for (int c = 0; c < kMaxD; ++c)  // all kMaxD, so that acc stays in registers
    if (c < n.dv) o[c] = acc[c] * inv;
  lse[h * n.tq + i] = m + log_of(l);
}

// dq (thread per query row) and delta = rowsum(g * out), which the dk/dv kernel reads.
template <typename T, int kMaxD>
__global__ void __launch_bounds__(kRows)
    attention_dq_kernel(T* dq, T* delta, const T* g, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, HeadLayout lg, HeadLayout lq, HeadLayout lk,
                        HeadLayout lv, HeadLayout lo, HeadLayout ldq, Sizes n, T scale) {
  constexpr int kCols = tile_cols<T, kMaxD>();
  __shared__ T ks[kCols * kMaxD];
  __shared__ T vs[kCols * kMaxD];
  const int64_t tiles = (n.tq + kRows - 1) / kRows;
  const int64_t h = blockIdx.x / tiles;
  const int64_t first = blockIdx.x % tiles * kRows, i = first + threadIdx.x;
  const bool live = i < n.tq;
  T qr[kMaxD], gr[kMaxD], acc[kMaxD];
  T dl = T(0);
  const T* qi = q + lq.head(h) + i * lq.ld;
  const T* gi = g + lg.head(h) + i * lg.ld;
  const T* oi = out + lo.head(h) + i * lo.ld;
  for (int c = 0; c < kMaxD; ++c) {
    qr[c] = live && c < n.d ? qi[c] : T(0);
    gr[c] = live && c < n.dv ? gi[c] : T(0);
    if (live && c < n.dv) dl += gr[c] * oi[c];
    acc[c] = T(0);
  }
  const T row_lse = live ? lse[h * n.tq + i] : T(0);
  if (live) delta[h * n.tq + i] = dl;
  const int64_t end = n.causal ? std::min(n.tk, first + kRows) : n.tk;
  for (int64_t j0 = 0; j0 < end; j0 += kCols) {
    __syncthreads();
    load_tile<T, kMaxD>(ks, k + lk.head(h), lk.ld, j0, kCols, n.tk, n.d);
    load_tile<T, kMaxD>(vs, v + lv.head(h), lv.ld, j0, kCols, n.tk, n.dv);
    __syncthreads();
    if (!live) continue;
    const int64_t stop = std::min<int64_t>(kCols, (n.causal ? i + 1 : n.tk) - j0);
    for (int jj = 0; jj < stop; ++jj) {
      T s = T(0), dp = T(0);
      for (int c = 0; c < kMaxD; ++c) {
        s += qr[c] * ks[jj * kMaxD + c];
        dp += gr[c] * vs[jj * kMaxD + c];
      }
      const T ds = exp_of(s * scale - row_lse) * (dp - dl);
      for (int c = 0; c < kMaxD; ++c) acc[c] += ds * ks[jj * kMaxD + c];
    }
  }
  if (!live) return;
  T* o = dq + ldq.head(h) + i * ldq.ld;
  for (int c = 0; c < kMaxD; ++c)
    if (c < n.d) o[c] = acc[c] * scale;
}

// dk and dv (thread per key row), from the queries at or after the key under a causal mask.
template <typename T, int kMaxD>
__global__ void __launch_bounds__(kRows)
    attention_dkdv_kernel(T* dk, T* dv, const T* g, const T* q, const T* k, const T* v,
                          const T* lse, const T* delta, HeadLayout lg, HeadLayout lq,
                          HeadLayout lk, HeadLayout lv, HeadLayout ldk, HeadLayout ldv, Sizes n,
                          T scale) {
  constexpr int kCols = tile_cols<T, kMaxD>();
  __shared__ T qs[kCols * kMaxD];
  __shared__ T gs[kCols * kMaxD];
  __shared__ T ls[kCols], ds_[kCols];
  const int64_t tiles = (n.tk + kRows - 1) / kRows;
  const int64_t h = blockIdx.x / tiles;
  const int64_t first = blockIdx.x % tiles * kRows, j = first + threadIdx.x;
  const bool live = j < n.tk;
  T kr[kMaxD], vr[kMaxD], dka[kMaxD], dva[kMaxD];
  const T* kj = k + lk.head(h) + j * lk.ld;
  const T* vj = v + lv.head(h) + j * lv.ld;
  for (int c = 0; c < kMaxD; ++c) {
    kr[c] = live && c < n.d ? kj[c] : T(0);
    vr[c] = live && c < n.dv ? vj[c] : T(0);
    dka[c] = dva[c] = T(0);
  }
  // Queries that see one of this block's keys: from its first key's diagonal when causal.
  const int64_t begin = n.causal ? first / kCols * kCols : 0;
  for (int64_t i0 = begin; i0 < n.tq; i0 += kCols) {
    __syncthreads();
    load_tile<T, kMaxD>(qs, q + lq.head(h), lq.ld, i0, kCols, n.tq, n.d);
    load_tile<T, kMaxD>(gs, g + lg.head(h), lg.ld, i0, kCols, n.tq, n.dv);
    for (int r = threadIdx.x; r < kCols; r += blockDim.x) {
      const int64_t i = i0 + r;
      ls[r] = i < n.tq ? lse[h * n.tq + i] : T(0);
      ds_[r] = i < n.tq ? delta[h * n.tq + i] : T(0);
    }
    __syncthreads();
    if (!live) continue;
    const int64_t stop = std::min<int64_t>(kCols, n.tq - i0);
    for (int ii = n.causal && j > i0 ? static_cast<int>(std::min<int64_t>(j - i0, kCols)) : 0;
         ii < stop; ++ii) {
      T s = T(0), dp = T(0);
      for (int c = 0; c < kMaxD; ++c) {
        s += qs[ii * kMaxD + c] * kr[c];
        dp += gs[ii * kMaxD + c] * vr[c];
      }
      const T p = exp_of(s * scale - ls[ii]);
      const T ds = p * (dp - ds_[ii]);
      for (int c = 0; c < kMaxD; ++c) {
        dva[c] += p * gs[ii * kMaxD + c];
        dka[c] += ds * qs[ii * kMaxD + c];
      }
    }
  }
  if (!live) return;
  T* ok = dk + ldk.head(h) + j * ldk.ld;
  T* ov = dv + ldv.head(h) + j * ldv.ld;
  for (int c = 0; c < kMaxD; ++c) {
    if (c < n.d) ok[c] = dka[c] * scale;
    if (c < n.dv) ov[c] = dva[c];
  }
}

Sizes sizes_of(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  LS_CHECK(q.size(-1) <= 256 && v.size(-1) <= 256,
           "scaled_dot_product_attention: head dims up to 256 on cuda, got ", q.size(-1), " and ",
           v.size(-1));
  int64_t heads = 1;
  for (int64_t d = 0; d < q.dim() - 2; ++d) heads *= q.size(d);
  return {heads, q.size(-2), k.size(-2), static_cast<int>(q.size(-1)),
          static_cast<int>(v.size(-1)), causal};
}

// f.template operator()<kMaxD>() for the smallest of 32, 64, 128, 256 that holds both head dims.
template <typename F>
void dispatch_head_dim(const Sizes& n, F&& f) {
  const int d = std::max(n.d, n.dv);
  LS_CHECK(d <= 256, "scaled_dot_product_attention: head dims up to 256 on cuda, got ", n.d,
           " and ", n.dv);
  if (d <= 32) return f.template operator()<32>();
  if (d <= 64) return f.template operator()<64>();
  if (d <= 128) return f.template operator()<128>();
  return f.template operator()<256>();
}

unsigned blocks_for(int64_t heads, int64_t rows) {
  const int64_t blocks = heads * ((rows + kRows - 1) / kRows);
  LS_CHECK(blocks <= 0x7fffffff, "scaled_dot_product_attention: ", heads, " heads of ", rows,
           " rows are too many for one launch");
  return static_cast<unsigned>(blocks);
}

void attention_kernel(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                      const Tensor& v, double scale, bool causal) {
  const Sizes n = sizes_of(q, k, v, causal);
  if (n.heads == 0 || n.tq == 0) return;
  TensorDeviceGuard guard(q);
  dispatch_float(q.dtype(), "scaled_dot_product_attention", [&]<typename T>() {
    dispatch_head_dim(n, [&]<int kMaxD>() {
      attention_forward_kernel<T, kMaxD>
          <<<blocks_for(n.heads, n.tq), kRows, 0, current_cuda_stream()>>>(
              data_of<T>(out), data_of<T>(lse), data_of<T>(q), data_of<T>(k), data_of<T>(v),
              HeadLayout(q), HeadLayout(k), HeadLayout(v), HeadLayout(out), n,
              static_cast<T>(scale));
      check_launch("scaled_dot_product_attention", q);
    });
  });
}

void attention_backward_kernel(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                               const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, double scale, bool causal) {
  const Sizes n = sizes_of(q, k, v, causal);
  if (n.heads == 0) return;
  TensorDeviceGuard guard(q);
  dispatch_float(q.dtype(), "scaled_dot_product_attention backward", [&]<typename T>() {
    dispatch_head_dim(n, [&]<int kMaxD>() {
      const Tensor delta = empty({n.heads, n.tq}, TensorOptions(q.dtype()).with_device(q.device()));
      const T s = static_cast<T>(scale);
      if (n.tq > 0) {
        attention_dq_kernel<T, kMaxD>
            <<<blocks_for(n.heads, n.tq), kRows, 0, current_cuda_stream()>>>(
                data_of<T>(dq), data_of<T>(delta), data_of<T>(g), data_of<T>(q), data_of<T>(k),
                data_of<T>(v), data_of<T>(out), data_of<T>(lse), HeadLayout(g), HeadLayout(q),
                HeadLayout(k), HeadLayout(v), HeadLayout(out), HeadLayout(dq), n, s);
        check_launch("scaled_dot_product_attention backward", q);
      }
      if (n.tk > 0) {
        attention_dkdv_kernel<T, kMaxD>
            <<<blocks_for(n.heads, n.tk), kRows, 0, current_cuda_stream()>>>(
                data_of<T>(dk), data_of<T>(dv), data_of<T>(g), data_of<T>(q), data_of<T>(k),
                data_of<T>(v), data_of<T>(lse), data_of<T>(delta), HeadLayout(g), HeadLayout(q),
                HeadLayout(k), HeadLayout(v), HeadLayout(dk), HeadLayout(dv), n, s);
        check_launch("scaled_dot_product_attention backward", q);
      }
    });
  });
}

}  // namespace

void fill_attention_kernels(Kernels& k) {
  k.attention = attention_kernel;
  k.attention_backward = attention_backward_kernel;
}

}  // namespace lockstep::cuda_ops
