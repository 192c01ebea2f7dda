"""dllm_fast as verl's actor engine (verl 0.9): `actor_rollout_ref.model.model_type=dllm_fast` trains a masked
diffusion LM with any dllm_fast objective, its paper's estimator intact, inside verl's own PPO dataflow.

    register_engine()   # what dllm_fast's verl plugin calls in every process that imports verl

    actor_rollout_ref.model.path=DIR                       # a dllm_fast checkpoint (LLaDA, Dream, SDAR, LLaDA2) or
                                                           #   an HF diffusion LM (dllm_fast's HF adapter)
    actor_rollout_ref.model.model_type=dllm_fast           # this engine, from verl's EngineRegistry
    actor_rollout_ref.actor.strategy=fsdp2
    +actor_rollout_ref.model.override_config.dllm_fast.objective=espo     # the section: settings.py
    algorithm.adv_estimator=grpo  algorithm.norm_adv_by_std_in_grpo=false  trainer.balance_batch=false

This module imports verl; only verl's processes import it (`dllm_fast.integrations.verl` itself does not).

What runs where (verl's PPO step, per data-parallel rank):
- building (`initialize`): the policy through dllm_fast's loaders (`models.loading.load_model`, every rank
  reading the checkpoint, then sharding it in place), wrapped as a
  `transformers.PreTrainedModel` (`DiffusionPreTrainedModel`, which verl's checkpoints need), with LoRA through
  dllm_fast's `add_lora` when `actor_rollout_ref.model.lora_rank > 0` (on the family's modules; verl's
  `target_modules="all-linear"` means all of them), sharded by FSDP2 over the model's own units
  (`shard_units()`, the LM head in the root's unit: the fused ops read it after the forward), in verl's mixed
  precision (`actor.fsdp_config.mixed_precision`, whose dtypes may also be fp64). The reference policy, where the
  objective has a reference term (rspo; espo, diffu_grpo and coupled_grpo with beta > 0), is a second frozen copy
  of the initial weights sharded the same way, or with LoRA the policy with its adapters disabled. verl's optimizer,
  its gradient clipping, LR schedule and checkpoints (`FSDPEngine`'s own) are untouched.
- old-policy scoring (verl's `compute_log_prob`, `forward_backward_batch(forward_only=True)`): the objective's own
  masks for every row (its sampler and n_t; each row's masks from a generator seeded by the section's seed and the
  row's uid and tokens, `batch.row_masks`, so that every rank, every micro-batch split and the update draw the same
  ones), scored with `likelihood.score`. The lp of each row is kept on this worker, keyed by the row, for the
  updates that come after the policy has moved. verl gets back, as `log_probs`, each token's share of the ELBO
  estimate (`batch.per_token`), and, where verl asks (`calculate_entropy`, as its trainer does for
  `actor/entropy`), each response position's predictive entropy averaged over the samples that score it, from the
  same model calls (entropy.py).
- update (`forward_backward_batch(data, loss_function)`, once per verl mini-batch): the rows regrouped by uid into
  whole prompt groups, across the data-parallel ranks where verl's dispatch split them (`_whole_groups`: verl's V1
  trainer balances a step's rows over the ranks by length, whatever their prompt; a group cut by verl's
  mini-batches is refused, naming the settings), the same masks drawn again, and `Objective.backward` on the whole
  mini-batch of this rank: the exact streaming gradient, memory set by the pairs per backward graph and flat in
  n_t, one or two passes as the objective needs, each backward reduce-scattering into FSDP2's sharded gradients
  (which accumulate there; no rank holds a whole gradient). Before the
  policy has moved (verl's first mini-batch) the update is on-policy (ratios exactly 1, dllm_fast's convention);
  after an optimizer step it reads the old policy's lp kept by the scoring. The reference is scored on the same
  masks. The objective's advantages come from verl's rewards (`token_level_rewards` summed per row) within each
  group and must equal verl's `advantages` (`settings.check_advantages`), so that the advantage estimator verl
  logs is the one trained on.
- batch keys: verl's own, padded (the legacy trainer) or nested (V1) (batch.py); trajectory objectives (tracerl)
  also read `dllm_fast_unmask_step`, the decoding order the rollout records, and optionally
  `dllm_fast_rollout_forwards`; dllm_fast's verl rollout puts them in the batch (batch_keys.py).

Micro-batching: verl's setting sets the memory, dllm_fast's engine runs it. Each update is one `Objective.backward`
over the rank's mini-batch (so wd1's group softmax and rspo's batch centring see what the trainer's see), its
backward graphs holding `ppo_micro_batch_size_per_gpu` rows' samples (x n_t pairs), or with dynamic batch sizes
`ppo_max_token_len_per_gpu` tokens' worth; `override_config.dllm_fast.micro_batch` sets the pairs directly. Old-
policy scoring takes `log_prob_micro_batch_size_per_gpu` likewise.

Refused, each naming the setting (settings.py, `check_verl_config` for the whole config in the driver):
unknown objectives or options, a model type no dllm_fast loader reads, FSDP1 (`strategy=fsdp`), sequence
parallelism, verl's loss settings the objective replaces (`loss_agg_mode`, the PPO clip ratios, `loss_scale_factor`,
`policy_loss.loss_mode`), verl's KL loss and entropy bonus, rollout-correction weights, a rollout temperature given
twice with two values, advantages that differ from the objective's, mini-batches that cut prompt groups, and a
verl other than 0.9.x.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections import Counter
from pathlib import Path

import torch
from packaging.version import Version

try:
    import verl
except ImportError as error:  # the plugin imports this module only where verl is installed
    raise ImportError("dllm_fast.integrations.verl.engine is dllm_fast's actor engine for verl and needs verl>=0.9,"
                      f"<0.10 (see docs/integrations.md for the venv); dllm_fast itself does not. ({error})") from error
from verl.utils.fsdp_utils import CPUOffloadPolicy, MixedPrecisionPolicy, apply_fsdp2
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from dllm_fast.integrations.verl.batch import (FORWARDS_KEY, UNMASK_STEP_KEY, per_token, portable_rows, row_masks,
                                               rows_from_verl, rows_of_portable, share_of_groups, uid_list,
                                               verl_advantages, verl_token_values)
from dllm_fast.integrations.verl.entropy import score_with_entropy
from dllm_fast.integrations.verl.model_types import SECTION, register_model_types
from dllm_fast.integrations.verl.settings import (MODEL_TYPE, SECTION_PATH, EngineSettings, advantage_estimator_for,
                                                  check_actor_settings)
from dllm_fast.likelihood import BackwardHooks, MicroBatching, score
from dllm_fast.models.hf_pretrained import DiffusionPreTrainedModel
from dllm_fast.objectives import InnerUpdate

SUPPORTED_VERL = (Version("0.9"), Version("0.10"))  # [low, high)
DTYPES = {"fp64": torch.float64, "float64": torch.float64, "double": torch.float64, "fp32": torch.float32,
          "float32": torch.float32, "float": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
ADVANTAGE_TOLERANCE = 1e-5  # verl computes advantages in fp32


def check_verl_version(version: str | None = None) -> None:
    """Refuse a verl outside the versions this engine is written against (its FSDPEngine's build steps)."""
    version = verl.__version__ if version is None else version
    low, high = SUPPORTED_VERL
    if not low <= Version(version) < high:
        raise RuntimeError(f"verl {version} is installed, but dllm_fast's actor engine is written against verl "
                           f"{low}.x (its EngineRegistry and FSDPEngine build steps); install verl>={low},<{high}.")


def register_engine() -> type:
    """Register the engine with verl's EngineRegistry for model_type "dllm_fast" (backends fsdp and fsdp2, devices
    cuda and cpu; fsdp is refused with the reason when built) and dllm_fast's model types with transformers'
    AutoConfig; idempotent. Returns the engine class."""
    check_verl_version()
    register_model_types()
    known = EngineRegistry._engines.get(MODEL_TYPE, {})
    if all(known.get(backend, {}).get(device) is DllmFastEngine for backend in ("fsdp", "fsdp2")
           for device in ("cuda", "cpu")):
        return DllmFastEngine
    EngineRegistry.register(model_type=MODEL_TYPE, backend=["fsdp", "fsdp2"], device=["cuda", "cpu"])(DllmFastEngine)
    return DllmFastEngine


def model_dtype(name, what: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{what}={name!r} is not a dtype the dllm_fast engine knows ({', '.join(DTYPES)}).")
    return DTYPES[name]


class OldPolicyScores:
    """What `compute_log_prob` leaves for the updates of this batch: each row's lp on its masks (by row key), the
    optimizer steps taken when it was scored, and every prompt's group size over all data-parallel ranks."""

    def __init__(self, lp_by_key: dict, optimizer_steps: int, group_sizes: Counter):
        self.lp_by_key, self.optimizer_steps, self.group_sizes = lp_by_key, optimizer_steps, group_sizes

    def lp(self, keys: list[bytes], uids: list[str], like: torch.Tensor) -> torch.Tensor:
        missing = [uid for key, uid in zip(keys, uids) if key not in self.lp_by_key]
        if missing:
            raise RuntimeError(f"a row of prompt {missing[0]!r} reached the update after an optimizer step, but verl's "
                               "compute_log_prob did not score it on this rank: the old policy's log-probs are kept "
                               "where they were scored. Keep verl's dispatch of the batch unchanged between "
                               "compute_log_prob and update_actor.")
        return torch.stack([self.lp_by_key[key] for key in keys]).to(like.device)


class DllmFastEngine(FSDPEngine):
    """verl's FSDP engine with dllm_fast's model, scoring and update (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        self.settings = EngineSettings.from_section((model_config.override_config or {}).get(SECTION),
                                                    default_seed=engine_config.seed)
        self.objective = self.settings.objective
        strategy = engine_config.strategy
        if strategy != "fsdp2":
            raise ValueError(f"actor_rollout_ref.actor.strategy={strategy!r}: the dllm_fast engine shards with FSDP2 "
                             "(its fused LM head reads the head's weight outside the forward, which FSDP1's flat "
                             "parameters do not allow); set actor_rollout_ref.actor.strategy=fsdp2.")
        if engine_config.ulysses_sequence_parallel_size > 1:
            raise ValueError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size="
                             f"{engine_config.ulysses_sequence_parallel_size}: the dllm_fast engine does not split "
                             "sequences (every masked copy attends to the whole sequence); set it to 1.")
        if model_config.enable_activation_offload:
            raise ValueError("actor_rollout_ref.model.enable_activation_offload=true hooks verl's activation offload "
                             "into HF decoder layers, which dllm_fast's models are not; set it to false (gradient "
                             "checkpointing, enable_gradient_checkpointing, is supported).")
        if getattr(model_config, "lora_adapter_path", None):
            raise ValueError("actor_rollout_ref.model.lora_adapter_path: the dllm_fast engine adds fresh LoRA adapters "
                             "(lora_rank); loading a trained adapter is not supported.")
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.reference = None
        self.optimizer_steps = 0  # steps actually taken (a refused non-finite gradient takes none)
        self.old_policy: OldPolicyScores | None = None

    # -- building: the steps of verl's FSDPEngine._build_model_optimizer ---------------------------------------
    def _dtype(self) -> torch.dtype:
        name = self.engine_config.model_dtype
        if name is None:
            name = "fp32" if not self.engine_config.forward_only else "bf16"
        return model_dtype(name, "actor_rollout_ref.actor.fsdp_config.model_dtype")

    def _build_module(self):
        """The dllm_fast model of actor_rollout_ref.model.path, wrapped as a PreTrainedModel for verl."""
        model = load_diffusion_lm(self.model_config, self._dtype())
        if self.model_config.enable_gradient_checkpointing and hasattr(model, "set_gradient_checkpointing"):
            model.set_gradient_checkpointing(True)
        module = DiffusionPreTrainedModel(model)
        # verl's FSDP2 policy shards the classes named in _no_split_modules as units (the model's own units), and
        # embeddings and modules named lm_head apart unless the config says the two are tied. dllm_fast's fused
        # ops read the LM head after the forward, so, as for a tied head, it must stay in the root's unit.
        module._no_split_modules = sorted({type(unit).__name__ for unit in model.shard_units()}) if hasattr(
            model, "shard_units") else None
        module.config.tie_word_embeddings = True
        return module

    def _build_lora_module(self, module):
        """LoRA adapters through dllm_fast's add_lora (the family's modules), rank and alpha from verl's model
        config; target_modules "all-linear" (verl's default) means every module the family allows."""
        from dllm_fast.train.precision import add_lora
        from dllm_fast.train.settings import LoraSettings

        targets = self.model_config.target_modules
        if targets in (None, "all-linear"):
            targets = None
        elif isinstance(targets, str):
            targets = [targets]
        lora = LoraSettings(enabled=True, rank=self.model_config.lora_rank, alpha=self.model_config.lora_alpha,
                            targets=None if targets is None else list(targets))
        try:
            module.diffusion_lm = add_lora(module.diffusion_lm, types.SimpleNamespace(lora=lora))
        except (ValueError, TypeError) as error:
            raise type(error)(f"actor_rollout_ref.model.target_modules={self.model_config.target_modules!r}: "
                              f"{error}") from None
        return module

    def _mixed_precision(self) -> tuple[torch.dtype, torch.dtype]:
        settings = self.engine_config.mixed_precision or {}
        where = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
        return (model_dtype(settings.get("param_dtype", "bf16"), f"{where}.param_dtype"),
                model_dtype(settings.get("reduce_dtype", "fp32"), f"{where}.reduce_dtype"))

    def _build_fsdp_module(self, module):
        """FSDP2 over the model's units, in verl's mixed precision (its dtypes extended with fp64)."""
        param_dtype, _ = self._mixed_precision()
        self._autocast_dtype = param_dtype
        self.scaler = None
        if param_dtype == torch.float16:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(growth_interval=400)
        offload = bool(self.engine_config.offload_policy or self.engine_config.forward_only)
        if offload:
            self._is_offload_param = self._is_offload_optimizer = False
            self._uses_fsdp2_cpu_offload_policy = True
        return self._shard(module, offload=offload)

    def _shard(self, module, *, offload: bool):
        param_dtype, reduce_dtype = self._mixed_precision()
        offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else None
        # reshard_after_forward None is FSDP2's own choice: the units reshard after their forward, the root does not.
        # The root's unit holds the LM head, which the fused ops read after the forward (an explicit True, verl's
        # default, would reshard the root too and leave the head sharded there).
        # cast_forward_inputs=False: a unit's float inputs are the activations (already in the parameters' dtype)
        # and the RoPE tables, which stay in fp32 (or fp64) whatever the activations' dtype; casting them would
        # round the angles to bf16, which the fused RoPE refuses.
        kwargs = {"mesh": self.device_mesh, "offload_policy": offload_policy,
                  "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                    cast_forward_inputs=False),
                  "reshard_after_forward": None if self.engine_config.reshard_after_forward else False}
        # Every rank read the whole checkpoint, so sharding in place leaves each rank its rows: no broadcast from
        # rank 0 (verl's fsdp2_load_full_state_dict cannot fill the parts of dllm_fast's fused weights on a meta
        # skeleton, which load through their own _load_from_state_dict).
        apply_fsdp2(module, kwargs, self.engine_config)
        module.register_state_dict_post_hook(_own_storage)
        return module

    def initialize(self):
        super().initialize()
        if self.objective.needs_reference and not self._is_lora:
            reference = self._build_module().requires_grad_(False)
            self.reference = self._shard(reference, offload=False).eval()

    def optimizer_step(self):
        grad_norm = super().optimizer_step()
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer_steps += 1
        return grad_norm

    def disable_adapter(self):
        inner = self.module.diffusion_lm
        return inner.disable_adapter() if hasattr(inner, "disable_adapter") else contextlib.nullcontext()

    # -- scoring and update ------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _autocast(self):
        dtype = getattr(self, "_autocast_dtype", torch.float32)
        if dtype in (torch.bfloat16, torch.float16):
            return torch.autocast(device_type=self._device().type, dtype=dtype)
        return contextlib.nullcontext()

    def _pairs_per_graph(self, data, n_t: int, sequence_length: int) -> int:
        """(sequence, sample) pairs per model call: the section's micro_batch, else verl's micro-batch rows times
        n_t, or with dynamic batch sizes verl's token budget in whole sequences."""
        if self.settings.micro_batch is not None:
            return self.settings.micro_batch
        if _non_tensor(data, "use_dynamic_bsz", False):
            tokens = _non_tensor(data, "max_token_len_per_gpu", None)
            if tokens is None:
                raise ValueError("use_dynamic_bsz=true needs actor_rollout_ref.actor.ppo_max_token_len_per_gpu (and "
                                 "rollout.log_prob_max_token_len_per_gpu), or set "
                                 f"{SECTION_PATH}.micro_batch.")
            return max(1, int(tokens) // sequence_length)
        rows = _non_tensor(data, "micro_batch_size_per_gpu", None)
        if rows is None:
            raise ValueError("set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (and "
                             f"rollout.log_prob_micro_batch_size_per_gpu), or {SECTION_PATH}.micro_batch.")
        return max(1, int(rows)) * n_t

    def _rows(self, data, *, grouped: bool, group_sizes=None):
        core = self.module
        return rows_from_verl(data, eos_token_id=core.eos_token_id, device=self._device(), grouped=grouped,
                              group_sizes=group_sizes, unmask_step=self.objective.needs_unmask_step)

    def forward_backward_batch(self, data, loss_function=None, forward_only=False):
        if forward_only:
            return self._score_old_policy(data)
        return self._update(data, loss_function)

    def _score_old_policy(self, data):
        """verl's compute_log_prob: the objective's masks, the policy's lp on them (kept for the updates after an
        optimizer step), each token's share of the ELBO for verl, and the group sizes over all ranks."""
        rows = self._rows(data, grouped=False)
        masks = row_masks(self.objective, rows.batch, rows.keys, seed=self.settings.seed, model=self.module)
        batching = MicroBatching(self._pairs_per_graph(data, masks.n_t, rows.batch.sequences.shape[1]))
        entropy = None
        with torch.no_grad(), self._autocast():
            if bool(_non_tensor(data, "calculate_entropy", False)):  # as verl's own engine: only when asked
                lp, entropy = score_with_entropy(self.module, rows.batch.sequences, masks, micro_batch=batching,
                                                 attention_mask=rows.batch.attention_mask)
            else:
                lp = score(self.module, rows.batch.sequences, masks, micro_batch=batching,
                           attention_mask=rows.batch.attention_mask)
        self.old_policy = OldPolicyScores({key: lp[k] for k, key in enumerate(rows.keys)}, self.optimizer_steps,
                                          self._global_group_sizes(uid_list(data)))
        output = {"log_probs": verl_token_values(per_token(lp, masks), rows)}
        if entropy is not None:
            output["entropy"] = verl_token_values(entropy, rows)
        return {"model_output": output, "loss": [0.0], "metrics": {}}

    def _global_group_sizes(self, uids: list[str]) -> Counter:
        counts = Counter(uids)
        group = self.get_data_parallel_group()
        if torch.distributed.get_world_size(group) == 1:
            return counts
        gathered = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, counts, group=group)
        return sum(gathered, Counter())

    def _update(self, data, loss_function):
        """One verl mini-batch on this rank: the objective's exact gradient on its masks (module docstring)."""
        self._check_update(data, loss_function)
        if self.old_policy is None:
            raise RuntimeError("the dllm_fast engine's update ran before verl's compute_log_prob scored this batch: "
                               "the objective's masks and the old policy's log-probs come from that scoring. Keep "
                               "algorithm.rollout_correction.bypass_mode off.")
        moved = self.optimizer_steps != self.old_policy.optimizer_steps
        needs_old = moved and self.objective.uses_old_policy
        groups, lp_old = self._whole_groups(data, needs_old)
        rows = self._rows(groups, grouped=True, group_sizes=self.old_policy.group_sizes)
        batch = rows.batch
        if self.settings.check_advantages:
            self._check_advantages(groups, rows)
        masks = row_masks(self.objective, rows.batch, rows.keys, seed=self.settings.seed, model=self.module)
        if needs_old:
            lp_old = (self.old_policy.lp(rows.keys, rows.uids, batch.sequences) if lp_old is None
                      else torch.stack([lp_old[i] for i in rows.order]).to(batch.sequences.device))
        batching = MicroBatching(self._pairs_per_graph(data, masks.n_t, batch.sequences.shape[1]))
        with self._autocast():
            lp_ref = self._reference_lp(batch, masks, batching) if self.objective.needs_reference else None
            scaler = self.scaler
            hooks = BackwardHooks(backward=(lambda loss: scaler.scale(loss).backward()) if scaler is not None else None)
            out = self.objective.backward(self.module, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=batching,
                                          lp_ref=lp_ref, hooks=hooks)
        metrics = {f"dllm_fast/{name}": [value] for name, value in out.stats.items()}
        metrics["dllm_fast/policy_moved"] = [float(moved)]  # since the old policy was scored
        return {"model_output": {}, "loss": [float(out.loss)], "metrics": metrics}

    def _whole_groups(self, data, needs_old: bool):
        """With several data-parallel ranks, this rank's share of the ranks' mini-batch as whole prompt groups:
        verl's V1 trainer spreads a step's rows over the ranks by length whatever their prompt, so each rank sends
        its rows (tokens, reward, verl's advantage, the rollout's decoding order, and after an optimizer step the
        old policy's lp it scored) to every rank, which takes the same number of whole groups
        (`batch.share_of_groups`; its own rows where they already are whole groups). Exact: the rows, their masks
        (seeded by the row) and old lp are the same wherever a row is trained, and FSDP2 averages the ranks'
        gradients of equal shares. Returns the batch to train on and its old lp by row (None: this rank's own
        store, `OldPolicyScores`), or `data` itself with one rank."""
        group = self.get_data_parallel_group()
        world = torch.distributed.get_world_size(group)
        if world == 1:
            return data, None
        lp_old = None
        if needs_old:
            local = self._rows(data, grouped=False)
            lp_old = self.old_policy.lp(local.keys, local.uids, local.batch.sequences)
        mine = portable_rows(data, rewards=True, advantages=self.settings.check_advantages,
                             unmask_step=self.objective.needs_unmask_step, lp_old=lp_old)
        parts = [None] * world
        torch.distributed.all_gather_object(parts, mine, group=group)
        share = share_of_groups(parts, torch.distributed.get_rank(group), self.old_policy.group_sizes)
        return rows_of_portable(share), ([row["lp_old"] for row in share] if needs_old else None)

    def _reference_lp(self, batch, masks, batching) -> torch.Tensor:
        with torch.no_grad():
            if self.reference is not None:
                return score(self.reference, batch.sequences, masks, micro_batch=batching,
                             attention_mask=batch.attention_mask)
            with self.disable_adapter():
                return score(self.module, batch.sequences, masks, micro_batch=batching,
                             attention_mask=batch.attention_mask)

    def _check_update(self, data, loss_function) -> None:
        """The verl settings the update would silently override, from the actor config verl's loss carries."""
        config = _actor_config(loss_function)
        check_actor_settings(self.objective, config)
        if "rollout_is_weights" in data.keys():
            raise ValueError("the batch carries rollout correction weights (rollout_is_weights), which dllm_fast's "
                             "objectives define none of; disable algorithm.rollout_correction.")
        temperature = self.settings.rollout.get("temperature")
        given = _non_tensor(data, "temperature", None)
        if temperature is not None and given is not None and float(given) != float(temperature):
            raise ValueError(f"{SECTION_PATH}.rollout.temperature={temperature!r} but actor_rollout_ref.rollout."
                             f"temperature={given!r}: give the rollout's temperature once, as verl's.")

    def _check_advantages(self, data, rows) -> None:
        ours = self.objective.advantages(rows.batch).cpu()
        theirs = verl_advantages(data, rows)
        off = (ours - theirs).abs() > ADVANTAGE_TOLERANCE * ours.abs().clamp_min(1.0)
        if bool(off.any()):
            k = int(off.nonzero()[0])
            match = advantage_estimator_for(self.objective)
            fix = (f"set {match}" if match else "no verl estimator computes them: set the objective's options "
                   "(advantage, scale_rewards, std_epsilon, population_std) to grpo's or rloo's")
            c = self.objective.config
            raise ValueError(f"verl's advantage of prompt {rows.uids[k]!r}'s completion is {float(theirs[k]):.6g}, "
                             f"{self.objective.name}'s own {float(ours[k]):.6g} (advantage={c.advantage!r}, "
                             f"scale_rewards={c.scale_rewards}, std_epsilon={c.std_epsilon}, population_std="
                             f"{c.population_std}); the engine trains on the objective's: {fix}, or {SECTION_PATH}"
                             ".check_advantages=false to train on the objective's while verl logs its own.")


def load_diffusion_lm(model_config, dtype: torch.dtype):
    """The model of verl's `actor_rollout_ref.model.path` through dllm_fast's loaders, on the CPU: a dllm_fast
    family's checkpoint, else an HF diffusion LM behind HFDiffusionLM. A path neither loads is refused, naming the
    setting and the model type."""
    from dllm_fast.models.loading import FAMILIES, load_model

    path = Path(model_config.local_path)
    model_type = getattr(model_config.hf_config, "model_type", None)
    if model_type in FAMILIES:
        return load_model(path, dtype=dtype, device="cpu")
    from dllm_fast.models.hf_diffusion import HFDiffusionLM

    try:
        return HFDiffusionLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=model_config.trust_remote_code)
    except (ValueError, TypeError, OSError) as error:
        raise ValueError(f"actor_rollout_ref.model.path={model_config.path!r} has model_type {model_type!r}, which "
                         f"neither a dllm_fast family ({', '.join(FAMILIES)}) nor dllm_fast's HF adapter loads "
                         f"({' '.join(str(error).split())[:300]}).") from None


def _own_storage(module, state_dict, prefix, local_metadata) -> None:
    """State-dict entries that are DTensor views into a larger shard (the parts of dllm_fast's fused weights, e.g.
    LLaDA's k_proj inside fused_qkv) as copies of their own: torch.save, which verl's checkpoints use, cannot save
    a DTensor whose local tensor is such a view."""
    from torch.distributed.tensor import DTensor

    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            local = value.to_local()
            if local.storage_offset() != 0 or local.untyped_storage().nbytes() != local.nbytes:
                state_dict[key] = DTensor.from_local(local.clone(), value.device_mesh, value.placements,
                                                     shape=value.shape, stride=value.stride())


def _actor_config(loss_function):
    """The ActorConfig verl's actor binds into its loss (functools.partial(ppo_loss, config=...))."""
    config = loss_function.keywords.get("config") if isinstance(loss_function, functools.partial) else None
    name = getattr(getattr(loss_function, "func", loss_function), "__name__", type(loss_function).__name__)
    if config is None or name != "ppo_loss":
        raise ValueError(f"the dllm_fast engine runs its objective's own loss, in place of verl's PPO loss; verl's "
                         f"actor passed {name!r} (distillation and custom actor losses are not supported).")
    return config


def _non_tensor(data, key: str, default):
    if key not in data.keys():
        return default
    value = data[key]
    return getattr(value, "data", value) if not isinstance(value, torch.Tensor) else value


__all__ = ["DllmFastEngine", "FORWARDS_KEY", "MODEL_TYPE", "UNMASK_STEP_KEY", "check_verl_version",
           "load_diffusion_lm", "register_engine"]
