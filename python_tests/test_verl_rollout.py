"""The verl rollout (`rollout.name=dllm_fast`), its server, the plugin's registrations, the rewards and the datasets,
in one process with verl's own config classes (the Ray run is test_verl_end_to_end.py). Needs verl: skipped
without it (pip install "dllm_fast[verl]"; .ci/verl runs these)."""

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

verl = pytest.importorskip("verl", reason="needs verl (pip install \"dllm_fast[verl]\"; .ci/verl installs it)")
pytest.importorskip("ray", reason="needs ray (a dependency of verl)")

import torch  # noqa: E402

from dllm_fast.integrations import verl_plugin  # noqa: E402  (registers, as verl's entry point would)
from dllm_fast.models.llada import LLaDAModel  # noqa: E402
from dllm_fast.rollout import generate  # noqa: E402
from dllm_fast.tasks import get_task  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[1]
SUDOKU4 = str(ROOT / "dllm_fast/assets/sudoku4")
SETTINGS = {"block_length": 8, "steps": 16, "record_unmask_step": True}


def rollout_config(**overrides):
    from verl.workers.config import RolloutConfig

    fields = dict(name="dllm_fast", tensor_model_parallel_size=1, response_length=16, prompt_length=64,
                  dtype="float32", seed=7, engine_kwargs={"dllm_fast": dict(SETTINGS)})
    fields.update(overrides)
    return RolloutConfig(**fields)


def make_rollout(**overrides):
    from verl.workers.config import HFModelConfig

    from dllm_fast.integrations.verl.rollout import DllmFastRollout

    return DllmFastRollout(rollout_config(**overrides), HFModelConfig(path=SUDOKU4), None)


@pytest.fixture(scope="module")
def actor():
    return LLaDAModel.from_pretrained(SUDOKU4, dtype=torch.float32)


def sync(rollout, named):
    asyncio.run(rollout.update_weights(iter(named), global_steps=1))


PROMPTS = [[104, 106, 7, 8, 9, 107], [104, 12, 13]]


def test_plugin_registers_everything_and_reports_no_error():
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.plugin.platform import PlatformRegistry
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from dllm_fast.integrations.verl.replica import DllmFastReplica
    from dllm_fast.integrations.verl.rollout import DllmFastRollout

    assert verl_plugin.ERROR is None, verl_plugin.ERROR
    assert get_rollout_class("dllm_fast", "async") is DllmFastRollout
    assert RolloutReplicaRegistry.get("dllm_fast") is DllmFastReplica
    assert get_reward_manager_cls("dllm_fast").__name__ == "DllmFastRewardManager"
    assert PlatformRegistry.get("cpu").__name__ == "PlatformCPU"
    assert callable(get_policy_loss_fn("dllm_fast_espo"))
    assert "llada" in verl_plugin.REGISTERED["model_types"] or "llada" in _auto_config_types()


def _auto_config_types():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return set(CONFIG_MAPPING.keys())


def test_a_verl_outside_the_supported_range_is_named(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.8.4")
    problem = verl_plugin.verl_version_problem()
    assert "verl 0.8.4" in problem and ">= 0.9.1" in problem and "dllm_fast[verl]" in problem
    monkeypatch.setattr(verl, "__version__", "0.9.1")
    assert verl_plugin.verl_version_problem() is None


def test_rollout_decodes_on_the_actors_own_weights(actor):
    from dllm_fast.integrations.verl.rollout import FORWARDS_KEY, UNMASK_STEP_KEY
    from dllm_fast.tasks.encoding import left_pad

    rollout = make_rollout()
    sync(rollout, ((f"model.{k}", v) for k, v in actor.state_dict().items()))  # the official names
    for (name, mine), theirs in zip(rollout.model.named_parameters(), actor.parameters()):
        assert mine.data_ptr() == theirs.data_ptr(), f"{name} was copied"
    outputs = rollout.decode(PROMPTS, 0.7)

    ids, mask = left_pad(PROMPTS, actor.config.pad_token_id)
    expected = generate(actor, ids, mask, rollout.settings.generate, temperature=0.7,
                        generator=torch.Generator().manual_seed(7), record_unmask_step=True)
    assert [o["token_ids"] for o in outputs] == expected.completion_ids.tolist()
    assert [o[UNMASK_STEP_KEY].tolist() for o in outputs] == expected.unmask_step.tolist()
    assert {o[FORWARDS_KEY] for o in outputs} == {expected.nfe}

    with torch.no_grad():  # an optimizer step, in place: the rollout decodes with it without another copy
        actor.transformer["ff_out"].weight.mul_(-1.0)
    try:
        again = rollout.decode(PROMPTS, 0.0)
        flipped = generate(actor, ids, mask, rollout.settings.generate, temperature=0.0)
        assert [o["token_ids"] for o in again] == flipped.completion_ids.tolist()
    finally:
        with torch.no_grad():
            actor.transformer["ff_out"].weight.mul_(-1.0)


def test_weights_under_wrapper_prefixes_native_names_and_casts(actor):
    rollout = make_rollout(dtype="bfloat16")
    sync(rollout, ((f"base_model.model.diffusion_lm.{k}", v) for k, v in actor.state_dict().items()))
    assert all(p.dtype == torch.bfloat16 for p in rollout.model.parameters())
    head = rollout.model.lm_head_weight
    assert head.data_ptr() != actor.lm_head_weight.data_ptr()  # another dtype: a copy, once per sync
    torch.testing.assert_close(head.float(), actor.lm_head_weight.bfloat16().float())


def test_bad_weights_are_named(actor):
    rollout = make_rollout()
    state = actor.state_dict()
    with pytest.raises(ValueError, match="'model.transformer.not_a_weight'"):
        sync(rollout, [*state.items(), ("model.transformer.not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lack 'transformer.ln_f.weight'"):
        sync(rollout, [(k, v) for k, v in state.items() if k != "transformer.ln_f.weight"])
    with pytest.raises(ValueError, match="lora.merge=True"):
        asyncio.run(rollout.update_weights(iter(state.items()), peft_config={"r": 8}))


def test_release_drops_the_weights_until_the_next_sync(actor):
    rollout = make_rollout()
    sync(rollout, actor.state_dict().items())
    asyncio.run(rollout.release())
    assert all(p.is_meta for p in rollout.model.parameters())
    with pytest.raises(RuntimeError, match="no weights yet"):
        rollout.decode(PROMPTS, 0.0)
    sync(rollout, actor.state_dict().items())
    assert len(rollout.decode(PROMPTS, 0.0)) == 2


@pytest.mark.parametrize("overrides, match", [
    (dict(tensor_model_parallel_size=2), r"tensor_model_parallel_size=2.*set it to 1"),
    (dict(top_p=0.9), r"rollout.top_p=0.9"),
    (dict(top_k=20), r"rollout.top_k=20"),
    (dict(calculate_log_probs=True), r"calculate_log_probs=True"),
    (dict(engine_kwargs={"dllm_fast": {"block_length": 8, "top_p": 1}}), r"dllm_fast.top_p is no dllm_fast"),
    (dict(engine_kwargs={"dllm_fast": {"block_length": 8, "gen_length": 16}}), r"gen_length is set from .*"
                                                                                  "response_length"),
    (dict(engine_kwargs={"dllm_fast": {"steps": 16}}), r"dllm_fast.block_length is required"),
    (dict(engine_kwargs={"dllm_fast": {"block_length": 8, "max_batch_size": 0}}), r"max_batch_size=0"),
])
def test_settings_verl_would_ignore_are_refused_by_name(overrides, match):
    from dllm_fast.integrations.verl.rollout import rollout_settings

    with pytest.raises((ValueError, TypeError), match=match):
        rollout_settings(rollout_config(**overrides))


def test_request_sampling_params_are_checked():
    from dllm_fast.integrations.verl.rollout import check_sampling_params

    assert check_sampling_params({"temperature": 0.5, "top_p": 1.0, "top_k": -1, "logprobs": False}) == 0.5
    with pytest.raises(ValueError, match="top_p=0.5"):
        check_sampling_params({"temperature": 1.0, "top_p": 0.5})
    with pytest.raises(ValueError, match="logprobs"):
        check_sampling_params({"temperature": 1.0, "logprobs": True})


def test_the_fields_the_rollout_records_are_the_ones_the_engine_reads(actor):
    """The decoding order and forward count the rollout records reach the engine's batch reader through both of
    verl's trainers' batches: V1's (each row's extra_fields, built by verl's list_of_dict_to_tensordict as its agent
    loop does) and the legacy trainer's (non_tensor_batch keys, verl's DataProto as the actor receives it). A key
    renamed on one side only fails here."""
    import numpy as np
    from verl import DataProto
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from dllm_fast.integrations.verl import batch as verl_batch
    from dllm_fast.tasks.encoding import left_pad

    rollout = make_rollout()
    sync(rollout, actor.state_dict().items())
    outputs = rollout.decode(PROMPTS, 1.0)
    ids, mask = left_pad(PROMPTS, actor.config.pad_token_id)
    expected = generate(actor, ids, mask, rollout.settings.generate, temperature=1.0,
                        generator=torch.Generator().manual_seed(7), record_unmask_step=True)
    responses = [torch.tensor(o.pop("token_ids")) for o in outputs]
    v1 = list_of_dict_to_tensordict([{"prompts": torch.tensor(p), "responses": r, "uid": f"p{n}", "extra_fields": o}
                                     for n, (p, r, o) in enumerate(zip(PROMPTS, responses, outputs))])
    legacy = DataProto.from_dict(
        tensors={"prompts": ids, "responses": torch.stack(responses),
                 "attention_mask": torch.cat([mask.long(), torch.ones(len(PROMPTS), 16, dtype=torch.long)], 1)},
        non_tensors={"uid": np.array(["p0", "p1"], dtype=object),
                     **{key: np.array([o[key] for o in outputs] + [None], dtype=object)[:-1] for key in outputs[0]}},
    ).to_tensordict()
    for data in (v1, legacy):
        rows = verl_batch.rows_from_verl(data, eos_token_id=actor.eos_token_id, device=torch.device("cpu"),
                                         grouped=False, unmask_step=True)
        assert torch.equal(rows.batch.unmask_step, expected.unmask_step)
        assert rows.batch.forwards == expected.nfe
        assert torch.equal(rows.batch.sequences[:, ids.shape[1]:], expected.completion_ids)


class _InProcessWorker:
    """A worker handle whose `__ray_call__.remote(fn, *args)` runs fn here, counting the calls."""

    def __init__(self):
        self.calls = []
        worker = self

        class _Call:
            @staticmethod
            def remote(fn, *args):
                worker.calls.append(args)
                future = asyncio.get_running_loop().create_future()
                future.set_result(fn(worker, *args))
                return future

        self.__ray_call__ = _Call()


def test_server_batches_concurrent_requests_by_temperature(actor):
    from dllm_fast.integrations.verl.replica import DllmFastServer
    from dllm_fast.integrations.verl.rollout import UNMASK_STEP_KEY

    rollout = make_rollout()
    sync(rollout, actor.state_dict().items())
    worker = _InProcessWorker()
    server = DllmFastServer([worker], max_batch_size=3, batch_wait_s=0.05, replica_rank=0)
    temperatures = [0.0, 0.0, 1.0, 0.0, 0.0]

    async def requests():
        return await asyncio.gather(*[
            server.generate(f"r{i}", [104, 10 + i], {"temperature": t, "top_p": 1.0, "top_k": -1})
            for i, t in enumerate(temperatures)])

    outputs = asyncio.run(requests())
    # 5 requests, at most 3 a batch: [3 arrived first] then [2]; each batch split by temperature.
    assert sorted(len(prompts) for prompts, _ in worker.calls) == [1, 2, 2]
    assert all(len(o.token_ids) == 16 and len(o.extra_fields[UNMASK_STEP_KEY]) == 16 for o in outputs)
    assert all(o.extra_fields["global_steps"] == 1 for o in outputs)
    greedy = rollout.decode([[104, 10]], 0.0)[0]["token_ids"]
    assert outputs[0].token_ids == greedy  # a greedy row does not depend on the batch it was decoded in
    with pytest.raises(ValueError, match="text only"):
        asyncio.run(server.generate("x", [104], {"temperature": 1.0}, image_data=[object()]))


def test_task_rewards_as_verl_reward_functions(tmp_path):
    pd = pytest.importorskip("pandas")
    from dllm_fast.integrations.verl import rewards
    from dllm_fast.integrations.verl.data import write_task

    paths = write_task("sudoku4", tmp_path, num_train=4, num_test=2, prompt_style="grid")
    frame = pd.read_parquet(paths["train"])
    assert list(frame.columns) == ["prompt", "data_source", "reward_model", "extra_info"]
    row = frame.iloc[0]
    task = get_task("sudoku4", prompt_style="grid")
    example = task.train_examples(0)[0]
    assert row["data_source"] == "dllm_fast/sudoku4" and row["prompt"][0]["content"] == example.question
    solution = task.demonstration(example)
    half = solution.replace(example.data["solution"][4], "0", 2)
    for completion in (solution, half, "no answer"):
        got = rewards.compute_score(row["data_source"], completion, row["reward_model"]["ground_truth"],
                                    dict(row["extra_info"]))
        assert got["score"] == task.reward(example, completion)
        assert got["acc"] == float(task.correct(example, completion))
    assert rewards.sudoku4("anything", solution, example.answer, dict(row["extra_info"]))["score"] == 1.0
    with pytest.raises(ValueError, match="names no dllm_fast task"):
        rewards.compute_score("dllm_fast/chess", solution, example.answer, dict(row["extra_info"]))
    with pytest.raises(ValueError, match="extra_info\\['dllm_fast'\\]"):
        rewards.compute_score("dllm_fast/sudoku4", solution, example.answer, {"index": 0})


def test_reward_manager_reads_the_completion_up_to_its_first_eos():
    from dllm_fast.integrations.verl.rewards import _UpToFirstEOS, _by_source
    from dllm_fast.models.loading import load_tokenizer

    tokenizer = load_tokenizer(SUDOKU4)
    eos = tokenizer.eos_token_id
    text = tokenizer.encode("<answer>1234</answer>", add_special_tokens=False)
    after = tokenizer.encode("4321", add_special_tokens=False)
    decoded = _UpToFirstEOS(tokenizer).decode(torch.tensor(text + [eos] + after), skip_special_tokens=True)
    assert decoded == tokenizer.decode(text, skip_special_tokens=True)
    assert tokenizer.decode(text + [eos] + after, skip_special_tokens=True) != decoded  # what `naive` reads
    seen = []
    score = _by_source(lambda **kw: seen.append(kw["data_source"]) or 0.5, custom=False)
    assert score("openai/gsm8k", "x", "1", {}) == 0.5 and seen == ["openai/gsm8k"]
    with pytest.raises(ValueError, match="extra_info"):
        score("dllm_fast/sudoku4", "x", "1", {})  # dllm_fast's rows go to the task, not to the configured one


def test_cpu_platform_answers_verls_device_calls():
    from verl.plugin.platform import PlatformRegistry

    platform = PlatformRegistry.get("cpu")()
    module = platform.device_module
    assert platform.device_name == "cpu" and platform.communication_backend_name() == "gloo"
    assert platform.current_device() == "cpu" and torch.zeros(1).to(platform.current_device()).device.type == "cpu"
    free, total = module.mem_get_info()
    assert 0 < free <= total
    module.empty_cache(), module.synchronize(), module.set_device(0)
    assert platform.is_platform_available() == (not torch.cuda.is_available())


def test_the_entry_point_registers_without_an_environment_variable():
    """In a fresh interpreter: `import verl` alone registers the rollout and the losses (the `verl.plugins` entry
    point of an installed dllm_fast)."""
    points = [p for p in importlib.metadata.entry_points(group="verl.plugins") if p.name == "dllm_fast"]
    if not points:
        pytest.skip("dllm_fast is not installed in this environment (its verl.plugins entry point comes with "
                    "`pip install \"dllm_fast[verl]\"`; .ci/verl installs it)")
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    code = ("import verl, json; from verl.workers.rollout.base import _ROLLOUT_REGISTRY; "
            "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as L; "
            "print(json.dumps([('dllm_fast', 'async') in _ROLLOUT_REGISTRY, 'dllm_fast_espo' in L]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True]


def test_the_launcher_defaults_verls_advantages_to_the_objectives_own():
    """`python -m dllm_fast.integrations.verl` sets the verl estimator that computes the objective's advantages (the
    engine refuses others on the first update), unless the command sets it."""
    from dllm_fast.integrations.verl.__main__ import overrides
    from dllm_fast.integrations.verl.settings import SECTION_PATH

    assert {"algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false"} <= set(overrides([]))
    scaled = overrides([f"++{SECTION_PATH}.objective=bgpo"])
    assert "algorithm.norm_adv_by_std_in_grpo=true" in scaled
    assert "algorithm.adv_estimator=rloo" in overrides([f"++{SECTION_PATH}.objective=coupled_grpo"])
    given = overrides(["algorithm.adv_estimator=gae"])
    assert [a for a in given if a.startswith("algorithm.adv_estimator")] == ["algorithm.adv_estimator=gae"]


def test_the_launchers_loss_and_rollout_follow_the_engines_objective():
    """With the engine, the policy loss defaults to the section's objective's (which the engine accepts; verl's
    vanilla for one not registered as a loss), TraceRL's rollout records its decoding order, and one mini-batch
    per step (verl V1 keeps a prompt's completions together only within the step)."""
    from dllm_fast.integrations.verl.__main__ import overrides
    from dllm_fast.integrations.verl.settings import SECTION_PATH

    assert "actor_rollout_ref.actor.policy_loss.loss_mode=dllm_fast_espo" in overrides([])
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}" in overrides([])
    wd1 = overrides([f"++{SECTION_PATH}.objective=wd1"])
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla" in wd1
    tracerl = overrides([f"++{SECTION_PATH}.objective=tracerl"])
    assert "++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.record_unmask_step=true" in tracerl


@pytest.mark.parametrize("arguments,message", [
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"], "actor.loss_agg_mode='seq-mean-token-sum'"),
    (["trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
     "ppo_mini_batch_size=2 with 2 data-parallel ranks"),
    (["++actor_rollout_ref.model.override_config.dllm_fast.objective=justgrpo",
      "++actor_rollout_ref.model.override_config.dllm_fast.check_advantages=false",
      "actor_rollout_ref.rollout.response_length=64"],
     "actor_rollout_ref.rollout.engine_kwargs.dllm_fast \\(objective justgrpo\\): .*block_length 1"),
    (["++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.top_p=0.9"],
     "engine_kwargs.dllm_fast.top_p is no dllm_fast rollout setting"),
    (["++actor_rollout_ref.model.override_config.dllm_fast.objective=justgrpo"],
     "does not compute justgrpo's advantages.*check_advantages=false"),
])
def test_the_launcher_refuses_a_config_the_engine_cannot_honour_before_ray_starts(arguments, message):
    from dllm_fast.integrations.verl import __main__ as launcher

    with pytest.raises(SystemExit, match=message):
        launcher.check_config(launcher.overrides(["actor_rollout_ref.rollout.n=2", *arguments]))
