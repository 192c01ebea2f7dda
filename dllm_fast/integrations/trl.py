"""Train a masked diffusion LM with TRL's GRPOTrainer (trl>=1,<2) on dllm_fast's rollouts, likelihoods and objectives.

    from trl import GRPOConfig
    from dllm_fast.integrations.trl import DiffusionGRPOTrainer, make_rollout_func

    trainer = DiffusionGRPOTrainer(
        model=LLaDAModel.from_pretrained(path), reward_funcs=[reward], train_dataset=dataset,
        processing_class=tokenizer,
        args=GRPOConfig(output_dir="out", num_generations=6, per_device_train_batch_size=6, max_completion_length=256),
        objective="espo", rollout_func=make_rollout_func(block_length=32, steps=128, temperature=0.9))
    trainer.train()

What comes from where:
- rollouts: TRL's `rollout_func` hook runs `dllm_fast.generate` (`make_rollout_func`);
- rewards: TRL's plumbing (reward_funcs, reward_weights, gathering across processes); the objective gets each
  completion's weighted reward sum. Each function's rewards are checked as the native trainer checks a task's
  (dllm_fast.tasks.rewards: real numbers within +-2^24; a string, list or NaN is an error naming the function);
  None is TRL's "does not apply", and a completion no function scores is an error;
- advantages and loss: any dllm_fast objective (a name or an instance), through its one entry point
  `Objective.backward`: exact gradient by the streaming backward, each backward call being TRL's own
  `accelerator.backward`. TRL's loss_type, epsilon and scale_rewards do not apply and its beta must stay 0; the
  objective's config holds the paper's settings (e.g. `objectives.get("diffu_grpo", beta=0.04)`).
- log-probs: `_get_per_token_logps_and_entropies` returns d1's one-step mean-field diffusion log-probs for the
  TRL code paths that ask for them (old log-probs when generation and optimisation are misaligned).

Each micro-batch holds whole prompt groups (per_device_train_batch_size a multiple of num_generations), since
objectives compute group advantages and some (wd1) a group softmax. With num_iterations > 1 or steps_per_generation
> gradient_accumulation_steps, the objective's masks for every reuse of a rollout are drawn when it is generated and
the old policy is scored on them before the policy moves, so ratios are exact. Evaluation rolls out and logs TRL's
reward metrics; its eval_loss is NaN (an objective value needs the training step's scoring).

The model may be a plain dllm_fast model (LLaDAModel, HFDiffusionLM): it is wrapped in `DiffusionPreTrainedModel`
(dllm_fast.models.hf_pretrained, also importable from here), the `transformers.PreTrainedModel` TRL requires. TRL
never calls its forward for logits: its generation and log-prob paths are the two hooks above.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, block_length as block_length_of, completion_mask, unwrap_model
from dllm_fast.integrations.logprobs import mean_field_logprobs
from dllm_fast.likelihood import BackwardHooks, MicroBatching
from dllm_fast.models.hf_pretrained import DiffusionPreTrainedConfig, DiffusionPreTrainedModel
from dllm_fast.models.loading import check_tokenizer
from dllm_fast.objectives import InnerUpdate
from dllm_fast.rollout.cache import cache_policy
from dllm_fast.rollout.config import GenerateConfig, rollout_settings
from dllm_fast.rollout.plan import check_generate_config
from dllm_fast.tasks.encoding import left_pad
from dllm_fast.tasks.rewards import MAX_ABS_REWARD, reward_value
from dllm_fast.train import step as train_step
from dllm_fast.train.precision import frozen_copy
from dllm_fast.validation import check_bool, check_int

__all__ = ["DiffusionGRPOTrainer", "DiffusionPreTrainedModel", "DiffusionPreTrainedConfig", "make_rollout_func"]


# ---------------------------------------------------------------------------------------------------------
# Rollouts through TRL's rollout_func hook


def make_rollout_func(config: GenerateConfig | None = None, *, seed: int = 0, **settings):
    """A TRL `rollout_func(prompts, trainer)` that decodes with `dllm_fast.generate` (block diffusion).

    The settings are generate's: a GenerateConfig (`config`, e.g. a TrainConfig's `generate_config(device)`),
    keywords (its fields: cache, compile, threshold, ...), or both, the keywords overriding the config's fields;
    each rollout passes generate one GenerateConfig. Left out or None, gen_length is the trainer's
    `max_completion_length`, steps gen_length (one token per step; none with a threshold or
    unmask_schedule="ass", whose steps follow from the block), temperature the
    trainer's `temperature`; block_length a block-diffusion model's own block (SDAR; a threshold with steps is its
    dynamic rule), else 32, capped at gen_length. cache ("none"; "prefix", "dual": Fast-dLLM's KV caches;
    "block": a block-diffusion model's exact cache of finished blocks), full_last_block and compile (each denoising
    step through torch.compile, CUDA graphs on a GPU; the first rollout compiles) are generate's; the trainer
    checks them against its model when it is built. Prompts are tokenized with the trainer's processing_class (the chat template for conversational
    prompts), left-padded, and decoded in one batch under `model.eval()`. Each completion is returned through its
    first EOS, as TRL expects; its sampling log-probs are not available from a diffusion sampler (None). Noise
    comes from a generator seeded with seed + the process index, so runs are reproducible. For an objective that
    replays the decoding order (`needs_unmask_step`, TraceRL) the rollout records it, and the trainer builds the
    RolloutBatch with it, bounded by the rollout's forwards (`GenerationResult.nfe`: a block-diffusion batch of
    prompts of different lengths runs more forwards than gen_length, see rollout/blocks.py).
    """
    given = rollout_settings(config, settings, "make_rollout_func")
    if given.get("block_length") is not None:
        check_int("block_length", given["block_length"], minimum=1)  # generate checks the rest when it runs
    check_int("seed", seed, minimum=0)
    check_bool("compile", given.get("compile", False))
    cache_policy(given.get("cache", "none"))  # a policy or a registered name (block models: "block")
    check_bool("full_last_block", given.get("full_last_block", False))
    generators: dict[torch.device, torch.Generator] = {}

    def rollout_func(prompts: list, trainer) -> dict:
        device = trainer.accelerator.device
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        model = trainer.model
        core = unwrap_model(model)
        rollouts = rollout_config(given, trainer.args, core)
        prompt_ids = tokenize_prompts(prompts, tokenizer, getattr(trainer, "chat_template_kwargs", None) or {})
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else core.eos_token_id
        input_ids, attention_mask = left_pad(prompt_ids, pad, device)
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed + trainer.accelerator.process_index)
        objective = getattr(trainer, "objective", None)
        result = train_step.roll_out(model, input_ids, attention_mask, rollouts, generator=generators[device],
                                     record_unmask_step=getattr(objective, "needs_unmask_step", False),
                                     hooks=train_step.StepHooks(autocast=trainer.accelerator.autocast))
        # Trajectory objectives (TraceRL) replay the decoding order: kept for this generation batch's plan, with
        # the rollout's forward count that bounds it.
        trainer._unmask_step = getattr(result, "unmask_step", None)
        trainer._rollout_forwards = result.nfe
        lengths = result.completion_mask.sum(-1).tolist()
        completions = [row[:n] for row, n in zip(result.completion_ids.tolist(), lengths)]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    rollout_func.settings = given  # what DiffusionGRPOTrainer checks against its model before training
    return rollout_func


def rollout_config(given: dict, args, model) -> GenerateConfig:
    """The GenerateConfig a rollout function made by make_rollout_func decodes with, for the trainer's `args`
    (GRPOConfig) and its `model` (see make_rollout_func for the defaults)."""
    length = given.get("gen_length")
    length = length if length is not None else args.max_completion_length
    check_int("gen_length", length, minimum=1, hint="tokens per completion (GRPOConfig.max_completion_length)")
    # A block-diffusion model decodes its own blocks (generate names a block_length that differs).
    own, block_length = block_length_of(model), given.get("block_length")
    block = (block_length or own) if own is not None else min(block_length or 32, length)
    steps, temperature = given.get("steps"), given.get("temperature")
    return GenerateConfig(**{
        **given, "gen_length": length, "block_length": block,
        "steps": steps if steps is not None or given.get("threshold") is not None
        or given.get("unmask_schedule") == "ass" else length,  # ASS: its steps follow from the block
        "temperature": temperature if temperature is not None else args.temperature})


def checked_reward_function(function):
    """A TRL reward function whose returned rewards are checked as the native trainer checks a task's
    (`dllm_fast.tasks.rewards.reward_value`: real numbers within +-2^24, NumPy/torch scalars taken as floats), with
    errors that name the function. None stays TRL's "does not apply to this completion". Reward models (modules)
    and model names are returned as given."""
    if isinstance(function, (str, nn.Module)) or not callable(function):
        return function
    name = getattr(function, "__name__", type(function).__name__)

    def checked(rewards):
        if isinstance(rewards, (str, bytes, dict)) or not hasattr(rewards, "__iter__"):
            raise TypeError(f"reward function {name!r} returned a {type(rewards).__name__}; it must return a list "
                            "of rewards, one per completion (None where it does not apply).")
        return [None if value is None else reward_value(value, f"reward function {name!r} for completion {row}")
                for row, value in enumerate(rewards)]

    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None)):
        @functools.wraps(function)
        async def checked_async(*args, **kwargs):
            return checked(await function(*args, **kwargs))

        return checked_async

    @functools.wraps(function)
    def checked_sync(*args, **kwargs):
        return checked(function(*args, **kwargs))

    return checked_sync


def tokenize_prompts(prompts: list, tokenizer, chat_template_kwargs: dict) -> list[list[int]]:
    """Token ids of each prompt: the chat template with the generation prompt for conversational prompts (lists
    of messages), the plain tokenizer for strings."""
    if is_conversational({"prompt": prompts[0]}):
        encoded = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **chat_template_kwargs)
        return [list(ids) for ids in encoded["input_ids"]]
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


# ---------------------------------------------------------------------------------------------------------
# The trainer


@dataclass
class _Use:
    """One micro-step's work: whole prompt groups and the objective's plan of this use of them."""

    batch: RolloutBatch
    update: InnerUpdate


class DiffusionGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with dllm_fast rollouts, diffusion log-probs and any dllm_fast objective (see the module
    docstring).

    Args (besides GRPOTrainer's):
        model: a `transformers.PreTrainedModel` with the model contract, or any dllm_fast model (wrapped in
            `DiffusionPreTrainedModel`).
        objective: a registered objective name (`dllm_fast.objectives.available()`) or an Objective instance.
        likelihood_micro_batch: (sequence, Monte Carlo sample) pairs per backward graph; memory scales with it.
            Default: per_device_train_batch_size.
        rollout_func: default `make_rollout_func()` (the trainer's max_completion_length and temperature).
        mask_seed: seeds the objective's Monte Carlo masks (plus the process index); default args.seed.
    """

    def __init__(self, model, reward_funcs, args=None, *, objective="diffu_grpo",
                 likelihood_micro_batch: int | None = None, rollout_func=None, mask_seed: int | None = None,
                 **kwargs):
        if not isinstance(model, PreTrainedModel):
            model = DiffusionPreTrainedModel(model)
        if isinstance(objective, str):
            objective = objectives.get(objective)
        if not isinstance(objective, objectives.Objective):
            raise TypeError(f"objective must be a name from {objectives.available()} or an Objective, got "
                            f"{type(objective).__name__}.")
        if objective.preference_pairs:
            raise ValueError(f"objective {objective.name!r} trains on stored preference pairs (offline VRPO/DPO), and "
                             "has no rollout for GRPOTrainer to generate nor rewards to score: train it with "
                             "`python -m dllm_fast train --objective vrpo_dpo --task sudoku4_pairs` (or --task "
                             "pairs_jsonl), or call Objective.backward on objectives.preference_batch(...) in your "
                             "own loop.")
        if getattr(objective, "needs_step_predictions", False):  # MDPO rewards every denoising step
            raise ValueError(f"objective {objective.name!r} rewards the model's one-step prediction at every "
                             "denoising step (K reward calls per rollout) and trains on the steps with the largest "
                             "advantage, but GRPOTrainer scores only the final completions with its reward "
                             "functions: train it with `python -m dllm_fast train --objective mdpo`, or in your own "
                             "loop: generate(..., record_step_predictions=True), reward each step's prediction, "
                             "MDPO.step_batch(...) and Objective.backward.")
        if getattr(objective, "tree_shape", None) is not None:  # d_treerpo
            raise ValueError(f"objective {objective.name!r} trains on the edges of tree rollouts (each prompt's "
                             "partial rollouts branching at fixed steps, rewarded at the leaves: rollout/tree.py); "
                             "GRPOTrainer generates G independent completions per prompt and cannot branch them: "
                             f"train it with `python -m dllm_fast train --objective {objective.name}`, or call "
                             "Objective.backward on objectives.tree_batch(rollout.tree.tree_rollout(...), ...) in "
                             "your own loop.")
        objective.check_model(model)  # e.g. EBPO's block samplers need a block-diffusion model
        if args is not None:
            check_trl_config(args)
        if kwargs.get("processing_class") is not None:  # TRL decodes completions for the rewards with it
            check_tokenizer(model, kwargs["processing_class"], model_name=type(unwrap_model(model)).__name__,
                            tokenizer_name="processing_class")
        reward_funcs = [checked_reward_function(f) for f in (reward_funcs if isinstance(reward_funcs, list)
                                                             else [reward_funcs])]
        # The reference policy: a frozen copy of the initial weights, or for PEFT the model without its adapters.
        # Copied before GRPOTrainer patches the model's forward (a closure over the original model); in bf16 when
        # the trainer computes in bf16 (frozen weights in the compute dtype: dllm_fast.train.precision).
        reference = None
        if (objective.needs_reference and kwargs.get("peft_config") is None
                and not hasattr(unwrap_model(model), "disable_adapter")):
            if getattr(args, "bf16", False):
                reference = frozen_copy(model, torch.bfloat16)
            else:
                reference = copy.deepcopy(model).eval().requires_grad_(False)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args,
                         rollout_func=rollout_func if rollout_func is not None else make_rollout_func(), **kwargs)
        check_trl_config(self.args)
        settings = getattr(self.rollout_func, "settings", None)
        if settings is not None:  # make_rollout_func's: its settings suit the model (a cache it has, its blocks)
            core = unwrap_model(self.model)
            check_generate_config(core, rollout_config(settings, self.args, core))
            objective.check_rollouts(rollout_config(settings, self.args, core))  # JustGRPO: left to right
        self._reference = None if reference is None else reference.to(self.accelerator.device)
        self.objective = objective
        self.likelihood_micro_batch = check_int(
            "likelihood_micro_batch", likelihood_micro_batch if likelihood_micro_batch is not None
            else self.args.per_device_train_batch_size, minimum=1, hint="(sequence, sample) pairs per backward graph")
        self._batching = MicroBatching(self.likelihood_micro_batch)
        self._step_hooks = train_step.StepHooks(autocast=self.accelerator.autocast)  # train/step.py's phases
        seed = self.args.seed if mask_seed is None else mask_seed
        self._mask_generator = torch.Generator().manual_seed(seed + self.accelerator.process_index)
        self._rewards: torch.Tensor | None = None
        self._unmask_step: torch.Tensor | None = None  # set by make_rollout_func's rollouts
        self._rollout_forwards: int | None = None
        self._updates: list[list[_Use]] | None = None

    # -- TRL hooks --------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards, plus this process's weighted reward sums kept for the objective."""
        per_function = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards = (per_function * self.reward_weights.to(per_function.device)[None]).nansum(dim=1)
        names = ", ".join(map(repr, self.reward_func_names))
        unscored = torch.isnan(per_function).all(dim=1)
        if unscored.any():
            row = int(unscored.nonzero()[0])
            raise ValueError(f"every reward function ({names}) returned None for completion {row} (prompt group "
                             f"{row // self.num_generations}); at least one must score each completion.")
        beyond = rewards.abs() > MAX_ABS_REWARD
        if beyond.any():
            row = int(beyond.nonzero()[0])
            raise ValueError(f"the weighted reward of completion {row} (reward functions {names}, reward_weights "
                             f"{self.reward_weights.tolist()}) is {float(rewards[row]):.6g}, beyond the reward range "
                             f"[-2^24, 2^24]; lower the reward_weights or rescale the rewards.")
        start = self.accelerator.process_index * len(prompts)
        self._rewards = rewards[start:start + len(prompts)]
        return per_function

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, **unused):
        """d1's one-step mean-field diffusion log-probs [B, logits_to_keep] of the completion tokens: the whole
        completion masked and each prompt token masked with the objective's perturb_prob. The masks are a
        function of each row's tokens, so old, reference and current log-probs of a completion share them.
        Entropies are not computed (NaN)."""
        perturb = getattr(self.objective.config, "perturb_prob", 0.15)
        logps = mean_field_logprobs(model, input_ids, attention_mask, logits_to_keep, perturb_prob=perturb,
                                    seed=self.args.seed, micro_batch=batch_size or input_ids.shape[0])
        entropies = torch.full_like(logps, math.nan) if compute_entropy else None
        return logps, entropies, None

    def _prepare_inputs(self, generation_batch):
        """Training: roll out and score once per `steps_per_generation * num_iterations` micro-steps, then hand out
        one `_Use` of whole groups per micro-step. Evaluation: TRL's rollouts and reward metrics."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        steps_per_generation = self.args.steps_per_generation
        if self._step % (steps_per_generation * self.num_iterations) == 0 or self._updates is None:
            generated = self._generate_and_score_completions(generation_batch)
            self._updates = self._plan_updates(generated)
        return self._updates[self._step % steps_per_generation][(self._step // steps_per_generation)
                                                                 % self.num_iterations]

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-step: the objective's gradient through `Objective.backward`, each backward call being
        accelerate's (scaled by 1 / gradient accumulation steps, as Trainer does)."""
        started = time.perf_counter()
        model.train()
        update = self._prepare_inputs(inputs)
        accumulation = self.current_gradient_accumulation_steps
        hooks = BackwardHooks(sync_gradients=self.accelerator.sync_gradients,
                              backward=lambda loss: self.accelerator.backward(loss / accumulation))
        # TRL's loop clips and steps the optimizer (accelerate): the shared step's phases up to the inner update
        out = train_step.inner_update(self.objective, model, update.batch, update.update, batching=self._batching,
                                      ref_model=self._reference, backward_hooks=hooks, hooks=self._step_hooks)
        for name, value in out.stats.items():
            self._metrics["train"][f"objective/{name}"].append(value)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % accumulation == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return out.loss.to(self.args.device) / accumulation

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self._prepare_inputs(inputs)  # rollouts and TRL's reward metrics
        return torch.tensor(math.nan, device=self.args.device), None, None

    # -- the objective's side ---------------------------------------------------------------------------------
    def _plan_updates(self, generated: dict) -> list[list[_Use]]:
        """Split a generation batch into micro-batches of whole groups, and plan each one's num_iterations uses
        with the objective: a use after an optimizer step (the policy has moved) gets the old policy's lp."""
        batch = rollout_batch(generated, self._rewards, self.num_generations, unwrap_model(self.model).eos_token_id,
                              unmask_step=self._unmask_step if self.objective.needs_unmask_step else None,
                              forwards=self._rollout_forwards)
        rows = self.args.per_device_train_batch_size
        groups = rows // self.num_generations
        accumulation = self.args.gradient_accumulation_steps
        generated_at = self._step
        updates = []
        for i in range(self.args.steps_per_generation):
            micro = batch.groups(i * groups, (i + 1) * groups)
            used_at = [generated_at + k * self.args.steps_per_generation + i for k in range(self.num_iterations)]
            moved = [at // accumulation != generated_at // accumulation for at in used_at]
            plan = train_step.plan_updates(self.objective, self.model, micro, moved=moved,
                                           generator=self._mask_generator, batching=self._batching,
                                           hooks=self._step_hooks)
            updates.append([_Use(micro, update) for update in plan])
        return updates


def check_trl_config(args) -> None:
    """Reject GRPOConfig settings this trainer cannot honour, naming the fix."""
    if args.beta != 0.0:
        raise ValueError(f"GRPOConfig.beta={args.beta} is TRL's KL term, which DiffusionGRPOTrainer does not use; set "
                         "beta=0.0 and give the objective its KL coefficient (e.g. objectives.get('diffu_grpo', "
                         "beta=0.04)).")
    if args.per_device_train_batch_size % args.num_generations:
        raise ValueError(f"per_device_train_batch_size={args.per_device_train_batch_size} must be a multiple of "
                         f"num_generations={args.num_generations}: each micro-batch holds whole prompt groups, whose "
                         "advantages the objective computes.")
    if getattr(args, "top_entropy_quantile", 1.0) != 1.0:
        raise ValueError("top_entropy_quantile needs token entropies, which diffusion log-probs do not provide; "
                         "leave it at 1.0.")


def rollout_batch(generated: dict, rewards: torch.Tensor | None, group_size: int, eos_token_id: int,
                  unmask_step: torch.Tensor | None = None, forwards: int | None = None) -> RolloutBatch:
    """The RolloutBatch of a TRL generation batch: prompt (left-padded) + completion (EOS-padded after its first
    EOS, as the sampler leaves it), attending to every completion position as in sampling. unmask_step: the
    rollout's [rows, gen_length] record, cut to TRL's completion width (positions past a row's first EOS hold EOS
    here, whatever the canvas held: a replayed state shows EOS there); forwards: the rollout's forward count
    (GenerationResult.nfe), which bounds it however it is cut (None: gen_length, what every rollout whose rows
    share one block alignment stays within)."""
    if rewards is None or rewards.shape[0] != generated["prompt_ids"].shape[0]:
        raise RuntimeError("no rewards were recorded for this generation batch (DiffusionGRPOTrainer reads them in "
                           "_calculate_rewards).")
    prompt_ids, prompt_mask = generated["prompt_ids"], generated["prompt_mask"]
    # TRL pads completions after their EOS with its pad token; the sampler's canvas holds EOS there.
    completion = generated["completion_ids"].masked_fill(generated["completion_mask"] == 0, eos_token_id)
    sequences = torch.cat([prompt_ids, completion], dim=1)
    attention_mask = None
    if not bool(prompt_mask.all()):
        attention_mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1).long()
    if unmask_step is None:
        forwards = None
    else:
        if unmask_step.shape[0] != completion.shape[0] or unmask_step.shape[1] < completion.shape[1]:
            raise RuntimeError(f"the recorded unmask_step {tuple(unmask_step.shape)} does not cover this generation "
                               f"batch's completions {tuple(completion.shape)}; roll out with make_rollout_func.")
        forwards = forwards if forwards is not None else unmask_step.shape[1]
        unmask_step = unmask_step[:, :completion.shape[1]].to(completion.device)
    return RolloutBatch(sequences=sequences, attention_mask=attention_mask, prompt_length=prompt_ids.shape[1],
                        completion_mask=completion_mask(completion, eos_token_id), rewards=rewards.float(),
                        group_size=group_size, unmask_step=unmask_step, forwards=forwards)
