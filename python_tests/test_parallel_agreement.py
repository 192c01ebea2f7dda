"""`plan` and `train` agree on which --parallel / --expert-parallel combinations run on N GPUs: every combination
train accepts (train/run.check_parallel, what RunSetup checks of them) the planner plans (its checks of them:
ParallelSettings as plan's flags build it, the rank's share of the prompts, the rank's model of its experts), and
every one train refuses the planner refuses too."""

import pytest

from dllm_fast.train.config import TrainConfig

COMBINATIONS = [(model, world, parallel, experts) for model in ("llada2-tiny", "sudoku4") for world in (1, 2, 4, 8)
                for parallel in ("ddp", "fsdp2") for experts in (1, 2, 4)]


def _skeletons():
    from dllm_fast.train.run import model_and_tokenizer_plan

    return {model: model_and_tokenizer_plan(_config(model, "ddp", 1))[2] for model in ("llada2-tiny", "sudoku4")}


def _config(model: str, parallel: str, experts: int) -> TrainConfig:
    return TrainConfig(model=model, parallel=parallel, expert_parallel=experts, prompts_per_step=8, group_size=2,
                       **({"block_length": 4, "gen_length": 8, "diffusion_steps": 4, "eval_gen_lengths": [8]}
                          if model == "llada2-tiny" else {}))


def _outcome(check) -> str | None:
    try:
        check()
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow  # about 15 s: two models' skeletons and 48 combinations
def test_plan_and_train_accept_the_same_parallel_combinations():
    from dllm_fast.planning.layout import expert_rank_config
    from dllm_fast.planning.parallel import rank_config
    from dllm_fast.planning.planner import parallel_settings
    from dllm_fast.train.run import check_parallel

    skeletons = _skeletons()

    def planned(config, world, skeleton):
        settings = parallel_settings(config, world=world, expert_parallel=config.run.expert_parallel)  # plan's CLI
        rank_config(config, world)
        expert_rank_config(skeleton.config, settings.expert_parallel)

    accepted = []
    for model, world, parallel, experts in COMBINATIONS:
        config = _config(model, parallel, experts)
        train = _outcome(lambda: check_parallel(config, skeletons[model], world))
        plan = _outcome(lambda: planned(config, world, skeletons[model]))
        where = f"--model {model} --gpus {world} --parallel {parallel} --expert-parallel {experts}"
        assert (train is None) == (plan is None), f"{where}: train says {train!r}, plan says {plan!r}"
        if train is None:
            accepted.append((model, world, parallel, experts))
    # both modes take expert parallelism on several ranks, LLaDA2 only
    assert ("llada2-tiny", 2, "ddp", 2) in accepted and ("llada2-tiny", 4, "fsdp2", 2) in accepted
    assert ("llada2-tiny", 4, "fsdp2", 4) in accepted and ("llada2-tiny", 1, "ddp", 2) not in accepted
    assert not any(model == "sudoku4" and experts > 1 for model, _, _, experts in accepted)
