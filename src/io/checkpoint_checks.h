// What every checkpoint writer and reader of io/ shares: SHA-256 (OpenSSL) and the finiteness
// check of Note [No NaN in a checkpoint]. Internal to the library (OpenSSL stays out of include/).
#pragma once

#include <openssl/evp.h>

#include <memory>
#include <string>

#include "lockstep/base/error.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::io {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
    LS_CHECK(ctx_ && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1,
             "checkpoint: cannot initialise SHA-256 (OpenSSL)");
  }
  void update(const void* data, size_t n) {
    if (n > 0) LS_CHECK(EVP_DigestUpdate(ctx_.get(), data, n) == 1, "checkpoint: SHA-256 failed");
  }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    LS_CHECK(EVP_DigestFinal_ex(ctx_.get(), md, &len) == 1, "checkpoint: SHA-256 failed");
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < len; ++i) {
      out.push_back(digits[md[i] >> 4]);
      out.push_back(digits[md[i] & 15]);
    }
    return out;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx_;
};

// "" when every value of `t` (on the host, contiguous) is finite; else what is not, for errors
// ("3 of its 40 values are not finite (1 NaN, 2 Inf)"). Integer tensors are always finite.
std::string non_finite_values(const Tensor& t);

}  // namespace lockstep::io
