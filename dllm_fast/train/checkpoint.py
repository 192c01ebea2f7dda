"""A run's state on disk: `checkpoint/` in the run directory, written atomically by rank 0 (a crash leaves the
previous one), from which `--resume true` continues bit for bit.

It holds the weights (the model family's own checkpoint layout, or the LoRA adapter), `state.pt` (the optimizer and
the learning-rate schedule, the step, the data position, the metrics history and every rank's random streams:
Python, NumPy, torch, CUDA, and the rollout and mask generators) and `config.json`, the configuration that ran.
`state.pt` holds tensors and plain values only and is read with `torch.load(weights_only=True)`: loading a
checkpoint never runs code, and a file holding anything else is refused.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from dllm_fast.files import atomic_directory, disk_full, follow_umask, settled_directory, write_text_atomic
from dllm_fast.models.expert_parallel import local_experts
from dllm_fast.models.loading import family_of, load_model
from dllm_fast.train.settings import AUTO
from dllm_fast.train.distributed import full_state, set_full_state
from dllm_fast.train.expert_parallel import local_sharded_state, local_state, whole_sharded_state, whole_state
from dllm_fast.train.resume import CONFIG, saved_config

CHECKPOINT = "checkpoint"
STATE = "state.pt"
FORMAT = 2  # state.pt's layout: 2 = tensors and plain values only (1, before, pickled NumPy objects)


def save_checkpoint(run) -> None:
    """Write the whole state of `run` (a train.run.Run) into its checkpoint directory. Every rank takes part
    (FSDP2 gathers its shards, every rank's random streams are collected); rank 0 writes."""
    model_state, optimizer_state = full_state(run.core, run.optimizer, run.sharded,
                                              trainable_only=run.config.lora.enabled)
    experts = getattr(run, "expert_group", None)
    if experts is not None and not run.config.lora.enabled:  # --expert-parallel: the experts in the whole layout
        if run.sharded:
            model_state, optimizer_state = whole_sharded_state(run.core, run.optimizer, model_state,
                                                               optimizer_state, experts, run.ranks.writer)
        else:
            model_state, optimizer_state = whole_state(run.core, run.optimizer, experts)
    streams = run.ranks.gather({"rng": rng_state(run.device), "rollout_generator": run.rollout_generator.get_state(),
                                "mask_generator": run.mask_generator.get_state()})
    if run.ranks.writer:
        target = run.run_dir.path(CHECKPOINT)
        previous = settled_directory(target).is_dir()
        try:
            with atomic_directory(target) as directory:
                if run.config.lora.enabled:  # under FSDP2, from the adapters' gathered weights
                    run.core.save_pretrained(str(directory / "adapter"), save_embedding_layers=False,
                                             **({} if model_state is None else {"state_dict": model_state}))
                    for file in (directory / "adapter").iterdir():
                        follow_umask(file)
                else:
                    unsharded_copy(run.core, model_state).save_pretrained(directory / "model",
                                                                          tokenizer=run.tokenizer)
                torch.save({"format": FORMAT, "step": run.step, "data_position": run.data.position,
                            "optimizer": optimizer_state, "schedule": run.schedule.state_dict(), "streams": streams,
                            "world": run.ranks.world, "history": run.metrics.history,
                            "micro_batch": run.batching.micro_batch}, directory / STATE)
                write_text_atomic(directory / CONFIG, json.dumps(run.config.to_dict(), indent=2) + "\n")
        except (OSError, RuntimeError) as error:
            raise _write_failure(error, target, previous) from error
    run.ranks.barrier()


def load_checkpoint(run) -> None:
    """Restore `run` from its checkpoint directory: weights, optimizer, schedule, step, data position, history
    and this rank's random streams."""
    directory = run.run_dir.path(CHECKPOINT)
    state = read_state(directory / STATE)
    check_state_matches(state, saved_config(directory), directory / STATE)
    if run.config.run.steps < state["step"]:
        raise ValueError(f"--steps {run.config.run.steps} is below the step {state['step']} the checkpoint in "
                         f"{run.output_dir} reached; give more --steps to train further.")
    weights = directory / ("adapter" if run.config.lora.enabled else "model")
    if not weights.is_dir():
        raise FileNotFoundError(f"{weights} is missing: the checkpoint is incomplete and cannot be resumed; start "
                                "afresh with --overwrite true.")
    if state["world"] != run.ranks.world:
        weights_hint = ("" if run.config.lora.enabled else
                        f" Its weights are whole (the model's own layout, also under FSDP2): to train them further on "
                        f"{run.ranks.world} ranks, start a new run from them with --model {weights}.")
        raise ValueError(f"{directory} was written by {state['world']} ranks; resume it with the same number "
                         f"of ranks (this run has {run.ranks.world}): each rank's random streams (rollouts, masks) "
                         f"are restored, so another number of ranks would not continue the run.{weights_hint}")
    try:
        _restore(run, directory, state)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, OSError) as error:
        raise ValueError(f"the checkpoint in {directory} does not restore into this run ({type(error).__name__}: "
                         f"{' '.join(str(error).split())[:300]}); it is damaged or was altered: start afresh with "
                         "--overwrite true.") from error
    run.step, run.data.position = state["step"], state["data_position"]
    if run.config.objective.micro_batch == AUTO and isinstance(state.get("micro_batch"), int):
        # --micro-batch auto resumes with the micro-batch it ran with (a refit to other free memory would cut the
        # pairs differently, and the run would not continue bit for bit)
        run.batching = dataclasses.replace(run.batching, micro_batch=state["micro_batch"])
    # The metrics file may hold steps past the checkpoint (written before a crash): keep what the state has.
    run.metrics.restart(state["history"])
    run.ranks.barrier()


def _restore(run, directory: Path, state: dict) -> None:
    """The weights, optimizer, schedule and this rank's random streams of `state` into `run`."""
    optimizer_state = state["optimizer"]
    if run.config.lora.enabled and run.sharded:
        from safetensors.torch import load_file

        adapter = load_file(str(directory / "adapter" / "adapter_model.safetensors"), device="cpu")
        set_full_state(run.core, run.optimizer, adapter_state(run.core, adapter), optimizer_state, True,
                       partial=True)
    elif run.config.lora.enabled:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = load_file(str(directory / "adapter" / "adapter_model.safetensors"), device=str(run.device))
        set_peft_model_state_dict(run.core, adapter)
    else:
        # in the dtype the weights train in (fp32 master weights; the exact tests' fp64), as they were saved
        saved = load_model(directory / "model", dtype=run.precision.trainable, device="cpu").state_dict()
        experts = getattr(run, "expert_group", None)
        if experts is not None and run.sharded:  # --expert-parallel: this rank's slice of the whole experts
            saved = local_experts(saved, experts)
            optimizer_state = local_sharded_state(run.core, optimizer_state, experts)
        elif experts is not None:
            saved, optimizer_state = local_state(run.core, run.optimizer, saved, optimizer_state, experts)
        set_full_state(run.core, run.optimizer, saved, optimizer_state, run.sharded)
    if not run.sharded:
        run.optimizer.load_state_dict(optimizer_state)
    run.schedule.load_state_dict(state["schedule"])
    streams = state["streams"][run.ranks.rank]
    set_rng_state(streams["rng"], run.device)
    run.rollout_generator.set_state(streams["rollout_generator"])
    run.mask_generator.set_state(streams["mask_generator"])


def adapter_state(model, saved: dict) -> dict:
    """A saved LoRA adapter's tensors (PEFT's file, whose names leave out the adapter's name) under the names of
    `model`'s trainable parameters, which PEFT derives them from; refused unless they are the same set."""
    names = {name.replace(f".{model.active_adapter}", ""): name
             for name, p in model.named_parameters() if p.requires_grad}
    if set(saved) != set(names):
        unknown, missing = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
        raise KeyError(f"the adapter's weights are not this run's adapters (not in the run: {unknown[:3]}; "
                       f"missing: {missing[:3]})")
    return {names[key]: value for key, value in saved.items()}


def read_state(path: Path) -> dict:
    """state.pt as saved, read without running any code (torch.load with weights_only=True)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete and cannot be resumed; start afresh "
                                "with --overwrite true.")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (a write cut short outside dllm_fast's atomic save?); the checkpoint "
                         "cannot be resumed: start afresh with --overwrite true.")
    damaged = f"{path} is damaged and cannot be read; start afresh with --overwrite true"
    if not zipfile.is_zipfile(path):  # torch.save's archive
        raise ValueError(f"{damaged} (it is not a torch.save archive).")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # weights_only's refusal, or a broken pickle inside the archive
        text = " ".join(str(error).split())
        if "Unsupported global" not in text:
            raise ValueError(f"{damaged} ({text[-200:]}).") from None
        unsafe = text[text.index("Unsupported global"):].split(" was ")[0]
        raise ValueError(f"{path} holds objects other than tensors and plain values ({unsafe}), so "
                         "loading it could run code: refused. It was not written by this version of dllm_fast, or "
                         "was altered; start afresh with --overwrite true.") from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise ValueError(f"{damaged} ({' '.join(str(error).split())[:200]}).") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dllm_fast training state of format {FORMAT}; start afresh with "
                         "--overwrite true.")
    problem = _state_problem(state)
    if problem:
        raise ValueError(f"{path} is damaged or was altered ({problem}); it cannot be resumed: start afresh with "
                         "--overwrite true.")
    return state


# What each entry of state.pt holds; a file that differs was not written by save_checkpoint.
_STATE_TYPES = {"step": int, "data_position": int, "world": int, "optimizer": dict, "schedule": dict,
                "streams": list, "history": list}
_STREAMS = ("rng", "rollout_generator", "mask_generator")


def _state_problem(state: dict) -> str | None:
    """What is wrong with a state.pt's entries (their presence, types and ranges), or None."""
    for key, kind in _STATE_TYPES.items():
        if key not in state:
            return f"it lacks {key!r}"
        if isinstance(state[key], bool) or not isinstance(state[key], kind):
            return f"its {key!r} is of type {type(state[key]).__name__}, not {kind.__name__}"
    if state["step"] < 0 or state["data_position"] < 0 or state["world"] < 1:
        return f"step {state['step']}, data position {state['data_position']}, world {state['world']}"
    if len(state["streams"]) != state["world"] or not all(
            isinstance(stream, dict) and all(name in stream for name in _STREAMS) for stream in state["streams"]):
        return f"it holds no random streams of each of its {state['world']} ranks"
    batch = state.get("micro_batch", 1)  # absent from checkpoints written before --micro-batch auto
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        return f"its micro-batch is {batch!r}, not a number of pairs >= 1"
    if not all(isinstance(row, dict) for row in state["history"]):
        return "its metrics history holds rows that are not mappings"
    if not {"state", "param_groups"} <= set(state["optimizer"]):
        return "its optimizer entry is not an optimizer's state"
    return None


def check_state_matches(state: dict, config, path: Path) -> None:
    """The state continues the run `config` describes: its step within the saved run's --steps, and its data
    position the prompts those steps took."""
    if state["step"] > config.run.steps:
        raise ValueError(f"{path} is at step {state['step']}, past the --steps {config.run.steps} the run was saved "
                         "with; the checkpoint was altered: start afresh with --overwrite true.")
    if state["data_position"] != state["step"] * config.run.prompts_per_step:
        raise ValueError(f"{path} has taken {state['data_position']} prompts in {state['step']} steps of "
                         f"{config.run.prompts_per_step}; the checkpoint was altered: start afresh with --overwrite "
                         "true.")


def unsharded_copy(model, state: dict | None):
    """`model` itself when `state` is None, else an unsharded model of its family holding `state` (FSDP2's
    gathered weights), to save in the family's layout."""
    if state is None:
        return model
    with torch.device("meta"):
        whole = family_of(model)(model.config)
    whole.load_state_dict(state, assign=True)
    return whole


def _write_failure(error: Exception, target: Path, previous: bool = True) -> OSError:
    """An error of a checkpoint write, said plainly: libraries word a full disk as e.g. "[enforce fail at
    inline_container.cc] ... file write failed". previous: whether a checkpoint was there before this write (the
    run's first has none to fall back on)."""
    text = " ".join(str(error).split())
    full = disk_full(error, target.parent) or any(words in text for words in ("file write failed", "enforce fail"))
    cause = "the disk is full (or over its quota)" if full else "the write failed"
    left = ("The previous checkpoint is intact; free some space and resume with --resume true." if previous else
            "This was the run's first checkpoint: there is none to resume from, and nothing half-written is left; "
            "free some space and start the run again.")
    return OSError(getattr(error, "errno", None) or (errno.ENOSPC if full else errno.EIO),
                   f"could not write the checkpoint {target}: {cause} ({text[:200]}). {left}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """Every global random stream as tensors and plain values (no NumPy objects, which weights_only refuses)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
