"""A rollout under FSDP2 on its per-forward gathers against the gather-once copy (train/rollout_weights.py), on
one device: a process group of one rank, so each FSDP2 all-gather is the copies it would make (into the gather
buffer, the one-rank collective, out to the unsharded parameters), and the copy's gather is one such unshard a
unit. Also the plain model (no FSDP2): the floor both paths approach.

    python benchmarks/bench_gather_rollout.py                 # CPU: tiny preset, batch 4, prompt 16, gen 32
    python benchmarks/bench_gather_rollout.py --device cuda   # GPU: llada-8b shapes (random weights: fp32 master,
                                                              #   bf16 gathers, bf16 autocast), batch 8, prompt 200,
                                                              #   gen 256, block 32, 128 steps, dual cache

Providers: sharded (generate on the FSDP2 model: each layer unit all-gathered at every forward, the root once),
gathered (GatheredWeights.gather(), then generate on the copy; gather_s is its part), plain (generate on the
unwrapped model). Greedy decoding, so the providers' tokens must agree (same_tokens). seconds: the median of
--repeats rollouts after a warm-up one; unshards: FSDP2's unshards of a sharded unit in one rollout (an
all-gather each on several ranks; on one rank FSDP2 skips the collective but still casts and copies the unit's
weights, which is what this measures). Eager rollouts: the per-forward path's hooks cannot be captured into the
compiled step's CUDA graphs anyway.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_results_dir_argument, print_table, synchronize, write_results  # noqa: E402

DEFAULTS = {"cpu": dict(preset="tiny", batch=4, prompt=16, gen=32, block=8, steps=8, cache="dual"),
            "cuda": dict(preset="llada-8b", batch=8, prompt=200, gen=256, block=32, steps=128, cache="dual")}


def build(point: dict):
    """(FSDP2 model on one rank, the same model's plain twin, prompts, GenerateConfig) for `point`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dllm_fast.models.loading import PRESETS
    from dllm_fast.rollout.config import GenerateConfig

    device = torch.device(point["device"])
    family, name = PRESETS[point["preset"]]
    config = family.preset_config(name)
    bf16 = device.type == "cuda"
    # the plain twin in what the gathers give the forwards (bf16 on CUDA: the seed's weights rounded once)
    plain = family.with_random_weights(config, dtype=torch.bfloat16 if bf16 else torch.float32, device=device,
                                       seed=0).eval()
    sharded = family.with_random_weights(config, dtype=torch.float32, device=device, seed=0).eval()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (1,))
    for unit in sharded.shard_units():
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(sharded, mesh=mesh, mp_policy=policy)
    vocab = min(plain.lm_head_weight.shape[0], plain.mask_token_id)
    ids = torch.randint(0, vocab, (point["batch"], point["prompt"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    settings = GenerateConfig(gen_length=point["gen"], block_length=point["block"], steps=point["steps"],
                              temperature=0.0, cache=point["cache"])
    return sharded, plain, ids, torch.ones_like(ids), settings


class UnshardCounter:
    """FSDP2's unshards of a unit that was sharded (each an all-gather on several ranks; on one rank FSDP2 skips
    the collective and casts and copies the unit's weights into its unsharded parameters), counted through its
    parameter group's unshard (a private class of torch's FSDP2: a benchmark's instrument only)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.count, self.cls, self.original = 0, FSDPParamGroup, FSDPParamGroup.unshard
        counter = self

        def unshard(group, *args, **kwargs):
            if not group.is_unsharded and group._all_gather_result is None:
                counter.count += 1
            return counter.original(group, *args, **kwargs)

        FSDPParamGroup.unshard = unshard

    def close(self):
        self.cls.unshard = self.original


def measure(point: dict, repeats: int) -> list[dict]:
    from dllm_fast.rollout import generate
    from dllm_fast.train.rollout_weights import GatheredWeights, fsdp_units

    sharded, plain, ids, mask, settings = build(point)
    device = ids.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    copy = GatheredWeights(sharded, dtype=torch.bfloat16 if device.type == "cuda" else None)
    counter = UnshardCounter()

    def reshard():  # FSDP2 keeps the root unsharded between no-grad forwards; a training step reshards it
        for unit in fsdp_units(sharded):
            unit.reshard()

    def sharded_rollout():
        reshard()
        return generate(sharded, ids, mask, settings, generator=torch.Generator(device).manual_seed(2))

    gather_seconds = []

    def gathered_rollout():
        reshard()
        synchronize(device)
        started = time.perf_counter()
        model = copy.gather()
        synchronize(device)
        gather_seconds.append(time.perf_counter() - started)
        try:
            return generate(model, ids, mask, settings, generator=torch.Generator(device).manual_seed(2))
        finally:
            copy.release()

    def plain_rollout():
        return generate(plain, ids, mask, settings, generator=torch.Generator(device).manual_seed(2))

    rows, tokens = [], {}
    try:
        for name, rollout in (("sharded", sharded_rollout), ("gathered", gathered_rollout), ("plain", plain_rollout)):
            with torch.no_grad(), autocast:
                rollout()  # warm-up
                gather_seconds.clear()
                counter.count = 0
                result = rollout()
                gathers = counter.count
                seconds = []
                for _ in range(repeats):
                    synchronize(device)
                    started = time.perf_counter()
                    rollout()
                    synchronize(device)
                    seconds.append(time.perf_counter() - started)
            tokens[name] = result.sequences.cpu()
            rows.append(dict(provider=name, **point, seconds=statistics.median(seconds), min_seconds=min(seconds),
                             gather_s=statistics.median(gather_seconds) if gather_seconds else 0.0,
                             unshards=gathers, forwards=int(result.nfe),
                             copy_gb=copy.nbytes / 1e9 if name == "gathered" else 0.0))
    finally:
        counter.close()
    for row in rows:
        row["same_tokens"] = bool(torch.equal(tokens[row["provider"]], tokens["sharded"]))
        row["vs_sharded"] = rows[0]["seconds"] / row["seconds"]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default=None, help="model preset (default: tiny on CPU, llada-8b on CUDA)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--gen", type=int, default=None)
    parser.add_argument("--block", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--cache", default=None, choices=["none", "prefix", "dual"])
    parser.add_argument("--repeats", type=int, default=3)
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here.")
    point = dict(DEFAULTS[args.device], device=args.device)
    for key in ("preset", "batch", "prompt", "gen", "block", "steps", "cache"):
        if getattr(args, key) is not None:
            point[key] = getattr(args, key)
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as rendezvous:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                                init_method=f"file://{rendezvous}/store")
        try:
            rows = measure(point, args.repeats)
        finally:
            dist.destroy_process_group()
    print_table(rows, ["provider", "preset", "batch", "gen", "steps", "cache", "seconds", "gather_s", "unshards",
                       "forwards", "copy_gb", "vs_sharded", "same_tokens"])
    print(f"wrote {write_results(f'gather_rollout_{args.device}', point, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
