// Dims: inline small vector.
#include "lockstep/tensor/dims.h"

#include <ostream>

#include "lockstep/base/error.h"

namespace lockstep {

Dims::Dims(std::initializer_list<int64_t> values) {
  LS_CHECK(static_cast<int64_t>(values.size()) <= kMaxDims, "tensors have at most ", kMaxDims,
           " dimensions, got ", values.size());
  for (int64_t v : values) d_[n_++] = v;
}

Dims::Dims(const std::vector<int64_t>& values) {
  LS_CHECK(static_cast<int64_t>(values.size()) <= kMaxDims, "tensors have at most ", kMaxDims,
           " dimensions, got ", values.size());
  for (int64_t v : values) d_[n_++] = v;
}

Dims Dims::filled(int64_t n, int64_t value) {
  Dims d;
  d.resize(n, value);
  return d;
}

void Dims::push_back(int64_t v) {
  LS_CHECK(n_ < kMaxDims, "tensors have at most ", kMaxDims, " dimensions");
  d_[n_++] = v;
}

void Dims::insert(int64_t pos, int64_t v) {
  LS_CHECK(n_ < kMaxDims, "tensors have at most ", kMaxDims, " dimensions");
  for (int64_t i = n_; i > pos; --i) d_[i] = d_[i - 1];
  d_[pos] = v;
  ++n_;
}

void Dims::erase(int64_t pos) {
  for (int64_t i = pos; i + 1 < n_; ++i) d_[i] = d_[i + 1];
  --n_;
}

void Dims::resize(int64_t n, int64_t value) {
  LS_CHECK(n >= 0 && n <= kMaxDims, "tensors have at most ", kMaxDims, " dimensions, got ", n);
  for (int64_t i = n_; i < n; ++i) d_[i] = value;
  n_ = n;
}

int64_t Dims::numel() const {
  int64_t p = 1;
  for (int64_t i = 0; i < n_; ++i) {
    // A corrupt file or a wrong flag can name a shape whose product wraps around; that must be
    // an error, not a small tensor with a huge shape.
    LS_CHECK(!__builtin_mul_overflow(p, d_[i], &p), "shape ", str(),
             " has more elements than fit in 64 bits");
  }
  return p;
}

std::string Dims::str() const {
  std::string s = "[";
  for (int64_t i = 0; i < n_; ++i) {
    if (i) s += ", ";
    s += std::to_string(d_[i]);
  }
  return s + "]";
}

bool operator==(const Dims& a, const Dims& b) {
  if (a.n_ != b.n_) return false;
  for (int64_t i = 0; i < a.n_; ++i)
    if (a.d_[i] != b.d_[i]) return false;
  return true;
}

std::ostream& operator<<(std::ostream& os, const Dims& d) { return os << d.str(); }

}  // namespace lockstep
