"""Greedy (T = 0) tokens of every sampler mode, frozen: refactors of the samplers must not change them.

The golden file was recorded at commit 9a1e464 (before the cache-policy and remasking registries) with

    PYTHONPATH=. python python_tests/test_generate_golden.py --record

One deliberate change since: a block is left once complete, so with more steps per block than masked tokens
the extra steps no longer run, and random remasking no longer draws their uniforms from the generator; its
later blocks then read a different stretch of the stream (same distribution). For those modes only the first
block, decoded before any skipped step, is compared.

Weights come from a generator seeded per state-dict name (the official checkpoint's key), so the model does not
depend on the init code of dllm_fast.models, nor on how its modules hold the weights (fused or not), only on the
architecture and the checkpoint layout. The model runs in float64, so the tokens
do not hinge on rounding.
"""

import json
import sys
import zlib
from itertools import product
from pathlib import Path

import pytest
import torch

import dllm_fast
from dllm_fast import reference
from dllm_fast.models import LLaDAConfig, LLaDAModel

GOLDEN = Path(__file__).parent / "data" / "generate_t0_golden.json"
PROMPT_LENGTHS = [3, 7, 5]
SCHEDULES = {"fixed": dict(steps=6), "steps>masked": dict(steps=24), "threshold": dict(threshold=0.4)}
MODES = [
    dict(cache=cache, schedule=schedule, remasking=remasking, cfg_scale=cfg)
    for cache, schedule, remasking, cfg in product(("none", "prefix", "dual"), SCHEDULES,
                                                   ("low_confidence", "random"), (0.0, 1.5))
] + [
    dict(cache="none", schedule="fixed", remasking="low_confidence", cfg_scale=0.0, logits_eos_inf=True,
         confidence_eos_eot_inf=True),
    dict(cache="dual", schedule="threshold", remasking="low_confidence", cfg_scale=0.0, logits_eos_inf=True,
         confidence_eos_eot_inf=True),
]


def golden_model() -> LLaDAModel:
    with torch.device("meta"):
        model = LLaDAModel(LLaDAConfig.preset("tiny"))
    model = model.to_empty(device="cpu").to(torch.float64)
    head = "transformer.ff_out.weight"
    with torch.no_grad():  # state-dict entries alias the parameters (fused or not): copy_ fills the model
        for name, weight in sorted(model.state_dict().items()):
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if weight.dim() == 1:  # norm scales
                weight.copy_(1.0 + 0.1 * torch.randn(weight.shape, generator=generator, dtype=torch.float64))
            else:  # a large head scale makes confident predictions, so thresholds unmask several tokens at once
                scale = 4.0 if name == head else 1.0
                weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float64)
                             * scale / weight.shape[1] ** 0.5)
    assert model.state_dict()[head].data_ptr() == model.lm_head_weight.data_ptr()
    return model.eval()


def golden_prompts():
    generator = torch.Generator().manual_seed(7)
    width = max(PROMPT_LENGTHS)
    ids = torch.full((len(PROMPT_LENGTHS), width), 126)
    mask = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length:] = torch.randint(0, 120, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def mode_name(mode: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in mode.items())


def run(sampler, model, mode: dict):
    ids, mask = golden_prompts()
    options = {key: value for key, value in mode.items() if key != "schedule"}
    result = sampler(model, ids, mask, gen_length=12, block_length=4, temperature=0.0,
                     generator=torch.Generator().manual_seed(11), **SCHEDULES[mode["schedule"]], **options)
    return result.completion_ids.tolist()


def record() -> None:
    model = golden_model()
    golden = {}
    for mode in MODES:
        tokens = run(dllm_fast.generate, model, mode)
        assert tokens == run(reference.generate, model, mode), mode_name(mode)
        assert model.mask_token_id not in sum(tokens, []), mode_name(mode)
        golden[mode_name(mode)] = tokens
    GOLDEN.parent.mkdir(exist_ok=True)
    lines = [f"{json.dumps(name)}: {json.dumps(tokens)}" for name, tokens in golden.items()]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")


@pytest.fixture(scope="module")
def model():
    return golden_model()


@pytest.mark.parametrize("mode", MODES, ids=mode_name)
def test_greedy_tokens_are_unchanged(model, mode, one_thread):
    golden = json.loads(GOLDEN.read_text())[mode_name(mode)]
    width = 4 if (mode["remasking"], mode["schedule"]) == ("random", "steps>masked") else 12  # see the docstring
    for sampler in (dllm_fast.generate, reference.generate):
        assert [row[:width] for row in run(sampler, model, mode)] == [row[:width] for row in golden]


if __name__ == "__main__" and "--record" in sys.argv:
    record()
