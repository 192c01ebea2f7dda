"""The `plan` command: one trainer step of a training configuration, planned on fake tensors for a GPU.

    python -m dllm_fast plan --model llada-8b --lora true --objective vrpo_ol --objective-options '{"n_t": 256}' \\
        --prompts-per-step 1 --group-size 8 --prompt-length 200 --gen-length 256 --block-length 32 \\
        --diffusion-steps 128 --cache dual --micro-batch 8 --gradient-checkpointing true --gpu h100
    python -m dllm_fast plan --config run.yaml --gpu a100-80gb --json      # the same flags as train, plus these

It takes every flag of `train` (python -m dllm_fast train --help), plus --gpu, --json, --prompt-length,
--weights-dtype, --engine, --search and --gpus (one GPU of N under torchrun, in --parallel's mode:
dllm_fast/planning/parallel.py). It prints per phase (rollout, old-policy and reference scoring, inner
updates, optimizer steps) the peak memory by category, FLOPs, bytes moved and the time on the GPU (a roofline
calibrated on a measured H200, with the host's launch costs: dllm_fast/planning/calibration.py), then
the verdict and the largest n_t, micro-batch and group size that fit. Every number is a planner estimate. A
step that cannot run (prompt and completion beyond the model's positions) or that a plan cannot replay in bounded
time is refused with the flags to change (planner.check_plannable).
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

from dllm_fast.planning.gpus import GPUS
from dllm_fast.train.cli import add_config_arguments, config_from_arguments, new_parser, parse, value_converter

PROG = "python -m dllm_fast plan"
DESCRIPTION = """Plan one RL training step before renting a GPU: the trainer's step (rollout, old and reference
scoring, the inner updates through the objective's engine, the optimizer step) runs on fake tensors at the
configured shapes and dtypes. Per phase: peak memory by category, FLOPs, bytes moved and a calibrated time on
the GPU; then the verdict and the largest n_t, micro-batch and group size that fit. Planner estimates, not
measurements. Takes every option of `train`, plus those below; the options that do not shape one step (steps,
evaluation, checkpoints, output directory, device) are checked as train checks them and otherwise unused."""
ENGINES = ("streaming", "two_pass", "all_graphs")
WEIGHT_DTYPES = ("float32", "bfloat16")


def add_plan_arguments(parser) -> None:
    group = parser.add_argument_group("planning options")
    group.add_argument("--gpu", default="h100", type=_gpu_name, metavar="NAME",
                       help=f"the GPU to plan for: {', '.join(GPUS)} (default: h100, the SXM part)")
    group.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    group.add_argument("--prompt-length", type=value_converter("prompt_length", int, True), default=None, metavar="N",
                       help="tokens per prompt (default: the task's longest training prompt, tokenized)")
    group.add_argument("--weights-dtype", default=None, choices=WEIGHT_DTYPES, metavar="DTYPE",
                       help="every weight, gradient and optimizer state in float32 or bfloat16 (default: what train "
                            "loads, dllm_fast/train/precision.py: fp32 with bf16 autocast on GPU)")
    group.add_argument("--engine", default="streaming", choices=ENGINES, metavar="NAME",
                       help="streaming: the objective's engine, as train runs it (default); two_pass: the same "
                            "engine with its scoring pass for every objective that is not separable (as before "
                            "one-pass sequence-local objectives); all_graphs: every pair's graph kept until one "
                            "backward, the naive way, for comparison")
    group.add_argument("--gpus", default=1, type=_gpu_count, metavar="N",
                       help="plan one GPU of N under torchrun, in --parallel's mode (ddp or fsdp2): each rank's share "
                            "of --prompts-per-step, its memory and its communication (default: 1)")
    group.add_argument("--search", default=True, type=value_converter("search", bool, False), metavar="true|false",
                       help="also find the largest n_t, micro-batch and group size that fit (default: true)")


def _gpu_count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"--gpus {value!r} must be a whole number of GPUs, at least 1.")
    return count


def _gpu_name(name: str) -> str:
    if name.lower() not in GPUS:
        raise argparse.ArgumentTypeError(f"--gpu {name!r} is not a GPU the planner knows; choose one of "
                                         f"{', '.join(GPUS)}.")
    return name.lower()


def main(argv: typing.Sequence[str] = ()) -> None:
    """`python -m dllm_fast plan ...`: a bad option is one line on stderr (exit status 2); an error while
    planning is one line too (exit status 1); --debug shows the traceback."""
    argv = list(argv)
    debug = "--debug" in argv
    parser = new_parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    add_plan_arguments(parser)
    add_config_arguments(parser, argv)
    try:
        args = parse(parser, argv)
        config = config_from_arguments(args)
        if args.gpus > 1:  # checked before anything loads
            from dllm_fast.planning.parallel import rank_config

            rank_config(config, args.gpus)
        if args.prompt_length is not None and args.prompt_length < 1:
            raise ValueError(f"--prompt-length {args.prompt_length} must be at least 1 (tokens per prompt).")
    except (ValueError, TypeError, OSError) as error:
        if debug:
            raise
        print(f"{PROG}: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    import torch

    from dllm_fast.planning.planner import plan_step
    from dllm_fast.planning.report import as_dict, text

    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    try:
        plan = plan_step(config, gpu=args.gpu, prompt_length=args.prompt_length, engine=args.engine,
                         weights_dtype=args.weights_dtype, search=args.search, world=args.gpus)
    except ImportError as error:  # a package the configuration needs (LoRA: peft) is not installed
        if debug:
            raise
        need = " (--lora true plans PEFT adapters, as train does: pip install peft)" if error.name == "peft" else ""
        print(f"{PROG}: {error}{need}; install it and plan again.", file=sys.stderr)
        raise SystemExit(1) from None
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        if debug:
            raise
        print(f"{PROG}: {' '.join(str(error).split())} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(as_dict(plan), indent=2) if args.json else text(plan))
