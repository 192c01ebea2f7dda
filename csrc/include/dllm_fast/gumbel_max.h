// The Gumbel-max score of the samplers, shared by the CPU kernel and the CUDA glue (torch-free): a token wins
// by the highest score = logit * logit_scale + noise_scale * Gumbel noise. (logit_scale, noise_scale) is
// (1, T) for T < 1 and (1 / T, 1) for T >= 1: a positive multiple of logit / T + Gumbel, so the same argmax and
// an exact sample of softmax(logits / T), that no temperature can overflow (logit / T left fp32's range just
// above the greedy cutoff, and the lowest id won instead of the argmax). T = 0 is greedy: (1, 0), no noise.
#pragma once

namespace dllm_fast {

template <typename acc_t>
struct SampleScales {
  acc_t logit, noise;
};

template <typename acc_t>
inline SampleScales<acc_t> sample_scales(double temperature) {
  if (temperature == 0.0) return {acc_t(1), acc_t(0)};
  if (temperature < 1.0) return {acc_t(1), static_cast<acc_t>(temperature)};
  return {static_cast<acc_t>(1.0 / temperature), acc_t(1)};
}

}  // namespace dllm_fast
