"""The minimal trainer: RL for masked diffusion LMs in one loop that reads top to bottom.

    python -m dllm_fast train                                    # the embedded default: sudoku4 on CPU
    python -m dllm_fast train --task countdown --objective espo --model path/to/LLaDA-8B-Instruct --lora true

Each step:
  1. take the next prompts (a seeded, resumable order over the task's training examples);
  2. roll out G completions per prompt with `dllm_fast.generate`;
  3. score them with the task's reward and build the RolloutBatch;
  4. draw the objective's Monte Carlo masks for each inner update and score the old policy on them (the
     reference is scored inside the objective's entry point, on the same masks);
  5. run mu inner updates through `Objective.backward` (exact gradient, memory independent of n_t), each followed
     by gradient clipping, an AdamW step and the learning-rate schedule.
Around the loop: JSONL metrics and a progress bar, greedy evaluation at several generation lengths, atomic
checkpoints every K steps from which `--resume true` continues bit for bit, and a PNG of the curves at the end.

Scaling out: `torchrun --nproc_per_node N -m dllm_fast train ...` runs on PyTorch's own engine, DDP (default) or
FSDP2 (`--parallel fsdp2`, full fine-tunes). Each rank rolls out its own share of the step's prompts, so advantages
stay within complete groups; gradients are all-reduced once per optimizer step (the objectives' entry point runs
every micro-batch but the last under no_sync); rank 0 writes the checkpoints and the metrics, and a resumed run
restores every rank's random streams.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, check_finite_rewards, unwrap_model
from dllm_fast.files import atomic_directory, settled_directory, write_text_atomic
from dllm_fast.likelihood import score
from dllm_fast.likelihood.engine import has_active_dropout
from dllm_fast.memory import peak_rss_bytes, reset_peak_rss
from dllm_fast.rollout import generate
from dllm_fast.tasks import get_task
from dllm_fast.tasks.encoding import decode_completions, encode_prompts
from dllm_fast.tasks.evaluate import evaluate
from dllm_fast.train_config import TrainConfig

CHECKPOINT = "checkpoint"
METRICS = "metrics.jsonl"
PLOT = "curves.png"


@dataclass
class TrainResult:
    """base_accuracy / final_accuracy: greedy test accuracy per evaluation generation length, before the first
    step and after the last. history: every metrics row written."""

    output_dir: Path
    base_accuracy: dict[int, float]
    final_accuracy: dict[int, float]
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)
    rank: int = 0


def train(config: TrainConfig) -> TrainResult:
    with distributed_session(config) as (rank, world):
        return _train(config, rank, world)


def _train(config: TrainConfig, rank: int, world: int) -> TrainResult:
    run = Run(config, rank, world)
    started = time.perf_counter()
    if run.step == 0:
        run.log(run.evaluate())  # the base model
    progress = run.progress(range(run.step, config.steps))
    for step in progress:
        step_started = time.perf_counter()
        run.reset_peak_memory()

        # 1-2. Prompts (this rank's share), then G rollouts each.
        examples = run.data.take(config.prompts_per_step)[run.share]
        rollout, completions, rollout_seconds = run.roll_out(examples)

        # 3. Rewards and the batch the objective consumes.
        batch = run.rollout_batch(examples, rollout, completions)

        # 4. Masks for each inner update; the old policy's lp on them before the policy moves.
        masks = [run.objective.draw_masks(batch, generator=run.mask_generator, eos_token_id=run.core.eos_token_id)
                 for _ in range(config.inner_updates)]
        lp_old = run.score_old_policy(batch, masks)

        # 5. Inner updates: objective gradient, clip, AdamW, schedule.
        updates = [run.update(batch, masks[k], lp_old[k], first=k == 0) for k in range(config.inner_updates)]

        row = run.step_metrics(step + 1, batch, examples, completions, updates, rollout, rollout_seconds,
                               time.perf_counter() - step_started)
        run.step = step + 1
        if run.step % config.eval_every == 0 or run.step == config.steps:
            row.update(run.evaluate())
        row = run.across_ranks(row)
        run.log(row)
        progress.set_postfix(reward=f"{row['reward_mean']:.3f}", accuracy=f"{row['accuracy']:.3f}")
        if run.step % config.checkpoint_every == 0 or run.step == config.steps:
            run.save_checkpoint()

    result = run.result(time.perf_counter() - started)
    if config.plot and rank == 0:
        plot_curves(result.history, result.output_dir / PLOT)
    return result


@contextlib.contextmanager
def distributed_session(config: TrainConfig):
    """(rank, world size): under torchrun (WORLD_SIZE > 1) a process group, gloo on CPU and NCCL on CUDA, for the
    run; (0, 1) otherwise."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        yield (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return
    cuda = torch.cuda.is_available() and config.device in ("auto", "cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


class Run:
    """Everything one training run holds: model, reference, task, objective, optimiser, random streams, data
    position and step. Built from a TrainConfig; `--resume` restores it from the latest checkpoint."""

    def __init__(self, config: TrainConfig, rank: int = 0, world: int = 1):
        self.config, self.rank, self.world = config, rank, world
        self.output_dir = Path(config.output_dir)
        self.device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if config.device == "auto" else config.device))
        if self.device.type == "cuda" and world > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if config.prompts_per_step % world:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must be a multiple of the {world} ranks: "
                             "each rank rolls out its own complete prompt groups.")
        share = config.prompts_per_step // world
        self.share = slice(rank * share, (rank + 1) * share)
        if world > 1 and config.parallel == "fsdp2" and config.threshold is not None:
            raise ValueError("threshold decoding takes a different number of model calls on each rank, which "
                             "FSDP2's sharded forwards cannot; use a fixed schedule (diffusion_steps) or DDP.")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        seed_everything(config.seed + rank)
        self.bf16 = config.bf16 if config.bf16 is not None else self.device.type == "cuda"
        self.task = get_task(config.task, **self._task_options())
        self.objective = objectives.get(config.objective, **config.objective_options)
        base, self.tokenizer = load_model_and_tokenizer(config, self.device)
        base.set_gradient_checkpointing(config.gradient_checkpointing)
        # The reference policy: the initial weights. With LoRA, the objective disables the adapters instead.
        self.ref_model = None
        if self.objective.needs_reference and not config.lora:
            self.ref_model = copy.deepcopy(base).eval().requires_grad_(False)
        self.model = add_lora(base, config) if config.lora else base
        self.model = data_parallel_wrapper(self.model, config, world, self.device)
        self.core = unwrap_model(self.model)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.lr, betas=tuple(config.betas),
                                           weight_decay=config.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, learning_rate_factor(config))
        self.rollout_generator = torch.Generator(self.device).manual_seed(config.seed + 7919 * rank)
        self.mask_generator = torch.Generator().manual_seed(config.seed + 1 + 7919 * rank)
        self.data = PromptStream(self.task.train_examples(seed=config.seed), seed=config.seed)
        self.test_examples = self.task.test_examples()[:config.eval_examples]
        self.step = 0
        self.history: list[dict] = []
        if rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.barrier()
        previous = settled_directory(self.output_dir / CHECKPOINT).is_dir()
        if previous and not (config.resume or config.overwrite):  # a new run would replace it at its first save
            raise FileExistsError(f"{self.output_dir} holds the checkpoint of an earlier run; continue it with "
                                  "--resume true, replace it with --overwrite true, or pick another --output-dir.")
        if config.resume and previous:
            self.load_checkpoint()
        elif rank == 0:
            (self.output_dir / METRICS).write_text("")
            write_text_atomic(self.output_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")

    def _task_options(self) -> dict:
        options = dict(self.config.task_options)
        if self.config.task == "sudoku4" and self.config.model == "sudoku4":
            from dllm_fast.assets import SUDOKU4_TASK_OPTIONS

            options = {**SUDOKU4_TASK_OPTIONS, **options}  # the prompt style the embedded model was trained on
        return options

    # -- the loop's steps -----------------------------------------------------------------------------------
    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def roll_out(self, examples):
        """G completions per prompt (rows g * G .. g * G + G - 1 are prompt g's), decoded."""
        c = self.config
        prompts = [self.task.prompt(e, self.tokenizer) for e in examples for _ in range(c.group_size)]
        input_ids, attention_mask = encode_prompts(self.tokenizer, prompts, device=self.device,
                                                   pad_token_id=self.core.eos_token_id)
        started = time.perf_counter()
        self.model.eval()  # no dropout while sampling
        with torch.no_grad(), self.autocast():  # core: DDP's wrapper adds nothing to sampling; FSDP2's is the model
            result = generate(self.core, input_ids, attention_mask, gen_length=c.gen_length,
                              block_length=c.block_length, steps=c.diffusion_steps, temperature=c.temperature,
                              remasking=c.remasking, cache=c.cache, threshold=c.threshold,
                              generator=self.rollout_generator)
        self.model.train()
        return result, decode_completions(self.tokenizer, result), time.perf_counter() - started

    def rollout_batch(self, examples, rollout, completions) -> RolloutBatch:
        G = self.config.group_size
        rewards = [self.task.reward(examples[row // G], text) for row, text in enumerate(completions)]
        for row, value in enumerate(rewards):
            if not math.isfinite(value):
                raise ValueError(f"task {self.task.name!r} returned reward {value} for prompt {row // G} of step "
                                 f"{self.step + 1} ({examples[row // G].question[:200]!r}), completion "
                                 f"{completions[row][:200]!r}; a reward must be finite: fix the task's reward.")
        rewards = torch.tensor(rewards, dtype=torch.float32, device=self.device)
        check_finite_rewards(rewards, G)
        return RolloutBatch.from_generation(rollout, rewards, group_size=G)

    def score_old_policy(self, batch, masks) -> list[torch.Tensor | None]:
        """The old policy's lp on each inner update's masks. With one inner update the old policy is the current
        one (the objective's on-policy default); ratio-free objectives need none."""
        if self.config.inner_updates == 1 or not self.objective.uses_old_policy:
            return [None] * len(masks)
        with torch.no_grad(), self.autocast():
            return [score(self.model, batch.sequences, m, micro_batch=self.config.micro_batch,
                          attention_mask=batch.attention_mask) for m in masks]

    def update(self, batch, masks, lp_old, first: bool) -> dict:
        """One inner update: the objective's gradient, clipping, an AdamW step and the schedule."""
        # At the first inner update the policy has not moved: its lp is the old policy's (skip a scoring pass).
        known = lp_old if first and lp_old is not None and not has_active_dropout(self.model) else None
        with self.autocast():
            out = self.objective.backward(self.model, batch, masks=masks, lp=known, lp_old=lp_old,
                                          ref_model=self.ref_model, micro_batch=self.config.micro_batch)
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"the gradient norm is {float(norm)} at step {self.step + 1}; no update was "
                                     "taken. Lower the learning rate or check the objective's options.")
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**out.stats, "grad_norm": float(norm)}

    # -- evaluation and metrics -----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        c = self.config
        row = {"step": self.step}
        for length in c.eval_gen_lengths:
            block, steps = eval_schedule(c, length)
            with self.autocast():
                result = evaluate(self.core, self.tokenizer, self.task, self.test_examples, gen_length=length,
                                  block_length=block, steps=steps, batch_size=c.eval_batch_size,
                                  threshold=c.threshold if steps is None else None, cache=c.cache)
            row[f"eval_accuracy@{length}"] = result.accuracy
            row[f"eval_reward@{length}"] = result.mean_reward
        return row

    def step_metrics(self, step, batch, examples, completions, updates, rollout, rollout_seconds, seconds) -> dict:
        G = self.config.group_size
        rewards = batch.rewards.double()
        correct = [self.task.correct(examples[row // G], text) for row, text in enumerate(completions)]
        averaged = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        return {
            "step": step,
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "accuracy": sum(correct) / len(correct),
            **averaged,
            "completion_length": float(batch.completion_lengths.double().mean()),
            "rollout_tokens_per_s": rollout.completion_ids.numel() / max(rollout_seconds, 1e-9),
            "rollout_seconds": rollout_seconds, "step_seconds": seconds,
            "lr": self.schedule.get_last_lr()[0], "peak_memory_mib": self.peak_memory() / 2**20,
        }

    def log(self, row: dict) -> None:
        self.history.append(row)
        if self.rank == 0:
            with open(self.output_dir / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def across_ranks(self, row: dict) -> dict:
        """The step's metrics averaged over ranks (every rank holds an equal share of the rollouts)."""
        if self.world == 1:
            return row
        rows = [None] * self.world
        torch.distributed.all_gather_object(rows, row)
        return {k: (sum(r[k] for r in rows) / self.world if isinstance(v, float) else v) for k, v in row.items()}

    def progress(self, steps):
        if self.config.progress and self.rank == 0:
            from tqdm.auto import tqdm

            return tqdm(steps, desc=f"{self.config.objective} on {self.config.task}", unit="step",
                        initial=self.step, total=self.config.steps)
        return _Silent(steps)

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with contextlib.suppress(OSError):
                reset_peak_rss()

    def peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        with contextlib.suppress(OSError, RuntimeError):
            return peak_rss_bytes()
        return 0

    def result(self, seconds: float) -> TrainResult:
        evals = [row for row in self.history if any(k.startswith("eval_accuracy@") for k in row)]
        accuracy = lambda row: {int(k.split("@")[1]): v for k, v in row.items() if k.startswith("eval_accuracy@")}  # noqa: E731
        return TrainResult(self.output_dir, accuracy(evals[0]) if evals else {},
                           accuracy(evals[-1]) if evals else {}, self.step, seconds, self.history, self.rank)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Write the whole run state into output_dir/checkpoint atomically (rank 0): a crash leaves the previous
        one. Every rank's random streams are kept, so a resumed run continues exactly."""
        model_state, optimizer_state = self.full_state()
        streams = {"rng": rng_state(self.device), "rollout_generator": self.rollout_generator.get_state(),
                   "mask_generator": self.mask_generator.get_state()}
        if self.world > 1:
            every_rank = [None] * self.world
            torch.distributed.all_gather_object(every_rank, streams)
        else:
            every_rank = [streams]
        if self.rank == 0:
            with atomic_directory(self.output_dir / CHECKPOINT) as directory:
                if self.config.lora:
                    self.core.save_pretrained(str(directory / "adapter"), save_embedding_layers=False)
                else:
                    unsharded_copy(self.core, model_state).save_pretrained(directory / "model",
                                                                           tokenizer=self.tokenizer)
                torch.save({"step": self.step, "data_position": self.data.position, "optimizer": optimizer_state,
                            "schedule": self.schedule.state_dict(), "streams": every_rank, "world": self.world,
                            "history": self.history}, directory / "state.pt")
                write_text_atomic(directory / "config.json", json.dumps(self.config.to_dict(), indent=2) + "\n")
        self.barrier()

    def full_state(self):
        """(model state, optimizer state) as whole tensors gathered from FSDP2's shards; (None, the optimizer's
        state) when the model holds whole tensors already."""
        if not (self.world > 1 and self.config.parallel == "fsdp2"):
            return None, self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(self.model, options=options),
                get_optimizer_state_dict(self.model, self.optimizer, options=options))

    def load_checkpoint(self) -> None:
        directory = self.output_dir / CHECKPOINT
        state = torch.load(directory / "state.pt", map_location="cpu", weights_only=False)
        if state["world"] != self.world:
            raise ValueError(f"{directory} was written by {state['world']} ranks; resume it with the same number "
                             f"of ranks (this run has {self.world}), since each rank's random streams are restored.")
        if self.config.lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            adapter = load_file(str(directory / "adapter" / "adapter_model.safetensors"), device=str(self.device))
            set_peft_model_state_dict(self.core, adapter)
        else:
            from dllm_fast.models import LLaDAModel

            saved = LLaDAModel.from_pretrained(directory / "model", dtype=torch.float32, device="cpu").state_dict()
            self.set_full_state(saved, state["optimizer"])
        if self.config.lora or not (self.world > 1 and self.config.parallel == "fsdp2"):
            self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        streams = state["streams"][self.rank]
        set_rng_state(streams["rng"], self.device)
        self.rollout_generator.set_state(streams["rollout_generator"])
        self.mask_generator.set_state(streams["mask_generator"])
        self.step, self.data.position, self.history = state["step"], state["data_position"], state["history"]
        # The metrics file may hold steps past the checkpoint (written before a crash): keep what the state has.
        if self.rank == 0:
            write_text_atomic(self.output_dir / METRICS, "".join(json.dumps(row) + "\n" for row in self.history))
        self.barrier()

    def set_full_state(self, model_state: dict, optimizer_state: dict) -> None:
        if self.world > 1 and self.config.parallel == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, model_state, options=options)
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)
        else:
            self.core.load_state_dict(model_state)


class _Silent:
    def __init__(self, steps):
        self.steps = steps

    def __iter__(self):
        return iter(self.steps)

    def set_postfix(self, **values) -> None:
        pass


class PromptStream:
    """The training examples in a fresh seeded order each epoch; `position` (examples taken so far) is all the
    state a resumed run needs."""

    def __init__(self, examples, seed: int):
        if not examples:
            raise ValueError("the task has no training examples.")
        self.examples, self.seed, self.position = list(examples), seed, 0
        self._epoch, self._order = -1, []

    def take(self, count: int):
        taken = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.examples))
            if epoch != self._epoch:
                self._order = list(range(len(self.examples)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            taken.append(self.examples[self._order[index]])
            self.position += 1
        return taken


# ---------------------------------------------------------------------------------------------------------
# Setup helpers


def load_model_and_tokenizer(config: TrainConfig, device: torch.device):
    """The policy's initial weights and its tokenizer, from the embedded default, a checkpoint directory or a
    preset with random weights (the tokenizer then comes from `config.tokenizer` or the embedded default)."""
    from dllm_fast.assets import SUDOKU4_DIR
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    presets = ("tiny", "small", "llada-8b")
    dtype = torch.float32
    if config.model in presets:
        model = LLaDAModel.with_random_weights(LLaDAConfig.preset(config.model), dtype=dtype, device=device,
                                               seed=config.seed)
        tokenizer_dir = config.tokenizer or SUDOKU4_DIR
    else:
        directory = SUDOKU4_DIR if config.model == "sudoku4" else Path(config.model)
        if not (Path(directory) / "config.json").is_file():
            raise FileNotFoundError(f"--model {config.model!r} is neither a preset {presets}, 'sudoku4' (the "
                                    "embedded default), nor a directory holding config.json.")
        model = LLaDAModel.from_pretrained(directory, dtype=dtype, device=device)
        tokenizer_dir = config.tokenizer or directory
    return model.train(), load_tokenizer(tokenizer_dir)


def load_tokenizer(directory):
    """AutoTokenizer of a directory. transformers knows no model_type "llada" and warns when AutoTokenizer reads
    such a config.json; LLaDA's tokenizer_config.json names its class, so a blank config is enough there."""
    from transformers import AutoTokenizer, PretrainedConfig

    config_file = Path(directory) / "config.json"
    llada = config_file.is_file() and json.loads(config_file.read_text()).get("model_type") == "llada"
    return AutoTokenizer.from_pretrained(str(directory), **({"config": PretrainedConfig()} if llada else {}))


def data_parallel_wrapper(model, config: TrainConfig, world: int, device: torch.device):
    """The model as every rank trains it: unchanged for one process, DDP, or FSDP2 (each block, then the root,
    so the LM head lives in the root's group and is gathered by the root's forward)."""
    if world == 1:
        return model
    if config.parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.transformer["blocks"]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def unsharded_copy(model, state: dict | None):
    """`model` itself when `state` is None, else an unsharded LLaDAModel holding `state` (FSDP2's gathered
    weights), to save in the official layout."""
    if state is None:
        return model
    from dllm_fast.models import LLaDAModel

    with torch.device("meta"):
        whole = LLaDAModel(model.config)
    whole.load_state_dict(state, assign=True)
    return whole


def lora_target_pattern(targets) -> str:
    """A PEFT target regex matching the named modules inside the transformer blocks only: LLaDA's LM head is also
    called ff_out, and an adapter on it would be ignored by the fused ops, which read lm_head_weight directly."""
    return r".*blocks\.\d+\.(" + "|".join(targets) + r")$"


def add_lora(model, config: TrainConfig):
    import peft

    lora = peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                           target_modules=lora_target_pattern(config.lora_targets))
    return peft.get_peft_model(model, lora)


def learning_rate_factor(config: TrainConfig):
    total = config.steps * config.inner_updates
    warmup = config.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1.0 - progress

    return factor


def eval_schedule(config: TrainConfig, length: int) -> tuple[int, int | None]:
    """Block length and diffusion steps for evaluating at `length` tokens: the training block when it divides the
    length, and the training rollout's steps per token."""
    block = config.block_length if length % config.block_length == 0 else length
    if config.diffusion_steps is None:
        return block, None
    blocks = length // block
    per_block = max(1, round(config.diffusion_steps * length / config.gen_length / blocks))
    return block, blocks * per_block


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def plot_curves(history: list[dict], path: Path) -> Path:
    """Training reward and accuracy per step, and greedy test accuracy at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in history if "reward_mean" in r]
    evals = [r for r in history if any(k.startswith("eval_accuracy@") for k in r)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="rollout reward")
    left.plot([r["step"] for r in steps], [r["accuracy"] for r in steps], label="rollout accuracy")
    left.set_xlabel("step")
    left.set_title("training rollouts")
    left.legend()
    for key in sorted({k for r in evals for k in r if k.startswith("eval_accuracy@")}):
        points = [(r["step"], r[key]) for r in evals if key in r]
        right.plot(*zip(*points), marker="o", label=f"greedy, {key.split('@')[1]} tokens")
    right.set_xlabel("step")
    right.set_title("test accuracy")
    right.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
