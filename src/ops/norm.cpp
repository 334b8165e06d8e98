// layer_norm: a fused forward that saves each row's mean and 1/std, and a fused backward that
// computes dx, dweight and dbias in one pass over the rows.
#include <algorithm>
#include <cmath>
#include <vector>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/cpu/rows.h"
#include "tensor/dispatch.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;

namespace {

// The backward sums dweight and dbias over rows in at most this many blocks (each with its own
// partial sums, added in block order), so the result does not depend on the thread count.
constexpr int64_t kMaxRowBlocks = 64;

struct LayerNormSaved {
  Tensor x;             // (M, N) contiguous, compute dtype
  Tensor weight, bias;  // (N) contiguous or undefined
  Tensor mean, rstd;    // (M)
  Dims x_shape, normalized_shape;
};

template <typename T>
void layer_norm_forward(const LayerNormSaved& s, const Tensor& y, double eps) {
  const int64_t m = s.mean.numel(), n = s.normalized_shape.numel();
  const T* px = s.x.data<T>();
  const T* pw = s.weight.defined() ? s.weight.data<T>() : nullptr;
  const T* pb = s.bias.defined() ? s.bias.data<T>() : nullptr;
  T* py = y.data<T>();
  T* pmean = s.mean.data<T>();
  T* prstd = s.rstd.data<T>();
  cpu::parallel_rows(m, n, [&](int64_t r) {
    const T* xr = px + r * n;
    T* yr = py + r * n;
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += xr[i];
    const double mean = sum / static_cast<double>(n);
    double ss = 0;  // two passes: no cancellation when |mean| >> std
    for (int64_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(xr[i]) - mean;
      ss += d * d;
    }
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    pmean[r] = static_cast<T>(mean);
    prstd[r] = static_cast<T>(rstd);
    const T mu = static_cast<T>(mean), rs = static_cast<T>(rstd);
    for (int64_t i = 0; i < n; ++i) {
      T v = (xr[i] - mu) * rs;
      if (pw) v *= pw[i];
      if (pb) v += pb[i];
      yr[i] = v;
    }
  });
}

// With xhat = (x - mean) * rstd and wg = g * weight (PyTorch's formula):
//   dx = rstd * (wg - mean(wg) - xhat * mean(wg * xhat)),
//   dweight = sum over rows of g * xhat, dbias = sum over rows of g.
template <typename T>
void layer_norm_backward(const LayerNormSaved& s, const Tensor& g, Tensor* dx, Tensor* dw,
                         Tensor* db) {
  const int64_t m = s.mean.numel(), n = s.normalized_shape.numel();
  const T* px = s.x.data<T>();
  const T* pg = g.data<T>();
  const T* pw = s.weight.defined() ? s.weight.data<T>() : nullptr;
  const T* pmean = s.mean.data<T>();
  const T* prstd = s.rstd.data<T>();
  T* pdx = dx->defined() ? dx->data<T>() : nullptr;
  const bool need_wb = dw->defined() || db->defined();

  const int64_t blocks = std::clamp<int64_t>(
      m * n / cpu::kElementwiseGrain, 1, std::min<int64_t>(kMaxRowBlocks, std::max<int64_t>(m, 1)));
  const int64_t rows_per_block = (m + blocks - 1) / blocks;
  // partial[k] holds block k's sums: dweight in [0, n), dbias in [n, 2n).
  std::vector<double> partial(need_wb ? static_cast<size_t>(blocks * 2 * n) : 0, 0.0);
  cpu::parallel_for(0, blocks, 1, [&](int64_t kb, int64_t ke) {
    for (int64_t k = kb; k < ke; ++k) {
      double* pdw = need_wb ? partial.data() + k * 2 * n : nullptr;
      double* pdb = need_wb ? pdw + n : nullptr;
      const int64_t r_end = std::min(m, (k + 1) * rows_per_block);
      for (int64_t r = k * rows_per_block; r < r_end; ++r) {
        const T* xr = px + r * n;
        const T* gr = pg + r * n;
        const T mu = pmean[r], rs = prstd[r];
        if (need_wb) {
          for (int64_t i = 0; i < n; ++i) {
            const T xhat = (xr[i] - mu) * rs;
            pdw[i] += static_cast<double>(gr[i] * xhat);
            pdb[i] += static_cast<double>(gr[i]);
          }
        }
        if (pdx) {
          double sum_wg = 0, sum_wg_xhat = 0;
          for (int64_t i = 0; i < n; ++i) {
            const T wg = pw ? gr[i] * pw[i] : gr[i];
            sum_wg += wg;
            sum_wg_xhat += static_cast<double>(wg * ((xr[i] - mu) * rs));
          }
          const T a = static_cast<T>(sum_wg / static_cast<double>(n));
          const T b = static_cast<T>(sum_wg_xhat / static_cast<double>(n));
          T* dr = pdx + r * n;
          for (int64_t i = 0; i < n; ++i) {
            const T wg = pw ? gr[i] * pw[i] : gr[i];
            dr[i] = rs * (wg - a - (xr[i] - mu) * rs * b);
          }
        }
      }
    }
  });
  if (!need_wb) return;
  T* odw = dw->defined() ? dw->data<T>() : nullptr;
  T* odb = db->defined() ? db->data<T>() : nullptr;
  cpu::parallel_for(0, n, cpu::kElementwiseGrain / blocks + 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      double sw = 0, sb = 0;
      for (int64_t k = 0; k < blocks; ++k) {
        sw += partial[k * 2 * n + i];
        sb += partial[k * 2 * n + n + i];
      }
      if (odw) odw[i] = static_cast<T>(sw);
      if (odb) odb[i] = static_cast<T>(sb);
    }
  });
}

void check_affine(const Tensor& t, const Tensor& x, const Dims& normalized_shape,
                  const char* what) {
  if (!t.defined()) return;
  detail::check_cpu(t, "layer_norm");
  LS_CHECK(t.shape() == normalized_shape, "layer_norm: ", what, " of shape ", t.shape().str(),
           " does not match normalized_shape ", normalized_shape.str());
  LS_CHECK(t.dtype() == x.dtype(), "layer_norm: ", what, " dtype ", dtype_name(t.dtype()),
           " differs from input dtype ", dtype_name(x.dtype()));
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Dims& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  LS_AUTOCAST("layer_norm", layer_norm, x, normalized_shape, weight, bias, eps);
  detail::check_cpu(x, "layer_norm");
  LS_CHECK(is_floating(x.dtype()), "layer_norm: expected a floating-point input, got ",
           dtype_name(x.dtype()));
  const int64_t k = normalized_shape.size();
  bool trailing = k >= 1 && k <= x.dim();
  for (int64_t i = 0; trailing && i < k; ++i)
    trailing = x.size(x.dim() - k + i) == normalized_shape[i];
  LS_CHECK(trailing, "layer_norm: normalized_shape ", normalized_shape.str(),
           " does not match the trailing dimensions of input of shape ", x.shape().str());
  LS_CHECK(eps >= 0, "layer_norm: eps must be non-negative, got ", eps);
  check_affine(weight, x, normalized_shape, "weight");
  check_affine(bias, x, normalized_shape, "bias");

  const DType dt = x.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;
  Dims lead = x.shape();
  for (int64_t i = 0; i < k; ++i) lead.erase(lead.size() - 1);
  const int64_t m = lead.numel();

  auto s = std::make_shared<LayerNormSaved>();
  s->x = x.detach().to(ct).contiguous();
  if (weight.defined()) s->weight = weight.detach().to(ct).contiguous();
  if (bias.defined()) s->bias = bias.detach().to(ct).contiguous();
  s->mean = empty({m}, ct);
  s->rstd = empty({m}, ct);
  s->x_shape = x.shape();
  s->normalized_shape = normalized_shape;
  Tensor y = empty(x.shape(), ct);
  cpu::dispatch_float(ct, "layer_norm", [&]<typename T>() { layer_norm_forward<T>(*s, y, eps); });
  y = y.to(dt);

  record("LayerNormBackward", {x, weight, bias}, y,
         [s, dt, rx = x.requires_grad(), rw = weight.defined() && weight.requires_grad(),
          rb = bias.defined() && bias.requires_grad()](const TensorList& g) {
           const DType ct = s->x.dtype();
           const Tensor gc = g[0].to(ct).contiguous();
           Tensor dx = rx ? empty(s->x_shape, ct) : Tensor();
           Tensor dw = rw ? empty(s->normalized_shape, ct) : Tensor();
           Tensor db = rb ? empty(s->normalized_shape, ct) : Tensor();
           cpu::dispatch_float(ct, "layer_norm", [&]<typename T>() {
             layer_norm_backward<T>(*s, gc, &dx, &dw, &db);
           });
           auto back = [dt](const Tensor& t) { return t.defined() ? t.to(dt) : t; };
           return TensorList{back(dx), back(dw), back(db)};
         });
  return y;
}

}  // namespace lockstep
