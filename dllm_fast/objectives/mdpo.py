"""MDPO (He et al. 2025, "MDPO: Overcoming the Training-Inference Divide of Masked Diffusion Language Models";
autonomousvision/mdpo, src/open_r1/mdpo/mdpo_trainer.py and src/mdlm_generation_utils.py): policy optimisation on
the rollout's intermediate denoising states, each rewarded through the model's one-step guess of the answer there.

The rollout (`generate(..., record_step_predictions=True)`) records, at every forward t, the canvas x_t and
x_hat_t, x_t with every masked position filled by the model's sample (GenerationResult.step_predictions). The
trainer rewards every x_hat_t (K reward calls per rollout, one batched call of the task's reward), and then

    a_nt = (r_nt - r_n,t-1) + 1 + F_nt,   F_nt = mean_{s > t} r_ns (t < K - 1), F_n,K-1 = r_n,K-1;  r_n,-1 = 0
    A_nt = (a_nt - mean_g a_.t) / (std_g a_.t + std_epsilon)                   (per step over the group)
    the k steps with the largest |A_nt| of each rollout are trained on: row (n, t) scores x_hat_t given x_t,
    lp_i = log softmax(f_theta(x_t) / T_s)[x_hat_t,i] at the masked positions M_t of x_t (sampler
    "recorded_state"), rho = exp(lp - lp_old), lambda_t = L / (|M_t| + 1e-4),
    loss = (1/N) sum_{(n, t) selected} sum_{i in M_t} conf_i [-min(rho A, clip(rho, 1 +- eps) A) lambda_t
                                                            + beta (lp_ref - lp)^2 / 2] / (|M_t| + 1e-4)

with N the rollouts. Defaults are the official README recipe's (L38-47): k 8 (sample_train_steps), beta 0.02 (k2
per token against the reference, weighted by the confidence but not by lambda), eps 0.2, the learner temperature
the rollout's (T_s; the recipe's 0.4 is the trainer's --temperature), std_epsilon 1e-4 with the unbiased std, the
advantage "official" (the code's adv-v3 + adv-v4), top-k per rollout. With one update per rollout batch (the
official num_iterations 1) the ratio is 1 and the clip inert.

Options, each a behaviour of the official code or of DARE's port (verl/trainer/ppo/mdpo_algos.py,
llada_dp_actor_mdpo.py):
- step_advantage: "official" (above), "reward" (v1: a = r_t), "future_mean" (v2: mean_{s >= t} r_s),
  "difference" (v3: (r_t - r_t-1) + 1), the code's commented-out variants;
- top_k_per: "rollout" (official: each rollout its own k steps) or "batch" (DARE: one set of k steps for the whole
  batch, by sum_n |A_nt|); std_epsilon 1e-6 is DARE's;
- learner_temperature: None (official: the rollout's T_s) or a number (DARE: 1.0);
- confidence: "policy" (official: conf = p_T(x_hat_i | x_t), the rollout policy's probability of its sample at
  the learner temperature, i.e. exp(lp_old): the recorded sampling probability whenever T matches and nothing
  truncates the distribution) or "recorded" (generate's own confidence: the probability under the unscaled
  logits, as LLaDA ranks positions);
- beta 0 drops the KL and the reference (DARE's recipe: use_kl_loss off).

Not offered: RCR (running-confidence remasking, the official `rcr`, off in all its configs). It re-masks committed
tokens, so decoding stops being absorbing: a position is unmasked more than once, and neither dllm_fast's fused
sampler (one write per position) nor `unmask_step` (one step per position, from which x_t is rebuilt here) can
express such a trajectory. The official "incremental_training" and "mixture_data" are data selection, not the loss.

Read against the official code: each step's loss divides by |M_t| of its row, the official's divisor (its
micro-batch's masked count, pooled) with its one rollout per device; its top-k over a device batch of one is "rollout".
Its sampler ranks positions by the tempered probability, dllm_fast's generate by the unscaled one (LLaDA's), so at
T != 1 the rollouts' order differs, while x_hat is an exact sample of softmax(logits / T) in both.

The target x_hat_t is not the final completion: positions still masked after step t hold samples that were later
discarded, so the step batch stores it (`StepBatch`). Separable: one term per (row, position), one scoring pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from dllm_fast.contracts import RolloutBatch, completion_mask, unwrap_model
from dllm_fast.likelihood import MaskSpec, sample_masks
from dllm_fast.objectives.advantages import group_advantages
from dllm_fast.objectives.base import (InnerUpdate, LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped,
                                       clipped_surrogate, mask_defaults)
from dllm_fast.objectives.justgrpo import tempered
from dllm_fast.validation import check_choice, check_float, check_int

STEP_ADVANTAGES = ("official", "reward", "future_mean", "difference")
TOP_K_PER = ("rollout", "batch")
CONFIDENCES = ("policy", "recorded")
# The official code's guard on the masked count (mdpo_trainer.py L1512, L1532).
MASKED_EPSILON = 1e-4


@dataclass
class MDPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="recorded_state", count="all")
    scale_rewards: bool = True  # per step over the group, unbiased std + 1e-4 (mdpo_trainer.py L849-858)
    std_epsilon: float = 1e-4
    epsilon: float = field(default=0.2, metadata={"help": "PPO clip range"})
    beta: float = field(default=0.02, metadata={"help": "k2 KL coefficient against the reference (0: none)"})
    top_k_steps: int = field(default=8, metadata={"help": "denoising steps trained on per rollout (largest |A|)"})
    top_k_per: str = field(default="rollout", metadata={"help": "rollout (official: each its own k steps) or batch "
                                                                "(DARE: one set of steps for the batch)"})
    step_advantage: str = field(default="official", metadata={"help": "official ((r_t - r_t-1) + 1 + future mean), "
                                                                      "reward, future_mean or difference"})
    learner_temperature: float | None = field(default=None, metadata={
        "help": "the learner's softmax temperature (none: the rollout's, official; DARE: 1.0)"})
    confidence: str = field(default="policy", metadata={"help": "the loss weight: policy (p_T of the sample, "
                                                                "official) or recorded (generate's confidence)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.advantage != "mean":
            raise ValueError(f"mdpo's advantage is its own per-step z-score (step_advantage=); advantage="
                             f"{self.advantage!r} does not apply: leave it at 'mean'.")
        if not self.scale_rewards or self.population_std:
            raise ValueError("mdpo z-scores each step's advantages with the unbiased std (scale_rewards=True, "
                             "population_std=False); set std_epsilon to change the guard.")
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="k2 KL coefficient; 0 drops the reference")
        check_int("top_k_steps", self.top_k_steps, minimum=1, hint="the official sample_train_steps (8 or 16)")
        check_choice("top_k_per", self.top_k_per, TOP_K_PER)
        check_choice("step_advantage", self.step_advantage, STEP_ADVANTAGES)
        if self.learner_temperature is not None:
            check_float("learner_temperature", self.learner_temperature, minimum=0.0, open_minimum=True,
                        hint="the learner's softmax temperature, or None for the rollout's")
        check_choice("confidence", self.confidence, CONFIDENCES)


@dataclass(frozen=True, eq=False)
class StepBatch(RolloutBatch):
    """The rows MDPO trains on: one per selected (rollout n, forward t), built by `MDPO.step_batch`.

    sequences: [prompt of n, x_hat_nt]; completion_mask: up to x_hat's first EOS; rewards: r_nt, the reward of
    x_hat_nt; unmask_step: n's steps re-based on t (unmask_step - t + 1, clamped at 0: 0 marks the positions x_t
    holds, >= 1 the masked ones, in their decoding order), forwards K + 1; group_size: G k, a prompt's rows.
    step_advantages: [N'] float64 A_nt; step_confidence: [N', L] the recorded confidences at x_t's masked
    positions; source_row, step: [N'] int64 the rollout and the forward of each row; rollouts: N, the loss's
    normaliser; rollout_temperature: T_s, the learner's default temperature.
    """

    step_advantages: torch.Tensor | None = None
    step_confidence: torch.Tensor | None = None
    source_row: torch.Tensor | None = None
    step: torch.Tensor | None = None
    rollouts: int = 0
    rollout_temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        N, L = self.num_rollouts, self.completion_length
        for name, shape in (("step_advantages", (N,)), ("step_confidence", (N, L)), ("source_row", (N,)),
                            ("step", (N,))):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                raise ValueError(f"StepBatch.{name} must be a {list(shape)} tensor; build the batch with "
                                 "MDPO.step_batch(...).")
        if self.unmask_step is None:
            raise ValueError("StepBatch.unmask_step (the re-based steps) is required; build the batch with "
                             "MDPO.step_batch(...).")
        check_int("StepBatch.rollouts", self.rollouts, minimum=1)

    def groups(self, start: int, end: int) -> "StepBatch":
        """Prompt groups [start, end) (each the G k rows of one prompt's rollouts) as a step batch of their own."""
        part = super().groups(start, end)
        rows = slice(start * self.group_size, end * self.group_size)
        per_rollout = self.num_rollouts // self.rollouts  # k
        return dataclasses.replace(self, **{f.name: getattr(part, f.name) for f in dataclasses.fields(RolloutBatch)},
                                   step_advantages=self.step_advantages[rows],
                                   step_confidence=self.step_confidence[rows], source_row=self.source_row[rows],
                                   step=self.step[rows], rollouts=part.num_rollouts // per_rollout)

    def to(self, device) -> "StepBatch":
        moved = super().to(device)
        return dataclasses.replace(self, **{f.name: getattr(moved, f.name) for f in dataclasses.fields(RolloutBatch)},
                                   step_advantages=self.step_advantages.to(device),
                                   step_confidence=self.step_confidence.to(device),
                                   source_row=self.source_row.to(device), step=self.step.to(device))


def step_advantages(step_rewards: torch.Tensor, group_size: int, *, variant: str = "official",
                    std_epsilon: float = 1e-4) -> torch.Tensor:
    """[N, K] rewards of each rollout's K one-step predictions -> [N, K] float64 MDPO advantages: a_nt by
    `variant` (see the module docstring), z-scored per step over each group of `group_size` rows (unbiased std
    + std_epsilon; a group of one, or of equal a, gets 0)."""
    check_choice("variant", variant, STEP_ADVANTAGES)
    r = step_rewards.double()
    N, K = r.shape
    later = r.flip(-1).cumsum(-1).flip(-1)  # sum_{s >= t} r_s
    count = torch.arange(K, 0, -1, dtype=torch.float64, device=r.device)  # K - t
    if variant == "reward":
        a = r
    elif variant == "future_mean":
        a = later / count
    else:
        previous = torch.cat([torch.zeros_like(r[:, :1]), r[:, :-1]], dim=-1)
        a = r - previous + 1.0
        if variant == "official":
            future = torch.where(count > 1, (later - r) / (count - 1).clamp_min(1), r)  # F_K-1 = r_K-1
            a = a + future
    # each step's column z-scored over the groups: step-major rows keep every group contiguous
    columns = group_advantages(a.t().reshape(-1), group_size, scale="std", std_epsilon=std_epsilon)
    return columns.view(K, N).t()


def select_steps(advantages: torch.Tensor, k: int, *, per: str = "rollout") -> torch.Tensor:
    """[N, K] advantages -> [N, min(k, K)] int64: the steps trained on, in step order. per "rollout": each row's
    k steps of largest |A| (official, mdpo_trainer.py L922); "batch": the k steps of largest sum_n |A_nt|, the
    same for every row (DARE's select_top_k_steps). Ties go to the earlier step."""
    check_choice("per", per, TOP_K_PER)
    N, K = advantages.shape
    k = min(k, K)
    size = advantages.abs()
    if per == "batch":
        size = size.sum(0, keepdim=True).expand(N, K)
    chosen = torch.argsort(-size, dim=-1, stable=True)[:, :k]
    return chosen.sort(dim=-1).values


class MDPO(Objective):
    name = "mdpo"
    Config = MDPOConfig
    uses_old_policy = True
    separable = True
    # The rollouts record every forward's one-step prediction (generate(..., record_step_predictions=True)), the
    # trainer rewards each and trains on `step_batch(...)` instead of the rollout batch.
    needs_step_predictions = True

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def check_rollouts(self, config) -> None:
        if self.config.learner_temperature is None and config.temperature <= 0:
            raise ValueError("mdpo's learner divides the logits by the rollout's temperature (learner_temperature "
                             "None, the official code), and the rollouts are greedy (temperature 0); sample them "
                             "(--temperature 0.4, the official recipe's) or set learner_temperature (e.g. 1.0).")

    # -- the step batch ----------------------------------------------------------------------------------------
    def step_batch(self, batch: RolloutBatch, step_predictions: torch.Tensor, step_confidence: torch.Tensor,
                   step_rewards: torch.Tensor, *, eos_token_id: int, rollout_temperature: float) -> StepBatch:
        """The rows to train on, from the rollouts (`batch`, with unmask_step), their record (step_predictions
        and step_confidence [N, K, L], GenerationResult's) and the rewards of every prediction [N, K]: each
        rollout's selected steps (module docstring), x_hat_t given x_t. eos_token_id: the model's (x_hat's
        completion mask); rollout_temperature: the rollouts' T, the learner's unless learner_temperature is set."""
        if not isinstance(batch, RolloutBatch) or batch.unmask_step is None:
            raise ValueError("mdpo's step batch needs the rollouts with unmask_step: roll out with "
                             "generate(..., record_step_predictions=True) and RolloutBatch.from_generation.")
        N, L = batch.num_rollouts, batch.completion_length
        if step_predictions.dim() != 3 or tuple(step_predictions.shape[::2]) != (N, L):
            raise ValueError(f"step_predictions must be [N, K, L] = [{N}, K, {L}] (GenerationResult.step_predictions"
                             f"), got {tuple(step_predictions.shape)}.")
        K = step_predictions.shape[1]
        for name, value in (("step_confidence", step_confidence), ("step_rewards", step_rewards)):
            expected = (N, K, L) if name == "step_confidence" else (N, K)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
                raise ValueError(f"{name} must be a {list(expected)} tensor, one per recorded step, got "
                                 f"{tuple(getattr(value, 'shape', ())) or type(value).__name__}.")
        c = self.config
        device = batch.sequences.device
        advantages = step_advantages(step_rewards.to(device), batch.group_size, variant=c.step_advantage,
                                     std_epsilon=c.std_epsilon)
        steps = select_steps(advantages, c.top_k_steps, per=c.top_k_per)  # [N, k]
        k = steps.shape[1]
        rows = torch.arange(N, device=device).repeat_interleave(k)
        step = steps.reshape(-1)
        predicted = step_predictions.to(device)[rows, step]  # [N k, L]
        P = batch.prompt_length
        rebased = (batch.unmask_step[rows] - step[:, None] + 1).clamp_min(0)
        mask = None if batch.attention_mask is None else batch.attention_mask[rows]
        return StepBatch(
            sequences=torch.cat([batch.sequences[rows, :P], predicted.to(batch.sequences.dtype)], dim=1),
            attention_mask=mask, prompt_length=P,
            completion_mask=completion_mask(predicted, eos_token_id),
            rewards=step_rewards.to(device=device, dtype=batch.rewards.dtype)[rows, step],
            group_size=batch.group_size * k, unmask_step=rebased, forwards=K + 1,
            step_advantages=advantages[rows, step], step_confidence=step_confidence.to(device)[rows, step],
            source_row=rows, step=step, rollouts=N, rollout_temperature=float(rollout_temperature))

    # -- the loss ------------------------------------------------------------------------------------------------
    def advantages(self, batch):
        return _step_batch(batch).step_advantages.double()

    def draw_masks(self, batch, *, generator, eos_token_id, model_block_length=None):
        batch = _step_batch(batch)
        return sample_masks(batch.sequences, self.config.masks, prompt_length=batch.prompt_length,
                            generator=generator, eos_token_id=eos_token_id, attention_mask=batch.attention_mask,
                            unmask_step=batch.unmask_step)

    def extra(self, batch, masks):
        masked = masks.targets[:, 0].sum(-1).double()  # |M_t| of each row
        confidence = _step_batch(batch).step_confidence.to(masks.weight.device)
        return {"masked": masked, "confidence": confidence, "rollouts": float(_step_batch(batch).rollouts),
                "length": float(masks.completion_length)}

    def token_terms(self, lp, old, ref, advantage, target, confidence):
        """Per-token loss terms (0 off the targets) and the ratio, for rows lp [b, L] with [b, 1] advantage."""
        c = self.config
        ratio = torch.exp(lp - old)
        surrogate = clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon)
        weight = torch.exp(old) if c.confidence == "policy" else confidence
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        kl = 0.5 * (ref - lp) ** 2 if ref is not None else zero
        return surrogate, torch.where(target, weight, zero), kl, ratio

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        target = inputs.masks.targets[sequence, sample]
        old = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample].to(lp_pairs.dtype)
        ref = inputs.lp_ref[sequence, sample].to(lp_pairs.dtype) if self.config.beta > 0 else None
        advantage = inputs.advantage(lp_pairs)[sequence, None]
        confidence = inputs.extra["confidence"][sequence].to(lp_pairs.dtype)
        surrogate, weight, kl, _ = self.token_terms(lp_pairs, old, ref, advantage, target, confidence)
        masked = inputs.extra["masked"].to(lp_pairs.dtype)[sequence, None] + MASKED_EPSILON
        scale = inputs.extra["length"] / masked  # lambda_t
        terms = weight * (-surrogate * scale + self.config.beta * kl) / masked
        return terms.sum() / inputs.extra["rollouts"]

    def stats(self, lp, inputs):
        target = inputs.masks.targets
        old = inputs.old(lp)
        ratio = torch.exp(lp - old)
        advantage = inputs.advantage(lp)[:, None, None].expand_as(lp)
        clip = clipped(ratio, advantage, self.config.epsilon, self.config.epsilon) & target
        tokens = target.sum().clamp_min(1)
        batch = _step_batch(inputs.batch)
        out = {"ratio_mean": ratio[target].mean(), "ratio_max": ratio[target].max(),
               "clip_fraction": clip.sum() / tokens, "step_reward_mean": batch.rewards.double().mean(),
               "masked_per_step": inputs.extra["masked"].mean(), "steps_per_rollout":
                   torch.tensor(batch.num_rollouts / batch.rollouts, dtype=torch.float64)}
        if inputs.lp_ref is not None:
            out["kl_ref"] = (0.5 * (inputs.lp_ref.to(lp.dtype) - lp) ** 2)[target].sum() / tokens
        return out

    # -- the learner's temperature: every policy scored at it (current, old, reference) --------------------------
    def learner_temperature(self, batch) -> float:
        """T_s: learner_temperature, or (None) the rollouts' temperature the step batch carries."""
        given = self.config.learner_temperature
        return _step_batch(batch).rollout_temperature if given is None else given

    def plan_updates(self, model, batch, **kwargs):
        with tempered(model, self.learner_temperature(batch)):
            return super().plan_updates(model, batch, **kwargs)

    def backward(self, model, batch, update=None, *, micro_batch, generator=None, lp_ref=None, ref_model=None,
                 hooks=None):
        if update is None:  # the masks are the recorded states: nothing to draw at random
            update = InnerUpdate(self.draw_masks(batch, generator=generator or torch.Generator(),
                                                 eos_token_id=getattr(unwrap_model(model), "eos_token_id", None)))
        if self.needs_reference and lp_ref is None:  # scored here, each policy tempered once
            lp_ref = self.reference_lp(model, batch, update.masks, micro_batch=micro_batch, ref_model=ref_model)
        with tempered(model, self.learner_temperature(batch)):
            return super().backward(model, batch, update, micro_batch=micro_batch, lp_ref=lp_ref,
                                    ref_model=ref_model, hooks=hooks)

    def reference_lp(self, model, batch, masks, *, micro_batch, ref_model=None):
        # the reference model, or (PEFT) the policy with its adapters disabled, at the learner's temperature
        with tempered(model if ref_model is None else ref_model, self.learner_temperature(batch)):
            return super().reference_lp(model, batch, masks, micro_batch=micro_batch, ref_model=ref_model)


def _step_batch(batch) -> StepBatch:
    if not isinstance(batch, StepBatch):
        raise TypeError(f"mdpo trains on the step batch of its rollouts (objectives.mdpo.StepBatch, from "
                        f"MDPO.step_batch(batch, result.step_predictions, result.step_confidence, step_rewards, "
                        f"eos_token_id=..., rollout_temperature=T)), got {type(batch).__name__}: roll out with "
                        "generate(..., record_step_predictions=True) and reward every step.")
    return batch
