"""dllm_fast's rollout inside verl's hybrid worker: `actor_rollout_ref.rollout.name=dllm_fast`.

verl registers a rollout twice: the class that lives inside each hybrid worker beside the actor
(`verl.workers.rollout.base._ROLLOUT_REGISTRY[("dllm_fast", "async")]`, this module's `DllmFastRollout`, a
`BaseRollout`), and the servers the agent loop sends its requests to (`RolloutReplicaRegistry`, `replica.py`). A
request reaches the worker through its server, which batches the agent loop's per-sample requests and calls
`decode_on_worker` in the worker process, where `DllmFastRollout.decode` runs `dllm_fast.generate` (caches, block
decoding, thresholds, compiled steps on CUDA; rollout/sampler.py) on the batch.

Settings: `actor_rollout_ref.rollout.engine_kwargs.dllm_fast` holds `GenerateConfig`'s fields (block_length,
steps, threshold, cache, remasking, cfg_scale, logits_eos_inf, confidence_eos_eot_inf, compile, full_last_block,
eos_early_stop) and the rollout's own (record_unmask_step, max_batch_size, batch_wait_s). gen_length is
`rollout.response_length`; the temperature is the request's (`rollout.temperature`, or `val_kwargs.temperature`
in validation); the seed is `rollout.seed`. `compile` defaults to True on CUDA and False on the CPU. An option
dllm_fast's sampler has no counterpart for (top_p, top_k, calculate_log_probs, multi-modal inputs,
tensor/pipeline/data parallel rollout) is refused naming the setting, instead of being ignored.

What lands in verl's batch: the completion is the whole canvas, `response_length` tokens (the positions after
the first EOS included, as dllm_fast's own RolloutBatch holds them; `contracts.completion_mask` says which count),
and with record_unmask_step the decoding order per response position under `UNMASK_STEP_KEY` (one int64 array per
sample: the forward that unmasked each position, as `generate(record_unmask_step=True)` gives it) and the batch's
forward count under `FORWARDS_KEY` (RolloutBatch.forwards), the keys of batch_keys.py that the engine reads. verl's
agent loop carries the server's `TokenOutput.extra_fields` into the batch unchanged (the legacy trainer as
`non_tensor_batch` keys, the V1 trainer in each row's `extra_fields`).

How the weights reach the rollout. verl calls `update_weights` after every actor update (its "naive" checkpoint
engine for the hybrid worker: `ActorRolloutRefWorker.update_weights` hands the actor engine's
`get_per_tensor_param()` stream to the rollout in the same process). The rollout's model is a meta skeleton of the
checkpoint (`models.loading.model_skeleton`: shapes only); each update `load_state_dict(..., assign=True)`s the
streamed tensors into it, so its parameters *are* those tensors:
- where the actor's weights are local (one rank, or replicated without FSDP) the stream yields the actor's own
  parameters (state_dict aliases them) and the rollout decodes with them: no copy, no memory, nothing to sync
  (the optimizer steps them in place);
- under FSDP2 each rank's stream all-gathers every parameter (`DTensor.full_tensor()`, one collective per
  tensor): the rollout then holds one full, unsharded copy per rank, P bytes (16 GB for LLaDA-8B in bf16) beside
  the actor's 1/W shard, and the update costs one all-gather of the model, each rank receiving (W-1)/W P bytes.
  `release()` (verl's sleep, before the actor trains) drops the rollout's references (freeing that copy; an
  alias frees nothing) and the next update brings the weights back;
- a tensor in another dtype than `rollout.dtype` is cast once per update (a copy: e.g. fp32 master weights of a
  bf16 rollout); set `rollout.dtype` to the actor's dtype to decode on its weights as they are.
The names may be the dllm_fast model's own or the official checkpoint's, under any wrapper prefix (PEFT,
DiffusionPreTrainedModel, FSDP): the longest prefix whose removal matches the skeleton is stripped. LoRA adapters
reach it merged (`actor_rollout_ref.model.lora.merge=True`); an adapter-only stream is refused.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from verl.workers.rollout.base import BaseRollout

from dllm_fast.contracts import block_length as block_length_of
from dllm_fast.integrations.verl.batch_keys import FORWARDS_KEY, UNMASK_STEP_KEY
from dllm_fast.models.checkpoint import native_state, official_state
from dllm_fast.models.loading import family_of, model_skeleton
from dllm_fast.rollout import GenerateConfig, generate
from dllm_fast.rollout.config import SETTINGS as GENERATE_SETTINGS
from dllm_fast.tasks.encoding import left_pad

ROLLOUT_NAME = "dllm_fast"
SETTINGS_PATH = "actor_rollout_ref.rollout.engine_kwargs.dllm_fast"
# Set from the request or from verl's own rollout fields, never from engine_kwargs.
_FROM_VERL = {"gen_length": "actor_rollout_ref.rollout.response_length",
              "temperature": "actor_rollout_ref.rollout.temperature (val_kwargs.temperature in validation)"}
_ROLLOUT_OWN = ("record_unmask_step", "max_batch_size", "batch_wait_s")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}

# The rollout living in this process (one per hybrid worker): where the server's calls land.
_LOCAL: dict[str, "DllmFastRollout"] = {}


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout's settings, checked: `generate` (GenerateConfig without the temperature, which each request
    brings), whether to record the decoding order, and the server's batching (at most max_batch_size requests a
    generate call, collected until no new one arrives for batch_wait_s seconds)."""

    generate: GenerateConfig
    record_unmask_step: bool = False
    max_batch_size: int = 256
    batch_wait_s: float = 0.05
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16


def rollout_settings(config: Any, device_type: str = "cpu") -> RolloutSettings:
    """`RolloutSettings` of a verl RolloutConfig (or its DictConfig); each refusal names the setting."""
    get = config.get if hasattr(config, "get") and not dataclasses.is_dataclass(config) else \
        (lambda key, default=None: getattr(config, key, default))
    for key, allowed in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                         ("data_parallel_size", 1)):
        if (get(key, 1) or 1) != allowed:
            raise ValueError(f"actor_rollout_ref.rollout.{key}={get(key)}: the dllm_fast rollout decodes each "
                             f"replica on one device (every hybrid worker is a replica); set it to 1.")
    if get("calculate_log_probs", False):
        raise ValueError("actor_rollout_ref.rollout.calculate_log_probs=True: a diffusion rollout has no per-token "
                         "sampling log-probs (tokens are unmasked in parallel, out of order); set it to False and "
                         "leave algorithm.rollout_correction off.")
    _check_sampling(get("top_p", 1.0), get("top_k", -1), "actor_rollout_ref.rollout")
    engine_kwargs = get("engine_kwargs", None) or {}
    given = dict(engine_kwargs.get(ROLLOUT_NAME, None) or {})
    for name, where in _FROM_VERL.items():
        if name in given:
            raise ValueError(f"{SETTINGS_PATH}.{name} is set from {where}; remove it from {SETTINGS_PATH}.")
    unknown = sorted(set(given) - set(GENERATE_SETTINGS) - set(_ROLLOUT_OWN))
    if unknown:
        raise ValueError(f"{SETTINGS_PATH}.{unknown[0]} is no dllm_fast rollout setting; they are "
                         f"{', '.join(s for s in GENERATE_SETTINGS if s not in _FROM_VERL)} and "
                         f"{', '.join(_ROLLOUT_OWN)}.")
    if "block_length" not in given:
        raise ValueError(f"{SETTINGS_PATH}.block_length is required (the denoising block, a divisor of "
                         "rollout.response_length), e.g. +actor_rollout_ref.rollout.engine_kwargs.dllm_fast."
                         "block_length=32.")
    own = {name: given.pop(name) for name in _ROLLOUT_OWN if name in given}
    given.setdefault("compile", device_type == "cuda")
    response_length = get("response_length", None)
    if not isinstance(response_length, int) or response_length < 1:
        raise ValueError(f"actor_rollout_ref.rollout.response_length={response_length!r} must be a positive int: "
                         "it is the rollout's gen_length.")
    generate_config = GenerateConfig(gen_length=response_length, **given)
    record = own.get("record_unmask_step", False)
    if not isinstance(record, bool):
        raise TypeError(f"{SETTINGS_PATH}.record_unmask_step={record!r} must be true or false.")
    max_batch = own.get("max_batch_size", RolloutSettings.max_batch_size)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"{SETTINGS_PATH}.max_batch_size={max_batch!r} must be a positive int.")
    wait = own.get("batch_wait_s", RolloutSettings.batch_wait_s)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not math.isfinite(wait) or wait < 0:
        raise ValueError(f"{SETTINGS_PATH}.batch_wait_s={wait!r} must be a finite number of seconds >= 0.")
    dtype_name = str(get("dtype", "bfloat16")).replace("torch.", "")
    if dtype_name not in DTYPES:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={dtype_name!r} is not one of {', '.join(DTYPES)}.")
    seed = get("seed", 0)
    return RolloutSettings(generate=generate_config, record_unmask_step=record, max_batch_size=max_batch,
                           batch_wait_s=float(wait), seed=int(seed if seed is not None else 0),
                           dtype=DTYPES[dtype_name])


def _check_sampling(top_p, top_k, where: str) -> None:
    if top_p is not None and float(top_p) != 1.0:
        raise ValueError(f"{where}.top_p={top_p}: dllm_fast's sampler draws from the full softmax (temperature "
                         "only); set top_p=1.")
    if top_k is not None and int(top_k) not in (-1, 0):
        raise ValueError(f"{where}.top_k={top_k}: dllm_fast's sampler draws from the full softmax (temperature "
                         "only); set top_k=-1.")


def check_sampling_params(params: dict) -> float:
    """The temperature of one request's sampling_params, refusing what the sampler would ignore."""
    _check_sampling(params.get("top_p", 1.0), params.get("top_k", -1), "sampling_params")
    if params.get("logprobs"):
        raise ValueError("sampling_params asks for logprobs (actor_rollout_ref.rollout.calculate_log_probs): a "
                         "diffusion rollout has none; set it to False.")
    penalty = params.get("repetition_penalty", 1.0)
    if penalty is not None and float(penalty) != 1.0:
        raise ValueError(f"sampling_params repetition_penalty={penalty}: dllm_fast's sampler has none; use 1.0.")
    temperature = params.get("temperature", 1.0)
    return float(1.0 if temperature is None else temperature)


# -- the weights ----------------------------------------------------------------------------------------------

def native_weights(model, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The streamed (name, tensor) pairs as `model`'s own state dict (module docstring): a name is matched to the
    skeleton's native or official names after dropping the longest wrapper prefix that makes it match."""
    cls = family_of(model)
    native_names = set(model.state_dict())
    official_names = set(official_state(cls, dict(model.state_dict())))
    native, official, unmatched = {}, {}, []
    for name, tensor in named:
        for target, names in ((native, native_names), (official, official_names)):
            key = _strip_to(name, names)
            if key is not None:
                target[key] = tensor
                break
        else:
            unmatched.append(name)
    if unmatched:
        raise ValueError(f"the actor's weight {unmatched[0]!r} (and {len(unmatched) - 1} more) matches no parameter "
                         f"of the rollout's {cls.__name__}; the actor and the rollout must load the same checkpoint "
                         "(actor_rollout_ref.model.path).")
    if native and official:
        raise ValueError("the actor's weights mix dllm_fast's native names with the official checkpoint's; "
                         "expected one naming.")
    state = native if native else native_state(cls, official)
    missing = sorted(native_names - set(state))
    if missing:
        raise ValueError(f"the actor's weights lack {missing[0]!r} (and {len(missing) - 1} more) of the rollout's "
                         f"{cls.__name__}.")
    return state


def fused_views(model, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Where the parts of a fused projection (models.layers.FusedLinear: q, k, v as rows of one weight) arrive as
    consecutive rows of one storage (a dllm_fast actor's own fused weight), hand the fused weight over as one view
    of that storage, so that assigning it aliases the actor's weight instead of copying the rows into a new one.
    Returns the state dict and the part names it replaced."""
    from dllm_fast.models.layers import FusedLinear, ProjectionSlice

    modules = dict(model.named_modules())
    slices: dict[int, list[tuple[int, str]]] = {}
    for name, module in modules.items():
        if isinstance(module, ProjectionSlice):
            slices.setdefault(id(module.fused), []).append((module.start, f"{name}.weight" if name else "weight"))
    state, replaced = dict(state), set()
    for name, module in modules.items():
        if not isinstance(module, FusedLinear) or id(module) not in slices:
            continue
        keys = [key for _, key in sorted(slices[id(module)])]
        tensors = [state.get(key) for key in keys]
        if any(t is None for t in tensors):
            continue
        first = tensors[0]
        rows, width = sum(t.shape[0] for t in tensors), module.in_features
        offset, consecutive = first.storage_offset(), True
        for t in tensors:
            consecutive &= (t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                            and t.dtype == first.dtype and t.dim() == 2 and t.stride() == (width, 1)
                            and t.storage_offset() == offset)
            offset += t.shape[0] * width
        if not consecutive:
            continue
        fused = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, width), (width, 1))
        for key in keys:
            del state[key]
        state[f"{name}.weight" if name else "weight"] = fused
        replaced.update(keys)
    return state, replaced


def _strip_to(name: str, names: set[str]) -> str | None:
    parts = name.split(".")
    for start in range(len(parts)):
        candidate = ".".join(parts[start:])
        if candidate in names:
            return candidate
    return None


# -- the rollout in the worker --------------------------------------------------------------------------------

class DllmFastRollout(BaseRollout):
    """`dllm_fast.generate` beside the actor in verl's hybrid worker (module docstring)."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        from verl.utils.device import get_device_id, get_device_name

        device_type = get_device_name()
        self.device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, get_device_id())
        self.settings = rollout_settings(self.config, self.device.type)
        path = self.model_config.local_path
        # A meta skeleton: the weights come with the first update_weights (verl syncs before the first rollout).
        self.model = model_skeleton(path)
        self.model.eval()
        self.model_path = path
        block = block_length_of(self.model)
        if block is not None and self.settings.generate.block_length != block:
            raise ValueError(f"{SETTINGS_PATH}.block_length={self.settings.generate.block_length}, but {path} is a "
                             f"block-diffusion model with blocks of {block}; set it to {block}.")
        self.generator = torch.Generator(device=self.device).manual_seed(self.settings.seed)
        self.has_weights = False
        self.global_steps = None
        _LOCAL["rollout"] = self

    async def resume(self, tags: list[str]):
        """Nothing to bring back: the weights come with update_weights and the caches live within a call."""

    async def release(self):
        self.release_now()

    def release_now(self) -> None:
        """Drop the rollout's references to the weights (verl's sleep, before the actor trains): a gathered or
        cast copy is freed; aliases of the actor's own parameters free nothing. The next update_weights
        brings them back."""
        self.model.to("meta")
        self.has_weights = False

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"the dllm_fast rollout takes full named tensors (actor_rollout_ref.rollout."
                             f"checkpoint_engine.backend=naive), got wire_format={wire_format!r}.")
        if kwargs.get("peft_config") is not None:
            raise ValueError("the actor streams LoRA adapters only; the dllm_fast rollout decodes merged weights: "
                             "set actor_rollout_ref.model.lora.merge=True.")
        self.load_weights(weights)
        self.global_steps = kwargs.get("global_steps", self.global_steps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Assign the streamed tensors as the model's parameters (a cast or a move only where dtype or device
        differ; module docstring)."""
        dtype, device = self.settings.dtype, self.device
        state = {}
        for name, tensor in native_weights(self.model, weights).items():
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype=dtype)
            state[name] = tensor.detach().to(device)
        state, parts = fused_views(self.model, state)
        result = self.model.load_state_dict(state, strict=False, assign=True)
        missing = sorted(set(result.missing_keys) - parts)
        if missing or result.unexpected_keys:
            raise ValueError(f"the actor's weights do not fit the rollout's model: missing {missing[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}.")
        self.model.eval()
        for name, value in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if value.is_meta:
                raise ValueError(f"after the weight sync the rollout's {name} is still a meta tensor; the actor did "
                                 "not send it.")
        self.has_weights = True

    def decode(self, prompts: list[list[int]], temperature: float) -> list[dict]:
        """Decode one batch of prompts (token ids, no padding) at `temperature`: per prompt the response's token
        ids (the whole canvas) and, with record_unmask_step, the decoding order and the forward count."""
        if not self.has_weights:
            raise RuntimeError("the dllm_fast rollout has no weights yet: verl syncs them (update_weights) before "
                               "every rollout; was the rollout released and not woken up?")
        pad = self.model.config.pad_token_id if getattr(self.model.config, "pad_token_id", None) is not None \
            else self.model.eos_token_id
        ids, mask = left_pad(prompts, pad, self.device)
        record = self.settings.record_unmask_step
        with torch.no_grad():
            result = generate(self.model, ids, mask, self.settings.generate, temperature=temperature,
                              generator=self.generator, record_unmask_step=record)
        completions = result.completion_ids.cpu().tolist()
        steps = result.unmask_step.cpu().numpy() if record else None
        return [{"token_ids": completions[i],
                 **({UNMASK_STEP_KEY: steps[i].astype(np.int64), FORWARDS_KEY: int(result.nfe)} if record else {})}
                for i in range(len(prompts))]


def local_rollout() -> DllmFastRollout:
    if "rollout" not in _LOCAL:
        raise RuntimeError("no dllm_fast rollout lives in this process: the server's worker is not a hybrid "
                           "ActorRolloutRefWorker with actor_rollout_ref.rollout.name=dllm_fast.")
    return _LOCAL["rollout"]


def decode_on_worker(worker, prompts: list[list[int]], temperature: float) -> list[dict]:
    """Run in the worker process through Ray's `__ray_call__` (the worker actor is its first argument); each
    output also says which actor step's weights decoded it (verl's `global_steps`)."""
    rollout = local_rollout()
    return [{**output, "global_steps": rollout.global_steps} for output in rollout.decode(prompts, temperature)]


def release_on_worker(worker) -> None:
    rollout = _LOCAL.get("rollout")
    if rollout is not None:
        rollout.release_now()
