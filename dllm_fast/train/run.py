"""Everything one training run holds, built from a TrainConfig, and the operations of the loop's steps.

A run holds the policy (possibly with LoRA adapters and a data-parallel wrapper), the reference policy, the task,
the objective, the optimizer and its schedule, the random streams, the data position, the metrics and the step.
`--resume true` restores it from the run directory's checkpoint. What is specific to a model family (how to load
it, which modules LoRA adapts, FSDP2's units, its tokenizer) comes from the family's hooks in dllm_fast.models.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import time
import warnings

import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, check_rewards, unwrap_model
from dllm_fast.files import settled_directory, write_text_atomic
from dllm_fast.models.loading import check_tokenizer, load_model, load_tokenizer, model_skeleton
from dllm_fast.objectives import InnerUpdate
from dllm_fast.rollout import generate
from dllm_fast.tasks import get_task
from dllm_fast.tasks.encoding import decode_completions, encode_prompts
from dllm_fast.tasks.rewards import task_reward
from dllm_fast.train.checkpoint import CHECKPOINT, load_checkpoint, seed_everything
from dllm_fast.train.config import TrainConfig, check_block_length, micro_batching, take_block_length, task_options
from dllm_fast.train.data import PromptStream
from dllm_fast.train.distributed import Ranks, check_offload, data_parallel_wrapper, sharded
from dllm_fast.train.expert_parallel import (ExpertGradients, check_expert_parallel, distribute, expert_group,
                                             expert_parallel_note, ignore_experts_in_ddp, shard_experts)
from dllm_fast.train.metrics import METRICS, PLOT, MetricsLog
from dllm_fast.train.optimizer import build_adamw
from dllm_fast.train.pairs import PairSource, check_pairs_task
from dllm_fast.train.precision import add_lora  # noqa: F401  (re-exported: the planner and tests import it here)
from dllm_fast.train.precision import (Precision, sharded_mixed_precision, short_name, training_models,
                                       training_precision)
from dllm_fast.train.resume import CONFIG, check_resumable, saved_config
from dllm_fast.train.rollout_rule import keep_copy
from dllm_fast.train.rollout_weights import rollout_weights_for
from dllm_fast.train import step as train_step
from dllm_fast.train.run_dir import RunDirectory
from dllm_fast.train.settings import AUTO, DEFAULT_MICRO_BATCH
from dllm_fast.train.step_rewards import decode_step_predictions, step_rewards
from dllm_fast.train.sources import model_source


class RunSetup:
    """Everything a run checks and decides before it writes anything: the device, the precision, the rollouts'
    settings against the model (its cache, its blocks, the evaluation's lengths), the task, the objective, the
    model's and tokenizer's files (without reading any weight), the sizes and the run directory's state. `train`
    builds it before it takes the run directory's lock, so a setting that cannot work leaves the directory as it
    was (no .lock, config.json or metrics.jsonl)."""

    def __init__(self, config: TrainConfig, ranks: Ranks, run_dir: RunDirectory):
        self.device = torch.device("cuda" if config.run.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if config.run.device == "auto" else config.run.device))
        if self.device.type == "cuda" and ranks.world > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_parallel(config, None, ranks.world)
        self.share = ranks.share(config.run.prompts_per_step)
        self.sharded = sharded(config.run.parallel, ranks)
        check_offload(config, self.sharded, ranks.world)
        if config.run.parallel == "fsdp2" and ranks.world == 1:  # said before the run starts, whatever --progress
            warnings.warn("--parallel fsdp2 shards the weights across torchrun's ranks, and this is one process (not "
                          "under torchrun, or one rank): the run trains unsharded, as one process does under any "
                          "--parallel. Launch it with `torchrun --nproc-per-node N -m dllm_fast train ...` to shard.",
                          UserWarning, stacklevel=2)
        if self.sharded and config.lora.enabled and config.lora.merge_rollouts and config.run.rollout_weights == \
                "sharded":  # the merged weights are the gathered copy's; per-layer gathers have no copy to merge into
            raise ValueError("--lora-merge-rollouts true under --parallel fsdp2 merges the adapters into the rollout "
                             "copy gathered once a step, which --rollout-weights sharded does without; use "
                             "--rollout-weights gathered (or auto), or --lora-merge-rollouts false.")
        for name in (METRICS, PLOT, CONFIG, CHECKPOINT):  # a link out of the directory, or the wrong kind: refused
            run_dir.expect(name, directory=name == CHECKPOINT)
        previous_checkpoint(config, run_dir)
        if config.run.threads is not None:
            cpus = os.cpu_count() or 1
            if config.run.threads > cpus:  # OpenMP fails to start that many threads and the process dies
                raise ValueError(f"--threads {config.run.threads} is more than this machine's {cpus} CPUs; use at most "
                                 f"{cpus} (or leave it out for torch's default).")
        # The dtype of every weight and the compute dtype (precision.py), and what compiles (--compile).
        self.precision = training_precision(config, self.device.type)
        # The rollouts' settings, one object: every rollout and evaluation decodes with it.
        self.generate_config = config.generate_config(self.device.type)
        self.task = get_task(config.run.task, **task_options(config))
        self.objective = objectives.get(config.objective.name, **config.objective.options)
        check_rollout_records(self.objective, config.objective.name)
        check_group_size(self.objective, config)
        self.data = PromptStream(self.task.train_examples(seed=config.run.seed), seed=config.run.seed)
        self.test_examples = self.task.test_examples()[:config.eval.examples]
        # The model, its tokenizer and the task's prompts agree before any weight is read.
        self.source, self.tokenizer, skeleton = model_and_tokenizer_plan(config)
        check_sizes(config, skeleton, self.device, ranks, self.objective.needs_reference, self.precision)
        check_parallel(config, skeleton, ranks.world)
        if config.run.expert_parallel > 1 and self.generate_config.compile:  # --compile auto: eager all-to-alls
            self.generate_config = dataclasses.replace(self.generate_config, compile=False)
        check_block_length(config, skeleton)
        take_block_length(config, skeleton)
        check_rollout_settings(config, self.generate_config, skeleton)
        check_objective_fits(self.objective, self.task, config, self.generate_config, skeleton)
        # d_treerpo rolls out a tree per prompt (rollout/tree.py): its leaves are the prompt's rollouts
        self.tree_shape = getattr(self.objective, "tree_shape", lambda: None)()
        if self.tree_shape is not None:
            check_tree_fits(self.tree_shape, config, self.generate_config, skeleton)
        # last: it tokenizes every prompt of the task
        check_lengths(config, self.task, self.data.examples, self.test_examples, self.tokenizer, skeleton)

    def apply(self, config: TrainConfig) -> None:
        """What the setup changes in this process: torch's threads."""
        if config.run.threads is not None:
            torch.set_num_threads(config.run.threads)


class Run:
    """What one training run holds; see the module docstring. Everything is built and checked before anything is
    written (`RunSetup`, then the weights): a run that fails to start leaves the run directory as it was."""

    def __init__(self, config: TrainConfig, ranks: Ranks = Ranks(), run_dir: RunDirectory | None = None,
                 setup: RunSetup | None = None):
        self.config, self.ranks = config, ranks
        self.run_dir = run_dir if run_dir is not None else RunDirectory(config.run.output_dir, ranks)
        self.output_dir = self.run_dir.root
        setup = setup if setup is not None else RunSetup(config, ranks, self.run_dir)
        setup.apply(config)
        self.device, self.share, self.sharded = setup.device, setup.share, setup.sharded
        self.previous = previous_checkpoint(config, self.run_dir)  # again: under the lock, it is the truth
        seed_everything(config.run.seed + ranks.rank)
        self.precision = setup.precision
        self.bf16 = self.precision.compute is not None
        self.generate_config = setup.generate_config
        self.compiled_rollouts = self.generate_config.compile
        self.task, self.objective, self.data = setup.task, setup.objective, setup.data
        self.tree_shape, self.tree = setup.tree_shape, None  # d_treerpo's trees (roll_out_tree)
        self.test_examples, self.tokenizer = setup.test_examples, setup.tokenizer
        source = setup.source
        # What the run decided for its device, said before the first step (on CPU by default: nothing).
        self.setup_notes = [self.precision.describe(config.lora.enabled)] if self.bf16 else []
        # The trainer's flags for the engine's micro-batching, in one place; --micro-batch auto is fitted to the
        # device's free memory before the weights take their share of it.
        fitted = DEFAULT_MICRO_BATCH
        if config.objective.micro_batch == AUTO:
            fitted, note = auto_micro_batch(config, self.device, ranks)
            self.setup_notes += [note] if self.device.type == "cuda" else []
        if self.compiled_rollouts:
            self.setup_notes.append(f"--compile {str(config.rollout.compile).lower()}: rollouts compiled; the first "
                                    "step compiles the denoising step (compile_seconds in metrics.jsonl)")
        self.batching = micro_batching(config, auto=fitted)
        base = load_model(source, dtype=self.precision.base_dtype(config.lora.enabled), device=self.device,
                          seed=config.run.seed, tokenizer=self.tokenizer,
                          allow_external_links=config.model.allow_external_links).train()
        take_block_length(config, base)
        base.set_gradient_checkpointing(config.model.gradient_checkpointing)
        # --expert-parallel N: this rank keeps its slice of the routed experts (train/expert_parallel.py)
        self.expert_group = expert_group(config.run.expert_parallel, ranks, self.device)
        base = distribute(base, self.expert_group)
        if self.expert_group is not None:
            self.setup_notes.append(expert_parallel_note(base, self.expert_group, setup.generate_config.compile
                                                         != config.generate_config(self.device.type).compile,
                                                         sharded=self.sharded))
        # The reference policy: the initial weights, frozen. With LoRA, the objective disables the adapters instead.
        # LoRA's initial adapters are drawn from --seed alone, the same on every rank: FSDP2 shards each rank's own
        # tensors (DDP would broadcast rank 0's), and the ranks' random streams (seeded by rank) go on untouched.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(config.run.seed)
            self.model, self.ref_model = training_models(base, config, self.precision,
                                                         needs_reference=self.objective.needs_reference)
        # Under FSDP2 the policy (a LoRA run's frozen base with its adapters) and the reference copy are sharded
        # alike, gathered in the compute dtype on CUDA; the reference trains nothing, so it has no optimizer state.
        mixed_precision = sharded_mixed_precision(self.precision, self.device.type)
        if self.expert_group is not None and not self.sharded:
            ignore_experts_in_ddp(self.model)
        # under FSDP2 a rank's routed experts are left whole, or sharded over their replicas (train/expert_parallel.py);
        # --fsdp-offload: the policy's shards on the host; --reference-offload: the reference's (no optimizer state)
        offload = config.run.fsdp_offload
        ignored = shard_experts(self.model, self.expert_group, mixed_precision, self.device, offload) \
            if self.sharded else set()
        self.model = data_parallel_wrapper(self.model, config.run.parallel, ranks, self.device,
                                           mixed_precision=mixed_precision, offload=offload, ignored_params=ignored)
        if self.sharded and self.ref_model is not None:
            reference_offload = config.run.fsdp_offload or config.run.reference_offload
            ignored = shard_experts(self.ref_model, self.expert_group, mixed_precision, self.device, reference_offload)
            self.ref_model = data_parallel_wrapper(self.ref_model, config.run.parallel, ranks, self.device,
                                                   mixed_precision=mixed_precision, offload=reference_offload,
                                                   ignored_params=ignored)
        self.core = unwrap_model(self.model)
        self.rollout_weights = None  # under FSDP2: the gathered copy rollouts run on (train/rollout_weights.py)
        if self.sharded:
            self.setup_notes.append(sharding_note(config, ranks, mixed_precision, self.ref_model is not None))
            self.rollout_weights, note = rollout_weights_for(self.model, config, ranks, self.device, self.precision)
            self.setup_notes.append(note)
        elif config.run.rollout_weights != "auto":
            self.setup_notes.append(f"--rollout-weights {config.run.rollout_weights}: nothing to gather without "
                                    "FSDP2 on several ranks; rollouts run on the model itself")
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_adamw(self.trainable, config.optim)  # fused on CUDA (train/optimizer.py)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, learning_rate_factor(config))
        self.step_hooks = train_step.StepHooks(autocast=self.autocast)  # train/step.py's phases in this precision
        # Preference objectives (vrpo_dpo) train on the task's stored pairs instead of rollouts (train/pairs.py).
        self.pairs = PairSource(self.task, self.tokenizer, config.rollout.gen_length, self.core.eos_token_id,
                                getattr(self.core, "eot_token_id", None),
                                self.device) if self.objective.preference_pairs else None
        self.rollout_generator = torch.Generator(self.device).manual_seed(config.run.seed + 7919 * ranks.rank)
        self.mask_generator = torch.Generator().manual_seed(config.run.seed + 1 + 7919 * ranks.rank)
        self.step = 0
        self.metrics = MetricsLog(self.run_dir)
        # Built and checked: now the run takes the directory over.
        if self.previous and config.run.resume:
            load_checkpoint(self)
        elif ranks.writer:
            if self.previous:  # --overwrite: the earlier run's checkpoint goes now, so nothing can resume it
                self.run_dir.remove(CHECKPOINT)
            self.metrics.start()
        if ranks.writer:
            write_text_atomic(self.run_dir.path(CONFIG), json.dumps(config.to_dict(), indent=2) + "\n")
        ranks.barrier()

    def autocast(self):
        return self.precision.autocast(self.device.type)

    # -- the loop's steps -----------------------------------------------------------------------------------
    def roll_out(self, examples):
        """G completions per prompt (rows g * G .. g * G + G - 1 are prompt g's), decoded. (A tree objective's:
        the leaves of a tree per prompt, `roll_out_tree`.)"""
        c = self.config
        if self.tree_shape is not None:
            return self.roll_out_tree(examples)
        prompts = [self.task.prompt(e, self.tokenizer) for e in examples for _ in range(c.run.group_size)]
        input_ids, attention_mask = encode_prompts(self.tokenizer, prompts, device=self.device,
                                                   pad_token_id=self.core.eos_token_id)
        started = time.perf_counter()
        # core: DDP's wrapper adds nothing to sampling; FSDP2's is the model
        result = train_step.roll_out(self.core, input_ids, attention_mask, self.generate_config,
                                     generator=self.rollout_generator,
                                     record_unmask_step=self.objective.needs_unmask_step, hooks=self.step_hooks,
                                     record_step_predictions=getattr(self.objective, "needs_step_predictions", False),
                                     merge_adapters=c.lora.enabled and c.lora.merge_rollouts and not self.sharded,
                                     weights=self.rollout_weights)
        return result, decode_completions(self.tokenizer, result), time.perf_counter() - started

    @property
    def rollouts_per_prompt(self) -> int:
        """The rollouts rewarded per prompt: --group-size, or a tree objective's leaves per prompt."""
        return self.config.run.group_size if self.tree_shape is None else self.tree_shape.leaves_per_prompt()

    def roll_out_tree(self, examples):
        """d_treerpo: a tree per prompt (rollout/tree.py), kept for the batch; its leaves, as one GenerationResult
        (rows of a prompt contiguous), decoded."""
        from dllm_fast.contracts import GenerationResult, completion_mask

        prompts = [self.task.prompt(e, self.tokenizer) for e in examples]
        input_ids, attention_mask = encode_prompts(self.tokenizer, prompts, device=self.device,
                                                   pad_token_id=self.core.eos_token_id)
        started = time.perf_counter()
        tree = train_step.roll_out(self.core, input_ids, attention_mask, self.generate_config,
                                   generator=self.rollout_generator, record_unmask_step=False, hooks=self.step_hooks,
                                   merge_adapters=self.config.lora.enabled and self.config.lora.merge_rollouts
                                   and not self.sharded, weights=self.rollout_weights, tree=self.tree_shape)
        self.tree = tree
        leaves = tree.canvases[tree.leaves]
        completion = leaves[:, tree.prompt_length:]
        mask = None if tree.attention_mask is None else tree.attention_mask[tree.prompt[tree.leaves]]
        result = GenerationResult(leaves, completion, completion_mask(completion, self.core.eos_token_id),
                                  tree.forwards, mask)
        return result, decode_completions(self.tokenizer, result), time.perf_counter() - started

    def after_step(self, peaks: dict[str, int]) -> None:
        """The measured rule of the gathered copy (train/rollout_weights.keep_copy): kept between steps when the
        step's measured peak without it (`peaks`: bytes by phase, CUDA's max_memory_allocated) plus the copy stays
        within the margin of the device's memory; the ranks agree on rank 0's answer."""
        copy = self.rollout_weights
        if copy is None or self.device.type != "cuda":
            return
        measured = max((peak for name, peak in peaks.items() if name != "rollout"), default=None)
        if measured is not None and copy.keep:
            measured -= copy.nbytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        copy.keep = self.ranks.gather(keep_copy(measured, copy.nbytes, total)[0])[0]

    def rollout_batch(self, examples, rollout, completions) -> RolloutBatch:
        """The task's rewards of the completions, with the rollouts: what the objective consumes."""
        G = self.rollouts_per_prompt
        rewards = [task_reward(self.task, examples[row // G], text,
                               f"prompt {row // G} of step {self.step + 1} ({examples[row // G].question[:200]!r}), "
                               f"completion {text[:200]!r}") for row, text in enumerate(completions)]
        rewards = torch.tensor(rewards, dtype=torch.float32, device=self.device)
        check_rewards(rewards, G)
        if self.tree_shape is not None:  # the tree's edges, valued from its leaves' rewards
            return objectives.tree_batch(self.tree, rewards, eos_token_id=self.core.eos_token_id,
                                         mask_token_id=self.core.mask_token_id, train_step=self.step)
        return RolloutBatch.from_generation(rollout, rewards, group_size=G)

    def learner_batch(self, examples, rollout, batch: RolloutBatch) -> RolloutBatch:
        """What the objective trains on: the rollout batch, or for MDPO (`needs_step_predictions`) its step batch:
        every recorded one-step prediction rewarded by the task (train/step_rewards.py), the top-k steps kept."""
        if not getattr(self.objective, "needs_step_predictions", False):
            return batch
        rewards = step_rewards(self.task, examples, self.config.run.group_size,
                               decode_step_predictions(self.tokenizer, rollout, self.core.eos_token_id),
                               f"step {self.step + 1}", self.device)
        return self.objective.step_batch(batch, rollout.step_predictions, rollout.step_confidence, rewards,
                                         eos_token_id=self.core.eos_token_id,
                                         rollout_temperature=self.generate_config.temperature)

    def plan_updates(self, batch: RolloutBatch) -> list[InnerUpdate]:
        """The objective's plan of this batch's mu inner updates: each one's masks, and the old policy's lp on
        the masks of every update after the first (the policy moves at each update)."""
        return train_step.plan_updates(self.objective, self.model, batch,
                                       moved=train_step.moved_after_first(self.config.objective.inner_updates),
                                       generator=self.mask_generator, batching=self.batching, hooks=self.step_hooks)

    def update(self, batch: RolloutBatch, update: InnerUpdate) -> dict:
        """One inner update: the objective's gradient, clipping, an AdamW step and the schedule."""
        clip = (ExpertGradients(self.model, self.expert_group, sharded=self.sharded)
                if self.expert_group is not None else None)
        optimization = train_step.Optimization(self.trainable, self.optimizer, self.config.optim.grad_clip,
                                               self.schedule, clip=clip)
        out, norm = train_step.run_update(self.objective, self.model, batch, update, batching=self.batching,
                                          optimization=optimization, ref_model=self.ref_model,
                                          hooks=self.step_hooks, when=f" at step {self.step + 1}")
        return {**out.stats, "grad_norm": float(norm)}


# ---------------------------------------------------------------------------------------------------------
# Setup helpers


def check_parallel(config: TrainConfig, skeleton, world: int) -> None:
    """Refuse, naming the flags, a --parallel / --expert-parallel the run cannot take on `world` ranks: prompts
    that do not split over the ranks, threshold decoding under FSDP2, and what expert parallelism refuses
    (train/expert_parallel.check_expert_parallel; with `skeleton`, the policy's, None before it is known). What
    passes here is what the planner plans (python_tests/test_parallel_agreement.py)."""
    if config.run.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {config.run.prompts_per_step} must be a multiple of the "
                         f"{world} ranks: each rank rolls out its own complete prompt groups.")
    if sharded(config.run.parallel, Ranks(0, world)) and config.rollout.threshold is not None:
        raise ValueError("--threshold decoding takes a different number of model calls on each rank, which "
                         "FSDP2's sharded forwards cannot; use a fixed schedule (--diffusion-steps) or DDP.")
    if skeleton is not None:
        check_expert_parallel(config, skeleton, world)


def previous_checkpoint(config: TrainConfig, run_dir: RunDirectory) -> bool:
    """Whether the run directory holds a checkpoint; with --resume, it must be one this config continues."""
    checkpoint = run_dir.path(CHECKPOINT)
    previous = settled_directory(checkpoint).is_dir()
    if previous and not (config.run.resume or config.run.overwrite):  # a new run would replace it
        raise FileExistsError(f"{run_dir.root} holds the checkpoint of an earlier run; continue it with "
                              "--resume true, replace it with --overwrite true, or pick another --output-dir.")
    if previous and config.run.resume:
        check_resumable(config, saved_config(checkpoint), str(checkpoint / CONFIG))
    return previous


def sharding_note(config: TrainConfig, ranks: Ranks, mixed_precision, reference: bool) -> str:
    """The setup line of a run under FSDP2: what is sharded, and the dtypes of its gathers and reductions."""
    what = "the frozen base with its LoRA adapters" if config.lora.enabled else "the policy"
    what += " and the reference copy" if reference else ""
    dtypes = ("in each weight's own dtype" if mixed_precision is None else
              f"in {short_name(mixed_precision.param_dtype)}, gradients reduce-scattered in "
              f"{short_name(mixed_precision.reduce_dtype)} at every backward")
    offloaded = ("; --fsdp-offload true: every shard, gradient and AdamW state in host memory, AdamW stepping "
                 "there" if config.run.fsdp_offload else "; --reference-offload true: the reference's shards in host "
                 "memory" if config.run.reference_offload and reference else "")
    return f"--parallel fsdp2: {what} sharded over {ranks.world} ranks, gathered {dtypes}{offloaded}"


def check_rollout_settings(config: TrainConfig, rollouts, model) -> None:
    """The rollouts' and every evaluation's settings suit the model (its caches, its blocks), checked as generate
    checks them (rollout.plan.check_generate_config) on the model's skeleton, before anything is written."""
    from dllm_fast.rollout.plan import check_generate_config
    from dllm_fast.train.evaluation import eval_config

    for where, settings in [("the rollouts", rollouts)] + [
            (f"the evaluation at --eval-gen-lengths {length}", eval_config(rollouts, config, length, model))
            for length in config.eval.gen_lengths]:
        try:
            check_generate_config(model, settings)
        except (ValueError, TypeError) as error:
            raise type(error)(f"--model {config.model.name!r} cannot decode {where} with these settings: "
                              f"{error}") from None


def auto_micro_batch(config: TrainConfig, device: torch.device, ranks: Ranks) -> tuple[int, str]:
    """--micro-batch auto: (the micro-batch, a line saying how it was chosen). On CPU the default; on CUDA the
    planner's fit (dllm_fast.train.micro_batch), the smallest over the ranks so that all cut pairs alike."""
    if device.type != "cuda":
        return DEFAULT_MICRO_BATCH, f"--micro-batch auto: {DEFAULT_MICRO_BATCH} on {device.type}"
    from dllm_fast.train.micro_batch import fitted_micro_batch

    micro_batch, note = fitted_micro_batch(config, device)
    fitted = min(ranks.gather(micro_batch))
    if fitted != micro_batch:
        note += f"; {fitted} on every rank (the smallest fit)"
    return fitted, note


def load_model_and_tokenizer(config: TrainConfig, device: torch.device | str):
    """The policy's initial weights and its tokenizer, from the embedded default, a checkpoint directory or a
    preset with random weights (see `model_and_tokenizer_plan`)."""
    source, tokenizer, _ = model_and_tokenizer_plan(config)
    model = load_model(source, dtype=torch.float32, device=device, seed=config.run.seed, tokenizer=tokenizer,
                       allow_external_links=config.model.allow_external_links)
    return model.train(), tokenizer


def model_and_tokenizer_plan(config: TrainConfig):
    """(what load_model loads, the tokenizer, the model's meta-device skeleton), checked to agree before any weight
    is read. The tokenizer is `config.model.tokenizer`, else the checkpoint's own, else (presets) the embedded
    default's, whose vocabulary and special ids a preset then takes."""
    source, _, tokenizer_dir = model_source(config.model, config.lora)
    tokenizer = load_tokenizer(tokenizer_dir)
    skeleton = model_skeleton(source, tokenizer=tokenizer, allow_external_links=config.model.allow_external_links)
    check_tokenizer(skeleton, tokenizer, model_name=repr(config.model.name), tokenizer_name=str(tokenizer_dir))
    return source, tokenizer, skeleton


def check_objective_fits(objective, task, config: TrainConfig, rollouts, model) -> None:
    """The objective suits the model (EBPO's block samplers need a block model), the rollouts (JustGRPO's
    left-to-right order) and the task (preference objectives need preference pairs), before any work."""
    name = config.objective.name
    check_pairs_task(objective, task, name, config.run.task)
    try:
        objective.check_model(model)
        if not objective.preference_pairs:
            objective.check_rollouts(rollouts)
        if getattr(objective, "needs_step_predictions", False):  # MDPO: generate can record these rollouts' steps
            from dllm_fast.rollout.plan import check_generate_config

            check_generate_config(model, rollouts, record_step_predictions=True)
    except ValueError as error:
        raise ValueError(f"--objective {name} with --model {config.model.name!r}: {error}") from None


def check_tree_fits(shape, config: TrainConfig, rollouts, model) -> None:
    """A tree objective's rollouts (rollout/tree.py) suit the settings and the model, before any work."""
    from dllm_fast.rollout.tree import check_tree_rollouts

    try:
        check_tree_rollouts(model, rollouts, shape)
    except ValueError as error:
        raise ValueError(f"--objective {config.objective.name} with --model {config.model.name!r}: {error}") from None


def check_rollout_records(objective, name: str) -> None:
    """An objective that replays the decoding order needs a generate that records it; refuse before any work."""
    if objective.needs_unmask_step and "record_unmask_step" not in inspect.signature(generate).parameters:
        raise ValueError(f"--objective {name} replays the rollout's decoding order, which this build's "
                         "dllm_fast.generate cannot record (it has no record_unmask_step option); use another "
                         "objective or a dllm_fast whose generate records it.")


def check_group_size(objective, config: TrainConfig) -> None:
    """A group of one completion: every group-relative advantage is 0, so the run cannot learn from its rewards."""
    if config.run.group_size < 2 and not objective.preference_pairs:
        raise ValueError(f"--group-size {config.run.group_size}: {config.objective.name}'s advantages are each "
                         "reward against its group's, so with one completion a prompt every advantage is 0 and the "
                         "run cannot learn; use --group-size 2 or more (8 is the default).")


def check_lengths(config: TrainConfig, task, train_examples, test_examples, tokenizer, model) -> None:
    """Every prompt plus its completion fits the model's positions (its max_sequence_length, when it has one):
    the longest training prompt with --gen-length, the longest test prompt with each of --eval-gen-lengths. A
    prompt too long to fit whatever it encodes to (more characters than the positions times the tokenizer's longest
    token) is refused before it is tokenised."""
    limit = getattr(model, "max_sequence_length", None)
    if limit is None:
        return
    for option, length in [("--gen-length", config.rollout.gen_length)] + [("--eval-gen-lengths", n)
                                                                     for n in config.eval.gen_lengths]:
        if length >= limit:
            raise ValueError(f"{option} {length} leaves no room for a prompt: the model has {limit} positions "
                             f"(max_sequence_length); lower {option}.")
    longest_token = max(map(len, tokenizer.get_vocab()), default=1)
    for split, examples, option, lengths in (("training", train_examples, "--gen-length", [config.rollout.gen_length]),
                                             ("test", test_examples, "--eval-gen-lengths", config.eval.gen_lengths)):
        room = limit - max(lengths)
        prompts = [task.prompt(example, tokenizer) for example in examples]
        for example, text in zip(examples, prompts):
            if len(text) > room * longest_token:
                raise ValueError(f"the {split} prompt {_named(example)} has {len(text)} characters, more than "
                                 f"{room} tokens can hold (the model's {limit} positions less {option} "
                                 f"{max(lengths)}); shorten or drop it.")
        if not prompts:
            continue
        counts = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        longest = max(range(len(counts)), key=counts.__getitem__)
        for length in lengths:
            if counts[longest] + length > limit:
                raise ValueError(f"the longest {split} prompt of task {task.name!r}, {_named(examples[longest])}, "
                                 f"has {counts[longest]} tokens, and with {option} {length} a sequence needs "
                                 f"{counts[longest] + length} positions; the model has {limit} (max_sequence_length). "
                                 f"Lower {option}, or use shorter prompts.")


def _named(example) -> str:
    """An example as messages name it: where it was read from, or the start of its question."""
    return example.source or repr(example.question[:80])


def check_sizes(config: TrainConfig, model, device: torch.device, ranks: Ranks, needs_reference: bool,
                precision: Precision) -> None:
    """Sizes that cannot work, refused before any weight is read: a LoRA rank above the model's width, and a model
    whose weights, gradients, AdamW moments and reference copy (in the dtypes of `precision`) alone exceed the
    device's free memory (an estimate that leaves out activations; checked for a single process)."""
    width = model.lm_head_weight.shape[1]
    if config.lora.enabled and config.lora.rank > width:
        raise ValueError(f"--lora-rank {config.lora.rank} exceeds the model's width {width}, beyond which LoRA adds "
                         "nothing; use e.g. --lora-rank 16.")
    available = free_memory(device)
    if ranks.world > 1 or available is None:
        return
    parameters = sum(p.numel() for p in model.parameters())
    trained, frozen = precision.trainable.itemsize, precision.frozen.itemsize
    reference = needs_reference and not config.lora.enabled
    # LoRA: the frozen weights; a full fine-tune: weights, gradients and 2 AdamW moments, and the reference copy
    needed = parameters * (frozen if config.lora.enabled else 4 * trained + (frozen if reference else 0))
    if needed > available:
        if config.lora.enabled:
            setup = f"its weights in {short_name(precision.frozen)}"
        elif reference and frozen != trained:
            setup = (f"weights, gradients and AdamW's two moments in {short_name(precision.trainable)} and the "
                     f"reference copy in {short_name(precision.frozen)}")
        else:
            setup = "weights, gradients, AdamW's two moments" + (" and the reference copy" if reference else "") + (
                f" in {short_name(precision.trainable)}")
        count = f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters:,}"
        raise ValueError(f"--model {config.model.name!r} has {count} parameters: {setup} take about "
                         f"{_size(needed)}, more than the {_size(available)} free on {device}. Use a smaller model"
                         f"{'' if config.lora.enabled else ', --lora true'} or a larger device.")


def _size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: CUDA's free memory, or the host's available memory (Linux); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def learning_rate_factor(config: TrainConfig):
    total = config.run.steps * config.objective.inner_updates
    warmup = config.optim.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if config.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.optim.schedule == "cosine" else 1.0 - progress

    return factor
