"""One trainer step on fake tensors, phase by phase, as `dllm_fast.train` runs it: the phases are train/step.py's
own functions, the ones the trainer calls, each accounted through their phase hook.

The phases:

1. rollout: `generate` with the configured cache and schedule, under no_grad and the trainer's autocast;
2. old-policy scoring: `Objective.plan_updates` (the old policy's lp for the updates after the first);
3. reference scoring: the reference policy's lp on each update's masks (the base model with its LoRA adapters
   disabled, or the reference copy of a full fine-tune), as `Objective.backward` scores it;
4. inner update: `Objective.backward`, the streaming engine (or, with engine="all_graphs", the whole loss through
   one graph of every pair, the naive way);
5. optimizer step: gradient clipping, AdamW, zeroing the gradients.

Phases 3 to 5 run once per inner update (mu); a phase's memory is its largest peak, its costs the sum. The step
runs in steady state: the optimizer's state exists from the start (a first step allocates it), gradients are None
between updates (the trainer zeroes them to None).

A `Session` builds the fake models once and runs phases at any group size, n_t and micro-batching, so that a
search reuses them (and the replayer's records). What the plan assumes of values the model would compute is in
dllm_fast.planning.fake; rewards alternate 0 and 1 within each group, so every group has a nonzero spread and
every pair a nonzero gradient weight (the most work).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace

import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch
from dllm_fast.likelihood import MicroBatching, score
from dllm_fast.models.merged_lora import merged_for_rollouts
from dllm_fast.ops.backend import chunks_sized_for
from dllm_fast.planning.accounting import CATEGORIES, Accountant, Costs, Target
from dllm_fast.planning.fake import Assumptions, PlanningFakeMode, fake_module, fake_world
from dllm_fast.planning.replay import RecordedWork, Replayer
from dllm_fast.train import step as train_step
from dllm_fast.train.config import TrainConfig, check_block_length, compiles_scoring, take_block_length
from dllm_fast.train.optimizer import build_adamw
from dllm_fast.train.sources import model_source
from dllm_fast.train.precision import Precision, training_models, training_precision

ENGINES = ("streaming", "two_pass", "all_graphs")
# Calls of the policy's model (its base, or the merged copy a LoRA rollout samples through) and of the reference
# copy, without and with autograd, and the tokens they feed: FSDP2 gathers a model's weights per call, expert
# parallelism moves each call's tokens to their experts and back.
MODEL_CALLS = ("policy", "policy_grad", "policy_tokens", "policy_grad_tokens", "reference", "reference_tokens")
PHASES = train_step.PHASES  # rollout, then per step the update phases
UPDATE_PHASES = PHASES[1:]


@dataclass
class PhasePlan:
    """What one phase of the step holds and costs. peak: the most bytes alive at once during the phase (all of
    them: parameters, state and data kept from earlier phases included), split by category in `memory`. runs:
    how many times the phase ran in the step (inner updates run mu times). calls_run / calls_replayed: module
    calls executed on fake tensors, and identical ones replayed from a recorded call (see replay.py).
    extrapolated_from: the two settings (n_t) it was run at when its values are extrapolated (see fit.py)."""

    name: str
    runs: int = 0
    peak: int = 0
    memory: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    costs: Costs = field(default_factory=Costs)
    calls_run: int = 0
    calls_replayed: int = 0
    extrapolated_from: tuple[float, float] | None = None
    start: int = 0  # bytes alive when the phase first started
    category_peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    # the model calls by kind (MODEL_CALLS), over its runs: what collectives a phase runs (planning/parallel.py)
    model_calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODEL_CALLS, 0))

    def add(self, peak: int, memory: dict[str, int], costs: Costs, calls_run: int, calls_replayed: int,
            start: int = 0, category_peaks: dict[str, int] | None = None,
            model_calls: dict[str, int] | None = None) -> None:
        for kind, count in (model_calls or {}).items():
            self.model_calls[kind] += count
        if not self.runs:
            self.start = start
        for category, size in (category_peaks or {}).items():
            self.category_peaks[category] = max(self.category_peaks[category], size)
        self.runs += 1
        if peak >= self.peak:
            self.peak, self.memory = peak, dict(memory)
        self.costs = self.costs + costs.settled()
        self.calls_run += calls_run
        self.calls_replayed += calls_replayed


@dataclass
class Rollout:
    """A planned rollout: its phase, the batch it produced, and the model calls that unmasked tokens."""

    phase: PhasePlan
    batch: RolloutBatch
    nfe: int


class Session:
    """The fake world of one configuration: models, optimizer (its state allocated), ledger and replayer.
    Enter it (`with session:`) to run phases; tensors made inside belong to it."""

    def __init__(self, config: TrainConfig, *, target: Target, weights_dtype: torch.dtype | None = None,
                 engine: str = "streaming", assumptions: Assumptions | None = None, optimizer: bool = True,
                 fast: bool = True, expert_parallel: int = 1):
        """weights_dtype: every model's weights in this dtype (None: what train loads for the target's device,
        dllm_fast.train.precision). optimizer: allocate the AdamW state a training step holds (False for a
        rollout on its own). fast=False plans the same step without the shortcuts that leave the plan as it is
        (every optimizer step run, every op on constants through FakeTensorMode's own path, every parameter a
        replayed call reaches linked into its graph): for tests that they change nothing. expert_parallel: the
        rank of an expert group of that many (its own num_experts / expert_parallel routed experts a MoE layer,
        planning/layout.expert_rank_config)."""
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is not one of {', '.join(ENGINES)}.")
        self.config, self.target, self.engine = config, target, engine
        self.objective = objectives.get(config.objective.name, **config.objective.options)
        self.precision = training_precision(config, target.device_type, weights=weights_dtype)
        self.policy, self.reference, self.base = _build_models(config, self.objective, self.precision,
                                                               expert_parallel)
        base = self.base
        if assumptions is None:
            special = (base.mask_token_id, base.eos_token_id, getattr(base, "eot_token_id", None))
            # threshold decoding: every confidence below the threshold, so a step unmasks one token (the most steps)
            threshold = config.rollout.threshold
            confidence = threshold / 2 if threshold is not None else Assumptions.confidence
            assumptions = Assumptions(confidence=confidence,
                                      avoid_ids=frozenset(i for i in special if i is not None))
        self.fast = fast
        self.mode = PlanningFakeMode(assumptions, shortcut_constants=fast)
        self.accountant = Accountant(target)
        self.bf16 = self.precision.compute is not None
        self.generate_config = config.generate_config(target.device_type)  # the rollouts, as train runs them
        self.compile = self.generate_config.compile
        self.compile_scoring = compiles_scoring(config)
        self._models = [m for m in (self.policy, self.reference) if m is not None]
        for module in self._models:
            fake_module(module, self.mode)
        self._stack = contextlib.ExitStack()
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.with_optimizer = optimizer

    def __enter__(self) -> "Session":
        stack = self._stack
        stack.enter_context(chunks_sized_for(self.target.device_type))
        stack.enter_context(_one_thread())
        stack.enter_context(_library_caches_kept())
        stack.enter_context(_compiled_calls_planned(self.accountant))
        stack.enter_context(fake_world(self.mode, self.accountant.count_kernels, self.accountant.read_back))
        stack.enter_context(self.accountant)
        stack.callback(self.accountant.close)
        for module in self._models:
            for tensor in [*module.parameters(), *module.buffers()]:
                self.accountant.track(tensor, "parameters")
        self.accountant.watch_gradients(self.trainable)
        # the models' calls, counted per phase (planning/parallel.py: FSDP2 gathers the weights per call)
        self.model_calls = dict.fromkeys(MODEL_CALLS, 0)
        for model, kind in ((self.base, "policy"), (self.reference, "reference")):
            if model is not None:
                stack.callback(model.register_forward_pre_hook(self._model_call(kind), with_kwargs=True).remove)
        self.replayer = Replayer(self.accountant, self.mode, state=_adapter_state(self.policy),
                                 link_all_parameters=not self.fast)
        self._recorded = RecordedWork(self.accountant, enabled=self.fast)
        self._replayed = set()
        for model in (self.base, self.reference):
            if model is not None:
                self.replayer.install(model)
                for block in model.shard_units():
                    self.replayer.install(block)
        _allocate_kv_cache_as(self.base, self.accountant, self.mode)
        c = self.config
        self.optimizer = None
        if self.with_optimizer:
            # train's AdamW on the target's device (train/optimizer.py: fused on CUDA, no temporary)
            self.optimizer = build_adamw(self.trainable, c.optim, device_type=self.target.device_type)
            _prime_optimizer(self.optimizer, self.trainable, self.accountant, self.mode, c.optim.grad_clip)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def _model_call(self, kind: str):
        def count(module, args, kwargs) -> None:
            name = kind + ("_grad" if kind == "policy" and torch.is_grad_enabled() else "")
            ids = args[0] if args else kwargs.get("input_ids")
            self.model_calls[name] += 1
            self.model_calls[name + "_tokens"] += ids.numel() if isinstance(ids, torch.Tensor) else 0
        return count

    def _replay(self, merged) -> None:
        """The merged copy of a LoRA policy that merged rollouts sample through (models.merged_lora), once: its
        own weights counted as parameters, its calls replayed as the policy's are."""
        if id(merged) in self._replayed:
            return
        self._replayed.add(id(merged))
        for parameter in merged.parameters():
            self.accountant.classify(parameter, "parameters", only_from="temporaries")
        self.replayer.install(merged)
        for block in merged.shard_units():
            self.replayer.install(block)
        self._stack.callback(merged.register_forward_pre_hook(self._model_call("policy"), with_kwargs=True).remove)

    @property
    def weight_bytes(self) -> int:
        """The bytes of weights one forward reads (the embedding is gathered, not read)."""
        base = self.base
        return sum(p.numel() * p.element_size() for name, p in base.named_parameters()
                   if "wte" not in name or base.config.weight_tying)

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, plan: PhasePlan):
        accountant, calls, model_calls = self.accountant, dict(self.replayer.calls), dict(self.model_calls)
        with self.replayer.region():
            mark = accountant.mark()
            yield
        accountant.release(mark)
        plan.add(mark.peak, mark.peak_memory, mark.costs,
                 self.replayer.calls["run"] - calls["run"], self.replayer.calls["replayed"] - calls["replayed"],
                 start=sum(mark.memory.values()), category_peaks=mark.category_peaks,
                 model_calls={kind: self.model_calls[kind] - model_calls[kind] for kind in MODEL_CALLS})

    def measure(self, name: str, fn):
        """Run `fn()` as a phase of its own: (its PhasePlan, what it returned). For plans of single calls (a
        scoring pass, one backward) such as benchmarks measure; tensors it makes belong to the session."""
        plan = PhasePlan(name)
        with self.phase(plan):
            result = fn()
        return plan, result

    # -- phases -------------------------------------------------------------------------------------------
    def rollout(self, *, prompts: int, group_size: int, prompt_length: int) -> Rollout:
        """Generate `group_size` completions for each of `prompts` prompts of `prompt_length` tokens; for an
        objective that trains on stored preference pairs (vrpo_dpo) nothing is generated: `pairs`."""
        c = self.config
        generator = torch.Generator().manual_seed(c.run.seed)
        vocab = min(self.base.lm_head_weight.shape[0], self.base.mask_token_id)
        input_ids = torch.randint(0, vocab, (prompts, prompt_length), generator=generator)
        if self.objective.preference_pairs:
            return self.pairs(input_ids, vocab, generator)
        tree_shape = getattr(self.objective, "tree_shape", lambda: None)()
        if tree_shape is None:
            input_ids = input_ids.repeat_interleave(group_size, dim=0)
        attention_mask = torch.ones_like(input_ids)
        plan = PhasePlan("rollout")
        rollouts = self.generate_config
        if rollouts.threshold is not None:  # confidences below the threshold: one token a step (see Assumptions)
            rollouts = replace(rollouts, assumed_steps_per_block=rollouts.block_length)
        merge = c.lora.enabled and c.lora.merge_rollouts
        if merge:  # the merged copy roll_out samples through, its calls replayed like the policy's
            self._replay(merged_for_rollouts(self.policy, refresh=False))
        if tree_shape is not None:  # d_treerpo: a tree per prompt, as train rolls it out (train/run.roll_out_tree)
            return self.tree_rollout(input_ids, attention_mask, rollouts, tree_shape, plan, merge)
        # as train does: trajectory objectives (TraceRL) ask generate to record the decoding order
        result = train_step.roll_out(self.policy, input_ids, attention_mask, rollouts,
                                     generator=torch.Generator().manual_seed(c.run.seed + 1),
                                     record_unmask_step=getattr(self.objective, "needs_unmask_step", False),
                                     hooks=self._hooks({"rollout": plan}), merge_adapters=merge,
                                     record_step_predictions=getattr(self.objective, "needs_step_predictions", False))
        rewards = torch.arange(input_ids.shape[0], dtype=torch.float32) % 2
        batch = RolloutBatch.from_generation(result, rewards, group_size=group_size)
        if getattr(self.objective, "needs_step_predictions", False):  # MDPO: as train does, its step batch (the
            # rewards of every step's prediction alternate, so every step has an advantage and top-k keeps k)
            step_rewards = (torch.arange(batch.num_rollouts * result.nfe, dtype=torch.float32) % 3).view(
                batch.num_rollouts, result.nfe)
            batch = self.objective.step_batch(batch, result.step_predictions, result.step_confidence, step_rewards,
                                              eos_token_id=self.base.eos_token_id,
                                              rollout_temperature=rollouts.temperature)
        return Rollout(plan, batch, int(result.nfe))

    def tree_rollout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rollouts, shape,
                     plan: PhasePlan, merge: bool) -> Rollout:
        """d_treerpo's rollout (rollout/tree.py): one tree of `shape` per prompt, one generate call per level
        resumed from the level above (generate(resume=...)), then its edges as train batches them
        (objectives.tree_batch): a sequence an edge, scored once on its parent's canvas (the tree_edge sampler).
        The leaves' rewards grow with their index (the leaves of a node are contiguous), so that siblings' values
        differ at every level and every edge has a nonzero advantage (the most work, as alternating rewards give
        a group rollout)."""
        c = self.config
        tree = train_step.roll_out(self.policy, input_ids, attention_mask, rollouts,
                                   generator=torch.Generator().manual_seed(c.run.seed + 1), record_unmask_step=False,
                                   hooks=self._hooks({"rollout": plan}), merge_adapters=merge, tree=shape)
        leaves = tree.leaves.shape[0]
        rewards = torch.arange(leaves, dtype=torch.float32) / leaves
        batch = objectives.tree_batch(tree, rewards, eos_token_id=self.base.eos_token_id,
                                      mask_token_id=self.base.mask_token_id, train_step=0)
        return Rollout(plan, batch, int(tree.forwards))

    def pairs(self, input_ids: torch.Tensor, vocab: int, generator: torch.Generator) -> Rollout:
        """A step of stored preference pairs (train/pairs.py): a chosen and a rejected completion of gen_length
        tokens per prompt, none of them EOS (as the rollout's plan assumes); its rollout phase never runs."""
        from dllm_fast.objectives.vrpo_dpo import preference_batch

        shape = (input_ids.shape[0], self.config.rollout.gen_length)
        eos = self.base.eos_token_id
        chosen, rejected = (torch.randint(0, vocab - 1, shape, generator=generator) for _ in range(2))
        chosen, rejected = (ids + (ids >= eos).long() for ids in (chosen, rejected))  # skip the EOS id
        batch = preference_batch(input_ids, chosen, rejected, eos_token_id=eos)
        return Rollout(PhasePlan("rollout"), batch, 0)

    def updates(self, batch: RolloutBatch, *, n_t: int, batching: MicroBatching) -> dict[str, PhasePlan]:
        """The phases after the rollout: the objective's plan of the mu inner updates (old-policy scoring), then
        for each update the reference scoring, the update itself and the optimizer step."""
        c = self.config
        objective = objectives.get(c.objective.name, **{**c.objective.options, "n_t": n_t})
        phases = {name: PhasePlan(name) for name in UPDATE_PHASES}
        hooks = self._hooks(phases)
        plan = train_step.plan_updates(objective, self.policy, batch,
                                       moved=train_step.moved_after_first(c.objective.inner_updates),
                                       generator=torch.Generator().manual_seed(c.run.seed + 2), batching=batching,
                                       hooks=hooks)
        optimization = train_step.Optimization(self.trainable, self.optimizer, c.optim.grad_clip)
        backward = functools.partial(_all_graphs_backward, objective) if self.engine == "all_graphs" else None
        for update in plan:  # train_step.run_update, its optimizer step replayed once recorded (optimizer_step)
            output = train_step.inner_update(objective, self.policy, batch, update, batching=batching,
                                             ref_model=self.reference, hooks=hooks, backward=backward)
            self.optimizer_step(optimization, phases[train_step.OPTIMIZER_STEP])  # the output alive, as there
            del output
        if phases["old-policy scoring"].calls_run + phases["old-policy scoring"].calls_replayed == 0:
            phases["old-policy scoring"].runs = 0  # mu = 1, or an objective without a ratio: nothing scored
        return phases

    def optimizer_step(self, optimization: train_step.Optimization, plan: PhasePlan) -> None:
        """train_step.optimizer_step as a phase, run once per kind and replayed after (replay.RecordedWork): its
        work (clipping, AdamW, zeroing) is decided by the trainable parameters and their gradients (shapes, dtypes,
        strides, the gradients' categories). The trainer's check of a finite gradient norm is a host sync; the plan
        assumes it passes. A replay leaves what the step leaves: the gradients set to None."""
        accountant = self.accountant
        key = (id(optimization.optimizer), optimization.grad_clip, torch.is_grad_enabled(), tuple(
            (tuple(p.shape), p.dtype) + (() if p.grad is None else (
                tuple(p.grad.shape), p.grad.dtype, p.grad.stride(), accountant.category_of(p.grad)))
            for p in optimization.trainable))
        with self.phase(plan):  # the phase opened here: train_step.optimizer_step's own hook is not called
            self._recorded.run(key, lambda: train_step.optimizer_step(optimization, hooks=train_step.NO_HOOKS),
                               lambda: optimization.optimizer.zero_grad(set_to_none=True))

    def _hooks(self, phases: dict[str, PhasePlan]) -> train_step.StepHooks:
        """train/step.py's hooks for this session: each phase of the step accounted into its PhasePlan."""
        return train_step.StepHooks(phase=lambda name: self.phase(phases[name]), autocast=self.autocast)


def _all_graphs_backward(objective, model, batch: RolloutBatch, update, *, micro_batch: MicroBatching,
                         lp_ref, hooks) -> None:
    """engine="all_graphs": every micro-batch's graph kept until one backward of the whole loss (the naive way)."""
    inputs = objective.prepare(batch, update.masks, lp_old=update.lp_old, lp_ref=lp_ref)
    lp = score(model, batch.sequences, update.masks, micro_batch=micro_batch,  # its micro_batch: a graph
               attention_mask=batch.attention_mask)
    objective.loss(lp, inputs).backward()


def valid_n_t(config: TrainConfig, n_t: int, *, down: bool = False, limit: int = 1 << 16) -> int | None:
    """The n_t nearest `n_t` that the configured objective accepts (`objectives.nearest_valid_n_t`)."""
    options = {name: value for name, value in config.objective.options.items() if name != "n_t"}  # n_t is searched
    return objectives.nearest_valid_n_t(config.objective.name, n_t, down=down, limit=limit, **options)


def smallest_n_t(config: TrainConfig) -> int:
    """The smallest n_t the objective accepts."""
    return valid_n_t(config, 1)


def fixed_n_t(config: TrainConfig) -> bool:
    """Whether the objective's samples are not n_t masks drawn per sequence but follow from the rollouts (TraceRL's
    trajectory sampler: the decoding states; JustGRPO's autoregressive one: a sample per completion position): its
    n_t stays as configured, and its work follows the rollout instead."""
    from dllm_fast.likelihood.samplers import SAMPLERS

    sampler = objectives.get(config.objective.name, **config.objective.options).config.sampler
    return SAMPLERS[sampler].data_n_t


def one_pass(config: TrainConfig, micro_batch: int, n_t: int, *, allowed: bool = True) -> bool:
    """Whether the engine differentiates the objective at n_t in one pass (`streaming_backward`: a loss that
    couples pairs only within a sequence, when a micro-batch holds a sequence's n_t samples; `allowed` is
    MicroBatching.one_pass). Its cost is not on the two-pass line, so neither side extrapolates to the other."""
    objective = objectives.get(config.objective.name, **config.objective.options)
    return allowed and objective.sequence_local and n_t <= micro_batch


def probe_n_t(config: TrainConfig, rollouts: int, micro_batch: int) -> tuple[int, int]:
    """Two small n_t to plan the updates at, from which larger ones are extrapolated (fit.py): the smallest at
    which every kind of micro-batch runs (at least two micro-batches of pairs), and the first valid one from four
    times it. An objective with a fixed n_t is planned at it, twice the same. The probes are planned with two
    passes (`two_pass_line`), the line every n_t above the micro-batch is on."""
    if fixed_n_t(config):
        n_t = objectives.get(config.objective.name, **config.objective.options).config.n_t
        return n_t, n_t
    wanted = -(-2 * micro_batch // max(rollouts, 1))
    low = valid_n_t(config, wanted) or valid_n_t(config, wanted, down=True)  # n_t capped (tree_edge: 1): the cap
    return low, valid_n_t(config, 4 * low) or low


def two_pass_line(batching: MicroBatching) -> MicroBatching:
    """`batching` with the engine's one pass off: the probes' setting, so that every n_t planned for an
    extrapolation takes the two passes a large n_t takes (one pass is for n_t <= micro-batch, planned directly)."""
    return replace(batching, one_pass=False)


# ---------------------------------------------------------------------------------------------------------
# building the fake models


def _build_models(config: TrainConfig, objective, precision: Precision, expert_parallel: int = 1):
    """(policy, reference copy or None, the base model), on the meta device, as train/run.py builds them, in the
    dtypes `precision` gives (train.precision.training_precision: the trainer's own choice, or every weight in
    one dtype for a what-if)."""
    from dllm_fast.models.loading import PRESETS

    source, family, _ = model_source(config.model, config.lora)
    with torch.device("meta"):
        if str(source) in PRESETS:
            base = family(family.preset_config(PRESETS[str(source)][1]))
        else:
            base = family.from_pretrained(source, device="meta")
        if expert_parallel > 1:  # the rank of an expert group: its own share of the routed experts
            from dllm_fast.planning.layout import expert_rank_config

            base = type(base)(expert_rank_config(base.config, expert_parallel))
    base = base.to(precision.base_dtype(config.lora.enabled)).train()
    base.set_gradient_checkpointing(config.model.gradient_checkpointing)
    check_block_length(config, base, evaluated=False)  # a block-diffusion model as train takes it: a preset in
    take_block_length(config, base)  # --block-length's blocks, a checkpoint in its own
    with torch.device("meta"):  # the adapters' layers too: no initialisation on the host
        policy, reference = training_models(base, config, precision, needs_reference=objective.needs_reference)
    return policy, reference, base


def _adapter_state(policy):
    """Whether the LoRA adapters are enabled: a call with them disabled computes something else."""
    layers = [m for m in policy.modules() if hasattr(m, "disable_adapters") and hasattr(m, "lora_A")]
    if not layers:
        return lambda: None
    first = layers[0]
    return lambda: bool(first.disable_adapters)


def _allocate_kv_cache_as(base, accountant: Accountant, mode: PlanningFakeMode) -> None:
    """Count what the model's new_cache allocates as the KV cache, and keep it fake: it holds model outputs, which
    the plan never reads, and a real buffer of each layer's keys (under the constant limit, e.g. 89 MB a layer for
    sdar-8b's 64 rollouts of 676 tokens) would be allocated and zeroed on the host for nothing."""
    original = base.new_cache

    def new_cache(*args, **kwargs):
        with accountant.allocating_as("kv_cache"), mode.fake_factories():
            return original(*args, **kwargs)

    base.new_cache = new_cache


@contextlib.contextmanager
def _compiled_calls_planned(accountant: Accountant):
    """The library's compiled calls run eagerly on fake tensors (torch.compile cannot trace them), priced as they
    run compiled: a compiled denoising step (rollout/step.py, mode="reduce-overhead") as one CUDA graph replay;
    compiled scoring (likelihood/compiled.py: inductor graphs, no CUDA graphs yet) on its padded shapes, its
    kernels launched one by one as eager ones are. Device time stays eager's, kernel for kernel: no credit for
    inductor's fusion."""
    import importlib

    step_module = importlib.import_module("dllm_fast.rollout.step")
    # the modules that call the compiled step
    rollout_modules = [importlib.import_module(f"dllm_fast.rollout.{name}") for name in ("sampler", "blocks")]
    compiled_module = importlib.import_module("dllm_fast.likelihood.compiled")

    def graph_step(*args):
        with accountant.graph_replay():
            return step_module.denoise_step(*args)

    eager = {"score_padded": compiled_module.score_padded,
             "known_gradient_padded": compiled_module.known_gradient_padded}
    kept = [module.compiled_step for module in rollout_modules], compiled_module.compiled
    for module in rollout_modules:
        module.compiled_step = lambda device_type, backend="inductor": graph_step
    compiled_module.compiled = lambda function_name, backend="inductor": eager[function_name]
    try:
        yield
    finally:
        for module, compiled_step in zip(rollout_modules, kept[0]):
            module.compiled_step = compiled_step
        compiled_module.compiled = kept[1]


@contextlib.contextmanager
def _one_thread():
    """Plan on one CPU thread: the real arithmetic of a plan is on the step's small data (masks, token ids), too
    small for threads to help, and on a busy host a parallel region waits for every thread to be scheduled (a
    [64, 438] mask gather took 6 ms on two threads of a loaded 2-core machine, 0.3 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _library_caches_kept():
    """Plan with the library's module-level tensor caches empty, and leave them as they were: a real tensor cached
    by an earlier real call would meet fake ones inside the plan, and tensors cached during a plan are fake and
    would poison later real calls in the process (likelihood.masks caches its fingerprint multipliers)."""
    from dllm_fast.likelihood import masks

    kept = dict(masks._fingerprint_multipliers)
    masks._fingerprint_multipliers.clear()
    try:
        yield
    finally:
        masks._fingerprint_multipliers.clear()
        masks._fingerprint_multipliers.update(kept)


def _prime_optimizer(optimizer, trainable, accountant: Accountant, mode: PlanningFakeMode, grad_clip: float) -> None:
    """Allocate the optimizer's state as a first step does (train_step.optimizer_step: clipping, its finite-norm
    check, the step, the gradients zeroed) and count it as optimizer state; then step once more, so that the
    launch queue is left as every later step leaves it (a replayed step's key, replay.RecordedWork). The step
    counters of a fused AdamW live on the device (a few bytes); otherwise on the host, so reading them is no
    device sync."""
    on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for first in (True, False):
        with mode.fake_factories():  # gradients as a backward leaves them: device tensors, made without a kernel
            for p in trainable:
                p.grad = torch.empty_like(p)
        train_step.optimizer_step(train_step.Optimization(trainable, optimizer, grad_clip))
        if not first:
            continue
        for state in optimizer.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    if name == "step" and not on_device:
                        accountant.host_resident(value)
                    else:
                        accountant.classify(value, "optimizer_state")
