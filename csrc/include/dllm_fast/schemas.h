// The schema of every op, listed once: csrc/registration.cpp declares them in the dllm_fast namespace and the
// emulated CUDA build (python_tests/emulation/registration.cpp) in dllm_fast_emulated. X(name, schema) per op. The ops
// trust their arguments; dllm_fast/ops/ checks them (see ops.h).
#pragma once

#define DLLM_FAST_OP_SCHEMAS(X)                                                                                \
  /* logp[i] = log_softmax(hidden[i] @ weight.T)[targets[i]], plus lse[i] = logsumexp(hidden[i] @ weight.T),  \
     chunked over the vocabulary with an online logsumexp: never more than [M, chunk_size] logits. Outputs   \
     are fp32 (fp64 for fp64 inputs); a target outside [0, V) gives logp NaN (on every device). The logits    \
     GEMM takes hidden and weight as they are and accumulates in fp32 (fp64 for fp64 inputs).                 \
     tf32_grad_gemms: how its backward's gradient GEMMs run (see masked_logprobs_backward); the forward is the \
     same either way. */                                                                                      \
  X(masked_logprobs,                                                                                           \
    "masked_logprobs(Tensor hidden, Tensor weight, Tensor targets, int chunk_size, "                           \
    "bool tf32_grad_gemms=False) -> (Tensor, Tensor)")                                                         \
  /* Gradients of sum(grad_logp * logp + grad_lse * lse) with respect to hidden and weight, recomputing the    \
     logits chunk by chunk (three GEMMs per chunk). output_mask selects which are computed; an unselected one  \
     comes back empty. For bf16/fp16 inputs the two gradient GEMMs take the chunk's d(logits), computed in     \
     fp32 and rounded once to the model's dtype, with hidden and weight as they are, accumulating in fp32.     \
     tf32_grad_gemms=True keeps d(logits) in fp32 and runs those GEMMs on fp32 operands in TF32 on CUDA (fp32   \
     copies of a bf16/fp16 hidden and weight chunk: half bf16's tensor-core rate, twice the bytes); on CPU,    \
     which has no TF32, in exact fp32. fp32 inputs: exact fp32 GEMMs (TF32 under the option, on CUDA); fp64:    \
     fp64 GEMMs either way. */                                                                                 \
  X(masked_logprobs_backward,                                                                                  \
    "masked_logprobs_backward(Tensor? grad_logp, Tensor? grad_lse, Tensor hidden, Tensor weight, "            \
    "Tensor targets, Tensor lse, int chunk_size, bool[2] output_mask, bool tf32_grad_gemms=False) "           \
    "-> (Tensor, Tensor)")                                                                                     \
  /* For an upstream gradient grad_logp known before the forward: (logp, grad_hidden) of sum(grad_logp * logp) \
     in one walk over the vocabulary (three GEMMs per chunk, typed as in masked_logprobs_backward), adding      \
     d/d weight into grad_weight in place when it is given (e.g. the parameter's .grad; never a new [V, d]      \
     tensor). lse: the rows' logsumexp when known; logp and grad_hidden come out exact even when it is off by a \
     little (the walk measures the true normaliser), grad_weight to first order. None: computed first. A       \
     target outside [0, V) gives logp NaN and no gradient. */                                                  \
  X(masked_logprobs_grad,                                                                                      \
    "masked_logprobs_grad(Tensor hidden, Tensor weight, Tensor targets, Tensor grad_logp, Tensor? lse, "       \
    "Tensor(a!)? grad_weight, int chunk_size, bool tf32_grad_gemms=False) -> (Tensor, Tensor)")                \
  /* One token per row of hidden, drawn from softmax(logits / temperature) by Gumbel-max with Philox noise     \
     keyed by (seed, offset, row_ids[i], token id); temperature 0 is argmax, ties to the lowest id. Also       \
     returns the softmax probability of that token under the unscaled logits. suppress_ids are removed from    \
     both; confidence_exclude_ids only from the confidence softmax (their confidence is 0). A row with no      \
     finite score gets token -1 and confidence NaN. */                                                        \
  X(sample_tokens,                                                                                             \
    "sample_tokens(Tensor hidden, Tensor weight, Tensor row_ids, float temperature, int seed, int offset, "   \
    "int[] suppress_ids, int[] confidence_exclude_ids, int chunk_size) -> (Tensor, Tensor)")                   \
  /* Per row, the candidate positions to unmask: the counts[b] most confident (ties to the lowest position)    \
     when threshold < 0, else the most confident one plus every candidate whose confidence >= threshold. A     \
     NaN confidence ranks as -inf. */                                                                          \
  X(select_transfer,                                                                                           \
    "select_transfer(Tensor confidence, Tensor candidates, Tensor counts, float threshold) -> Tensor")         \
  /* Rotary position embedding of the first rotated_heads heads of x [B, L, heads, D] (D even, last dimension  \
     contiguous), in one pass: out = x * tables[0] + roll(x * tables[1], D / 2) along D, each product and the  \
     sum rounded in the tables' dtype (fp32; fp64 for fp64 x), then once to x's dtype; the other heads are     \
     copied. tables [2, B, L, 1, D] (layers.rope_tables; any strides, the last contiguous). out: a new          \
     contiguous tensor shaped like x. */                                                                      \
  X(rope, "rope(Tensor x, Tensor tables, int rotated_heads) -> Tensor")

// The CUDA implementation of each op that has one: X(name, function). The emulated build runs these on CPU.
#define DLLM_FAST_CUDA_KERNELS(X)                               \
  X(masked_logprobs, masked_logprobs_cuda)                      \
  X(masked_logprobs_backward, masked_logprobs_backward_cuda)    \
  X(masked_logprobs_grad, masked_logprobs_grad_cuda)            \
  X(sample_tokens, sample_tokens_cuda)                          \
  X(select_transfer, select_transfer_cuda)                      \
  X(rope, rope_cuda)
