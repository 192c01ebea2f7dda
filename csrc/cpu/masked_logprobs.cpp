// CPU kernels of dllm_fast::masked_logprobs (LM head + log-softmax + gather, chunked over the vocabulary), its
// backward, and masked_logprobs_grad (the gradients for an upstream gradient known before the forward).
//
// Forward, per vocabulary chunk of C rows of the head: one GEMM into a reused [M, C] accumulator buffer
// (MKL), then one pass per row that merges the chunk's max and sum of exponentials into a running
// logsumexp and picks up the target logit. Backward recomputes each chunk's logits and turns them in place
// into d(loss)/d(logits) = g_lse * p + g_logp * (onehot - p), then two GEMMs accumulate grad_hidden and write
// grad_weight's rows for the chunk. masked_logprobs_grad walks the chunks once with the same three GEMMs, but
// given the upstream gradient and the rows' logsumexp up front it needs no forward first, and it adds
// grad_weight's rows into a caller's buffer (the parameter's .grad) instead of returning a new [V, d] tensor.
// Peak temporary memory is [M, C] plus one converted weight chunk.
// bf16/fp16 inputs are upcast per chunk and every product accumulates in fp32 (fp64 for fp64 inputs).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "dllm_fast/ops.h"
#include "vec_math.h"

namespace dllm_fast {
namespace {

using cpu::online_logsumexp_update;
using cpu::row_scaled_exp;
using cpu::row_scaled_exp_sum;

// Rows per parallel task: enough that a task touches ~64K logits.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1)); }

template <typename acc_t>
std::tuple<Tensor, Tensor> forward_impl(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                        int64_t chunk_size) {
  const int64_t M = hidden.size(0), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  Tensor logp = at::empty({M}, opts), lse = at::empty({M}, opts);
  if (M == 0) return {logp, lse};

  const Tensor tgt = targets.contiguous();
  const Tensor h = hidden.to(acc).contiguous();
  const Tensor w_all = weight.contiguous();
  const int64_t C = std::min(chunk_size, V);
  Tensor buffer = at::empty({M * C}, opts);

  // A target outside [0, V) is never found: its log-prob stays NaN, as on CUDA (checking costs a sync there).
  std::vector<acc_t> run_max(M, -std::numeric_limits<acc_t>::infinity()), run_sum(M, 0),
      target_logit(M, std::numeric_limits<acc_t>::quiet_NaN());
  const int64_t* t = tgt.data_ptr<int64_t>();
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const Tensor w = w_all.narrow(0, v0, c).to(acc);  // a view when weight is already acc_t
    Tensor logits = buffer.narrow(0, 0, M * c).view({M, c});
    at::mm_out(logits, h, w.t());
    const acc_t* L = logits.data_ptr<acc_t>();
    at::parallel_for(0, M, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t* row = L + i * c;
        online_logsumexp_update(run_max[i], run_sum[i], row, c);
        const int64_t col = t[i] - v0;
        if (col >= 0 && col < c) target_logit[i] = row[col];
      }
    });
  }
  acc_t* lp = logp.data_ptr<acc_t>();
  acc_t* ls = lse.data_ptr<acc_t>();
  for (int64_t i = 0; i < M; ++i) {
    ls[i] = run_max[i] + std::log(run_sum[i]);
    lp[i] = target_logit[i] - ls[i];
  }
  return {logp, lse};
}

template <typename acc_t>
std::tuple<Tensor, Tensor> backward_impl(const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_lse,
                                         const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                         const Tensor& lse, int64_t chunk_size, std::array<bool, 2> output_mask) {
  const int64_t M = hidden.size(0), V = weight.size(0), d = hidden.size(1);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  const bool need_h = output_mask[0], need_w = output_mask[1];
  Tensor grad_h = need_h ? at::zeros({M, d}, opts) : Tensor();
  Tensor grad_w = need_w ? at::empty_like(weight, at::MemoryFormat::Contiguous) : Tensor();
  const bool has_glp = grad_logp.has_value() && grad_logp->defined();
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if ((!need_h && !need_w) || M == 0 || (!has_glp && !has_glse)) {
    if (need_w) grad_w.zero_();
    return {need_h ? grad_h.to(hidden.scalar_type()) : Tensor(), grad_w};
  }

  const Tensor tgt = targets.contiguous();
  const Tensor h = hidden.to(acc).contiguous();
  const Tensor w_all = weight.contiguous();
  // The log-prob of a target outside [0, V) is a constant NaN: nothing flows back through it (as on CUDA).
  const Tensor outside = (tgt < 0).logical_or_(tgt >= V);
  const Tensor glp = has_glp ? grad_logp->to(acc).masked_fill(outside, 0).contiguous() : at::zeros({M}, opts);
  const Tensor glse = has_glse ? grad_lse->to(acc).contiguous() : at::zeros({M}, opts);
  const Tensor lse_c = lse.to(acc).contiguous();
  const int64_t C = std::min(chunk_size, V);
  Tensor buffer = at::empty({M * C}, opts);

  const int64_t* t = tgt.data_ptr<int64_t>();
  const acc_t* g_lp = glp.data_ptr<acc_t>();
  const acc_t* g_lse = glse.data_ptr<acc_t>();
  const acc_t* ls = lse_c.data_ptr<acc_t>();
  const bool weight_is_acc = weight.scalar_type() == acc;
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const Tensor w = w_all.narrow(0, v0, c).to(acc);
    Tensor dlogits = buffer.narrow(0, 0, M * c).view({M, c});
    at::mm_out(dlogits, h, w.t());
    acc_t* D = dlogits.data_ptr<acc_t>();
    at::parallel_for(0, M, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t* row = D + i * c;
        row_scaled_exp(row, c, ls[i], g_lse[i] - g_lp[i]);
        const int64_t col = t[i] - v0;
        if (col >= 0 && col < c) row[col] += g_lp[i];
      }
    });
    if (need_h) grad_h.addmm_(dlogits, w);
    if (need_w) {
      Tensor rows = grad_w.narrow(0, v0, c);
      if (weight_is_acc) {
        at::mm_out(rows, dlogits.t(), h);
      } else {
        rows.copy_(at::mm(dlogits.t(), h));
      }
    }
  }
  return {need_h ? grad_h.to(hidden.scalar_type()) : Tensor(), grad_w};
}


// The gradients of sum_i g_i * logp_i given lse (possibly approximate: lse' = lse - delta per row). One walk over
// the vocabulary: e = exp(logits - lse'), S_i = sum_v e (= exp(delta_i), 1 for an exact lse), dlogits =
// g (onehot - e), grad_h' = dlogits W, grad_W += dlogits^T h. The true softmax is e / S, so at the end logp =
// target - lse' - log S and grad_h = grad_h' / S + g W[t] (1 - 1/S) are exact; grad_W's softmax part carries a
// relative error S - 1 (its rows are summed over rows i before S_i is known).
template <typename acc_t>
std::tuple<Tensor, Tensor> grad_impl(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                     const Tensor& grad_logp, const std::optional<Tensor>& lse_in,
                                     const std::optional<Tensor>& grad_weight, int64_t chunk_size) {
  const int64_t M = hidden.size(0), V = weight.size(0), d = hidden.size(1);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  const bool need_w = grad_weight.has_value() && grad_weight->defined();
  Tensor logp = at::empty({M}, opts);
  Tensor grad_h = at::zeros({M, d}, opts);
  if (M == 0) return {logp, grad_h.to(hidden.scalar_type())};

  const Tensor tgt = targets.contiguous();
  // A target outside [0, V) is never found (logp stays NaN) and passes no gradient back, as in forward/backward.
  const Tensor outside = (tgt < 0).logical_or_(tgt >= V);
  const bool has_lse = lse_in.has_value() && lse_in->defined();
  const Tensor lse = has_lse ? lse_in->to(acc).contiguous()
                             : std::get<1>(forward_impl<acc_t>(hidden, weight, targets, chunk_size));
  const Tensor h = hidden.to(acc).contiguous();
  const Tensor w_all = weight.contiguous();
  const Tensor g_all = grad_logp.to(acc).masked_fill(outside, 0).contiguous();
  const int64_t C = std::min(chunk_size, V);
  Tensor buffer = at::empty({M * C}, opts);

  std::vector<acc_t> sum_e(M, 0), target_logit(M, std::numeric_limits<acc_t>::quiet_NaN());
  const int64_t* t = tgt.data_ptr<int64_t>();
  const acc_t* g = g_all.data_ptr<acc_t>();
  const acc_t* ls = lse.data_ptr<acc_t>();
  const bool accumulate_in_place = need_w && grad_weight->scalar_type() == acc;
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const Tensor w = w_all.narrow(0, v0, c).to(acc);
    Tensor dlogits = buffer.narrow(0, 0, M * c).view({M, c});
    at::mm_out(dlogits, h, w.t());
    acc_t* D = dlogits.data_ptr<acc_t>();
    at::parallel_for(0, M, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t* row = D + i * c;
        const int64_t col = t[i] - v0;
        const bool has_target = col >= 0 && col < c;
        if (has_target) target_logit[i] = row[col];
        sum_e[i] += row_scaled_exp_sum(row, c, ls[i], -g[i]);
        if (has_target) row[col] += g[i];
      }
    });
    grad_h.addmm_(dlogits, w);
    if (need_w) {
      Tensor rows = grad_weight->narrow(0, v0, c);
      if (accumulate_in_place) {
        rows.addmm_(dlogits.t(), h);
      } else {
        rows.add_(at::mm(dlogits.t(), h));  // bf16/fp16 .grad: the chunk's fp32 sum, rounded once
      }
    }
  }
  // grad_h was accumulated with e instead of e / S: rescale its softmax part, g W[t] - grad_h'.
  const Tensor target_rows = w_all.index_select(0, tgt.clamp(0, V - 1)).to(acc).contiguous();  // g = 0 outside
  const acc_t* wt = target_rows.data_ptr<acc_t>();
  acc_t* lp = logp.data_ptr<acc_t>();
  acc_t* gh = grad_h.data_ptr<acc_t>();
  for (int64_t i = 0; i < M; ++i) {
    const acc_t S = sum_e[i];
    lp[i] = target_logit[i] - ls[i] - std::log(S);
    const acc_t inverse = acc_t(1) / S;
    for (int64_t k = 0; k < d; ++k) {
      gh[i * d + k] = gh[i * d + k] * inverse + g[i] * wt[i * d + k] * (acc_t(1) - inverse);
    }
  }
  return {logp, grad_h.to(hidden.scalar_type())};
}

}  // namespace

std::tuple<Tensor, Tensor> masked_logprobs_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                               int64_t chunk_size) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return forward_impl<decltype(acc)>(hidden, weight, targets, chunk_size);
  });
}

std::tuple<Tensor, Tensor> masked_logprobs_backward_cpu(const std::optional<Tensor>& grad_logp,
                                                        const std::optional<Tensor>& grad_lse, const Tensor& hidden,
                                                        const Tensor& weight, const Tensor& targets, const Tensor& lse,
                                                        int64_t chunk_size, std::array<bool, 2> output_mask) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return backward_impl<decltype(acc)>(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask);
  });
}

}  // namespace dllm_fast

namespace dllm_fast {

std::tuple<Tensor, Tensor> masked_logprobs_grad_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                                    const Tensor& grad_logp, const std::optional<Tensor>& lse,
                                                    const std::optional<Tensor>& grad_weight, int64_t chunk_size) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return grad_impl<decltype(acc)>(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size);
  });
}

}  // namespace dllm_fast
