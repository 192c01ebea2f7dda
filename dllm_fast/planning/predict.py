"""The planner's time for single calls that the benchmarks measure on a GPU, each run on fake tensors in a planning
session exactly as the benchmark runs it:

- `head`: the LM head's per-token log-probs (benchmarks/bench_logprob.py, peers_logprob.py): naive PyTorch, the
  fused op (forward, forward + backward) and the known-gradient walk, at d = 4096, V = 126464;
- `rollout`: one `generate` call (benchmarks/bench_rollout.py): the reference sampler or dllm_fast's, any cache,
  eager or compiled (CUDA graphs);
- `engine`: one forward + backward of the VRPO-OL objective over n_t masks (benchmarks/bench_elbo.py): naive
  (every pair's full logits in one graph) or the streaming engine's two passes.

Each returns the call's Costs (dllm_fast.planning.accounting): `.seconds` is the estimate, `.device_seconds`,
`.host_seconds`, `.kernels` its parts. bench_plan.py --gpu prints them against the recorded measurements
(calibration.RECORDED), and python_tests/test_plan_calibration.py pins them.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from dllm_fast.planning.accounting import Costs, Target
from dllm_fast.planning.calibration import DEFAULT, Calibration, Recorded
from dllm_fast.planning.gpus import GPU, gpu as gpu_named
from dllm_fast.planning.step import Session
from dllm_fast.train.config import TrainConfig

HEAD_D, HEAD_V = 4096, 126464
HEAD_PROVIDERS = ("naive", "dllm_fast", "dllm_grad", "dllm_grad_lse")
ENGINE_PROVIDERS = ("naive", "two_pass")
ENGINE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj"]  # bench_elbo's


def target(gpu: str | GPU, calibration: Calibration = DEFAULT, *, tf32_grad_gemms: bool = False) -> Target:
    return Target("cuda", gpu_named(gpu) if isinstance(gpu, str) else gpu, calibration=calibration,
                  tf32_grad_gemms=tf32_grad_gemms)


def _op_session(target_: Target) -> Session:
    """A session for calls that need no model of their own (the tiny preset's weights stand by, unused)."""
    return Session(TrainConfig(model="tiny", bf16=False), target=target_, optimizer=False)


def head(gpu: str | GPU, *, M: int, provider: str, backward: bool, dtype: torch.dtype = torch.bfloat16,
         calibration: Calibration = DEFAULT, tf32_grad_gemms: bool = False, split: dict | None = None) -> Costs:
    """One call of the LM head's log-probs on M rows, as bench_logprob times it: the forward on detached inputs,
    or forward + backward with an fp32 upstream gradient into new .grad tensors; dllm_grad: masked_logprobs_grad
    with its logsumexp pass and a grad_weight buffer (peers_logprob's "dllm_grad"); dllm_grad_lse: the same with
    the rows' logsumexp known (3 GEMMs per chunk, as the engine's pass 2 runs it). tf32_grad_gemms: the fused
    backward's gradient GEMMs in TF32 (the CUDA kernels at b7790f6). split: filled with the device seconds by
    what bounds them (for fitting the calibration)."""
    from dllm_fast.ops import masked_logprobs, masked_logprobs_grad

    if provider not in HEAD_PROVIDERS:
        raise ValueError(f"provider {provider!r} is not one of {', '.join(HEAD_PROVIDERS)}.")
    session = _op_session(target(gpu, calibration, tf32_grad_gemms=tf32_grad_gemms))
    with session:
        with session.mode.fake_factories():  # device-sized inputs stay fake: no real [M, V] product on the host
            hidden = torch.empty(M, HEAD_D, dtype=dtype, requires_grad=backward)
            weight = torch.empty(HEAD_V, HEAD_D, dtype=dtype, requires_grad=backward)
            targets = torch.zeros(M, dtype=torch.long)
            upstream = torch.empty(M)
            known = provider.startswith("dllm_grad")
            grad_weight = torch.zeros(HEAD_V, HEAD_D, dtype=dtype) if known else None
            lse = torch.empty(M) if provider == "dllm_grad_lse" else None

        def call():
            if known:
                return masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=grad_weight)
            if provider == "naive":
                logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
            else:
                logp = masked_logprobs(hidden, weight, targets)
            if backward:
                logp.backward(upstream)
            return logp

        session.accountant.split = split
        phase, _ = session.measure("head", call)
    return phase.costs


def rollout(gpu: str | GPU, *, preset: str = "llada-8b", batch: int = 8, prompt: int = 200, gen: int = 256,
            block: int = 32, steps: int = 128, cache: str = "dual", provider: str = "dllm_fast",
            compile: bool = False, dtype: torch.dtype = torch.bfloat16, calibration: Calibration = DEFAULT,
            allow_tf32: bool = False) -> tuple[Costs, int]:
    """(Costs, forwards) of one greedy generate call as bench_rollout times it: random weights in `dtype`, no
    autocast, `batch` prompts of `prompt` tokens; provider "reference" runs dllm_fast.reference.generate (cache
    none). compile: generate(compile=True), each denoising step one CUDA graph replay."""
    from dllm_fast import reference
    from dllm_fast.rollout import generate

    config = TrainConfig(model=preset, prompts_per_step=batch, group_size=1, gen_length=gen, block_length=block,
                         diffusion_steps=steps, cache=cache, temperature=0.0, bf16=False)
    target_ = Target("cuda", gpu_named(gpu) if isinstance(gpu, str) else gpu, allow_tf32=allow_tf32,
                     calibration=calibration)
    session = Session(config, target=target_, weights_dtype=dtype, optimizer=False)
    with session:
        model = session.policy.eval()
        prompts = torch.randint(0, model.mask_token_id, (batch, prompt), generator=torch.Generator().manual_seed(1))
        options = dict(gen_length=gen, block_length=block, steps=steps, temperature=0.0,
                       generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            if provider == "reference":
                phase, result = session.measure("rollout", lambda: reference.generate(model, prompts, **options))
            else:
                phase, result = session.measure("rollout", lambda: generate(
                    model, prompts, cache=cache, compile=compile, **options))
    return phase.costs, int(result.nfe)


def engine(gpu: str | GPU, *, provider: str, n_t: int, micro_batch: int = 1, preset: str = "llada-8b",
           prompt: int = 200, completion: int = 512, lora: bool = True, lora_rank: int = 128, sequences: int = 1,
           dtype: torch.dtype = torch.bfloat16, calibration: Calibration = DEFAULT) -> Costs:
    """One forward + backward of VRPO-OL's exp(ELBO - ELBO_old) over n_t stratified masks of `sequences`
    sequences, as bench_elbo runs it: weights in `dtype` (no autocast), LoRA r`lora_rank` on q, k, v and up (or
    every weight trained), gradients None at the start. naive: reference.likelihood.score_naive, every pair's
    full logits in one graph; two_pass: likelihood.streaming_backward with `micro_batch` pairs per graph."""
    from dllm_fast import reference
    from dllm_fast.likelihood import MicroBatching, elbo, sample_masks, streaming_backward

    if provider not in ENGINE_PROVIDERS:
        raise ValueError(f"provider {provider!r} is not one of {', '.join(ENGINE_PROVIDERS)}.")
    config = TrainConfig(model=preset, bf16=False, lora=lora, lora_rank=lora_rank, lora_alpha=max(1, lora_rank // 2),
                         lora_targets=ENGINE_LORA_TARGETS if lora else None, micro_batch=micro_batch)
    session = Session(config, target=target(gpu, calibration), weights_dtype=dtype, optimizer=False)
    with session:
        model = session.policy
        generator = torch.Generator().manual_seed(1)
        sequence = torch.randint(0, session.base.mask_token_id, (sequences, prompt + completion), generator=generator)
        masks = sample_masks(sequence, prompt_length=prompt, n_t=n_t, sampler="stratified_l", count="all",
                             generator=torch.Generator().manual_seed(n_t))

        def objective(lp):
            value = elbo(lp, masks)
            return -torch.exp(value - value.detach()).sum()

        def call():
            model.zero_grad(set_to_none=True)
            if provider == "naive":
                objective(reference.likelihood.score_naive(model, sequence, masks)).backward()
            else:
                streaming_backward(model, sequence, masks, objective, micro_batch=MicroBatching(micro_batch))

        phase, _ = session.measure("engine", call)
    return phase.costs



def _launching(calibration: Calibration, scale: float) -> Calibration:
    """`calibration` for a call whose code launched `scale` times the kernels planned today (a recorded point of
    older code): each kernel stands for `scale` of them, in host time and in launch-queue entries. The device work
    of the kernels since removed (small elementwise ones) is neglected."""
    return replace(calibration, eager_launch=calibration.eager_launch * scale,
                   launch_queue=max(1, round(calibration.launch_queue / scale)))


@contextlib.contextmanager
def composite_rope():
    """LLaDA blocks rotate queries and keys as the code before dllm_fast::rope did: a product with both tables, a
    roll and a sum written back in place (three kernels through fp32 temporaries), for points measured on it."""
    from dllm_fast.ops import rotary

    def in_place(qkv, tables, rotated_heads):
        rotated = qkv[:, :, :rotated_heads]
        products = rotated.unsqueeze(0) * tables
        torch.add(products[0], products[1].roll(qkv.shape[-1] // 2, dims=-1), out=rotated)
        return qkv

    kernel = rotary.rope
    rotary.rope = in_place
    try:
        yield
    finally:
        rotary.rope = kernel


def recorded(point: Recorded, gpu: str | GPU = "h200", calibration: Calibration = DEFAULT) -> dict:
    """The planner's value for a recorded point (calibration.RECORDED): {"predicted": seconds or ratio on today's
    code (with RoPE as the point's code ran it: Recorded.rope_kernel), and the parts: "device_s", "host_s",
    "kernels_per_step" where they apply; "predicted_then": the value with the kernels the recorded code launched,
    where the point records them (Recorded.kernels_then)}."""
    with contextlib.nullcontext() if point.rope_kernel else composite_rope():
        return _recorded(point, gpu, calibration)


def _recorded(point: Recorded, gpu: str | GPU, calibration: Calibration) -> dict:
    if point.kind == "head":
        costs = head(gpu, calibration=calibration, **point.options)
        return dict(predicted=costs.seconds, device_s=costs.device_seconds, host_s=costs.host_seconds)
    if point.kind == "rollout":
        costs, nfe = rollout(gpu, calibration=calibration, **point.options)
        values = dict(predicted=costs.seconds, device_s=costs.device_seconds, host_s=costs.host_seconds,
                      kernels_per_step=costs.kernels / nfe)
        if point.kernels_then is not None:  # the same call on the recorded code, which launched kernels_then a step
            then = _launching(calibration, point.kernels_then / values["kernels_per_step"])
            values["predicted_then"] = rollout(gpu, calibration=then, **point.options)[0].seconds
        return values
    if point.kind == "engine":
        n_t = point.options["n_t"]
        costs = {p: engine(gpu, provider=p, calibration=calibration, **point.options) for p in ENGINE_PROVIDERS}
        naive, two_pass = (costs[p].seconds / n_t for p in ENGINE_PROVIDERS)
        values = dict(predicted=two_pass / naive, naive_ms_per_sample=1e3 * naive,
                      two_pass_ms_per_sample=1e3 * two_pass)
        if point.kernels_then is not None:  # each provider on the recorded code, which launched kernels_then[p]
            naive, two_pass = (engine(gpu, provider=p, calibration=_launching(
                calibration, point.kernels_then[p] / costs[p].kernels), **point.options).seconds
                for p in ENGINE_PROVIDERS)
            values["predicted_then"] = two_pass / naive
        return values
    raise ValueError(f"a recorded point of kind {point.kind!r}: expected head, rollout or engine.")
