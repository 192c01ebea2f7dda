// CPU kernels of dllm_fast::masked_logprobs (LM head + log-softmax + gather, chunked over the vocabulary), its
// backward, and masked_logprobs_grad (the gradients for an upstream gradient known before the forward).
//
// All three walk the vocabulary chunks once, in walk_vocabulary: per chunk of C rows of the head, one GEMM into
// a reused [M, C] accumulator buffer (MKL), then one pass per row, then the gradient GEMMs when asked. The
// forward's pass merges the chunk's max and sum of exponentials into a running logsumexp and picks up the
// target logit. The backward recomputes each chunk's logits and turns them in place into d(loss)/d(logits) =
// g_lse * p + g_logp * (onehot - p); two GEMMs then accumulate grad_hidden and write grad_weight's rows.
// masked_logprobs_grad walks the chunks once with the same three GEMMs, but given the upstream gradient and the
// rows' logsumexp up front it needs no forward first, and it adds grad_weight's rows into a caller's buffer (the
// parameter's .grad) instead of returning a new [V, d] tensor. Peak temporary memory is [M, C] plus one
// converted weight chunk.
//
// Precision: every product accumulates in fp32 (fp64 for fp64 inputs); bf16/fp16 inputs are upcast (exactly)
// for MKL. For them d(logits) is rounded once to the model's dtype before the gradient GEMMs, as the CUDA glue
// rounds it for its bf16/fp16 tensor-core GEMMs: exact fp32 products of those rounded values, summed in fp32,
// are what a bf16 x bf16 -> fp32 GEMM computes, so CPU and CUDA give the same result up to summation order.
// fp16 rounds d(logits) times the same power of two as the CUDA glue (dllm_fast/gradient_scale.h), here divided
// out again right after rounding (exact).
// tf32_grad_gemms keeps d(logits) in fp32 (CPUs have no TF32: the GEMMs stay exact fp32).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <limits>
#include <vector>

#include "dllm_fast/gradient_scale.h"
#include "dllm_fast/ops.h"
#include "vec_math.h"

namespace dllm_fast {
namespace {

using cpu::online_logsumexp_update;
using cpu::row_scaled_exp;
using cpu::row_scaled_exp_sum;

// Rows per parallel task: enough that a task touches ~64K logits.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1)); }

// x[j] <- x[j] rounded to nearest even in `dtype` (bf16 or fp16) after scaling by `scale` (a power of two),
// then divided by it again, kept as acc_t: d(logits) as the model-dtype gradient GEMMs take it.
template <typename acc_t>
void round_row_to(at::ScalarType dtype, float scale, acc_t* x, int64_t n) {
  if (dtype == at::kBFloat16) {
    for (int64_t j = 0; j < n; ++j) x[j] = static_cast<acc_t>(static_cast<float>(c10::BFloat16(x[j] * scale)) / scale);
  } else {
    for (int64_t j = 0; j < n; ++j) x[j] = static_cast<acc_t>(static_cast<float>(c10::Half(x[j] * scale)) / scale);
  }
}

// What a walk computes besides each row's step: grad_hidden [M, d] in acc_t, accumulated over the chunks;
// grad_weight [V, d] (the model's dtype or acc_t), each chunk's rows written, or added into when
// add_into_weight. Undefined tensors are not computed.
struct WalkOutputs {
  Tensor grad_hidden;
  Tensor grad_weight;
  bool add_into_weight = false;
};

// The one walk over the vocabulary chunks of the forward, the backward and the known-gradient walk. h: hidden
// in acc_t (contiguous). Per chunk: logits[M, c] = h @ weight[v0:v0+c]^T; row_step(i, row, c, v0) for every
// row, in parallel, which turns the row into d(logits) when the walk has outputs (then rounded to the model's
// dtype unless tf32_grad_gemms); grad_hidden += d(logits) @ chunk; grad_weight's rows (+)= d(logits)^T @ h.
// upstream_bound: [M] bounds on each row's |d(logits)|, read for fp16 only (undefined for the forward).
template <typename acc_t, typename RowStep>
void walk_vocabulary(const Tensor& h, const Tensor& weight, int64_t chunk_size, bool tf32_grad_gemms,
                     const Tensor& upstream_bound, WalkOutputs& out, RowStep&& row_step) {
  const int64_t M = h.size(0), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const bool need_h = out.grad_hidden.defined(), need_w = out.grad_weight.defined();
  const bool round = (need_h || need_w) && weight.scalar_type() != acc && !tf32_grad_gemms;
  const float scale = round && weight.scalar_type() == at::kHalf ? fp16_gradient_scale(upstream_bound).item<float>()
                                                                 : 1.0f;
  const Tensor w_all = weight.contiguous();
  const int64_t C = std::min(chunk_size, V);
  Tensor buffer = at::empty({M * C}, h.options());
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const Tensor w = w_all.narrow(0, v0, c).to(acc);  // a view when weight is already acc_t
    Tensor logits = buffer.narrow(0, 0, M * c).view({M, c});
    at::mm_out(logits, h, w.t());
    acc_t* L = logits.data_ptr<acc_t>();
    at::parallel_for(0, M, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        row_step(i, L + i * c, c, v0);
        if (round) round_row_to(weight.scalar_type(), scale, L + i * c, c);
      }
    });
    if (need_h) out.grad_hidden.addmm_(logits, w);
    if (need_w) {
      Tensor rows = out.grad_weight.narrow(0, v0, c);
      if (rows.scalar_type() == acc) {
        if (out.add_into_weight) {
          rows.addmm_(logits.t(), h);
        } else {
          at::mm_out(rows, logits.t(), h);
        }
      } else if (out.add_into_weight) {
        rows.add_(at::mm(logits.t(), h));  // bf16/fp16 .grad: the chunk's fp32 sum, rounded once
      } else {
        rows.copy_(at::mm(logits.t(), h));
      }
    }
  }
}

template <typename acc_t>
std::tuple<Tensor, Tensor> forward_impl(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                        int64_t chunk_size) {
  const int64_t M = hidden.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  Tensor logp = at::empty({M}, opts), lse = at::empty({M}, opts);
  if (M == 0) return {logp, lse};

  const Tensor tgt = targets.contiguous();
  // A target outside [0, V) is never found: its log-prob stays NaN, as on CUDA (checking costs a sync there).
  std::vector<acc_t> run_max(M, -std::numeric_limits<acc_t>::infinity()), run_sum(M, 0),
      target_logit(M, std::numeric_limits<acc_t>::quiet_NaN());
  const int64_t* t = tgt.data_ptr<int64_t>();
  WalkOutputs none;
  walk_vocabulary<acc_t>(hidden.to(acc).contiguous(), weight, chunk_size, false, Tensor(), none,
                         [&](int64_t i, const acc_t* row, int64_t c, int64_t v0) {
                           online_logsumexp_update(run_max[i], run_sum[i], row, c);
                           const int64_t col = t[i] - v0;
                           if (col >= 0 && col < c) target_logit[i] = row[col];
                         });
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
                                         const Tensor& lse, int64_t chunk_size, std::array<bool, 2> output_mask,
                                         bool tf32_grad_gemms) {
  const int64_t M = hidden.size(0), V = weight.size(0), d = hidden.size(1);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  const bool need_h = output_mask[0], need_w = output_mask[1];
  WalkOutputs out;
  if (need_h) out.grad_hidden = at::zeros({M, d}, opts);
  if (need_w) out.grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);  // every chunk writes its rows
  const bool has_glp = grad_logp.has_value() && grad_logp->defined();
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if ((!need_h && !need_w) || M == 0 || (!has_glp && !has_glse)) {
    if (need_w) out.grad_weight.zero_();
    return {need_h ? out.grad_hidden.to(hidden.scalar_type()) : Tensor(), out.grad_weight};
  }

  const Tensor tgt = targets.contiguous();
  // The log-prob of a target outside [0, V) is a constant NaN: nothing flows back through it (as on CUDA).
  const Tensor outside = (tgt < 0).logical_or_(tgt >= V);
  const Tensor glp = has_glp ? grad_logp->to(acc).masked_fill(outside, 0).contiguous() : at::zeros({M}, opts);
  const Tensor glse = has_glse ? grad_lse->to(acc).contiguous() : at::zeros({M}, opts);
  const Tensor lse_c = lse.to(acc).contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  const acc_t* g_lp = glp.data_ptr<acc_t>();
  const acc_t* g_lse = glse.data_ptr<acc_t>();
  const acc_t* ls = lse_c.data_ptr<acc_t>();
  walk_vocabulary<acc_t>(hidden.to(acc).contiguous(), weight, chunk_size, tf32_grad_gemms,
                         softmax_grad_bound(glp, glse), out, [&](int64_t i, acc_t* row, int64_t c, int64_t v0) {
                           row_scaled_exp(row, c, ls[i], g_lse[i] - g_lp[i]);
                           const int64_t col = t[i] - v0;
                           if (col >= 0 && col < c) row[col] += g_lp[i];
                         });
  return {need_h ? out.grad_hidden.to(hidden.scalar_type()) : Tensor(), out.grad_weight};
}

// The gradients of sum_i g_i * logp_i given lse (possibly approximate: lse' = lse - delta per row). One walk over
// the vocabulary: e = exp(logits - lse'), S_i = sum_v e (= exp(delta_i), 1 for an exact lse), dlogits =
// g (onehot - e), grad_h' = dlogits W, grad_W += dlogits^T h. The true softmax is e / S, so at the end logp =
// target - lse' - log S and grad_h = grad_h' / S + g W[t] (1 - 1/S) are exact; grad_W's softmax part carries a
// relative error S - 1 (its rows are summed over rows i before S_i is known).
template <typename acc_t>
std::tuple<Tensor, Tensor> grad_impl(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                     const Tensor& grad_logp, const std::optional<Tensor>& lse_in,
                                     const std::optional<Tensor>& grad_weight, int64_t chunk_size,
                                     bool tf32_grad_gemms) {
  const int64_t M = hidden.size(0), V = weight.size(0), d = hidden.size(1);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  Tensor logp = at::empty({M}, opts);
  WalkOutputs out;
  out.grad_hidden = at::zeros({M, d}, opts);
  if (M == 0) return {logp, out.grad_hidden.to(hidden.scalar_type())};
  if (grad_weight.has_value() && grad_weight->defined()) out.grad_weight = *grad_weight;
  out.add_into_weight = true;

  const Tensor tgt = targets.contiguous();
  // A target outside [0, V) is never found (logp stays NaN) and passes no gradient back, as in forward/backward.
  const Tensor outside = (tgt < 0).logical_or_(tgt >= V);
  const bool has_lse = lse_in.has_value() && lse_in->defined();
  const Tensor lse = has_lse ? lse_in->to(acc).contiguous()
                             : std::get<1>(forward_impl<acc_t>(hidden, weight, targets, chunk_size));
  const Tensor g_all = grad_logp.to(acc).masked_fill(outside, 0).contiguous();
  std::vector<acc_t> sum_e(M, 0), target_logit(M, std::numeric_limits<acc_t>::quiet_NaN());
  const int64_t* t = tgt.data_ptr<int64_t>();
  const acc_t* g = g_all.data_ptr<acc_t>();
  const acc_t* ls = lse.data_ptr<acc_t>();
  // |d(logits)| = |g (onehot - e)| <= |g| (e <= 1 for an exact lse)
  walk_vocabulary<acc_t>(hidden.to(acc).contiguous(), weight, chunk_size, tf32_grad_gemms, g_all, out,
                         [&](int64_t i, acc_t* row, int64_t c, int64_t v0) {
                           const int64_t col = t[i] - v0;
                           const bool has_target = col >= 0 && col < c;
                           if (has_target) target_logit[i] = row[col];
                           sum_e[i] += row_scaled_exp_sum(row, c, ls[i], -g[i]);
                           if (has_target) row[col] += g[i];
                         });
  // grad_h was accumulated with e instead of e / S: rescale its softmax part, g W[t] - grad_h'.
  const Tensor target_rows =
      weight.contiguous().index_select(0, tgt.clamp(0, V - 1)).to(acc).contiguous();  // g = 0 outside
  const acc_t* wt = target_rows.data_ptr<acc_t>();
  acc_t* lp = logp.data_ptr<acc_t>();
  acc_t* gh = out.grad_hidden.data_ptr<acc_t>();
  for (int64_t i = 0; i < M; ++i) {
    const acc_t S = sum_e[i];
    lp[i] = target_logit[i] - ls[i] - std::log(S);
    const acc_t inverse = acc_t(1) / S;
    for (int64_t k = 0; k < d; ++k) {
      gh[i * d + k] = gh[i * d + k] * inverse + g[i] * wt[i * d + k] * (acc_t(1) - inverse);
    }
  }
  return {logp, out.grad_hidden.to(hidden.scalar_type())};
}

}  // namespace

std::tuple<Tensor, Tensor> masked_logprobs_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                               int64_t chunk_size, bool /*tf32_grad_gemms: its backward's*/) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return forward_impl<decltype(acc)>(hidden, weight, targets, chunk_size);
  });
}

std::tuple<Tensor, Tensor> masked_logprobs_backward_cpu(const std::optional<Tensor>& grad_logp,
                                                        const std::optional<Tensor>& grad_lse, const Tensor& hidden,
                                                        const Tensor& weight, const Tensor& targets, const Tensor& lse,
                                                        int64_t chunk_size, std::array<bool, 2> output_mask,
                                                        bool tf32_grad_gemms) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return backward_impl<decltype(acc)>(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask,
                                        tf32_grad_gemms);
  });
}

std::tuple<Tensor, Tensor> masked_logprobs_grad_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                                    const Tensor& grad_logp, const std::optional<Tensor>& lse,
                                                    const std::optional<Tensor>& grad_weight, int64_t chunk_size,
                                                    bool tf32_grad_gemms) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return grad_impl<decltype(acc)>(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                    tf32_grad_gemms);
  });
}

}  // namespace dllm_fast
