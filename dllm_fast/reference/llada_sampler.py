"""The published sampler, in plain PyTorch: LLaDA's generate.py (block semi-autoregressive, low-confidence or random
remasking, CFG, EOS options) with Fast-dLLM's parallel decoding (threshold) and prefix/dual caches: full logits
over every fed position, float64 Gumbel noise from a torch.Generator, per-row top-k with ties to the lowest
position. The oracle for dllm_fast.generate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_fast.contracts import GenerationResult, completion_mask, logit_shift
from dllm_fast.reference import eoser_ass
from dllm_fast.rollout.config import GenerateConfig, rollout_config
from dllm_fast.rollout.plan import check_generate_args, initial_canvas
from dllm_fast.rollout.resume import Resume, check_resume
from dllm_fast.rollout.rules import check_block_done, confidence_excluded_ids, raise_if_not_finite, suppressed_ids


def transfer_schedule(masked_in_block: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] tokens to unmask per step (LLaDA's get_num_transfer_tokens): n // steps each, and the
    first n % steps steps one more."""
    n = masked_in_block.sum(dim=1, keepdim=True)
    step = torch.arange(steps, device=n.device)[None, :]
    return n // steps + (step < n % steps).to(torch.int64)


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, config: GenerateConfig | None = None, *, generator=None,
             resume: Resume | None = None, **settings) -> GenerationResult:
    """Reference block diffusion sampler (LLaDA generate.py + Fast-dLLM), the oracle for dllm_fast.generate.

    Differences from the published code, each deliberate: batches with left padding and an attention mask;
    top-k ties go to the lowest position (torch.topk leaves them unspecified); confidence_eos_eot_inf removes
    EOS and EoT from the confidence softmax at every temperature (LLaDA's code does both only at T = 0);
    caches and threshold work for batch > 1; the mask token is never decoded (removed from sampling and from
    the confidence softmax); a block is left once complete (Fast-dLLM), so steps beyond block_length run no
    forward; Gumbel-max runs in the log domain, argmax(logits / T - log(-log u)), the same argmax as LLaDA's
    exp(logits) / (-log u)^T without its overflow; a decoded position without a defined confidence (a NaN or
    +inf logit among the tokens that may be decoded) raises, as in the fused sampler.

    unmask_schedule="ass" and eos_schedule are CJ-GRPO's decoders, the official rules (reference/eoser_ass.py).

    Takes the settings as dllm_fast.generate does (a GenerateConfig, keywords over it), but runs eagerly on values:
    compile and assumed_steps_per_block (the fused sampler's) are refused. resume (a rollout.Resume)
    resumes a partly decoded canvas at a step of the global schedule as dllm_fast.generate does (rollout/resume.py);
    this sampler's noise is drawn step by step from the generator, so a resumed call matches the uninterrupted
    one token for token at T = 0 (at T > 0 it samples the same distribution with other draws).
    """
    config = rollout_config(config, settings, "reference.generate")
    if config.compile is not False:
        raise ValueError(f"compile={config.compile!r}: the reference sampler runs eagerly; pass compile=False (or "
                         "use dllm_fast.generate).")
    if config.assumed_steps_per_block is not None:
        raise ValueError(f"assumed_steps_per_block={config.assumed_steps_per_block}: the reference sampler reads "
                         "the masked count at every step; drop it (or use dllm_fast.generate).")
    plan = check_generate_args(model, input_ids, attention_mask, config, generator=generator)
    gen_length, block_length = config.gen_length, config.block_length
    resume = check_resume(model, plan, input_ids, gen_length, block_length, resume)
    mask_id, device = model.mask_token_id, input_ids.device
    B, P = input_ids.shape
    total = P + gen_length
    x, attention_mask = initial_canvas(input_ids, attention_mask, gen_length, mask_id)
    if resume.canvas is not None:
        x = resume.canvas.clone()
    prompt_positions = x != mask_id
    weight = model.lm_head_weight
    shift = logit_shift(model)
    guided = plan.cfg_scale > 0
    kv = plan.cache.new_cache(model, 2 * B if guided else B, total)
    suppress, exclude = suppressed_ids(model, plan), confidence_excluded_ids(model, plan)

    def logits_at(start: int, end: int, step: int) -> torch.Tensor:
        """Logits for the positions the cache policy feeds at this step of the block [start, end)."""
        ids = x
        mask = attention_mask
        if guided:
            ids = torch.cat([x, x.masked_fill(prompt_positions, mask_id)])
            mask = None if mask is None else torch.cat([mask, mask])
        hidden = plan.cache.forward(model, ids, mask, kv, start, end, step)
        if shift:  # the hidden state at i - 1 predicts token i; position 0 is a prompt token, never sampled
            hidden = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
        logits = F.linear(hidden, weight)
        if guided:
            cond, uncond = logits.chunk(2)
            logits = uncond + (plan.cfg_scale + 1) * (cond - uncond)
        return logits

    nfe = 0
    for block in range(gen_length // block_length):
        start, end = P + block * block_length, P + (block + 1) * block_length
        first, last = resume.block_steps(block, plan.step_limit(block_length))
        if first == last:  # decoded before this call (or after it stops)
            continue
        schedule = None
        if plan.steps_per_block is not None:  # the counts of the block as it was at its start, fully masked
            at_start = x[:, start:end] == mask_id if first == 0 else torch.ones_like(x[:, start:end], dtype=torch.bool)
            schedule_of = eoser_ass.ass_transfer_schedule if plan.unmask_schedule == "ass" else transfer_schedule
            schedule = schedule_of(at_start, plan.step_limit(block_length))
        for step in range(first, last):
            if not (x[:, start:end] == mask_id).any():  # Fast-dLLM leaves a complete block
                break
            # Positions fed this step: everything (no cache / refresh), [start, L) (prefix), the block (dual).
            seen, seen_end = plan.cache.fed_span(start, end, total, step)
            logits = logits_at(start, end, step)
            nfe += 1
            window = x[:, seen:seen_end]
            candidates = window == mask_id
            candidates[:, end - seen:] = False  # only the current block
            logits[:, :, suppress] = float("-inf")
            # The kernels' rule: a decoded position without a defined confidence (a NaN or +inf logit among the
            # tokens not excluded) or without a token to sample raises; a NaN never wins the argmax.
            block_logits = logits[:, start - seen:end - seen]  # a view
            defining = block_logits.clone()
            defining[:, :, exclude] = float("-inf")
            undefined = (defining.isnan() | defining.isposinf()).any(dim=-1)
            block_logits.masked_fill_(block_logits.isnan(), float("-inf"))
            undefined |= (block_logits == float("-inf")).all(dim=-1)
            raise_if_not_finite(undefined & candidates[:, start - seen:end - seen], start - P, plan.cfg_scale, weight)
            if plan.temperature == 0:
                x0 = logits.argmax(dim=-1)
            else:
                uniform = torch.rand(logits.shape, dtype=torch.float64, device=device, generator=generator)
                x0 = (logits.double() / plan.temperature - torch.log(-torch.log(uniform))).argmax(dim=-1)
            x0_p = None
            if plan.remasking.uses_model_confidence:
                confidence_logits = logits.clone()
                confidence_logits[:, :, exclude] = float("-inf")
                x0_p = torch.softmax(confidence_logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)
                if plan.eos_schedule is not None:  # CJ-GRPO's EOSER, the official rule
                    factor = eoser_ass.eos_factor(step, plan.step_limit(block_length), plan.eos_schedule,
                                                  ass=plan.unmask_schedule == "ass")
                    x0_p = eoser_ass.scale_eos(x0_p, x0, model.eos_token_id, factor)
            x0_p = plan.remasking.scores(x0_p, fed_shape=tuple(x0.shape), fed_positions=None, generator=generator,
                                         device=device)
            x0_p = x0_p.double().masked_fill(~candidates, float("-inf"))
            if schedule is not None:
                k = schedule[:, step]
                order = torch.sort(x0_p, dim=-1, descending=True, stable=True).indices
                chosen = torch.zeros_like(candidates)
                for row in range(B):  # the published per-row loop
                    chosen[row, order[row, : int(k[row])]] = True
            else:
                order = torch.sort(x0_p, dim=-1, descending=True, stable=True).indices
                chosen = torch.zeros_like(candidates)
                for row in range(B):
                    if candidates[row].any():
                        chosen[row, order[row, 0]] = True
                        chosen[row] |= x0_p[row] >= plan.threshold
            chosen &= candidates
            window[chosen] = x0[chosen]
        if not resume.finishes(block):  # this call stops inside the block
            break
        check_block_done(int((x[:, start:end] == mask_id).sum()), block, plan.step_limit(block_length))
    completion = x[:, P:]
    return GenerationResult(x, completion, completion_mask(completion, model.eos_token_id), nfe, attention_mask)
