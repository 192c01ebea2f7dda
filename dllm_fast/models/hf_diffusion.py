"""Any Hugging Face diffusion LM whose forward returns logits, behind dllm_fast's model contract (Dream-7B and
models built like it).

    model = HFDiffusionLM.from_pretrained("path/to/Dream-v0-Instruct-7B", dtype=torch.bfloat16, trust_remote_code=True)
    result = dllm_fast.generate(model, prompt_ids, gen_length=256, block_length=32, steps=256)

The contract asks for the hidden states that enter the LM head, so that the fused ops apply the head only where
they need it. They are taken from the LM head's own input, with a forward pre-hook on
`get_output_embeddings()`, rather than from `output_hidden_states` (whose last entry is before or after the final
norm depending on the model). By default the forward stops right there, so the [B, S, V] logits are never built.

Conventions that differ between models are explicit options, defaulted from the config's `model_type`:

- `logit_shift`: Dream's logits at position i predict token i + 1 (1); LLaDA's predict token i (0).
- `attention_mask_style`: "hf" passes the [B, S] 0/1 padding mask as is; "dream" passes what Dream's own
  `diffusion_generate` passes: the string "full" without padding, else a [B, 1, S, S] boolean mask (here over
  the real keys) and position ids counted from each row's first real token; "block" (SDAR, model_type "sdar",
  whose remote code attends bidirectionally unless given a mask) passes the block-causal [B, 1, S, S] boolean
  mask of models/block_attention.py (blocks of `block_length`, default config.block_size, aligned to each row's
  first real token) with position ids counted from that token. A "block" model is a block-diffusion model for
  dllm_fast (`block_length`; its forward takes `clean_length=` for the two-stream likelihood layout), so
  generate decodes it block by block (cache="none": each step recomputes, there is no KV cache here).

There is no KV cache (generate rejects cache modes for logit_shift = 1 anyway). The likelihood engine replays
dropout only for `torch.nn.Dropout` modules; a model that applies functional dropout in training mode (an HF
config's `attention_dropout > 0`) must run in eval mode or with those probabilities at 0 for exact gradients.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch
from torch import nn

from dllm_fast.files import disk_full, disk_full_error, refuse_link_out_of
from dllm_fast.models.block_attention import block_causal, check_block_length, first_token, positions_of, two_stream
from dllm_fast.validation import check_choice, check_int

# model_type (lower case) -> (logit_shift, attention_mask_style)
KNOWN_MODEL_TYPES: dict[str, tuple[int, str]] = {"dream": (1, "dream"), "llada": (0, "hf"), "sdar": (0, "block")}
ATTENTION_MASK_STYLES = ("hf", "dream", "block")


class _HiddenCaptured(Exception):
    """Raised by the LM head's pre-hook to end the forward once its input is captured."""


class HFDiffusionLM(nn.Module):
    """Wraps an HF model (`model(input_ids, attention_mask=...)` returning `.logits`) as a dllm_fast DiffusionLM.

    Args:
        model: the HF model, with its LM head reachable through `get_output_embeddings()`.
        mask_token_id, eos_token_id, eot_token_id: special ids; default to the model config's fields of those
            names (`eot_token_id` is optional: only `confidence_eos_eot_inf` needs it).
        logit_shift: 1 when the logits at i predict token i + 1 (Dream), 0 when they predict token i (LLaDA).
            Default: from the config's model_type (see KNOWN_MODEL_TYPES); other model types must say.
        attention_mask_style: "hf", "dream" or "block" (see the module docstring); default from the model type,
            else "hf".
        block_length: "block" style: the block size (default: the config's block_size).
        skip_lm_head: end the wrapped forward at the LM head (no full logits). Set False when a wrapper of the HF
            model (e.g. FSDP applied to it) needs its forward to run to the end.
    """

    def __init__(self, model: nn.Module, *, mask_token_id: int | None = None, eos_token_id: int | None = None,
                 eot_token_id: int | None = None, logit_shift: int | None = None,
                 attention_mask_style: str | None = None, skip_lm_head: bool = True,
                 block_length: int | None = None):
        super().__init__()
        if not isinstance(model, nn.Module) or not callable(getattr(model, "get_output_embeddings", None)):
            raise TypeError(f"HFDiffusionLM wraps a Hugging Face model with get_output_embeddings(), got "
                            f"{type(model).__name__}.")
        if model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings() is None): load the "
                             "class whose forward returns logits (e.g. AutoModelForCausalLM or AutoModelForMaskedLM "
                             "instead of AutoModel) and wrap that.")
        self.model = model
        config = getattr(model, "config", None)
        model_type = str(getattr(config, "model_type", "")).lower()
        known_shift, known_style = KNOWN_MODEL_TYPES.get(model_type, (None, "hf"))
        if logit_shift is None:
            if known_shift is None:
                raise ValueError(f"model_type {model_type!r} has no known logit convention; pass logit_shift=1 if "
                                 "its logits at position i predict token i + 1 (Dream-style, autoregressive "
                                 "initialisation) or logit_shift=0 if they predict token i (LLaDA-style).")
            logit_shift = known_shift
        self.logit_shift = check_int("logit_shift", logit_shift, minimum=0, maximum=1,
                                     hint="1: logits at i predict token i + 1 (Dream); 0: token i (LLaDA)")
        self.attention_mask_style = check_choice("attention_mask_style", attention_mask_style or known_style,
                                                 ATTENTION_MASK_STYLES)
        self.block_length = None  # contracts.block_length: None for a bidirectional model
        if self.attention_mask_style == "block":
            block_length = block_length if block_length is not None else getattr(config, "block_size", None)
            if block_length is None:
                raise ValueError("attention_mask_style='block' needs the block size: pass block_length= (the config "
                                 "has no block_size).")
            self.block_length = check_block_length(block_length)
        elif block_length is not None:
            raise ValueError(f"block_length={block_length} applies to attention_mask_style='block' only.")
        self.mask_token_id = _special_id("mask_token_id", mask_token_id, config, required=True)
        self.eos_token_id = _special_id("eos_token_id", eos_token_id, config, required=True)
        self.eot_token_id = _special_id("eot_token_id", eot_token_id, config, required=False)
        self.skip_lm_head = bool(skip_lm_head)
        parameters = inspect.signature(model.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self._passes_use_cache = "use_cache" in parameters or takes_any

    # -- model contract -------------------------------------------------------------------------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def max_sequence_length(self) -> int | None:
        """The positions the wrapped model takes (its config's max_position_embeddings), or None if it says none:
        generate and score refuse longer sequences."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, clean_length: int | None = None) -> torch.Tensor:
        """input_ids [B, S] -> hidden [B, S, d]: the input of the LM head (the final norm applied).
        clean_length ("block" style): the two-stream layout of SDARModel.forward."""
        if cache is not None:
            raise ValueError("HFDiffusionLM has no KV cache; call generate with cache='none'.")
        if clean_length is not None and self.attention_mask_style != "block":
            raise ValueError("clean_length (the two-stream layout) needs attention_mask_style='block'.")
        kwargs = self._model_inputs(input_ids, attention_mask, position_ids, clean_length)
        captured: list[torch.Tensor] = []

        def capture(module, args, kwargs):
            captured.append(args[0] if args else next(iter(kwargs.values())))
            if self.skip_lm_head:
                raise _HiddenCaptured

        handle = self.model.get_output_embeddings().register_forward_pre_hook(capture, with_kwargs=True)
        try:
            self.model(**kwargs)
        except _HiddenCaptured:
            pass
        finally:
            handle.remove()
        if len(captured) != 1:
            raise RuntimeError(f"{type(self.model).__name__}'s forward called its LM head {len(captured)} times; "
                               "HFDiffusionLM needs exactly one call on the hidden states of every position.")
        hidden = captured[0]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(f"the LM head of {type(self.model).__name__} received a tensor of shape "
                               f"{tuple(hidden.shape)} for input_ids of shape {tuple(input_ids.shape)}; the model "
                               "must apply its head to every position (no logits_to_keep slicing).")
        return hidden

    def _model_inputs(self, input_ids, attention_mask, position_ids, clean_length=None) -> dict:
        kwargs = {"input_ids": input_ids}
        if self._passes_use_cache:
            kwargs["use_cache"] = False
        if self.attention_mask_style == "block":
            B, T = input_ids.shape
            first = first_token(attention_mask, B, input_ids.device)
            if clean_length is not None:
                allowed, positions = two_stream(clean_length, T, first, self.block_length, attention_mask)
            else:
                columns = torch.arange(T, device=input_ids.device)
                allowed = block_causal(columns, T, first, self.block_length, attention_mask)
                positions = positions_of(columns, first)
            kwargs["attention_mask"] = allowed
            position_ids = positions if position_ids is None else position_ids
        elif self.attention_mask_style == "dream":
            if attention_mask is None:
                kwargs["attention_mask"] = "full"
            else:
                real = attention_mask.to(torch.bool)
                S = real.shape[1]
                kwargs["attention_mask"] = real[:, None, None, :].expand(-1, 1, S, S)
                if position_ids is None:  # Dream counts positions from each row's first real token
                    position_ids = (real.long().cumsum(-1) - 1).clamp_min(0)
        elif attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        return kwargs

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def logits(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Full [B, S, V] logits; prefer the fused ops, which apply the head only where needed."""
        return nn.functional.linear(self(input_ids, attention_mask, position_ids), self.lm_head_weight)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute activations in backward (through the HF model's own gradient checkpointing)."""
        if enabled:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_disable()

    # -- loading and saving -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        auto_class=None, **options) -> "HFDiffusionLM":
        """Load with `transformers.AutoModel` (Dream registers its logits model there; pass `auto_class=` for
        another, e.g. AutoModelForMaskedLM) and wrap it. `options` are HFDiffusionLM's keyword arguments."""
        import transformers

        loader = auto_class if auto_class is not None else transformers.AutoModel
        kwargs = {"trust_remote_code": trust_remote_code}
        if dtype is not None:
            kwargs["dtype"] = dtype
        model = loader.from_pretrained(path, **kwargs)
        if device is not None:
            model = model.to(device)
        return cls(model, **options)

    def save_pretrained(self, path: str | os.PathLike, **kwargs) -> None:
        """The wrapped model's own save_pretrained (its layout, loadable by from_pretrained). Not atomic, but
        under dllm_fast's rules for writes: `path` may not be a symbolic link leaving its parent directory, and
        a full disk is reported naming `path`."""
        target = Path(os.path.abspath(path))
        refuse_link_out_of(target, target.parent)
        try:
            self.model.save_pretrained(path, **kwargs)
        except Exception as error:
            if disk_full(error, target):
                raise disk_full_error(target, error) from error
            raise


def _special_id(name: str, value, config, *, required: bool) -> int | None:
    source = "argument"
    if value is None:
        value, source = getattr(config, name, None), "model config"
    if value is None:
        if required:
            raise ValueError(f"{name} is not in the model config; pass {name}= to HFDiffusionLM "
                             "(Dream's mask token is <|mask|>, tokenizer.mask_token_id).")
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"the {source} gives {name}={value!r}, several ids; pass the one that ends a "
                             f"completion as {name}=.")
        value = value[0]
    return check_int(name, value, minimum=0)
