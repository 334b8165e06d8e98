// A GPT-2 style decoder for examples/train_gpt: token and learned position embeddings, n_layer
// pre-LayerNorm blocks (causal multi-head self-attention, then a GELU MLP, each added to the
// residual stream), a final LayerNorm and an output head tied to the token embedding.
//
// Shapes in comments: B batch, T tokens (<= block_size), C n_embd, H n_head, D = C / H head dim,
// V vocab_size.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/lockstep.h"
#include "lockstep/nn/layers.h"
#include "lockstep/ops/attention.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::examples {

struct GptModelConfig {
  int64_t vocab_size = 256;  // byte tokens
  int64_t block_size = 128;  // the longest context (position embeddings)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
};

// Note [GPT-2 initialisation]
// As GPT-2 (and nanoGPT, llm.c): every Linear weight and both embeddings are drawn from
// N(0, 0.02), biases are zero, LayerNorms are (1, 0). The two projections that write into the
// residual stream in each block (attention's c_proj and the MLP's c_proj) are drawn with std
// 0.02 / sqrt(2 n_layer): the stream is a sum of 2 n_layer such writes, so its variance at the
// top stays near that of the embeddings whatever the depth. The output head is the token
// embedding itself (tied), so it needs no init of its own; its gradient is the sum of the two
// uses.
constexpr double kGptInitStd = 0.02;

inline void gpt_normal_(Tensor& t, double std, Generator& gen) {
  NoGradGuard no_grad;
  t.copy_(randn(t.shape(), gen, t.dtype(), 0.0, std));
}

inline void gpt_init_linear(nn::Linear& l, double std, Generator& gen) {
  gpt_normal_(l.weight(), std, gen);
  if (l.bias().defined()) {
    NoGradGuard no_grad;
    l.bias().zero_();
  }
}

// Causal multi-head self-attention: one Linear makes q, k and v for all heads, the fused
// attention op attends (Note [Fused attention]), one Linear projects back.
class CausalSelfAttention : public nn::Module {
 public:
  CausalSelfAttention(const GptModelConfig& cfg, Generator& gen)
      : nn::Module("CausalSelfAttention"), n_head_(cfg.n_head) {
    c_attn_ =
        register_module("c_attn", std::make_shared<nn::Linear>(cfg.n_embd, 3 * cfg.n_embd, gen));
    c_proj_ = register_module("c_proj", std::make_shared<nn::Linear>(cfg.n_embd, cfg.n_embd, gen));
    gpt_init_linear(*c_attn_, kGptInitStd, gen);
    gpt_init_linear(*c_proj_, kGptInitStd / std::sqrt(2.0 * cfg.n_layer), gen);
  }

  Tensor forward(const Tensor& x) override {  // x (B,T,C)
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = n_head_, D = C / H;
    Tensor qkv = (*c_attn_)(x);  // (B,T,3C)
    // Strided views, which the attention reads as they are and whose output it lays out as
    // (B,T,H,D), so the transpose back is contiguous already (Note [Strided attention inputs]);
    // unbind's one backward node gathers their gradients into qkv's (Note [unbind's backward]).
    std::vector<Tensor> heads = unbind(qkv.view({B, T, 3, H, D}), 2);       // 3 x (B,T,H,D)
    Tensor q = heads[0].transpose(1, 2);                                    // (B,H,T,D)
    Tensor k = heads[1].transpose(1, 2);                                    // (B,H,T,D)
    Tensor v = heads[2].transpose(1, 2);                                    // (B,H,T,D)
    Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = true});  // (B,H,T,D)
    y = y.transpose(1, 2).contiguous().view({B, T, C});                     // (B,T,C)
    return (*c_proj_)(y);                                                   // (B,T,C)
  }

 private:
  int64_t n_head_;
  std::shared_ptr<nn::Linear> c_attn_, c_proj_;
};

// The MLP: C -> 4C, GELU (tanh approximation, as GPT-2), 4C -> C.
class GptMlp : public nn::Module {
 public:
  GptMlp(const GptModelConfig& cfg, Generator& gen) : nn::Module("GptMlp") {
    c_fc_ = register_module("c_fc", std::make_shared<nn::Linear>(cfg.n_embd, 4 * cfg.n_embd, gen));
    c_proj_ =
        register_module("c_proj", std::make_shared<nn::Linear>(4 * cfg.n_embd, cfg.n_embd, gen));
    gpt_init_linear(*c_fc_, kGptInitStd, gen);
    gpt_init_linear(*c_proj_, kGptInitStd / std::sqrt(2.0 * cfg.n_layer), gen);
  }

  Tensor forward(const Tensor& x) override {         // x (B,T,C)
    Tensor h = gelu((*c_fc_)(x), GeluApprox::tanh);  // (B,T,4C)
    return (*c_proj_)(h);                            // (B,T,C)
  }

 private:
  std::shared_ptr<nn::Linear> c_fc_, c_proj_;
};

// Pre-LayerNorm: x + attn(ln_1(x)), then + mlp(ln_2(.)).
class GptBlock : public nn::Module {
 public:
  GptBlock(const GptModelConfig& cfg, Generator& gen) : nn::Module("GptBlock") {
    ln_1_ = register_module("ln_1", std::make_shared<nn::LayerNorm>(Dims{cfg.n_embd}));
    attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(cfg, gen));
    ln_2_ = register_module("ln_2", std::make_shared<nn::LayerNorm>(Dims{cfg.n_embd}));
    mlp_ = register_module("mlp", std::make_shared<GptMlp>(cfg, gen));
  }

  Tensor forward(const Tensor& x) override {  // x (B,T,C)
    Tensor h = x + (*attn_)((*ln_1_)(x));     // (B,T,C)
    return h + (*mlp_)((*ln_2_)(h));          // (B,T,C)
  }

 private:
  std::shared_ptr<nn::LayerNorm> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<GptMlp> mlp_;
};

// The parameters of a Gpt of `c`, counted without building it (train_gpt --plan): the token and
// position embeddings (V C + block_size C), per block two LayerNorms (2 x 2C), c_attn
// (3C^2 + 3C), attention's c_proj (C^2 + C), c_fc (4C^2 + 4C) and the MLP's c_proj (4C^2 + C),
// and ln_f (2C); the tied head adds none. The Gpt constructor checks it against the model it
// built.
inline int64_t gpt_num_parameters(const GptModelConfig& c) {
  const int64_t C = c.n_embd;
  const int64_t block =
      4 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C);
  return (c.vocab_size + c.block_size) * C + c.n_layer * block + 2 * C;
}

// Model FLOPs per trained token (forward and backward) at context T, as llm.c and nanoGPT count
// them: 6 per parameter (the embeddings' lookups included, a slight overcount) plus the
// attention's q k^T and (att) v, 12 L T C.
inline double gpt_flops_per_token(const GptModelConfig& c, int64_t T) {
  return 6.0 * static_cast<double>(gpt_num_parameters(c)) +
         12.0 * static_cast<double>(c.n_layer * T * c.n_embd);
}

class Gpt : public nn::Module {
 public:
  Gpt(const GptModelConfig& cfg, Generator& gen) : nn::Module("Gpt"), cfg_(cfg) {
    LS_CHECK(cfg.n_embd % cfg.n_head == 0, "expected --n-embd divisible by --n-head, got ",
             cfg.n_embd, " and ", cfg.n_head);
    wte_ = register_module("wte", std::make_shared<nn::Embedding>(cfg.vocab_size, cfg.n_embd, gen));
    wpe_ = register_module("wpe", std::make_shared<nn::Embedding>(cfg.block_size, cfg.n_embd, gen));
    gpt_normal_(wte_->weight(), kGptInitStd, gen);
    gpt_normal_(wpe_->weight(), kGptInitStd, gen);
    for (int64_t i = 0; i < cfg.n_layer; ++i)
      blocks_.push_back(
          register_module("h" + std::to_string(i), std::make_shared<GptBlock>(cfg, gen)));
    ln_f_ = register_module("ln_f", std::make_shared<nn::LayerNorm>(Dims{cfg.n_embd}));
    LS_CHECK(num_parameters() == gpt_num_parameters(cfg), "gpt_num_parameters counts ",
             gpt_num_parameters(cfg), " parameters, the model has ", num_parameters());
  }

  const GptModelConfig& config() const { return cfg_; }

  // tokens i64 (B,T), T <= block_size -> logits (B,T,V).
  Tensor forward(const Tensor& tokens) override {
    const int64_t T = tokens.size(1);
    LS_CHECK(T <= cfg_.block_size, "expected at most block_size ", cfg_.block_size, " tokens, got ",
             T);
    Tensor pos = arange(T).to(tokens.device());   // (T)
    Tensor x = (*wte_)(tokens) + (*wpe_)(pos);    // (B,T,C) + (T,C)
    for (auto& block : blocks_) x = (*block)(x);  // (B,T,C)
    x = (*ln_f_)(x);                              // (B,T,C)
    return linear(x, wte_->weight());             // (B,T,V), tied head
  }

  // gpt_flops_per_token of this model.
  double flops_per_token(int64_t T) const { return gpt_flops_per_token(cfg_, T); }

 private:
  GptModelConfig cfg_;
  std::shared_ptr<nn::Embedding> wte_, wpe_;
  std::vector<std::shared_ptr<GptBlock>> blocks_;
  std::shared_ptr<nn::LayerNorm> ln_f_;
};

// Next-token cross entropy: logits (B,T,V) against targets i64 (B,T), the mean over B T tokens.
inline Tensor gpt_loss(const Tensor& logits, const Tensor& targets) {
  const int64_t V = logits.size(2);
  return cross_entropy(logits.reshape({-1, V}), targets.reshape({-1}));  // () f32
}

// AdamW's two groups, as GPT-2 trains: weight decay on the matrices (Linear weights and the
// embeddings, the tied head with them), none on biases and LayerNorm gains and shifts (the
// 1-dim parameters), whose decay toward 0 would only shrink what normalisation restores.
inline std::vector<optim::ParamGroup> gpt_param_groups(const nn::Module& model,
                                                       double weight_decay) {
  optim::ParamGroup decay{.weight_decay = weight_decay}, no_decay{.weight_decay = 0.0};
  for (const Tensor& p : model.parameters()) (p.dim() >= 2 ? decay : no_decay).params.push_back(p);
  return {decay, no_decay};
}

}  // namespace lockstep::examples
