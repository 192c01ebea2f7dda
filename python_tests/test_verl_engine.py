"""dllm_fast as verl's actor engine (integrations/verl/engine.py), driven in-process with verl's own classes:
verl's EngineRegistry builds the engine from verl's config dataclasses, verl's DataProto and padding helpers make
the batch its PPO trainer hands the actor, verl's advantage estimators fill `advantages`, and the engine's own
`infer_batch` (compute_log_prob), `train_batch` (zero_grad, forward_backward_batch, verl's clipped optimizer
step) and `lr_scheduler_step` run the step, on gloo with one rank, in fp64 on the CPU.

The property (issue 47.4): on the same prompts, completions, masks and seeds, the verl step gives the same loss and
the same parameter update as dllm_fast's own trainer step (`train.step.run_update`), to 1e-9, for the default
objective and one of each kind, over two inner updates (verl's ppo_epochs=2: the first on-policy, the second after
the policy moved, on the old policy's log-probs scored before it moved).

These tests need verl (the documented venv, docs/integrations.md); without it they skip, naming it.
"""

import contextlib
import dataclasses
import functools
import os
import socket
import types

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed: the engine's tests drive verl's own classes "
                                          "(run them in the verl venv, docs/integrations.md)")

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.plugin.platform import platform_manager  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss, sft_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import dllm_fast  # noqa: E402
from dllm_fast import objectives  # noqa: E402
from dllm_fast.contracts import RolloutBatch, completion_mask  # noqa: E402
from dllm_fast.integrations.verl import batch as verl_batch  # noqa: E402
from dllm_fast.integrations.verl import engine as verl_engine  # noqa: E402
from dllm_fast.integrations.verl.settings import advantage_estimator_for  # noqa: E402
from dllm_fast.likelihood import MicroBatching, score  # noqa: E402
from dllm_fast.models.loading import load_model  # noqa: E402
from dllm_fast.objectives import InnerUpdate  # noqa: E402
from dllm_fast.train import step as train_step  # noqa: E402
from dllm_fast.train.precision import add_lora  # noqa: E402
from dllm_fast.train.settings import LoraSettings  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MODEL = os.path.join(os.path.dirname(dllm_fast.__file__), "assets", "sudoku4")
G, PROMPTS, PROMPT_LENGTH, GEN_LENGTH = 4, 2, 6, 8
PAIRS = 8  # (sequence, sample) pairs per backward graph, in both trainers
LR = 1e-3
PAD = 7  # verl pads responses with the tokenizer's pad id; not EOS here, so the canvas's EOS must be restored
SHUFFLED = [0, 4, 1, 5, 2, 6, 3, 7]  # verl's rows need not keep a prompt's group together: the engine regroups
# One of each kind (issue 47.4): the default objective; one pass (separable); two passes (a non-linear sequence
# loss); a reference term; wd1's group softmax; TraceRL's trajectory (the rollout's decoding order).
KINDS = {"espo": {}, "bgpo": {"n_t": 4}, "vrpo_ol": {}, "rspo": {}, "wd1": {}, "tracerl": {}}


class CPUPlatform(PlatformBase):
    """The least of verl's platform interface its FSDP engine reads, on the CPU. dllm_fast's verl plugin registers
    the product's CPU platform; the in-process test sets this one only where verl's current platform is not a CPU."""

    device_name, vendor_name = "cpu", "cpu"
    device_module = torch.cpu

    # No accelerator: verl's checkpoints then keep the host's RNG state alone (with True, resuming would ask
    # torch.cpu for an accelerator RNG state it does not have).
    def is_available(self): return False
    def current_device(self): return "cpu"
    def device_count(self): return 1
    def set_device(self, index): pass
    def synchronize(self, index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def communication_backend_name(self): return "gloo"
    def cudart(self): return None
    def get_device_capability(self, index=0): return None, None
    def is_ipc_supported(self): return False
    def nvtx_range(self, msg): return contextlib.nullcontext()
    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_noset_envvars(self): return []
    def ray_resource_name(self): return "CPU"
    def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group on verl's CPU platform, with the engine registered."""
    previous = platform_manager.get_platform()
    if previous.device_name != "cpu":
        platform_manager.set_platform(CPUPlatform())
    started = not dist.is_initialized()
    if started:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    verl_engine.register_engine()
    yield
    if started:
        dist.destroy_process_group()
    platform_manager.set_platform(previous)


def build_engine(name: str, *, lora_rank=0, lora_alpha=16, strategy="fsdp2", dtypes=("fp64", "fp64", "fp64"),
                 **section):
    """The engine for objective `name`; dtypes: the model's, FSDP2's parameter and reduce dtypes."""
    model_config = HFModelConfig(path=MODEL, model_type="dllm_fast", enable_gradient_checkpointing=False,
                                 lora_rank=lora_rank, lora_alpha=lora_alpha,
                                 override_config={"dllm_fast": {"objective": name, "options": KINDS[name],
                                                                "micro_batch": PAIRS, **section}})
    engine_config = FSDPEngineConfig(strategy=strategy, model_dtype=dtypes[0], use_torch_compile=False,
                                     mixed_precision={"param_dtype": dtypes[1], "reduce_dtype": dtypes[2]})
    optimizer_config = FSDPOptimizerConfig(lr=LR, total_training_steps=4, lr_warmup_steps=0, weight_decay=0.01)
    engine = EngineRegistry.new(model_type="dllm_fast", backend=strategy, model_config=model_config,
                                engine_config=engine_config, optimizer_config=optimizer_config,
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine, optimizer_config


def rollouts(policy, seed=0):
    """G completions of each of PROMPTS prompts by dllm_fast's sampler (the decoding order recorded), rewards."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 100, (PROMPTS, PROMPT_LENGTH), generator=generator).repeat_interleave(G, 0)
    attention = torch.ones_like(prompts)
    attention[:G, :2] = 0  # the first prompt is left-padded
    prompts = prompts.masked_fill(attention == 0, policy.eos_token_id)
    result = dllm_fast.generate(policy, prompts, attention, gen_length=GEN_LENGTH, block_length=GEN_LENGTH,
                                steps=GEN_LENGTH, temperature=1.0, generator=generator, record_unmask_step=True)
    # Two completions end early, as the sampler leaves a canvas that decoded EOS there (EOS to the end).
    sequences = result.sequences.clone()
    sequences[1, PROMPT_LENGTH + 5:] = policy.eos_token_id
    sequences[6, PROMPT_LENGTH + 2:] = policy.eos_token_id
    result = dataclasses.replace(result, sequences=sequences, completion_ids=sequences[:, PROMPT_LENGTH:],
                                 completion_mask=completion_mask(sequences[:, PROMPT_LENGTH:], policy.eos_token_id))
    rewards = torch.rand(PROMPTS * G, generator=generator, dtype=torch.float64).float()
    return result, rewards


def verl_data(result, rewards, objective, eos_token_id, order=SHUFFLED):
    """verl's actor batch of the rollouts, as its PPO trainer builds it: a response runs through its first EOS
    and is padded after it, the reward sits on its last token, advantages come from verl's estimator."""
    completion = result.sequences[:, PROMPT_LENGTH:]
    lengths = result.completion_mask.sum(-1)
    response_mask = (torch.arange(GEN_LENGTH)[None] < lengths[:, None]).long()
    responses = completion.masked_fill(response_mask == 0, PAD)
    attention = torch.cat([result.attention_mask[:, :PROMPT_LENGTH].long(), response_mask], dim=1)
    token_rewards = torch.zeros(len(rewards), GEN_LENGTH)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    uid = np.array([f"prompt-{row // G}" for row in range(len(rewards))], dtype=object)
    estimator = advantage_estimator_for(objective) or "grpo"
    if "rloo" in estimator:
        advantages, _ = core_algos.compute_rloo_outcome_advantage(token_rewards, response_mask, uid)
    else:
        advantages, _ = core_algos.compute_grpo_outcome_advantage(
            token_rewards, response_mask, uid, norm_adv_by_std_in_grpo="norm_adv_by_std_in_grpo=true" in estimator)
    prompts = result.sequences[:, :PROMPT_LENGTH]
    fields = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
              "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),
              "response_mask": response_mask, "token_level_rewards": token_rewards, "advantages": advantages,
              verl_batch.UNMASK_STEP_KEY: result.unmask_step,
              verl_batch.FORWARDS_KEY: torch.full((len(rewards),), result.nfe)}
    batch = DataProto.from_single_dict({key: value[order] for key, value in fields.items()})
    batch.non_tensor_batch["uid"] = uid[order]
    batch.meta_info["temperature"] = 1.0
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
    return data, list(uid)


def full(parameter):
    value = parameter.detach()
    return value.full_tensor() if isinstance(value, DTensor) else value


def parameters(engine):
    return {name.removeprefix("diffusion_lm."): full(p).clone() for name, p in engine.module.named_parameters()}


def actor_loss(**settings):
    """verl's actor loss as its worker binds it: ppo_loss with the actor's config (two PPO epochs)."""
    actor = FSDPActorConfig(**{"strategy": "fsdp2", "ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_gpu": 2,
                               "rollout_n": G, "ppo_epochs": 2, **settings})
    return functools.partial(ppo_loss, config=actor)


def same_step(engine, optimizer_config, policy, reference, trainer_reference=None):
    """verl's step (compute_log_prob, then two epochs of train_batch and the LR schedule) beside dllm_fast's
    trainer's (`run_update` twice, the second on the old policy's lp scored before the first), on the same rollouts
    and masks: the same per-token scores, losses, gradient norms and parameters after each update, to 1e-9."""
    objective = engine.objective
    for n, p in policy.named_parameters():
        assert torch.equal(parameters(engine)[n], p.detach()), n
    with torch.no_grad():
        result, rewards = rollouts(policy)
    assert (result.completion_mask.sum(-1) < GEN_LENGTH).any()  # some response is cut at its EOS and padded
    data, uids = verl_data(result, rewards, objective, policy.eos_token_id)

    # the trainer's step on the same rollouts and masks: RolloutBatch.from_generation, the engine's row seeds
    batch = RolloutBatch.from_generation(result, rewards, group_size=G)
    masks = verl_batch.row_masks(objective, batch, verl_batch.row_keys(batch, uids), seed=engine.settings.seed,
                                 model=policy)
    batching = MicroBatching(PAIRS)
    with torch.no_grad():
        lp_old = score(policy, batch.sequences, masks, micro_batch=batching, attention_mask=batch.attention_mask)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimization = train_step.Optimization(trainable, torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999),
                                                                        weight_decay=optimizer_config.weight_decay),
                                           grad_clip=optimizer_config.clip_grad)
    plan = [InnerUpdate(masks), InnerUpdate(masks, lp_old=lp_old)]  # verl's epochs reuse each row's masks

    with engine.eval_mode():
        scored = engine.infer_batch(data)
    per_token = no_padding_2_padding(scored["model_output"]["log_probs"], data)
    want = verl_batch.per_token(lp_old, masks)[SHUFFLED]
    torch.testing.assert_close(per_token * data["response_mask"], want * data["response_mask"], rtol=0, atol=1e-9)

    initial = {n: p.detach().clone() for n, p in policy.named_parameters()}
    for epoch, update in enumerate(plan):
        with engine.train_mode():
            out = engine.train_batch(data, loss_function=actor_loss())
        engine.lr_scheduler_step()
        ours, norm = train_step.run_update(objective, policy, batch, update, batching=batching,
                                           optimization=optimization, ref_model=trainer_reference)
        assert out["metrics"]["dllm_fast/policy_moved"] == [float(epoch > 0)]
        assert abs(out["loss"][0] - float(ours.loss)) <= 1e-9, (epoch, out["loss"], float(ours.loss))
        assert abs(out["metrics"]["grad_norm"] - float(norm)) <= 1e-9 * max(1.0, float(norm))
        after = parameters(engine)
        moved = 0.0
        for n, p in policy.named_parameters():
            torch.testing.assert_close(after[n], p.detach(), rtol=0, atol=1e-9,
                                       msg=f"{objective.name} epoch {epoch}: {n}")
            moved = max(moved, float((p.detach() - initial[n]).abs().max()))
        assert moved > 1e-4  # the update did move the weights: the comparison is not of two unchanged models
    assert float(ours.loss) != 0.0  # after the policy moved (espo's on-policy loss is 0: ratio 1, mean(A) = 0)
    return data


@pytest.mark.parametrize("name", list(KINDS))
def test_a_verl_step_is_the_trainers_step(one_rank, name):
    # TraceRL's z-score (population std, no epsilon) is none of verl's estimators: verl's grpo fills `advantages`
    matched = advantage_estimator_for(objectives.get(name, **KINDS[name])) is not None
    engine, optimizer_config = build_engine(name, check_advantages=matched)
    policy = load_model(MODEL, dtype=torch.float64, device="cpu").train()  # dllm_fast's trainer's copy
    reference = load_model(MODEL, dtype=torch.float64, device="cpu").eval().requires_grad_(False)
    same_step(engine, optimizer_config, policy, reference, trainer_reference=reference)


def test_lora_with_the_adapters_disabled_as_the_reference(one_rank):
    """LoRA through dllm_fast's add_lora on the family's modules, and rspo's reference term scored by the policy
    with its adapters disabled, in both trainers."""
    engine, optimizer_config = build_engine("rspo", lora_rank=4, lora_alpha=8)
    assert engine.reference is None and hasattr(engine.module.diffusion_lm, "disable_adapter")
    lora = LoraSettings(enabled=True, rank=4, alpha=8)
    policy = add_lora(load_model(MODEL, dtype=torch.float64, device="cpu"), types.SimpleNamespace(lora=lora)).train()
    with torch.no_grad():  # the adapters' random initialisation, as the engine drew it
        for n, p in policy.named_parameters():
            p.copy_(parameters(engine)[n])
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    same_step(engine, optimizer_config, policy, None)


def test_verls_default_bf16_parameters_score_and_train(one_rank):
    """verl's default mixed precision (fp32 weights, bf16 parameters in the forward, fp32 gradient reduction): the
    RoPE tables the model hands its FSDP2 units stay fp32 (FSDP2 casting them to bf16 was refused by the fused
    RoPE), and scoring and an update give finite values."""
    engine, _ = build_engine("espo", dtypes=("fp32", "bf16", "fp32"))
    policy = load_model(MODEL, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        result, rewards = rollouts(policy)
    data, _ = verl_data(result, rewards, engine.objective, policy.eos_token_id)
    with engine.eval_mode():
        scored = engine.infer_batch(data)
    assert torch.isfinite(scored["model_output"]["log_probs"].values()).all()
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=actor_loss())
    assert torch.isfinite(torch.tensor(out["loss"])).all() and out["metrics"]["grad_norm"] > 0


def test_verls_checkpoint_of_the_engine_resumes_bit_for_bit(one_rank, tmp_path):
    """verl's own FSDP checkpoint manager saves the engine (model shards, optimizer, LR schedule) and a fresh
    engine resumes from it: the same parameters, and the same next step."""
    engine, _ = build_engine("espo")
    policy = load_model(MODEL, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        result, rewards = rollouts(policy)
    data, _ = verl_data(result, rewards, engine.objective, policy.eos_token_id)

    def step(engine):
        with engine.eval_mode():
            engine.infer_batch(data)
        with engine.train_mode():
            engine.train_batch(data, loss_function=actor_loss())
        engine.lr_scheduler_step()

    step(engine)
    engine.save_checkpoint(str(tmp_path / "global_step_1"), global_step=1)
    resumed, _ = build_engine("espo")
    resumed.load_checkpoint(str(tmp_path / "global_step_1"))
    assert parameters(resumed).keys() == parameters(engine).keys()
    for name, value in parameters(engine).items():
        assert torch.equal(parameters(resumed)[name], value), name
    step(engine)
    step(resumed)
    for name, value in parameters(engine).items():
        assert torch.equal(parameters(resumed)[name], value), name


# -- bad input (issue 47.7): each refusal names the setting --------------------------------------------------------

@pytest.fixture(scope="module")
def espo_engine(one_rank):
    engine, _ = build_engine("espo")
    policy = load_model(MODEL, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        result, rewards = rollouts(policy)
    return engine, result, rewards


def test_the_engine_is_verls_for_model_type_dllm_fast(one_rank):
    assert verl_engine.register_engine() is verl_engine.DllmFastEngine  # idempotent
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("dllm_fast", backend) is verl_engine.DllmFastEngine
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.strategy='fsdp'.*strategy=fsdp2"):
        build_engine("espo", strategy="fsdp")


@pytest.mark.parametrize("version", ["0.8.5", "0.10.0", "1.0"])
def test_a_verl_of_another_version_is_refused_naming_the_versions(version):
    with pytest.raises(RuntimeError, match=f"verl {version} is installed.*install verl>=0.9,<0.10"):
        verl_engine.check_verl_version(version)
    verl_engine.check_verl_version()  # the installed one


def test_an_update_before_the_old_policy_was_scored_is_refused(one_rank):
    engine, _ = build_engine("espo")
    policy = load_model(MODEL, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        result, rewards = rollouts(policy)
    data, _ = verl_data(result, rewards, engine.objective, policy.eos_token_id)
    with pytest.raises(RuntimeError, match="before verl's compute_log_prob"), engine.train_mode():
        engine.train_batch(data, loss_function=actor_loss())


@pytest.mark.parametrize("settings,message", [
    ({"loss_agg_mode": "seq-mean-token-mean"}, "actor.loss_agg_mode='seq-mean-token-mean' is verl's own loss setting"),
    ({"clip_ratio": 0.3}, "actor.clip_ratio=0.3 is verl's own loss setting"),
    ({"policy_loss": {"loss_mode": "gspo"}}, "policy_loss.loss_mode='gspo'"),
    ({"entropy_coeff": 0.001}, "entropy_coeff=0.001"),
    ({"use_kl_loss": True}, "use_kl_loss=true"),
])
def test_verl_actor_settings_the_objective_replaces_are_refused(espo_engine, settings, message):
    engine, result, rewards = espo_engine
    data, _ = verl_data(result, rewards, engine.objective, engine.module.eos_token_id)
    with engine.eval_mode():
        engine.infer_batch(data)
    with pytest.raises(ValueError, match=message), engine.train_mode():
        engine.train_batch(data, loss_function=actor_loss(**settings))
    with pytest.raises(ValueError, match="verl's actor passed 'sft_loss'"), engine.train_mode():
        engine.train_batch(data, loss_function=functools.partial(sft_loss, config=None))


def test_advantages_other_than_the_objectives_are_refused_naming_verls_settings(espo_engine):
    engine, result, rewards = espo_engine
    scaled = objectives.get("bgpo")  # verl's grpo with std scaling, which espo's own advantages are not
    data, _ = verl_data(result, rewards, scaled, engine.module.eos_token_id)
    with engine.eval_mode():
        engine.infer_batch(data)
    with pytest.raises(ValueError, match="espo's own .*set algorithm.adv_estimator=grpo "
                                         "algorithm.norm_adv_by_std_in_grpo=false"), engine.train_mode():
        engine.train_batch(data, loss_function=actor_loss())


def test_a_mini_batch_that_cuts_a_prompt_group_is_refused(espo_engine):
    engine, result, rewards = espo_engine
    data, _ = verl_data(result, rewards, engine.objective, engine.module.eos_token_id)
    with engine.eval_mode():
        engine.infer_batch(data)
    half = tu.chunk_tensordict(data, 2)[0]  # verl's rows are shuffled: two completions of each prompt
    with pytest.raises(ValueError, match="holds 2 of prompt 'prompt-.''s 4 completions.*balance_batch=false"), \
            engine.train_mode():
        engine.train_batch(half, loss_function=actor_loss())


def test_rows_the_old_policy_did_not_score_are_refused_after_the_policy_moved(espo_engine):
    engine, result, rewards = espo_engine
    data, _ = verl_data(result, rewards, engine.objective, engine.module.eos_token_id)
    with engine.eval_mode():
        engine.infer_batch(data)
    with engine.train_mode():
        engine.train_batch(data, loss_function=actor_loss())  # an optimizer step: the policy has moved
    with torch.no_grad():
        other, other_rewards = rollouts(load_model(MODEL, dtype=torch.float64, device="cpu"), seed=1)
    unscored, _ = verl_data(other, other_rewards, engine.objective, engine.module.eos_token_id)
    with pytest.raises(RuntimeError, match="compute_log_prob did not score it on this rank"), engine.train_mode():
        engine.train_batch(unscored, loss_function=actor_loss())


def test_a_rollout_temperature_given_twice_must_agree(one_rank):
    engine, _ = build_engine("espo", rollout={"temperature": 0.7})
    policy = load_model(MODEL, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        result, rewards = rollouts(policy)
    data, _ = verl_data(result, rewards, engine.objective, policy.eos_token_id)
    with engine.eval_mode():
        engine.infer_batch(data)
    with pytest.raises(ValueError, match="rollout.temperature=0.7 but actor_rollout_ref.rollout.temperature=1.0"), \
            engine.train_mode():
        engine.train_batch(data, loss_function=actor_loss())


def test_tracerl_without_the_decoding_order_names_the_batch_key(one_rank):
    engine, _ = build_engine("tracerl", check_advantages=False)
    policy = load_model(MODEL, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        result, rewards = rollouts(policy)
    data, _ = verl_data(result, rewards, engine.objective, policy.eos_token_id)
    del data[verl_batch.UNMASK_STEP_KEY]
    with pytest.raises(KeyError, match="no 'dllm_fast_unmask_step'"), engine.eval_mode():
        engine.infer_batch(data)


def test_a_model_no_loader_reads_is_refused_naming_the_path(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    config = types.SimpleNamespace(local_path=str(tmp_path), path=str(tmp_path), trust_remote_code=False,
                                   hf_config=types.SimpleNamespace(model_type="bert"))
    with pytest.raises(ValueError, match=f"actor_rollout_ref.model.path='{tmp_path}' has model_type 'bert', which "
                                         "neither a dllm_fast family"):
        verl_engine.load_diffusion_lm(config, torch.float32)


@pytest.mark.parametrize("name", ["espo", "bgpo", "coupled_grpo", "vrpo_ol"])
def test_the_verl_estimator_named_for_an_objective_computes_its_advantages(name):
    objective = objectives.get(name)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 0.0, 1.0, 1.0])
    uid = np.array(["a"] * 4 + ["b"] * 4, dtype=object)
    token_rewards, mask = torch.zeros(8, 3), torch.ones(8, 3)
    token_rewards[:, -1] = rewards
    named = advantage_estimator_for(objective)
    if "rloo" in named:
        theirs, _ = core_algos.compute_rloo_outcome_advantage(token_rewards, mask, uid)
    else:
        theirs, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, uid,
                                                              norm_adv_by_std_in_grpo="=true" in named)
    batch = types.SimpleNamespace(rewards=rewards, group_size=4)
    torch.testing.assert_close(objective.advantages(batch), theirs[:, 0].double(), rtol=0, atol=1e-6)


# -- two ranks (opt-in: each rank imports verl, about 12 s of CPU apiece, beyond this file's budget) ---------------

def _two_rank_worker(rank, port, out, name, split):
    platform_manager.set_platform(CPUPlatform())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        verl_engine.register_engine()
        engine, _ = build_engine(name)
        policy = load_model(MODEL, dtype=torch.float64, device="cpu")
        with torch.no_grad():
            result, rewards = rollouts(policy)
        # verl's dispatch: one prompt group per rank, or (verl V1's balancing) part of each group on each rank
        data, _ = verl_data(result, rewards, engine.objective, policy.eos_token_id,
                            order=SHUFFLED if split else list(range(PROMPTS * G)))
        share = tu.chunk_tensordict(data, 2)[rank]
        with engine.eval_mode():
            engine.infer_batch(share)
        norms, moved = [], []
        for _ in range(2):
            with engine.train_mode():
                metrics = engine.train_batch(share, loss_function=actor_loss())["metrics"]
            norms.append(metrics["grad_norm"])
            moved.append(metrics["dllm_fast/policy_moved"])
            engine.lr_scheduler_step()
        state = parameters(engine)
        if rank == 0:
            torch.save({"parameters": state, "norms": norms, "moved": moved}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,split", [("espo", False), ("espo", True), ("wd1", False), ("wd1", True)])
@pytest.mark.skipif(os.environ.get("DLLM_FAST_VERL_TWO_RANKS") != "1",
                    reason="two verl processes cost about 25 s of CPU; set DLLM_FAST_VERL_TWO_RANKS=1 to run")
def test_two_ranks_give_the_trainers_step_on_the_whole_batch(tmp_path, name, split):
    """FSDP2 over two gloo ranks, each with one prompt group, or (split) each with half of every group, as verl
    V1's dispatch leaves them, which the engine regathers into one whole group per rank: verl's averaged gradient
    and global clipping give the trainer's step on the whole batch in one process (each rank's objective is its
    groups' mean; wd1's group softmax sees each whole group, and its prompt perturbation draws the same on a rank
    whose prompts are all short: `batch.row_masks`), over two updates (the second on the old policy's log-probs,
    which travel with the rows)."""
    from dllm_fast.testing.ranks import run_ranks

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "rank0.pt"
    run_ranks(_two_rank_worker, (port, str(out), name, split), 2, timeout_s=900)
    saved = torch.load(out)
    assert saved["moved"] == [[0.0], [1.0]]
    policy = load_model(MODEL, dtype=torch.float64, device="cpu").train()
    objective = objectives.get(name, **KINDS[name])
    reference = (load_model(MODEL, dtype=torch.float64, device="cpu").eval().requires_grad_(False)
                 if objective.needs_reference else None)
    with torch.no_grad():
        result, rewards = rollouts(policy)
    batch = RolloutBatch.from_generation(result, rewards, group_size=G)
    uids = [f"prompt-{row // G}" for row in range(PROMPTS * G)]
    masks = verl_batch.row_masks(objective, batch, verl_batch.row_keys(batch, uids), seed=42, model=policy)
    batching = MicroBatching(PAIRS)
    with torch.no_grad():
        lp_old = score(policy, batch.sequences, masks, micro_batch=batching, attention_mask=batch.attention_mask)
    optimization = train_step.Optimization(list(policy.parameters()), torch.optim.AdamW(
        policy.parameters(), lr=LR, weight_decay=0.01), grad_clip=1.0)
    for k, update in enumerate([InnerUpdate(masks), InnerUpdate(masks, lp_old=lp_old)]):
        _, norm = train_step.run_update(objective, policy, batch, update, batching=batching,
                                        optimization=optimization, ref_model=reference)
        assert abs(saved["norms"][k] - float(norm)) <= 1e-9
    for parameter_name, p in policy.named_parameters():
        torch.testing.assert_close(saved["parameters"][parameter_name], p.detach(), rtol=0, atol=1e-9,
                                   msg=parameter_name)
