"""GenerateConfig (issue 30 item 2): the rollout settings as one object. A config decodes the tokens its keywords
decode, keywords over a config override its fields, a bad field is refused by its name, generate's signature stays
at most 8 parameters, and the trainer, its evaluation, the planner and the TRL rollout function each pass generate
one GenerateConfig: the TrainConfig's."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import types

import pytest
import torch

import dllm_fast
from dllm_fast import reference
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.rollout import GenerateConfig
from dllm_fast.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(gen_length=8, block_length=4, steps=4)


def tiny_model():
    return LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), seed=3).eval()


def prompts():
    ids = torch.randint(0, 120, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 126, 0  # a left-padded row
    return ids, mask


def seeded():
    return torch.Generator().manual_seed(11)


def spy_on_generate(monkeypatch, module_name: str) -> list:
    """Record what `module_name` passes generate (the config, and the other keywords' names), then decode."""
    module = importlib.import_module(module_name)
    real, calls = module.generate, []

    def recording(model, input_ids, attention_mask=None, config=None, **keywords):
        calls.append((config, sorted(keywords)))
        return real(model, input_ids, attention_mask, config, **keywords)

    monkeypatch.setattr(module, "generate", recording)
    return calls


# -- one object, the same tokens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    BASE,
    dict(gen_length=8, block_length=4, steps=8, temperature=0.8, remasking="random", cache="dual"),
    dict(gen_length=8, block_length=8, threshold=0.5, cache="prefix", logits_eos_inf=True,
         confidence_eos_eot_inf=True),
    dict(gen_length=8, block_length=4, steps=4, cfg_scale=1.5, temperature=1.0),
])
def test_a_config_decodes_the_tokens_its_keywords_decode(settings):
    model, (ids, mask) = tiny_model(), prompts()
    config = GenerateConfig(**settings)
    for sampler in (dllm_fast.generate, reference.generate):
        by_keywords = sampler(model, ids, mask, generator=seeded(), **settings)
        by_config = sampler(model, ids, mask, config, generator=seeded())
        assert torch.equal(by_config.sequences, by_keywords.sequences) and by_config.nfe == by_keywords.nfe


def test_keywords_over_a_config_override_its_fields(monkeypatch):
    """generate(config, **settings) decodes dataclasses.replace(config, **settings); a config alone travels as
    itself."""
    model, (ids, mask) = tiny_model(), prompts()
    config = GenerateConfig(**BASE, temperature=1.0, cache="dual")
    overridden = dllm_fast.generate(model, ids, mask, config, temperature=0.0, steps=8, generator=seeded())
    replaced = dllm_fast.generate(model, ids, mask, dataclasses.replace(config, temperature=0.0, steps=8))
    assert torch.equal(overridden.sequences, replaced.sequences)
    checked = []
    module = importlib.import_module("dllm_fast.rollout.sampler")
    real = module.check_generate_args
    monkeypatch.setattr(module, "check_generate_args", lambda *args, **kw: checked.append(args[3]) or real(*args, **kw))
    dllm_fast.generate(model, ids, mask, config)
    dllm_fast.generate(model, ids, mask, config, cache="none", threshold=0.9, steps=None)
    assert checked[0] is config
    assert checked[1] == GenerateConfig(**{**BASE, "steps": None}, temperature=1.0, threshold=0.9)


def test_the_config_is_frozen_and_generate_takes_at_most_9_parameters():
    # 9: the records beside the config (record_unmask_step, MDPO's record_step_predictions) and d-TreeRPO's resume
    assert len(inspect.signature(dllm_fast.generate).parameters) <= 9
    assert len(inspect.signature(reference.generate).parameters) <= 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerateConfig(**BASE).steps = 8


# -- the same errors, naming the field ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, error, match", [
    ("gen_length", 6, ValueError, r"gen_length=6 is not a multiple of block_length=4"),
    ("block_length", 0, ValueError, r"block_length=0 must be an int >= 1"),
    ("steps", 3, ValueError, r"steps=3 is not a multiple of the number of blocks 2"),
    ("temperature", -1.0, ValueError, r"temperature=-1\.0"),
    ("remasking", "sideways", ValueError, r"remasking='sideways' is not one of"),
    ("cfg_scale", float("nan"), ValueError, r"cfg_scale=nan must be a finite number"),
    ("cache", "full", ValueError, r"cache='full' is not one of"),
    ("threshold", 1.5, ValueError, r"threshold=1\.5"),
    ("logits_eos_inf", 1, TypeError, r"logits_eos_inf=1 must be True or False"),
    ("confidence_eos_eot_inf", "yes", TypeError, r"confidence_eos_eot_inf='yes' must be True or False"),
    ("compile", "yes", TypeError, r"compile='yes' must be True or False"),
    ("assumed_steps_per_block", 2, ValueError, r"assumed_steps_per_block=2 replaces threshold decoding"),
])
def test_a_bad_field_is_refused_by_its_name_as_config_and_as_keyword(field, value, error, match):
    model, (ids, mask) = tiny_model(), prompts()
    settings = {**BASE, field: value}
    with pytest.raises(error, match=match):
        dllm_fast.generate(model, ids, mask, GenerateConfig(**settings))
    with pytest.raises(error, match=match):
        dllm_fast.generate(model, ids, mask, **settings)
    with pytest.raises(error, match=match):
        dllm_fast.generate(model, ids, mask, GenerateConfig(**BASE), **{field: value})


def test_unknown_settings_missing_lengths_and_a_wrong_config_are_refused():
    model, (ids, mask) = tiny_model(), prompts()
    with pytest.raises(TypeError, match="unexpected keyword argument 'gen_len'; the rollout settings are"):
        dllm_fast.generate(model, ids, mask, gen_len=8, block_length=4, steps=4)
    with pytest.raises(TypeError, match="generate\\(\\) needs gen_length and block_length"):
        dllm_fast.generate(model, ids, mask, steps=4)
    with pytest.raises(TypeError, match="takes config=GenerateConfig\\(...\\) or None, got dict"):
        dllm_fast.generate(model, ids, mask, dict(BASE))
    with pytest.raises(ValueError, match="compile=True: the reference sampler runs eagerly"):
        reference.generate(model, ids, mask, GenerateConfig(**BASE, compile=True))


# -- the callers pass the TrainConfig's one object ---------------------------------------------------------------

def test_a_train_config_gives_its_rollouts_settings_as_one_config():
    config = TrainConfig(gen_length=16, block_length=8, diffusion_steps=None, threshold=0.9, temperature=0.7,
                         remasking="random", cache="dual")
    expected = GenerateConfig(gen_length=16, block_length=8, steps=None, temperature=0.7, remasking="random",
                              cache="dual", threshold=0.9, compile=False)
    assert config.generate_config("cpu") == expected  # --compile auto: eager on CPU
    assert config.generate_config("cuda") == dataclasses.replace(expected, compile=True)
    assert TrainConfig(compile=True).generate_config("cpu").compile


def test_the_trainer_and_its_evaluation_pass_generate_the_train_configs_one_object(tmp_path, monkeypatch):
    from dllm_fast.train import train

    rollouts = spy_on_generate(monkeypatch, "dllm_fast.train.step")
    evaluations = spy_on_generate(monkeypatch, "dllm_fast.train.evaluation")
    config = TrainConfig(model="tiny", task="synthetic", task_options={"prompt_length": 16}, prompts_per_step=2,
                         group_size=2, gen_length=8, block_length=4, diffusion_steps=4, temperature=0.7,
                         remasking="random", cache="dual", steps=1, eval_every=1, eval_examples=2,
                         eval_gen_lengths=[8, 12], checkpoint_every=10, progress=False, plot=False, threads=1,
                         output_dir=str(tmp_path / "run"))
    train(config)
    expected = config.generate_config("cpu")
    assert rollouts == [(expected, ["generator", "record_unmask_step"])]
    # evaluation: the rollouts' settings at each length's schedule (steps per token kept), greedy and eager
    at_8 = dataclasses.replace(expected, temperature=0.0, compile=False)
    at_12 = dataclasses.replace(at_8, gen_length=12, steps=6)
    assert evaluations == [(at_8, ["generator"]), (at_12, ["generator"])] * 2  # the base model, then step 1


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_the_planner_passes_generate_the_train_configs_one_object(threshold, monkeypatch):
    from dllm_fast.planning.accounting import Target
    from dllm_fast.planning.step import Session

    calls = spy_on_generate(monkeypatch, "dllm_fast.train.step")
    config = TrainConfig(model="tiny", prompts_per_step=1, group_size=2, gen_length=8, block_length=4,
                         diffusion_steps=None if threshold else 4, threshold=threshold, cache="dual", micro_batch=4,
                         objective="vrpo_ol", bf16=False)
    with Session(config, target=Target("cpu")) as session:
        session.rollout(prompts=1, group_size=2, prompt_length=8)
    expected = config.generate_config("cpu")
    if threshold is not None:  # the planner's one addition: no masked count can be read on fake tensors
        expected = dataclasses.replace(expected, assumed_steps_per_block=4)
    assert calls == [(expected, ["generator", "record_unmask_step"])]


def test_the_trl_rollout_function_passes_generate_one_object(monkeypatch):
    pytest.importorskip("trl")
    from dllm_fast.integrations import trl_example
    from dllm_fast.integrations.trl import make_rollout_func

    calls = spy_on_generate(monkeypatch, "dllm_fast.train.step")
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), process_index=0, autocast=contextlib.nullcontext)
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(max_completion_length=8, temperature=0.5),
                                    accelerator=accelerator, processing_class=trl_example.build_tokenizer(),
                                    model=tiny_model(), chat_template_kwargs={})
    config = TrainConfig(gen_length=8, block_length=4, diffusion_steps=4, temperature=0.7, cache="dual",
                         compile=False).generate_config("cpu")
    completions = [make_rollout_func(config, seed=1)(["a1 b70", "b99"], trainer)["completion_ids"],
                   make_rollout_func(seed=1, **dataclasses.asdict(config))(["a1 b70", "b99"], trainer)["completion_ids"]]
    make_rollout_func(config, temperature=0.0)(["a1"], trainer)
    make_rollout_func(block_length=4)(["a1"], trainer)  # the rest from the trainer: its length and temperature
    assert [call[0] for call in calls] == [config, config, dataclasses.replace(config, temperature=0.0),
                                           GenerateConfig(gen_length=8, block_length=4, steps=8, temperature=0.5)]
    assert completions[0] == completions[1]
    with pytest.raises(TypeError, match="make_rollout_func\\(\\) got an unexpected keyword argument 'gen_len'"):
        make_rollout_func(gen_len=8)
