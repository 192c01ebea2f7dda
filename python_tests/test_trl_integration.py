"""The TRL adapter on CPU with a tiny random LLaDA model: training steps through TRL with finite losses and nonzero
gradients, the objective's gradient through accelerate equal to a direct Objective.backward, rollouts, the
PreTrainedModel wrapper, and the config checks."""

import contextlib
import copy
import math
import os
import types
import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import dllm_fast  # noqa: E402
from dllm_fast.integrations import trl_example  # noqa: E402
from dllm_fast.integrations.trl import (DiffusionPreTrainedModel, check_trl_config, left_pad,  # noqa: E402
                                        make_rollout_func)
from dllm_fast.models import LLaDAConfig, LLaDAModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, MASK = 126, 127


class GradientNorms(TrainerCallback):
    """Records the gradient norm of the trainable parameters before every optimizer step."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0)


def trained_parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_two_training_steps_give_finite_losses_and_nonzero_gradients(tmp_path):
    trainer = trl_example.build_trainer(str(tmp_path), objective="diffu_grpo", steps=2)
    norms = GradientNorms()
    trainer.add_callback(norms)
    before = trained_parameters(trainer.model)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert len(norms.norms) == 2 and all(n > 0 for n in norms.norms)
    after = trained_parameters(trainer.model)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert all("objective/clip_fraction" in row for row in rows)
    # diffu_grpo's default beta needs a reference: the initial weights, which the policy has left after step 1.
    assert rows[0]["objective/kl"] == 0 and rows[1]["objective/kl"] > 0
    torch.manual_seed(0)
    initial = LLaDAModel(LLaDAConfig.preset("tiny"))  # build_trainer's model before training
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(trainer._reference(ids), initial(ids))
        assert not torch.allclose(trainer.model(ids), initial(ids))


def test_a_bf16_trainer_keeps_its_reference_copy_in_bf16(tmp_path):
    """GRPOConfig(bf16=True): the frozen reference copy is stored in bf16 (the policy's weights are the caller's)."""
    trainer = trl_example.build_trainer(str(tmp_path), objective="diffu_grpo", steps=1, bf16=True)
    assert {p.dtype for p in trainer._reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in trainer._reference.parameters())


def test_lora_off_policy_iterations_with_a_reference(tmp_path):
    """PEFT adapters train and the base is the reference; the second use of a rollout (num_iterations=2) comes
    after an optimizer step, so the old policy was scored on its masks when it was generated."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = trl_example.build_trainer(str(tmp_path), objective="diffu_grpo", steps=2, num_iterations=2,
                                        peft_config=config)  # diffu_grpo's default beta=0.04 needs a reference
    assert trainer._reference is None
    norms = GradientNorms()
    trainer.add_callback(norms)
    trainer.train()
    assert all(n > 0 for n in norms.norms)
    assert all(("lora_" in name) == p.requires_grad for name, p in trainer.model.named_parameters())
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert rows[0]["objective/ratio_mean"] == 1.0  # on-policy: the rollout's first use
    assert rows[1]["objective/ratio_mean"] != 1.0  # off-policy: scored against the old policy
    assert rows[1]["objective/kl"] > 0  # against the adapter-free base
    assert trainer._updates[0][1].update.lp_old is not None and trainer._updates[0][0].update.lp_old is None


def test_the_gradient_is_the_objectives_scaled_by_accumulation(tmp_path):
    def alternating(completions, **kwargs):  # every group has a spread of rewards, whatever was sampled
        return [float(i % 2) for i in range(len(completions))]

    trainer = trl_example.build_trainer(str(tmp_path), objective="wd1", steps=1, gradient_accumulation_steps=2,
                                        per_device_train_batch_size=4, steps_per_generation=2,
                                        reward_funcs=[alternating])
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    dataset_rows = [{"prompt": p} for p in trainer.train_dataset["prompt"][:2] for _ in range(4)]
    policy = trainer.model.diffusion_lm
    reference = LLaDAModel(LLaDAConfig.preset("tiny"))
    reference.load_state_dict(policy.state_dict())
    trainer.training_step(trainer.model, dataset_rows)
    update = trainer._updates[0][0]
    assert update.batch.num_rollouts == 4 and update.batch.group_size == 4
    assert update.batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    trainer.objective.backward(reference, update.batch, update.update, micro_batch=4)
    for got, want in zip(policy.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad / 2, rtol=1e-5, atol=1e-8)
    assert all(p.grad.abs().sum() > 0 for p in policy.parameters())


class EndsAfter(torch.nn.Module):
    """A model-contract stand-in whose greedy completion of row r is token 3 for 2 + r positions, then EOS."""

    mask_token_id, eos_token_id, logit_shift = MASK, EOS, 0

    def __init__(self):
        super().__init__()
        self.lm_head_weight = torch.nn.Parameter(torch.eye(128))

    def forward(self, input_ids, attention_mask=None):
        B, S = input_ids.shape
        hidden = torch.zeros(B, S, 128)
        hidden[..., 3] = 5.0
        completion_start = S - 8
        for row in range(B):
            hidden[row, completion_start + 2 + row:, EOS] = 10.0
        return hidden


def fake_trainer(model, tokenizer):
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), process_index=0, autocast=contextlib.nullcontext)
    args = types.SimpleNamespace(max_completion_length=8, temperature=0.0)
    return types.SimpleNamespace(args=args, accelerator=accelerator, processing_class=tokenizer, model=model,
                                 chat_template_kwargs={})


def test_rollouts_end_at_the_first_eos_and_restore_the_mode():
    tokenizer = trl_example.build_tokenizer()
    model = EndsAfter().train()
    rollout = make_rollout_func(block_length=4)
    prompts = ["a1 b70 a5", "b99", "a3 a4"]
    out = rollout(prompts, fake_trainer(model, tokenizer))
    assert out["logprobs"] is None
    assert out["prompt_ids"] == [[1, 70, 5], [99], [3, 4]]
    assert out["completion_ids"] == [[3, 3, EOS], [3, 3, 3, EOS], [3, 3, 3, 3, EOS]]
    assert model.training


def test_threshold_decoding_sets_its_own_steps():
    trainer = fake_trainer(EndsAfter(), trl_example.build_tokenizer())
    out = make_rollout_func(block_length=8, threshold=0.9)(["a1", "b99"], trainer)
    assert out["completion_ids"] == [[3, 3, EOS], [3, 3, 3, EOS]]


@pytest.mark.compile
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.slow
def test_the_rollout_function_passes_cache_and_compile_to_generate(cache, monkeypatch):
    """cache= and compile= reach generate: the completions are generate's own for that cache; compile=True runs
    the compiled step (counted; aot_eager keeps it seconds) with the same tokens."""
    import importlib

    from torch._dynamo.testing import CompileCounterWithBackend

    from dllm_fast.rollout.step import denoise_step

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr(importlib.import_module("dllm_fast.rollout.sampler"), "compiled_step", lambda device: step)
    tokenizer = trl_example.build_tokenizer()
    model = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), seed=3).eval()
    trainer = fake_trainer(model, tokenizer)
    prompts = ["a1 b70 a5", "b99"]
    options = dict(gen_length=8, block_length=4, steps=4, temperature=1.0, seed=5)
    eager, compiled = (make_rollout_func(cache=cache, compile=compile, **options)(prompts, trainer)
                       for compile in (False, True))
    input_ids, attention_mask = left_pad([[1, 70, 5], [99]], EOS, torch.device("cpu"))
    direct = dllm_fast.generate(model, input_ids, attention_mask, gen_length=8, block_length=4, steps=4,
                                temperature=1.0, cache=cache, generator=torch.Generator().manual_seed(5))
    lengths = direct.completion_mask.sum(-1).tolist()
    assert eager["completion_ids"] == [row[:n] for row, n in zip(direct.completion_ids.tolist(), lengths)]
    assert compiled["completion_ids"] == eager["completion_ids"]
    assert counter.frame_count >= 1  # compile=True ran the compiled step
    with pytest.raises(ValueError, match=r"cache='full' is not one of \('none', 'prefix', 'dual', 'block'\)"):
        make_rollout_func(cache="full")
    with pytest.raises(TypeError, match="compile='yes' must be True or False"):
        make_rollout_func(compile="yes")


def test_conversational_prompts_use_the_chat_template():
    tokenizer = trl_example.build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}a0"
    out = make_rollout_func(block_length=4)([[{"role": "user", "content": "b99 b64"}]],
                                            fake_trainer(EndsAfter(), tokenizer))
    assert out["prompt_ids"] == [[99, 64, 0]]


def test_the_wrapper_keeps_the_contract_and_the_weights(tmp_path):
    torch.manual_seed(0)
    inner = LLaDAModel(LLaDAConfig.preset("tiny"))
    weights = copy.deepcopy(inner.state_dict())
    wrapped = DiffusionPreTrainedModel(inner)
    assert all(torch.equal(weights[k], v) for k, v in inner.state_dict().items())  # post_init left them alone
    assert isinstance(wrapped, dllm_fast.DiffusionLM) and wrapped.logit_shift == 0
    assert (wrapped.mask_token_id, wrapped.eos_token_id, wrapped.eot_token_id) == (MASK, EOS, 125)
    assert wrapped.generation_config.eos_token_id == EOS and wrapped.lm_head_weight is inner.lm_head_weight
    ids = torch.randint(0, 100, (2, 4))
    kwargs = dict(gen_length=8, block_length=4, steps=8, cache="prefix")
    assert torch.equal(dllm_fast.generate(wrapped, ids, **kwargs).sequences,
                       dllm_fast.generate(inner, ids, **kwargs).sequences)
    wrapped.save_pretrained(tmp_path)
    loaded = LLaDAModel.from_pretrained(tmp_path)
    assert all(torch.equal(weights[k], v) for k, v in loaded.state_dict().items())
    with pytest.raises(TypeError, match="lacks lm_head_weight"):
        DiffusionPreTrainedModel(torch.nn.Linear(2, 2))


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], 126, "cpu")
    assert ids.tolist() == [[5, 6, 7], [126, 126, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left_pad([[1, 2], [3, 4]], 126, "cpu")[1] is None
    with pytest.raises(ValueError, match="empty prompt"):
        left_pad([[1], []], 126, "cpu")


def config(**overrides):
    options = dict(output_dir="unused", num_generations=4, per_device_train_batch_size=8, use_cpu=True, bf16=False,
                   report_to="none", **trl_example.activation_checkpointing(True))
    options.update(overrides)
    return GRPOConfig(**options)


def test_configs_the_trainer_cannot_honour_are_rejected():
    with pytest.raises(ValueError, match=r"GRPOConfig.beta=0.04 .* objectives.get\('diffu_grpo', beta=0.04\)"):
        check_trl_config(config(beta=0.04))
    with pytest.raises(ValueError, match="per_device_train_batch_size=6 must be a multiple of num_generations=4"):
        check_trl_config(config(per_device_train_batch_size=6, generation_batch_size=24))
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        check_trl_config(config(top_entropy_quantile=0.5))
    check_trl_config(config())


@pytest.mark.parametrize("name", ["coupled_grpo", "gdpo"])
def test_the_new_objectives_train_through_trl(tmp_path, name):
    """coupled_grpo and gdpo through TRL's loop: a finite loss, on-policy ratios of exactly 1 (one iteration)."""
    trainer = trl_example.build_trainer(str(tmp_path), objective=name, steps=1)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])
    assert rows[0]["objective/ratio_mean"] == 1.0 and rows[0]["objective/clip_fraction"] == 0.0


def test_the_example_uses_current_option_names_and_refuses_no_steps(tmp_path, capsys):
    """transformers 5 warns on GRPOConfig's gradient_checkpointing (now activation_checkpointing); TRL reads
    max_steps <= 0 as "train by epochs", so the example trained with --steps 0 and --steps -1."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        trl_example.build_trainer(str(tmp_path), steps=1)
    for steps in ("0", "-1"):
        with pytest.raises(SystemExit) as exit:
            trl_example.main(["--steps", steps])
        assert exit.value.code == 2 and f"--steps: takes an integer >= 1, got '{steps}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        trl_example.build_trainer(str(tmp_path), steps=0)


# -- issue 40: block models through TRL: their cache, and TraceRL on prompts of different lengths ------------------

def sdar_trainer(tmp_path, model=None, **rollout):
    from datasets import Dataset

    from dllm_fast import objectives
    from dllm_fast.integrations.trl import DiffusionGRPOTrainer
    from dllm_fast.models import SDARConfig, SDARModel

    torch.manual_seed(0)
    model = model if model is not None else SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"))
    prompts = ["a1 b70 a5", "b99 b64", "a10 a11 a12 b100", "b80"]  # 3, 2, 4 and 1 tokens: every alignment
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                      gradient_accumulation_steps=1, max_completion_length=8, learning_rate=1e-3, temperature=1.0,
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0)
    return DiffusionGRPOTrainer(model=model, reward_funcs=[trl_example.a_words_reward], args=args,
                                train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                                processing_class=trl_example.build_tokenizer(),
                                objective=objectives.get("tracerl", preset="sdar"),
                                rollout_func=make_rollout_func(**rollout))


@pytest.mark.parametrize("rollout", [dict(steps=8, cache="block"), dict(steps=8), dict(steps=4, threshold=0.5),
                                     dict(steps=8, cache="block", full_last_block=True)],
                         ids=["block cache", "no cache", "dynamic", "full last block"])
def test_tracerl_trains_a_block_model_on_prompts_of_different_lengths(tmp_path, rollout):
    """Issue 40 item 1: the rollout ran 11 forwards for gen_length 8 (each row's blocks align to its own first
    token), and the adapter bounded unmask_step by gen_length: "unmask_step[4, 3] = 8 is not a denoising step in
    [0, 8)". It is bounded by the rollout's forwards (nfe), as in the library's own trainer."""
    trainer = sdar_trainer(tmp_path, **rollout)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])
    batch = trainer._updates[0][0].batch
    assert batch.forwards == trainer._rollout_forwards and int(batch.unmask_step.max()) < batch.forwards


def test_the_rollout_func_takes_a_block_models_cache_and_the_trainer_checks_it_against_its_model(tmp_path):
    """Issue 40 item 5: make_rollout_func(cache="block") said 'block' is not one of none, prefix, dual."""
    from dllm_fast.models import SDARConfig, SDARModel
    from dllm_fast.rollout.cache import BlockCache

    sdar = DiffusionPreTrainedModel(SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny")))
    out = make_rollout_func(cache="block", steps=8)(["a1 b70 a5", "b99"], fake_trainer(sdar, trl_example.build_tokenizer()))
    assert len(out["completion_ids"]) == 2
    make_rollout_func(cache=BlockCache())  # a policy object, as generate takes it
    with pytest.raises(ValueError, match=r"cache='block' keeps the exact keys and values of finished blocks"):
        sdar_trainer(tmp_path, LLaDAModel(LLaDAConfig.preset("tiny")), cache="block", block_length=4, steps=8)
    with pytest.raises(ValueError, match=r"cache='dual' is Fast-dLLM's approximate cache .* pass cache='block'"):
        sdar_trainer(tmp_path, cache="dual", steps=8)
    with pytest.raises(TypeError, match=r"full_last_block='yes' must be True or False"):
        make_rollout_func(full_last_block="yes")
