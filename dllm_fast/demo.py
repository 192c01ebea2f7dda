"""`python -m dllm_fast demo`: what is built, on an embedded default.

The native LLaDA model at the `small` preset (LLaDA's 126464 vocabulary, a small body, random weights); block
diffusion rollouts with the reference sampler and with dllm_fast's cache modes; the fused masked log-prob op
against the naive LM head + log-softmax; the streaming ELBO backward against the all-graphs one; and a checkpoint
round trip in the official layout.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import dllm_fast
from dllm_fast import likelihood, reference
from dllm_fast.memory import count_saved_tensors, track_live_saved_tensors
from dllm_fast.models import LLaDAConfig, LLaDAModel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dllm_fast demo", description=__doc__.split("\n\n")[1])
    parser.add_argument("--preset", default="small", help="model preset: tiny, small or llada-8b (default: small)")
    parser.add_argument("--batch", type=int, default=4, help="prompts (default: 4)")
    parser.add_argument("--prompt-length", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("--gen-length", type=int, default=256,
                        help="completion length for the log-prob demo (default: 256)")
    parser.add_argument("--rollout-length", type=int, default=64, help="tokens generated per prompt (default: 64)")
    parser.add_argument("--n-t", type=int, default=8, help="Monte Carlo masks in the ELBO demo (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and inputs (default: 0)")
    demo(parser.parse_args(argv))


def demo(args) -> None:
    torch.manual_seed(args.seed)
    print(f"dllm_fast {dllm_fast.__version__}: {dllm_fast.build_info()}")
    config = LLaDAConfig.preset(args.preset)
    model = LLaDAModel(config)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: LLaDA preset {args.preset!r}, {params:.1f}M parameters, vocab {config.vocab_size}")

    prompts = torch.randint(0, config.mask_token_id, (args.batch, args.prompt_length))
    settings = dict(gen_length=args.rollout_length, block_length=32, steps=args.rollout_length // 2)
    print(f"rollouts: {args.batch} prompts x {settings['gen_length']} tokens, block 32, "
          f"{settings['steps']} steps, greedy:")
    baseline = None
    for name, sampler, cache in (("reference", reference.generate, "none"), ("dllm_fast", dllm_fast.generate, "none"),
                                 ("dllm_fast", dllm_fast.generate, "prefix"), ("dllm_fast", dllm_fast.generate, "dual")):
        start = time.perf_counter()
        result = sampler(model, prompts, cache=cache, **settings)
        seconds = time.perf_counter() - start
        baseline = baseline if baseline is not None else result.completion_ids
        same = (result.completion_ids == baseline).float().mean().item()
        print(f"  {name:>9} cache={cache:<6}: {result.completion_ids.numel() / seconds:7.1f} tokens/s, "
              f"{result.nfe} forwards, {same:.0%} of tokens equal to the reference")

    # A batch of prompt + completion sequences with about half of each completion masked, as in an ELBO sample.
    batch, prompt, completion = args.batch, args.prompt_length, args.gen_length
    clean = torch.randint(0, config.mask_token_id, (batch, prompt + completion))
    masked = torch.zeros_like(clean, dtype=torch.bool)
    masked[:, prompt:] = torch.rand(batch, completion) < 0.5
    noisy = clean.masked_fill(masked, config.mask_token_id)
    with torch.no_grad():
        hidden = model(noisy)
    rows, targets = hidden[masked].requires_grad_(), clean[masked]
    print(f"LM head + log-softmax on {rows.shape[0]} masked positions of {batch} sequences of length "
          f"{prompt + completion}, forward and backward:")

    for name, fn in (("naive", reference.masked_logprobs), ("dllm_fast", dllm_fast.masked_logprobs)):
        fn(rows[:8], model.lm_head_weight, targets[:8]).sum().backward()  # warm-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with count_saved_tensors(exclude=[rows, model.lm_head_weight]) as saved:
            logp = fn(rows, model.lm_head_weight, targets)
        logp.sum().backward()
        seconds = time.perf_counter() - start
        print(f"  {name:>9}: sum log p = {logp.sum().item():12.4f}   {seconds * 1e3:7.1f} ms   "
              f"saved for backward beyond the inputs: {saved.bytes / 2**20:7.1f} MiB")

    elbo_demo(model, clean[:1], prompt, args.n_t)

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        again = LLaDAModel.from_pretrained(directory)
        same = torch.equal(again(noisy[:1]), model(noisy[:1]))
    print(f"checkpoint round trip in the official layout: {'identical' if same else 'DIFFERENT'} hidden states")


def elbo_demo(model, sequences, prompt: int, n_t: int) -> None:
    """VRPO-OL's exp(ELBO - ELBO_old) on one sequence: the naive all-graphs backward against the engine's."""
    masks = likelihood.sample_masks(sequences, prompt_length=prompt, n_t=n_t, sampler="stratified_l", count="all",
                                    generator=torch.Generator().manual_seed(0))

    def objective(lp):
        value = likelihood.elbo(lp, masks)
        return -torch.exp(value - value.detach()).sum()

    print(f"ELBO objective with n_t={n_t} Monte Carlo masks of one sequence, forward and backward:")
    for name in ("all graphs", "streaming"):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with track_live_saved_tensors(exclude=model.parameters()) as saved:
            if name == "all graphs":
                value = objective(likelihood.score(model, sequences, masks, micro_batch=n_t))
                value.backward()
            else:
                value = likelihood.streaming_backward(model, sequences, masks, objective, micro_batch=1)
        seconds = time.perf_counter() - start
        norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None))
        print(f"  {name:>10}: value {value.item():.6f}, gradient norm {norm.item():.6f}, {seconds:5.2f} s, "
              f"peak saved for backward {saved.peak / 2**20:7.1f} MiB")
