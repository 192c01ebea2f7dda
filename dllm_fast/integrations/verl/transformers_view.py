"""dllm_fast's checkpoints as transformers sees them, for verl, which reads every model through transformers'
auto classes:

- the families' config types come from `model_types.register_model_types()` (one registration, which the
  engine's settings section rides on).
- `register_causal_lm()`: LLaDA as an `AutoModelForCausalLM` (`causal_lm_class()`, LLaDAForCausalLM: the native model under the
  official key names, logits out), so that verl's stock FSDP engine can load and train a dllm_fast LLaDA
  checkpoint. Its log-probs are verl's (next-token, on the unmasked sequence), not a diffusion likelihood: it
  exercises verl's dataflow and is no substitute for dllm_fast's own engine (`model_type=dllm_fast`).
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig

from dllm_fast.integrations.verl.model_types import config_class


def _whole_projection_parts(module, state_dict, prefix, local_metadata) -> None:
    """Under FSDP2 a fused projection's parts are row slices of a sharded DTensor, which torch.save cannot write
    (verl saves the sharded state dict as it is): give them whole. Loading takes whole parts (each rank copies
    the rows it holds: models.layers._copy_rows)."""
    from dllm_fast.models.layers import ProjectionSlice

    for name, sub in module.named_modules():
        key = f"{prefix}{name}.weight"
        if isinstance(sub, ProjectionSlice) and hasattr(state_dict.get(key), "full_tensor"):
            state_dict[key] = state_dict[key].full_tensor()


@functools.lru_cache(maxsize=None)
def causal_lm_class() -> type:
    """`LLaDAForCausalLM`, built on first use (transformers' modeling classes take seconds to import)."""
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    from dllm_fast.models.config import LLaDAConfig
    from dllm_fast.models.llada import LLaDAModel

    class LLaDAForCausalLM(PreTrainedModel):
        """LLaDAModel under transformers' loading (module docstring): `model` is the native model, so the parameter
        names are the official checkpoint's keys ("model.transformer...") and `from_pretrained` reads an official
        checkpoint as it is."""

        config_class = config_class("llada")  # transformers reads the class attribute
        base_model_prefix = "model"
        _no_split_modules = ["LLaDABlock"]
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            names = set(LLaDAConfig.__dataclass_fields__) - {"extra"}
            values = config.to_dict()
            self.model = LLaDAModel(LLaDAConfig(**{k: values[k] for k in names if values.get(k) is not None}))
            self.post_init()
            self._register_state_dict_hook(_whole_projection_parts)

        def _init_weights(self, module):
            """The native model initialises itself (or is loaded); nothing to redo."""

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, torch_dtype=None, dtype=None,
                            **kwargs):
            """The checkpoint through dllm_fast's own loader (transformers' would set the fused projections'
        parts one by one, which are views, not parameters)."""
            path = pretrained_model_name_or_path
            config = config if config is not None else AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                model = cls(config)
            dtype = dtype if dtype is not None else torch_dtype
            model.model = LLaDAModel.from_pretrained(path, dtype=None if dtype in (None, "auto") else dtype)
            return model.eval()

        def get_input_embeddings(self):
            return self.model.transformer["wte"]

        def get_output_embeddings(self):
            return self.model.transformer["wte"] if self.model.config.weight_tying else self.model.transformer["ff_out"]

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **unused) -> CausalLMOutput:
            if attention_mask is not None and attention_mask.dim() != 2:
                attention_mask = None
            hidden = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
            return CausalLMOutput(logits=torch.nn.functional.linear(hidden, self.model.lm_head_weight))

    return LLaDAForCausalLM


def register_causal_lm() -> None:
    """`AutoModelForCausalLM` and `AutoModel` for model_type "llada" (verl picks AutoModel for an architecture named
    otherwise than *ForCausalLM, as LLaDA's "LLaDAModelLM"); a second call changes nothing."""
    from transformers import AutoModel, AutoModelForCausalLM

    llada_config = config_class("llada")  # registers the families' config types first
    for auto in (AutoModelForCausalLM, AutoModel):
        if llada_config not in auto._model_mapping._extra_content:
            auto.register(llada_config, causal_lm_class())
