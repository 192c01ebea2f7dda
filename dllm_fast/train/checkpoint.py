"""A run's state on disk: `checkpoint/` in the run directory, written atomically by rank 0 (a crash leaves the
previous one), from which `--resume true` continues bit for bit.

It holds the weights (the model family's own checkpoint layout, or the LoRA adapter), the optimizer and the
learning-rate schedule, the step, the data position, the metrics history and every rank's random streams (Python,
NumPy, torch, CUDA, and the rollout and mask generators).
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from dllm_fast.files import atomic_directory, write_text_atomic
from dllm_fast.models.loading import family_of, load_model
from dllm_fast.train.distributed import full_state, set_full_state

CHECKPOINT = "checkpoint"


def save_checkpoint(run) -> None:
    """Write the whole state of `run` (a train.run.Run) into its checkpoint directory. Every rank takes part
    (FSDP2 gathers its shards, every rank's random streams are collected); rank 0 writes."""
    model_state, optimizer_state = full_state(run.core, run.optimizer, run.sharded)
    streams = run.ranks.gather({"rng": rng_state(run.device), "rollout_generator": run.rollout_generator.get_state(),
                                "mask_generator": run.mask_generator.get_state()})
    if run.ranks.writer:
        with atomic_directory(run.output_dir / CHECKPOINT) as directory:
            if run.config.lora:
                run.core.save_pretrained(str(directory / "adapter"), save_embedding_layers=False)
            else:
                unsharded_copy(run.core, model_state).save_pretrained(directory / "model", tokenizer=run.tokenizer)
            torch.save({"step": run.step, "data_position": run.data.position, "optimizer": optimizer_state,
                        "schedule": run.schedule.state_dict(), "streams": streams, "world": run.ranks.world,
                        "history": run.metrics.history}, directory / "state.pt")
            write_text_atomic(directory / "config.json", json.dumps(run.config.to_dict(), indent=2) + "\n")
    run.ranks.barrier()


def load_checkpoint(run) -> None:
    """Restore `run` from its checkpoint directory: weights, optimizer, schedule, step, data position, history
    and this rank's random streams."""
    directory = run.output_dir / CHECKPOINT
    state = torch.load(directory / "state.pt", map_location="cpu", weights_only=False)
    if state["world"] != run.ranks.world:
        raise ValueError(f"{directory} was written by {state['world']} ranks; resume it with the same number "
                         f"of ranks (this run has {run.ranks.world}), since each rank's random streams are restored.")
    if run.config.lora:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = load_file(str(directory / "adapter" / "adapter_model.safetensors"), device=str(run.device))
        set_peft_model_state_dict(run.core, adapter)
    else:
        saved = load_model(directory / "model", dtype=torch.float32, device="cpu").state_dict()
        set_full_state(run.core, run.optimizer, saved, state["optimizer"], run.sharded)
    if run.config.lora or not run.sharded:
        run.optimizer.load_state_dict(state["optimizer"])
    run.schedule.load_state_dict(state["schedule"])
    streams = state["streams"][run.ranks.rank]
    set_rng_state(streams["rng"], run.device)
    run.rollout_generator.set_state(streams["rollout_generator"])
    run.mask_generator.set_state(streams["mask_generator"])
    run.step, run.data.position = state["step"], state["data_position"]
    # The metrics file may hold steps past the checkpoint (written before a crash): keep what the state has.
    run.metrics.restart(state["history"])
    run.ranks.barrier()


def unsharded_copy(model, state: dict | None):
    """`model` itself when `state` is None, else an unsharded model of its family holding `state` (FSDP2's
    gathered weights), to save in the family's layout."""
    if state is None:
        return model
    with torch.device("meta"):
        whole = family_of(model)(model.config)
    whole.load_state_dict(state, assign=True)
    return whole


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
