"""Build an embedded default model from scratch: `python -m dllm_fast.build_sudoku4 --out DIR`.

Its output is dllm_fast/assets/sudoku4 (`--architecture llada`, the default), or with `--architecture sdar` the
block-diffusion model dllm_fast/assets/sdar_sudoku4 (an SDARModel of the same size, block-causal attention in
blocks of `--block-size`, fine-tuned with the same SFT loss, which scores a block model's masked tokens given
the clean earlier blocks, and evaluated with block decoding). It lives outside assets/ because it evaluates with the trainer's
`evaluate`, and the trainer reads assets/: imports point down.

Deterministic on CPU (fixed seeds, a fixed thread count, a fixed data order):

1. a character-level tokenizer in LLaDA's conventions (`dllm_fast/assets/char_tokenizer.py`);
2. a tiny LLaDAModel (or SDARModel) with random weights;
3. masked-diffusion SFT (`dllm_fast.sft`) on sudoku4's "grid" prompts, AdamW, batch by batch;
4. from `--min-steps` on, every `--eval-every` steps, greedy accuracy on the sudoku4 test split at the shipped
   generation settings; the run stops at the first evaluation that reaches `--stop-accuracy` (and fails if it
   overshoots `--max-accuracy`: the band that leaves room for RL);
5. config.json, model.safetensors, the tokenizer files and build_sudoku4.json (settings, accuracy curve, time).

The shipped SDAR model (`--architecture sdar`, the defaults) crossed 20% at its first evaluation from step 500 on
that did: 17% at step 500, 15-18% until step 1500, 21% at step 1600 (66 min on one loaded core: its two-stream
SFT forward is about six times the LLaDA model's), hence its lower --min-steps default.

Why the demonstrations mix two solvers. A model fine-tuned only on correct solutions and stopped early in the
20-50% band makes puzzle-specific mistakes: each RL update then fixes a few training puzzles and perturbs the
rest, and in our probes (REINFORCE on the ELBO, several learning rates and estimators) no setting raised test
accuracy within 600 steps. So, as pretraining text mixes careful and careless writing, `--careless-fraction` of
the demonstrations come from a careless solver that fills each row's missing digits in increasing order and
ignores columns and boxes (it solves about 15% of puzzles). The fine-tuned model can solve many puzzles, but its
greedy decoding often follows the careless habit; within every group of rollouts the reward separates the two,
a signal shared by all puzzles, so RL raises test accuracy within minutes on a laptop CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from dllm_fast.assets import SDAR_SUDOKU4_GENERATION, SUDOKU4_GENERATION, SUDOKU4_TASK_OPTIONS
from dllm_fast.assets.char_tokenizer import build_char_tokenizer, save_tokenizer, special_token_ids
from dllm_fast.files import write_text_atomic
from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel
from dllm_fast.sft import draw_sft_masks, encode_sft_batch, sft_loss
from dllm_fast.tasks import Example, get_task
from dllm_fast.tasks.sudoku4 import as_rows, row_by_row_fill
from dllm_fast.train.evaluation import evaluate
from dllm_fast.validation import check_int, check_probability

COMPLETION_LENGTH = SUDOKU4_GENERATION["gen_length"]
ARCHITECTURES = ("llada", "sdar")
# Each architecture's generation settings (what it is evaluated with) and the defaults of its build that differ.
GENERATION = {"llada": SUDOKU4_GENERATION, "sdar": SDAR_SUDOKU4_GENERATION}
MIN_STEPS = {"llada": 4500, "sdar": 500}


def careless_demonstration(example: Example) -> str:
    return f"<answer>{as_rows(row_by_row_fill(example.data['puzzle']))}</answer>"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dllm_fast.build_sudoku4",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="llada",
                        help="llada (dllm_fast/assets/sudoku4) or sdar (block diffusion: dllm_fast/assets/sdar_sudoku4)")
    parser.add_argument("--block-size", type=int, default=SDAR_SUDOKU4_GENERATION["block_length"],
                        help="sdar: the block-causal attention's block (its config.json block_size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed, for a reproducible build)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4, help="attention heads (sdar: also its key/value heads)")
    parser.add_argument("--mlp-hidden-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--careless-fraction", type=float, default=0.5,
                        help="share of the demonstrations written by the careless row-by-row solver")
    parser.add_argument("--min-steps", type=int, default=None,
                        help=f"train at least this many steps (default: {MIN_STEPS['llada']} for llada, "
                             f"{MIN_STEPS['sdar']} for sdar, the shipped models')")
    parser.add_argument("--max-steps", type=int, default=8000, help="give up (and fail) after this many steps")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--stop-accuracy", type=float, default=0.2)
    parser.add_argument("--max-accuracy", type=float, default=0.5)
    parser.add_argument("--num-train", type=int, default=20000, help="training puzzles (cycled in a fixed order)")
    parser.add_argument("--num-test", type=int, default=256)
    return parser.parse_args(argv)


def random_model(args: argparse.Namespace, tokenizer):
    """The untrained model of `args.architecture`: the same width, depth, heads and MLP for both (about 96k
    parameters), the character tokenizer's vocabulary and special ids."""
    special = special_token_ids(tokenizer)
    if args.architecture == "llada":
        config = LLaDAConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                             mlp_hidden_size=args.mlp_hidden_size, vocab_size=len(tokenizer),
                             max_sequence_length=tokenizer.model_max_length, rope_theta=10000.0, **special)
        return LLaDAModel.with_random_weights(config, seed=args.seed)
    if args.d_model % args.n_heads:
        raise ValueError(f"--d-model {args.d_model} must be a multiple of --n-heads {args.n_heads} (head_dim).")
    config = SDARConfig(hidden_size=args.d_model, intermediate_size=args.mlp_hidden_size,
                        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                        num_key_value_heads=args.n_heads, head_dim=args.d_model // args.n_heads,
                        vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
                        rope_theta=10000.0, block_size=args.block_size, **special)
    return SDARModel.with_random_weights(config, seed=args.seed)


def generation_settings(args: argparse.Namespace) -> dict:
    """What the model is evaluated (and its accuracy recorded) with: the architecture's shipped settings, the SDAR
    model's blocks being --block-size."""
    generation = dict(GENERATION[args.architecture])
    if args.architecture == "sdar":
        generation["block_length"] = args.block_size
    return generation


def build(args: argparse.Namespace) -> dict:
    if args.min_steps is None:
        args.min_steps = MIN_STEPS[args.architecture]
    check_probability("--careless-fraction", args.careless_fraction)
    check_int("--eval-every", args.eval_every, minimum=1)
    check_int("--threads", args.threads, minimum=1)
    check_int("--block-size", args.block_size, minimum=1)
    if COMPLETION_LENGTH % args.block_size:
        raise ValueError(f"--block-size {args.block_size} must divide the completion's {COMPLETION_LENGTH} tokens.")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    tokenizer = build_char_tokenizer()
    task = get_task("sudoku4", **SUDOKU4_TASK_OPTIONS, num_train=args.num_train, num_test=args.num_test)
    model = random_model(args, tokenizer)
    config = model.config
    generation = generation_settings(args)
    examples = task.train_examples(seed=args.seed)
    careless = random.Random(f"careless-{args.seed}")
    demonstrations = [careless_demonstration(e) if careless.random() < args.careless_fraction
                      else task.demonstration(e) for e in examples]
    data = encode_sft_batch(tokenizer, [task.prompt(e, tokenizer) for e in examples], demonstrations,
                            completion_length=COMPLETION_LENGTH, eos_token_id=config.eos_token_id,
                            eot_token_id=config.eot_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(examples), generator=generator)
    cursor = 0
    curve: list[dict] = []
    for step in range(1, args.max_steps + 1):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(examples), generator=generator), 0
        sequences = data.sequences[order[cursor:cursor + args.batch_size]]
        cursor += args.batch_size
        masks = draw_sft_masks(sequences, prompt_length=data.prompt_length, generator=generator)
        loss = sft_loss(model, sequences, masks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % args.eval_every or step < args.min_steps:
            continue
        result = evaluate(model, tokenizer, task, **generation)
        curve.append({"step": step, "loss": round(loss.item(), 4), "test_accuracy": result.accuracy,
                      "test_reward": round(result.mean_reward, 4), "seconds": round(time.perf_counter() - started, 1)})
        print(f"step {step:5d}  loss {loss.item():.4f}  test accuracy {result.accuracy:.3f}  "
              f"reward {result.mean_reward:.3f}  ({curve[-1]['seconds']:.0f} s)", flush=True)
        if result.accuracy > args.max_accuracy:
            raise RuntimeError(f"test accuracy is {result.accuracy:.3f} at step {step}, above --max-accuracy="
                               f"{args.max_accuracy}: no room left for RL. Lower --min-steps or raise "
                               "--careless-fraction.")
        if result.accuracy >= args.stop_accuracy:
            break
    else:
        raise RuntimeError(f"test accuracy did not reach --stop-accuracy={args.stop_accuracy} in {args.max_steps} "
                           "steps; train longer or use a larger model.")
    out = Path(args.out)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    summary = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "task_options": SUDOKU4_TASK_OPTIONS, "generation": generation,
        "parameters": sum(p.numel() for p in model.parameters()),
        "chosen_step": step, "test_accuracy": result.accuracy, "curve": curve,
        "seconds": round(time.perf_counter() - started, 1), "torch": torch.__version__,
    }
    write_text_atomic(out / "build_sudoku4.json", json.dumps(summary, indent=2) + "\n")
    print(f"saved {out}: step {step}, greedy test accuracy {result.accuracy:.3f}, {summary['seconds']:.0f} s")
    return summary


def main(argv=None) -> None:
    build(parse_args(argv))


if __name__ == "__main__":
    main()
