"""Plain-PyTorch twins of every compiled op and published algorithm: test oracles, benchmark baselines and the
explicit ``backend="reference"``."""

from dllm_fast.reference import likelihood, objectives, sft
from dllm_fast.reference.logprobs import masked_logprobs, masked_logprobs_grad
from dllm_fast.reference.llada_sampler import generate
from dllm_fast.reference.sampling_ops import sample_tokens, select_transfer

__all__ = ["generate", "likelihood", "masked_logprobs", "masked_logprobs_grad", "objectives", "sample_tokens",
           "select_transfer", "sft"]
