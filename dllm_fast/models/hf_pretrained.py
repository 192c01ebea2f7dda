"""A dllm_fast model as a `transformers.PreTrainedModel`, for trainers built on transformers' Trainer (TRL's
GRPOTrainer through dllm_fast.integrations.trl): the reverse of hf_diffusion.py, which puts a Hugging Face model
behind dllm_fast's model contract. The wrapper keeps the contract (forward returns hidden states), so the fused ops
still apply the LM head only where they need it.

Its own module, not models/__init__'s: subclassing PreTrainedModel imports transformers' modeling stack, which
only its users should pay for.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

__all__ = ["DiffusionPreTrainedConfig", "DiffusionPreTrainedModel"]


class DiffusionPreTrainedConfig(PretrainedConfig):
    """The special ids and shapes of a wrapped diffusion LM, for TRL and transformers' Trainer."""

    model_type = "dllm_fast_diffusion_lm"

    def __init__(self, vocab_size: int = 0, hidden_size: int = 0, mask_token_id: int | None = None,
                 logit_shift: int = 0, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.mask_token_id, self.logit_shift = mask_token_id, logit_shift
        super().__init__(**kwargs)


class DiffusionPreTrainedModel(PreTrainedModel):
    """A `transformers.PreTrainedModel` around any dllm_fast model, keeping the model contract: forward returns
    the hidden states, and lm_head_weight, the special ids, logit_shift and (when the model has one) new_cache are
    the wrapped model's. `save_pretrained` writes the wrapped model's own layout."""

    config_class = DiffusionPreTrainedConfig
    base_model_prefix = "diffusion_lm"
    supports_gradient_checkpointing = True

    def __init__(self, diffusion_lm: nn.Module):
        for name in ("lm_head_weight", "mask_token_id", "eos_token_id"):
            if not hasattr(diffusion_lm, name):
                raise TypeError(f"{type(diffusion_lm).__name__} lacks {name}; DiffusionPreTrainedModel wraps a model "
                                "with the dllm_fast model contract (e.g. LLaDAModel or HFDiffusionLM).")
        vocab, hidden = diffusion_lm.lm_head_weight.shape
        pad = getattr(getattr(diffusion_lm, "config", None), "pad_token_id", None)
        config = DiffusionPreTrainedConfig(
            vocab_size=vocab, hidden_size=hidden, mask_token_id=diffusion_lm.mask_token_id,
            logit_shift=getattr(diffusion_lm, "logit_shift", 0), eos_token_id=diffusion_lm.eos_token_id,
            pad_token_id=pad if pad is not None else diffusion_lm.eos_token_id)
        super().__init__(config)
        self.diffusion_lm = diffusion_lm
        self.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
        if hasattr(diffusion_lm, "new_cache"):
            self.new_cache = diffusion_lm.new_cache
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """The wrapped model's weights are already initialised (or loaded): post_init must not touch them."""

    # -- model contract -------------------------------------------------------------------------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.diffusion_lm.lm_head_weight

    @property
    def mask_token_id(self) -> int:
        return self.diffusion_lm.mask_token_id

    @property
    def eos_token_id(self) -> int:
        return self.diffusion_lm.eos_token_id

    @property
    def eot_token_id(self) -> int | None:
        return getattr(self.diffusion_lm, "eot_token_id", None)

    @property
    def logit_shift(self) -> int:
        return getattr(self.diffusion_lm, "logit_shift", 0)

    @property
    def block_length(self) -> int | None:
        """A block-diffusion model's block size (contracts.block_length); None for a bidirectional one."""
        return getattr(self.diffusion_lm, "block_length", None)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Hidden states [B, S, d] (the model contract), not logits: TRL's paths that need logits are replaced."""
        return self.diffusion_lm(input_ids, attention_mask=attention_mask, **kwargs)

    def get_input_embeddings(self):
        return self.diffusion_lm.get_input_embeddings()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **options) -> None:
        """Every layer of the wrapped model recomputed in backward (TRL turns this on by default)."""
        self.diffusion_lm.set_gradient_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self.diffusion_lm.set_gradient_checkpointing(False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        inner = self.diffusion_lm
        return bool(getattr(inner, "gradient_checkpointing", False) or
                    getattr(getattr(inner, "model", None), "is_gradient_checkpointing", False))

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """The wrapped model's own checkpoint layout (LLaDA's official one for LLaDAModel), from its own weights:
        Trainer's state_dict= (gathered shards under FSDP/ZeRO-3) is not used."""
        self.diffusion_lm.save_pretrained(save_directory)
