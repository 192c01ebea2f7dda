"""Typed Python faces of the compiled ops: input checks, fake kernels for torch.compile, autograd, backend choice.

Every op runs on one of two backends:

- ``"compiled"``: the C++/CUDA kernel in dllm_fast._C for the tensors' device;
- ``"reference"``: the plain-PyTorch twin in dllm_fast/ops/twins.py (also named by dllm_fast.reference).

``backend=None`` (or ``"auto"``) takes the compiled kernel when one is registered for the device and otherwise
falls back to the reference with a one-time warning. Asking for ``"compiled"`` explicitly raises instead of
falling back. The environment variable ``DLLM_FAST_BACKEND`` sets the default.
"""

from dllm_fast.ops import costs  # registers the ops' FLOP formulas with torch.utils.flop_counter
from dllm_fast.ops.backend import BACKENDS, choose_backend, default_chunk_size
from dllm_fast.ops.logprobs import logprobs_with_known_gradient, masked_logprobs, masked_logprobs_grad
from dllm_fast.ops.rotary import rope
from dllm_fast.ops.sampling import sample_tokens, select_transfer

__all__ = ["BACKENDS", "choose_backend", "default_chunk_size", "logprobs_with_known_gradient", "masked_logprobs",
           "masked_logprobs_grad", "rope", "sample_tokens", "select_transfer"]
