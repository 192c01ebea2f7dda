"""The `plan` command: one trainer step of a training configuration, planned on fake tensors for a GPU.

    python -m dllm_fast plan --model llada-8b --lora true --objective vrpo_ol --objective-options '{"n_t": 256}' \\
        --prompts-per-step 1 --group-size 8 --prompt-length 200 --gen-length 256 --block-length 32 \\
        --diffusion-steps 128 --cache dual --micro-batch 8 --gradient-checkpointing true --gpu h100
    python -m dllm_fast plan --config run.yaml --gpu a100-80gb --json      # the same flags as train, plus these

It takes every flag of `train` (python -m dllm_fast train --help), plus --gpu, --json, --prompt-length,
--weights-dtype, --engine, --search and --gpus (one GPU of N under torchrun, in --parallel's mode:
dllm_fast/planning/parallel.py) with --gpus-per-node and the links' bandwidths, and the run settings of issue 46
that train may not have yet (--expert-parallel, --fsdp-offload: RUN_SETTINGS). It prints per phase (rollout,
old-policy and reference scoring, inner updates, optimizer steps) the peak memory by category, FLOPs, bytes moved
and the time on the GPU (a roofline calibrated on a measured H200, with the host's launch costs:
dllm_fast/planning/calibration.py), then the verdict and the largest n_t, micro-batch and group size that fit. Every
number is a planner estimate. A step that cannot run (prompt and completion beyond the model's positions) or that a
plan cannot replay in bounded time is refused with the flags to change (planner.check_plannable).
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

from dllm_fast.planning.gpus import GPUS, GPUS_PER_NODE
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
    group = parser.add_argument_group("several GPUs (with --gpus N: dllm_fast/planning/parallel.py)")
    group.add_argument("--gpus-per-node", default=GPUS_PER_NODE, type=_whole("--gpus-per-node"), metavar="N",
                       help=f"GPUs a node: ranks inside a node talk over NVLink, across nodes over the network "
                            f"(default: {GPUS_PER_NODE})")
    for name, what in (("intra-node", "inside a node (default: the GPU's NVLink entry)"),
                       ("inter-node", "across nodes, a GPU (default: the GPU's network entry)"),
                       ("host", "between host and GPU, for --fsdp-offload and --reference-offload (default: the GPU's "
                                "PCIe entry)")):
        group.add_argument(f"--{name}-bandwidth", default=None, type=_bandwidth(f"--{name}-bandwidth"),
                           metavar="GB/s", help=f"the bus bandwidth {what}; planning/gpus.py names the defaults")


# Settings of a run that the training side may not have yet (issue 46's expert parallelism and FSDP2's offload): the
# planner takes them as its own options where `train` does not.
RUN_SETTINGS = {
    "--expert-parallel": dict(default=1, type="whole", metavar="N",
                              help="ranks an expert group spans, inside a node: each holds num_experts / N routed "
                                   "experts, tokens move to them by all-to-all (default: 1, none)"),
}


def add_run_settings(parser) -> None:
    """The RUN_SETTINGS that `train`'s own flags (already added to `parser`) do not define."""
    group = parser.add_argument_group("run settings planned ahead of train")
    for name, options in RUN_SETTINGS.items():
        if name in parser._option_string_actions:  # train has it: the configuration carries it
            continue
        kind = options["type"]
        converter = _whole(name) if kind == "whole" else value_converter(name[2:].replace("-", "_"), bool, False)
        group.add_argument(name, default=options["default"], type=converter, metavar=options["metavar"],
                           help=options["help"])


def parallel_settings_of(args, config):
    """The ParallelSettings `plan`'s flags and the configuration give."""
    from dllm_fast.planning.planner import parallel_settings

    options = {"gpus_per_node": args.gpus_per_node}
    flat = config.flat()
    for name in RUN_SETTINGS:
        key = name[2:].replace("-", "_")
        options[key] = flat[key] if key in flat else getattr(args, key)  # the plan asked for, on any --gpus
    for key in ("intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth"):
        value = getattr(args, key)
        options[key] = None if value is None else value * 1e9
    return parallel_settings(config, world=args.gpus, **options)


def _whole(flag: str):
    def convert(value: str) -> int:
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            raise argparse.ArgumentTypeError(f"{flag} {value!r} must be a whole number, at least 1.")
        return count
    return convert


def _bandwidth(flag: str):
    def convert(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = 0.0
        if not number > 0 or number == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} {value!r} must be a positive bandwidth in GB/s.")
        return number
    return convert


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


def plan_parser(argv: typing.Sequence[str] = ()):
    """The `plan` command's parser: its own options, every option of `train`, then the run settings train lacks."""
    parser = new_parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    add_plan_arguments(parser)
    add_config_arguments(parser, argv)
    add_run_settings(parser)
    return parser


def main(argv: typing.Sequence[str] = ()) -> None:
    """`python -m dllm_fast plan ...`: a bad option is one line on stderr (exit status 2); an error while
    planning is one line too (exit status 1); --debug shows the traceback."""
    argv = list(argv)
    debug = "--debug" in argv
    parser = plan_parser(argv)
    try:
        args = parse(parser, argv)
        config = config_from_arguments(args)
        parallel = parallel_settings_of(args, config)  # checked before anything loads
        if args.gpus > 1:
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
                         weights_dtype=args.weights_dtype, search=args.search, parallel=parallel)
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
