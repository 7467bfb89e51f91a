// The gated delta rule's chunked (WY / UT-transform) form on fp32 blocks, forward and backward.
// Internal to ops/gated_delta_ops.cpp, which prepares the operands (head repeat, L2 norm, scale,
// padding) and maps the gradients back.
//
// Per head, with the state S [dk, dv] (the definition: transformers' torch_recurrent_gated_delta_rule):
//   S <- S * exp(g_t);  delta_t = beta_t (v_t - S^T k_t);  S <- S + k_t delta_t^T;  o_t = S^T q_t.
// Within a chunk of C tokens starting from S0, with gam = cumsum(g) inside the chunk and
// E[t, s] = exp(gam_t - gam_s) for s <= t (0 above the diagonal):
//   (I + A) Delta = beta*V - beta*exp(gam)*K S0,   A = strict_lower((beta*K) K^T .* E)
//   so Delta = U - W S0 with U = T (beta*V), W = T (beta*exp(gam)*K), T = (I + A)^-1;
//   O = (exp(gam)*Q) S0 + ((Q K^T) .* E) Delta;   S_C = exp(gam_C) S0 + (exp(gam_C - gam)*K)^T Delta.
// Every quantity but the state is local to its chunk, so it is computed for a block of chunks at
// once (batched matmuls over heads and chunks); only the state runs through the chunks in order. Memory is linear in the sequence: [C, C] blocks
// per chunk and one state per chunk boundary, never [T, T] and never a state per token.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace qlora::ops::gated_delta {

// The operands, fp32 contiguous, chunk-major (a block of chunks is one contiguous slice), heads and
// batch flattened into one dim: q, k [N, BH, C, dk]
// (q already normalised and scaled), v [N, BH, C, dv], g and beta [N, BH, C]. Padding tokens carry
// g = beta = 0 and zero vectors, which leave the state as it is.
struct Chunks {
  at::Tensor q, k, v, g, beta;
};

// Each chunk's matrices, computed from its own tokens (the notation above).
struct Local {
  at::Tensor e;     // E                     [N, BH, C, C], 0 above the diagonal
  at::Tensor ae;    // ((beta*K) K^T) .* E   [N, BH, C, C] (A is its strict lower part)
  at::Tensor p;     // (Q K^T) .* E          [N, BH, C, C]
  at::Tensor t;     // T = (I + A)^-1        [N, BH, C, C], unit lower triangular
};

// What backward reads back from the forward, per chunk: memory linear in the sequence, and no
// chunk's [C, C] matrices (the inverse above all) computed twice.
struct Saved {
  at::Tensor starts;  // [N, BH, dk, dv]: the state entering each chunk
  at::Tensor delta;   // [N, BH, C, dv]: Delta = U - W S0
  Local local;

  std::vector<at::Tensor> list() const { return {starts, delta, local.e, local.ae, local.p, local.t}; }
  static Saved of(const std::vector<at::Tensor>& l, size_t i) {
    return {l[i], l[i + 1], {l[i + 2], l[i + 3], l[i + 4], l[i + 5]}};
  }
};

struct Forward {
  at::Tensor out;  // [N, BH, C, dv]
  Saved saved;
  at::Tensor final;  // [BH, dk, dv]
};

// state0 [BH, dk, dv] fp32, or undefined for zeros.
Forward chunked_forward(const Chunks& x, const at::Tensor& state0);

struct Grads {
  at::Tensor q, k, v, g, beta;  // shaped as Chunks' fields
  at::Tensor state0;            // [BH, dk, dv]
};

// d_out [N, BH, C, dv]; d_final [BH, dk, dv] or undefined (no gradient reached the final state).
Grads chunked_backward(const Chunks& x, const Saved& saved, const at::Tensor& d_out, const at::Tensor& d_final);

}  // namespace qlora::ops::gated_delta
