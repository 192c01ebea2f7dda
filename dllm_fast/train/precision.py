"""Which dtype each weight of a run lives in, decided in one place (`training_precision`), and the models a run
builds in those dtypes (`training_models`: the policy, its LoRA adapters, the reference copy). train/run.py and
the planner (dllm_fast/planning/step.py) both build through them, so a plan's weight bytes are the run's.

With bf16 compute (`--bf16`, on by default on CUDA: autocast to bf16):

- weights that never train are stored in bf16: a LoRA run's base model (embedding, norms and LM head included)
  and every reference copy. Autocast casts an fp32 weight to bf16 at every matmul anyway, so the matmuls see the
  same bf16 values; stored in bf16 they take half the memory and each forward streams half the bytes (16 GB
  instead of 32 for LLaDA-8B). TRL and verl keep frozen and reference weights in bf16 the same way.
- weights that train keep fp32 master copies (the usual mixed precision): the LoRA adapters (PEFT keeps them
  fp32 on a bf16 base; checked here), and in a full fine-tune every weight of the policy. An AdamW step changes a
  weight by about lr (1e-4 to 1e-6) relative to its size, far below bf16's resolution of 2^-8, so updates applied
  to bf16 weights would mostly round away. The adapters are small (rank x (in + out) per adapted matrix).

Checkpoints hold the trained weights as they train: the adapter, or the full policy, in fp32. Without bf16 compute
(the CPU default) every weight stays fp32, as before.

Under FSDP2 (`sharded_mixed_precision`) the same split holds for the gathers: on CUDA with bf16 compute each unit's
weights are all-gathered in bf16 (half the bytes of fp32 master weights; what autocast would cast them to anyway)
and its gradients reduce-scattered in fp32 into the fp32 shards. On CPU the shards are gathered in their own dtype.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """compute: the autocast dtype (None: no autocast, the weights' own dtype). trainable: the dtype of weights
    the optimizer updates (master weights). frozen: the dtype of weights that never train."""

    compute: torch.dtype | None
    trainable: torch.dtype
    frozen: torch.dtype

    def base_dtype(self, lora: bool) -> torch.dtype:
        """The dtype the policy's base model loads in: frozen under LoRA, trainable in a full fine-tune."""
        return self.frozen if lora else self.trainable

    def autocast(self, device_type: str):
        """The context every forward of the run runs in."""
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute)

    def describe(self, lora: bool) -> str:
        """One line for the run's log and the plan's summary."""
        if self.compute is None:
            return f"weights in {short_name(self.trainable)}, no autocast"
        trained = "LoRA adapters" if lora else "policy weights"
        frozen = "base model and reference copy" if lora else "reference copy"
        return (f"{short_name(self.compute)} autocast; {trained} train in {short_name(self.trainable)} (master "
                f"weights), {frozen} frozen in {short_name(self.frozen)}")


def training_precision(config, device_type: str, *, weights: torch.dtype | None = None) -> Precision:
    """The dtypes of a run of `config` (a TrainConfig) on `device_type` ("cuda" or "cpu"): bf16 compute when
    --bf16 says so (default: on CUDA), and then frozen weights in bf16 and trained ones in fp32 (module
    docstring). weights: every weight in this dtype instead, trained or not (the planner's what-if of a pure
    bf16 run, which train does not offer)."""
    bf16 = config.model.bf16 if config.model.bf16 is not None else device_type == "cuda"
    compute = torch.bfloat16 if bf16 else None
    if weights is not None:
        return Precision(compute, weights, weights)
    return Precision(compute, torch.float32, torch.bfloat16 if bf16 else torch.float32)


def sharded_mixed_precision(precision: Precision, device_type: str):
    """FSDP2's MixedPrecisionPolicy for a run in `precision` on `device_type`, or None (gathers and reductions in
    each weight's own dtype). On CUDA with bf16 compute: parameters gathered in the compute dtype, gradients
    reduced in fp32 (the master weights' dtype). On CPU the run keeps its own dtype (fp32, or fp64 in the exact
    tests), whatever the compute dtype."""
    if device_type != "cuda" or precision.compute is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=torch.float32)


def training_models(base, config, precision: Precision, *, needs_reference: bool):
    """(policy, reference or None) of a run, from its base model loaded in `precision.base_dtype(config.lora.enabled)`:
    the base with LoRA adapters in the trainable dtype (--lora true; the reference is then the base with the
    adapters disabled), or the base itself with, when the objective needs one, a frozen copy in the frozen
    dtype. On the meta device (the planner) nothing is initialised."""
    expected = precision.base_dtype(config.lora.enabled)
    floating = {p.dtype for p in base.parameters() if p.is_floating_point()}
    if floating != {expected}:
        raise ValueError(f"the base model holds {sorted(map(short_name, floating))} weights; load it in "
                         f"{short_name(expected)} (Precision.base_dtype) before building the run's models.")
    if config.lora.enabled:
        policy = add_lora(base, config)
        for parameter in policy.parameters():
            if parameter.requires_grad and parameter.dtype != precision.trainable:
                parameter.data = parameter.data.to(precision.trainable)
        return policy, None
    reference = frozen_copy(base, precision.frozen) if needs_reference else None
    return base, reference


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` in eval mode with no gradients, its weights cast to `dtype` one at a time (a model in
    fp32 and its bf16 copy never need a second fp32 copy at once)."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in model.parameters()}
    copied = copy.deepcopy(model, memo)
    return copied.to(dtype).eval().requires_grad_(False)


def add_lora(model, config):
    """The model with PEFT LoRA adapters on --lora-targets (default: every module its family allows)."""
    import peft

    from dllm_fast.train.sources import lora_targets

    lora = peft.LoraConfig(r=config.lora.rank, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
                           target_modules=model.lora_target_pattern(lora_targets(type(model), config.lora)))
    # With checkpointing on, PEFT hooks the input embeddings so that their output requires grad, which reentrant
    # checkpointing needs. The models' checkpointing is non-reentrant, and the hook's requires_grad_ breaks the
    # compiled rollout step's graph (torch 2.11's dynamo cannot trace it): take back the hooks the wrapping added.
    embeddings = model.get_input_embeddings()
    hooks_before = set(embeddings._forward_hooks)
    wrapped = peft.get_peft_model(model, lora)
    for key in set(embeddings._forward_hooks) - hooks_before:
        del embeddings._forward_hooks[key]
    return wrapped


def short_name(dtype: torch.dtype) -> str:
    """fp32, bf16, or torch's name without its prefix."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))
