// The one place where dllm_fast's ops are declared (TORCH_LIBRARY) and bound to their CPU and CUDA kernels.
// Python reaches every op through torch.ops.dllm_fast.*; see dllm_fast/ops.py for the typed faces,
// fake (meta) kernels and autograd formulas. pybind11 exposes build information only, never tensors.

#include <torch/extension.h>

#include "dllm_fast/ops.h"

TORCH_LIBRARY(dllm_fast, m) {
  // logp[i] = log_softmax(hidden[i] @ weight.T)[targets[i]], plus lse[i] = logsumexp(hidden[i] @ weight.T).
  // Chunked over the vocabulary with an online logsumexp: never holds more than [M, chunk_size] logits.
  // Outputs are fp32 (fp64 for fp64 inputs).
  m.def("masked_logprobs(Tensor hidden, Tensor weight, Tensor targets, int chunk_size) -> (Tensor, Tensor)");
  // Gradients of sum(grad_logp * logp + grad_lse * lse) with respect to hidden and weight, recomputing the
  // logits chunk by chunk. output_mask selects which are computed; an unselected one comes back empty.
  m.def(
      "masked_logprobs_backward(Tensor? grad_logp, Tensor? grad_lse, Tensor hidden, Tensor weight, "
      "Tensor targets, Tensor lse, int chunk_size, bool[2] output_mask) -> (Tensor, Tensor)");
  // For an upstream gradient grad_logp known before the forward: (logp, grad_hidden) of sum(grad_logp * logp)
  // in one walk over the vocabulary (three GEMMs per chunk), adding d/d weight into grad_weight in place when it
  // is given (a [V, d] buffer such as the parameter's .grad; never a new [V, d] tensor). lse: the rows' logsumexp
  // when known (e.g. target logit minus a known logp); logp and grad_hidden come out exact even when it is off
  // by a little (the walk measures the true normaliser), grad_weight to first order. None: computed first.
  m.def(
      "masked_logprobs_grad(Tensor hidden, Tensor weight, Tensor targets, Tensor grad_logp, Tensor? lse, "
      "Tensor(a!)? grad_weight, int chunk_size) -> (Tensor, Tensor)");
  // One token per row of hidden, drawn from softmax(logits / temperature) by Gumbel-max with Philox noise keyed
  // by (seed, offset, row_ids[i], token id); temperature 0 is argmax, ties to the lowest id. Also returns the
  // softmax probability of that token under the unscaled logits. suppress_ids are removed from both;
  // confidence_exclude_ids only from the confidence softmax (their confidence is 0).
  m.def(
      "sample_tokens(Tensor hidden, Tensor weight, Tensor row_ids, float temperature, int seed, int offset, "
      "int[] suppress_ids, int[] confidence_exclude_ids, int chunk_size) -> (Tensor, Tensor)");
  // Per row, the candidate positions to unmask: the counts[b] most confident (ties to the lowest position) when
  // threshold < 0, else the most confident one plus every candidate whose confidence >= threshold.
  m.def("select_transfer(Tensor confidence, Tensor candidates, Tensor counts, float threshold) -> Tensor");
}

TORCH_LIBRARY_IMPL(dllm_fast, CPU, m) {
  m.impl("masked_logprobs", &dllm_fast::masked_logprobs_cpu);
  m.impl("masked_logprobs_backward", &dllm_fast::masked_logprobs_backward_cpu);
  m.impl("masked_logprobs_grad", &dllm_fast::masked_logprobs_grad_cpu);
  m.impl("sample_tokens", &dllm_fast::sample_tokens_cpu);
  m.impl("select_transfer", &dllm_fast::select_transfer_cpu);
}

#ifdef DLLM_FAST_WITH_CUDA
TORCH_LIBRARY_IMPL(dllm_fast, CUDA, m) {
  m.impl("masked_logprobs", &dllm_fast::masked_logprobs_cuda);
  m.impl("masked_logprobs_backward", &dllm_fast::masked_logprobs_backward_cuda);
  m.impl("sample_tokens", &dllm_fast::sample_tokens_cuda);
  m.impl("select_transfer", &dllm_fast::select_transfer_cuda);
}
#endif

#ifndef DLLM_FAST_VERSION
#define DLLM_FAST_VERSION "0.1.0"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "dllm_fast compiled ops; importing this module registers torch.ops.dllm_fast.*";
#ifdef DLLM_FAST_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // The torch this extension was compiled against; a different runtime torch cannot load it.
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  m.attr("version") = DLLM_FAST_VERSION;
}
