"""Plain-PyTorch twins of every compiled op and published algorithm: test oracles, benchmark baselines and the
explicit ``backend="reference"``. The ops' twins live beside the ops they stand in for (dllm_fast/ops/twins.py,
so that the fast path imports down only) and are named here with the algorithms'."""

from dllm_fast.ops.twins import masked_logprobs, masked_logprobs_grad, rope, sample_tokens, select_transfer
from dllm_fast.reference import likelihood, objectives, sft
from dllm_fast.reference.llada_sampler import generate

__all__ = ["generate", "likelihood", "masked_logprobs", "masked_logprobs_grad", "objectives", "rope", "sample_tokens",
           "select_transfer", "sft"]
