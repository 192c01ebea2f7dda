"""Command line: `python -m dllm_fast [demo | train ...]`.

train  RL training (dllm_fast.trainer). With no options: the embedded default, RL from a tiny sudoku4 model on
       CPU, printing base vs final greedy test accuracy and writing the curves. Options: `--config FILE`
       (YAML/JSON) and any TrainConfig field as `--name value`, e.g.
       `python -m dllm_fast train --task countdown --objective espo --model PATH --lora true`.
demo   shows what is built on an embedded default: the native LLaDA model at the `small` preset (LLaDA's 126464
       vocabulary, a small body, random weights); block diffusion rollouts with the reference sampler and with
       dllm_fast's cache modes; the fused masked log-prob op against the naive LM head + log-softmax; the
       streaming ELBO backward against the all-graphs one; and a checkpoint round trip in the official layout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

import dllm_fast
from dllm_fast import likelihood, reference
from dllm_fast.memory import count_saved_tensors, track_live_saved_tensors
from dllm_fast.models import LLaDAConfig, LLaDAModel


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


def train_command(arguments: list[str]) -> None:
    from dllm_fast.train_config import TrainConfig, parse_overrides
    from dllm_fast.trainer import PLOT, train

    if arguments[:1] in (["-h"], ["--help"]):
        print(__doc__.split("demo   ")[0].strip())
        print("\noptions (defaults):")
        for name, value in TrainConfig().to_dict().items():
            print(f"  --{name.replace('_', '-'):<24} {value!r}")
        return
    config_file = None
    if "--config" in arguments:
        index = arguments.index("--config")
        if index + 1 >= len(arguments):
            raise SystemExit("--config needs a YAML or JSON file.")
        config_file = arguments[index + 1]
        arguments = arguments[:index] + arguments[index + 2:]
    try:
        overrides = parse_overrides(arguments)
        config = TrainConfig.from_file(config_file, **overrides) if config_file else TrainConfig.from_dict(overrides)
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise SystemExit(f"python -m dllm_fast train: {error}") from None
    try:
        result = train(config)
    except FileExistsError as error:
        raise SystemExit(f"python -m dllm_fast train: {error}") from None
    if result.rank != 0:
        return
    for length in sorted(result.final_accuracy):
        base, final = result.base_accuracy.get(length, float("nan")), result.final_accuracy[length]
        print(f"greedy test accuracy at {length} tokens: base {base:.3f} -> final {final:.3f} ({final - base:+.3f})")
    print(f"{result.steps} steps in {result.seconds:.0f} s; metrics, checkpoint and {PLOT} in {result.output_dir}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        train_command(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m dllm_fast", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("train", help="RL training; `python -m dllm_fast train --help` lists the options")
    demo_parser = commands.add_parser("demo", help="show what is built (the default)")
    for p in (parser, demo_parser):
        p.add_argument("--preset", default="small", help="model preset: tiny, small or llada-8b")
        p.add_argument("--batch", type=int, default=4)
        p.add_argument("--prompt-length", type=int, default=64)
        p.add_argument("--gen-length", type=int, default=256, help="completion length for the log-prob demo")
        p.add_argument("--rollout-length", type=int, default=64, help="tokens generated per prompt")
        p.add_argument("--n-t", type=int, default=8, help="Monte Carlo masks in the ELBO demo")
        p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    demo(args)


if __name__ == "__main__":
    main()
