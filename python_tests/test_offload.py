"""Host offload and the optimizer's implementation (issue 46 items 1 and 5): `--reference-offload true` (a full
fine-tune's reference copy sharded by FSDP2 into host memory, CPUOffloadPolicy), `--fsdp-offload true` (the
policy's shards, gradients and AdamW state too), and train's AdamW (fused on CUDA, torch's default elsewhere:
train/optimizer.py). The flags are refused where they cannot work; on gloo ranks in fp64 the offloaded runs' weights
after two optimizer steps equal one process's (which equals the non-offloaded FSDP2 run, test_fsdp2.py) to 1e-10;
and the planner prices both (the reference's shards off the GPU, its host copies; no AdamW temporary for fused)."""

import dataclasses
import os
import sys
from datetime import timedelta

import pytest
import torch

from dllm_fast.testing.ranks import run_ranks
from dllm_fast.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------
# train's AdamW


def test_adamw_is_fused_on_cuda_and_torchs_default_elsewhere():
    from dllm_fast.train.optimizer import adamw_implementation, build_adamw

    weights = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    optim = TrainConfig().optim
    assert adamw_implementation(weights) == "default"  # CPU tensors: unchanged
    assert adamw_implementation(weights, "cuda") == "fused"  # a plan's fake tensors taken as on CUDA
    assert adamw_implementation([*weights, torch.nn.Parameter(torch.zeros(2, dtype=torch.int64),
                                                              requires_grad=False)], "cuda") == "default"
    assert adamw_implementation([], "cuda") == "default"
    cpu = build_adamw(weights, optim)
    assert not cpu.defaults["fused"] and cpu.defaults["foreach"] is None  # torch's own choice, as before
    assert (cpu.defaults["lr"], cpu.defaults["betas"], cpu.defaults["weight_decay"]) == (
        optim.lr, tuple(optim.betas), optim.weight_decay)
    assert build_adamw(weights, optim, device_type="cuda").defaults["fused"]


def test_a_plan_builds_the_adamw_train_builds_on_its_device():
    """The planner's session steps train's AdamW: fused for a GPU (its step counters on the device), torch's default
    on the CPU (the counters on the host)."""
    from dllm_fast.planning.accounting import Target
    from dllm_fast.planning.gpus import GPUS
    from dllm_fast.planning.step import Session

    state = {}
    for target in (Target("cuda", GPUS["h100"]), Target("cpu")):
        with Session(TrainConfig(model="tiny"), target=target) as session:
            state[target.device_type] = session.accountant.memory["optimizer_state"]
            assert bool(session.optimizer.defaults["fused"]) == (target.device_type == "cuda")
    assert state["cuda"] > state["cpu"]  # the counters: a few bytes each, in CUDA's 512-byte blocks


def test_the_planner_prices_fused_adamw_without_a_temporary_and_at_28_bytes_an_element():
    """A plan for a GPU builds train's fused AdamW: its step allocates no temporary the size of the weights (the
    foreach step's square roots) and moves 28 bytes a trained fp32 element (read weight, gradient, two moments;
    write weight and moments), where foreach's in-place ops, which return nothing, are counted too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dllm_fast.planning.accounting import Accountant, Target
    from dllm_fast.planning.gpus import GPUS

    elements = 8 * 256 * 256

    def step(**kind):
        with FakeTensorMode():
            weights = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(8)]
            for p in weights:
                p.grad = torch.zeros_like(p)
            optimizer = torch.optim.AdamW(weights, lr=1e-3, **kind)
            optimizer.step()  # the state exists, as in a plan's steady state
            accountant = Accountant(Target("cuda", GPUS["h100"]))
            with accountant:
                for p in weights:
                    accountant.track(p, "parameters")
                    accountant.track(p.grad, "gradients")
                for state in optimizer.state.values():
                    accountant.track(state["exp_avg"], "optimizer_state")
                    accountant.track(state["exp_avg_sq"], "optimizer_state")
                mark = accountant.mark()
                optimizer.step()
            accountant.release(mark)
            return mark.peak_memory["temporaries"], mark.costs.bytes

    fused_temporaries, fused_bytes = step(fused=True)
    foreach_temporaries, foreach_bytes = step(foreach=True)
    assert fused_temporaries == 0 and foreach_temporaries >= elements * 4
    assert 28 * elements <= fused_bytes < 29 * elements  # and the step counts' few bytes
    assert foreach_bytes > 2 * fused_bytes  # a dozen passes over the state


# ---------------------------------------------------------------------------------------------------------
# the flags


def test_offload_flags_need_fsdp2_and_a_reference_to_offload():
    with pytest.raises(ValueError, match="--reference-offload true offloads FSDP2's shards to the host; add "
                                         "--parallel fsdp2"):
        TrainConfig(reference_offload=True)
    with pytest.raises(ValueError, match="--fsdp-offload true offloads FSDP2's shards"):
        TrainConfig(fsdp_offload=True, parallel="ddp")
    with pytest.raises(ValueError, match="with --lora true the reference is the policy's own base"):
        TrainConfig(parallel="fsdp2", reference_offload=True, lora=True, objective="espo",
                    objective_options={"beta": 0.05})
    with pytest.raises(ValueError, match="uses no reference; leave it false"):
        TrainConfig(parallel="fsdp2", reference_offload=True, objective="espo", objective_options={"beta": 0.0})
    TrainConfig(parallel="fsdp2", reference_offload=True, objective="espo", objective_options={"beta": 0.05})
    TrainConfig(parallel="fsdp2", fsdp_offload=True, lora=True)


def test_offload_is_refused_on_one_process_and_under_one_expert_group(tmp_path):
    """Nothing is sharded on one process, and one expert group keeps a rank's experts whole, outside FSDP2's shards:
    refused before anything is written. Several groups shard the experts over their replicas: offloaded alike."""
    from dllm_fast.planning.layout import ParallelSettings
    from dllm_fast.train.distributed import Ranks, check_offload
    from dllm_fast.train.run import RunSetup
    from dllm_fast.train.run_dir import RunDirectory

    config = TrainConfig(output_dir=str(tmp_path / "run"), parallel="fsdp2", fsdp_offload=True, device="cpu")
    with pytest.raises(ValueError, match="--fsdp-offload true offload FSDP2's shards to the host, and this is one "
                                         "process"):
        RunSetup(config, Ranks(), RunDirectory(config.run.output_dir, Ranks()))
    config = config.replace(expert_parallel=2, prompts_per_step=2)
    with pytest.raises(ValueError, match="with --expert-parallel 2 on 2 ranks: one expert group keeps each rank's "
                                         "routed experts whole"):
        RunSetup(config, Ranks(0, 2), RunDirectory(config.run.output_dir, Ranks(0, 2)))
    assert not (tmp_path / "run").exists()
    check_offload(config, True, 4)  # two groups of two: the experts are FSDP2 shards over their replicas
    for world, refused in ((2, True), (4, False)):  # the planner draws the same line
        settings = dict(world=world, parallel="fsdp2", expert_parallel=2, fsdp_offload=True)
        if refused:
            with pytest.raises(ValueError, match="one expert group keeps each rank's routed experts whole"):
                ParallelSettings(**settings)
        else:
            ParallelSettings(**settings)


def test_the_wrapper_hands_fsdp2_the_offload_policy(monkeypatch):
    """offload=True: every unit and the root get CPUOffloadPolicy (pinned on CUDA); off, the plain OffloadPolicy."""
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy

    from dllm_fast.models import LLaDAConfig, LLaDAModel
    from dllm_fast.train.distributed import Ranks, data_parallel_wrapper

    placed = []
    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh", lambda device, shape: ("mesh", shape))
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard",
                        lambda module, *, mesh, mp_policy, offload_policy: placed.append(offload_policy) or module)
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    for device, offload in ((torch.device("cpu"), False), (torch.device("cpu"), True), (torch.device("cuda"), True)):
        placed.clear()
        data_parallel_wrapper(model, "fsdp2", Ranks(0, 2), device, offload=offload)
        assert len(placed) == len(model.shard_units()) + 1
        assert all(isinstance(p, CPUOffloadPolicy) == offload for p in placed)
        if offload:
            assert all(p.pin_memory == (device.type == "cuda") for p in placed)


def test_plan_takes_the_offload_flags_from_train():
    from dllm_fast.planning.cli import parallel_settings_of, plan_parser
    from dllm_fast.train.cli import config_from_arguments, parse

    argv = ["--parallel", "fsdp2", "--gpus", "2", "--objective", "espo", "--reference-offload", "true"]
    args = parse(plan_parser(argv), argv)
    settings = parallel_settings_of(args, config_from_arguments(args))
    assert settings.reference_offload and not settings.fsdp_offload and settings.reference_on_host


# ---------------------------------------------------------------------------------------------------------
# the planner's memory and copies


def test_the_planner_moves_the_reference_shards_to_the_host_and_prices_their_copies():
    """--reference-offload: the reference's shards (1,000 bf16 elements over 4 ranks) leave every phase's GPU memory
    and become host memory; each reference gather copies them in over the host link (none without it); the
    policy's memory and copies are unchanged."""
    from test_plan_parallel import dense_layout, run

    shape = dense_layout()
    (on_gpu, plain), (on_host, offloaded) = run(shape), run(shape, reference_offload=True)
    shard = 1000 // 4 * 2
    for name, phase in on_gpu.items():
        if phase.runs:
            assert phase.memory["parameters"] - on_host[name].memory["parameters"] == shard, name
            assert phase.memory["gradients"] == on_host[name].memory["gradients"], name
    assert plain.host_bytes == 0 and offloaded.host_bytes == shard
    reference = "reference scoring"
    assert plain.collectives[reference].host_bytes == 0
    # the layers' shards at each call, the root's once a phase (its unit stays gathered between calls)
    layers, root = (1000 - 200) // 4 * 2, 200 // 4 * 2
    calls = on_gpu[reference].model_calls["reference"]
    assert calls == 2 and offloaded.collectives[reference].host_bytes == calls * layers + root
    assert offloaded.collectives[reference].seconds > plain.collectives[reference].seconds
    assert offloaded.collectives["inner update"].host_bytes == 0  # the policy stays on the GPU
    assert any("--reference-offload true: the reference copy's shards on the host" in note
               for note in offloaded.notes)


# ---------------------------------------------------------------------------------------------------------
# Gloo ranks


def offload_config(output_dir, **offload) -> TrainConfig:
    from test_fsdp2 import run_config

    return run_config(output_dir, False, groups=2).replace(**offload)


def fused_on_dtensors_matches_the_default(rank: int) -> float:
    """torch's fused AdamW stepping FSDP2's DTensor shards (the CPU kernel here; train fuses on CUDA), against the
    default on the same shards and gradients: the largest difference after two steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    models = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(6, 5, dtype=torch.float64), mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None)
        for step in range(2):
            torch.manual_seed(10 + step + rank)
            model(torch.randn(4, 6, dtype=torch.float64)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        models.append([p.full_tensor() for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*models))


def worker(rank, world, rendezvous, output_dir, result_path):
    import torch.distributed as dist

    from dllm_fast.train.distributed import Ranks
    from test_fsdp2 import two_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    import dllm_fast.train.run as run_module

    wrap = run_module.data_parallel_wrapper
    placed = []

    def recorded(model, *args, **kwargs):  # which of the models' FSDP2 units really hold their shards offloaded
        wrapped = wrap(model, *args, **kwargs)
        groups = [unit._get_fsdp_state()._fsdp_param_group for unit in wrapped.modules()
                  if hasattr(unit, "_get_fsdp_state")]
        placed.append(sorted({p.offload_to_cpu for group in groups if group is not None for p in group.fsdp_params}))
        return wrapped

    run_module.data_parallel_wrapper = recorded
    try:
        results = {"fused": fused_on_dtensors_matches_the_default(rank)}
        for name, offload in (("reference", {"reference_offload": True}), ("fsdp", {"fsdp_offload": True})):
            placed.clear()
            run = two_steps(offload_config(os.path.join(output_dir, name), **offload), Ranks(rank, world))
            results[name] = {**run, "offloaded": list(placed)}  # [policy's, reference's]
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.distributed
@pytest.mark.slow
def test_offloaded_fsdp2_ranks_equal_one_process_after_two_steps(tmp_path):
    """2 gloo ranks, a full fine-tune with a reference (ESPO, beta 0.05), fp64: with the reference's shards on the
    host (--reference-offload true) and with everything offloaded (--fsdp-offload true: the policy's shards,
    gradients and AdamW state too, AdamW stepping there), the trained weights after two AdamW steps equal one
    process's on the whole batch to 1e-10, as the non-offloaded FSDP2 run's do (test_fsdp2.py); and fused AdamW
    steps DTensor shards as the default does."""
    from test_fsdp2 import _one_process, two_steps

    result = tmp_path / "rank0.pt"
    run_ranks(worker, (2, str(tmp_path / "rendezvous"), str(tmp_path / "ranks"), str(result)), 2, timeout_s=400)
    distributed = torch.load(result)
    assert distributed["fused"] < 1e-12
    single = two_steps(offload_config(tmp_path / "single"), _one_process())
    for name in ("reference", "fsdp"):
        run = distributed[name]
        assert run["sharded_reference"]
        assert run["offloaded"] == ([[False], [True]] if name == "reference" else [[True], [True]])
        said = ("--reference-offload true: the reference's shards in host memory" if name == "reference" else
                "--fsdp-offload true: every shard, gradient and AdamW state in host memory")
        assert any(said in note for note in run["notes"])
        assert run["weights"].keys() == single["weights"].keys()
        for key, want in single["weights"].items():
            torch.testing.assert_close(run["weights"][key], want, rtol=1e-10, atol=1e-12, msg=f"{name}: {key}")
