"""Plain-PyTorch twins of every compiled op and published algorithm: test oracles, benchmark baselines and the
explicit ``backend="reference"``."""

from dllm_fast.reference.logprobs import accumulate_dtype, masked_logprobs
from dllm_fast.reference import likelihood

__all__ = ["accumulate_dtype", "masked_logprobs"]
