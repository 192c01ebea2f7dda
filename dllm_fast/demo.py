"""`python -m dllm_fast demo`: what is built, on an embedded default.

The native LLaDA model at the `small` preset (LLaDA's 126464 vocabulary, a small body, random weights); block
diffusion rollouts with the reference sampler and with dllm_fast's cache modes; the fused masked log-prob op
against the naive LM head + log-softmax; the streaming ELBO backward against the all-graphs one; and a checkpoint
round trip in the official layout. Each phase says what it runs before it starts, and the rollouts count their
model forwards as they go (a loaded machine takes minutes for the reference sampler alone).
"""

from __future__ import annotations

import argparse
import contextlib
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
    say(f"dllm_fast {dllm_fast.__version__}: {dllm_fast.build_info()}")
    config = LLaDAConfig.preset(args.preset)
    model = LLaDAModel(config)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    say(f"model: LLaDA preset {args.preset!r}, {params:.1f}M parameters, vocab {config.vocab_size}")

    prompts = torch.randint(0, config.mask_token_id, (args.batch, args.prompt_length))
    settings = dict(gen_length=args.rollout_length, block_length=32, steps=args.rollout_length // 2)
    say(f"rollouts: {args.batch} prompts x {settings['gen_length']} tokens, block 32, "
        f"{settings['steps']} steps, greedy:")
    baseline = None
    for name, sampler, cache in (("reference", reference.generate, "none"), ("dllm_fast", dllm_fast.generate, "none"),
                                 ("dllm_fast", dllm_fast.generate, "prefix"), ("dllm_fast", dllm_fast.generate, "dual")):
        label = f"  {name:>9} cache={cache:<6}"
        start = time.perf_counter()
        with forwards_counted(model, label, settings["steps"]):
            result = sampler(model, prompts, cache=cache, **settings)
        seconds = time.perf_counter() - start
        baseline = baseline if baseline is not None else result.completion_ids
        same = (result.completion_ids == baseline).float().mean().item()
        say(f"\r{label}: {result.completion_ids.numel() / seconds:7.1f} tokens/s, {result.nfe} forwards, "
            f"{same:.0%} of tokens equal to the reference")

    # A batch of prompt + completion sequences with about half of each completion masked, as in an ELBO sample.
    batch, prompt, completion = args.batch, args.prompt_length, args.gen_length
    clean = torch.randint(0, config.mask_token_id, (batch, prompt + completion))
    masked = torch.zeros_like(clean, dtype=torch.bool)
    masked[:, prompt:] = torch.rand(batch, completion) < 0.5
    noisy = clean.masked_fill(masked, config.mask_token_id)
    with torch.no_grad():
        hidden = model(noisy)
    rows, targets = hidden[masked].requires_grad_(), clean[masked]
    say(f"LM head + log-softmax on {rows.shape[0]} masked positions of {batch} sequences of length "
        f"{prompt + completion}, forward and backward:")

    for name, fn in (("naive", reference.masked_logprobs), ("dllm_fast", dllm_fast.masked_logprobs)):
        fn(rows[:8], model.lm_head_weight, targets[:8]).sum().backward()  # warm-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with count_saved_tensors(exclude=[rows, model.lm_head_weight]) as saved:
            logp = fn(rows, model.lm_head_weight, targets)
        logp.sum().backward()
        seconds = time.perf_counter() - start
        say(f"  {name:>9}: sum log p = {logp.sum().item():12.4f}   {seconds * 1e3:7.1f} ms   "
            f"saved for backward beyond the inputs: {saved.bytes / 2**20:7.1f} MiB")

    elbo_demo(model, clean[:1], prompt, args.n_t)

    say("checkpoint round trip in the official layout: ", end="")
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        again = LLaDAModel.from_pretrained(directory)
        same = torch.equal(again(noisy[:1]), model(noisy[:1]))
    say(f"{'identical' if same else 'DIFFERENT'} hidden states")


def say(text: str, end: str = "\n") -> None:
    """Print at once, also into a pipe or a log file (where print alone would wait for a full buffer)."""
    print(text, end=end, flush=True)


@contextlib.contextmanager
def forwards_counted(model, label: str, expected: int):
    """Show `label: forward k/expected` after each forward of `model` while the block runs, on one line that the
    block's result line then overwrites."""
    count = 0

    def shown(module, args, output):
        nonlocal count
        count += 1
        say(f"\r{label}: forward {count}/{expected}", end="")

    handle = model.register_forward_hook(shown)
    try:
        say(f"{label}: starting", end="")
        yield
    finally:
        handle.remove()


def elbo_demo(model, sequences, prompt: int, n_t: int) -> None:
    """VRPO-OL's exp(ELBO - ELBO_old) on one sequence: the naive all-graphs backward against the engine's."""
    masks = likelihood.sample_masks(sequences, prompt_length=prompt, n_t=n_t, sampler="stratified_l", count="all",
                                    generator=torch.Generator().manual_seed(0))

    def objective(lp):
        value = likelihood.elbo(lp, masks)
        return -torch.exp(value - value.detach()).sum()

    say(f"ELBO objective with n_t={n_t} Monte Carlo masks of one sequence, forward and backward:")
    for name in ("all graphs", "streaming"):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        forwards = 1 if name == "all graphs" else 2 * n_t  # streaming: pass 1 and pass 2, one mask per forward
        with forwards_counted(model, f"  {name:>10}", forwards), \
                track_live_saved_tensors(exclude=model.parameters()) as saved:
            if name == "all graphs":
                value = objective(likelihood.score(model, sequences, masks, micro_batch=n_t))
                value.backward()
            else:
                value, _ = likelihood.streaming_backward(model, sequences, masks, objective, micro_batch=1)
        seconds = time.perf_counter() - start
        norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None))
        say(f"\r  {name:>10}: value {value.item():.6f}, gradient norm {norm.item():.6f}, {seconds:5.2f} s, "
            f"peak saved for backward {saved.peak / 2**20:7.1f} MiB")
