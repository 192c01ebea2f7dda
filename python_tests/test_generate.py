"""dllm_fast.generate against the reference LLaDA / Fast-dLLM sampler, and the sampler's properties."""

import pytest
import torch

import dllm_fast
from dllm_fast import ops, reference
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.models.kv_cache import KVCache
from dllm_fast.contracts import completion_mask


def tiny_model(device, dtype=torch.float64, head_scale=1.0, seed=0):
    torch.manual_seed(seed)
    model = LLaDAModel(LLaDAConfig.preset("tiny")).to(device=device, dtype=dtype)
    with torch.no_grad():
        model.lm_head_weight.mul_(head_scale)  # a larger head makes confident predictions (threshold tests)
    return model.eval()


def prompts(device, lengths, pad_id=126):
    """Left-padded prompts of the given lengths and their attention mask."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, device=device)
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, 120, (length,), device=device)
        mask[row, width - length:] = 1
    return ids, mask


def both(model, ids, mask, **kwargs):
    seed = kwargs.pop("seed", 0)
    fused = dllm_fast.generate(model, ids, mask, generator=torch.Generator(ids.device).manual_seed(seed), **kwargs)
    plain = reference.generate(model, ids, mask, generator=torch.Generator(ids.device).manual_seed(seed), **kwargs)
    return fused, plain


class ScriptedModel(torch.nn.Module):
    """The model contract with context-free logits: position j's logits are table[j] whatever the canvas, so a
    test knows every token in advance and can read the unmasking order off the canvases it was fed."""

    mask_token_id, eos_token_id, eot_token_id = 7, 6, 5

    def __init__(self, table):
        super().__init__()
        self.table = table  # [L, V]
        self.lm_head_weight = torch.eye(table.shape[1], dtype=table.dtype)  # hidden states are the logits
        self.canvases = []

    def forward(self, input_ids, attention_mask=None):
        self.canvases.append(input_ids.clone())
        return self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)


def unmask_steps(canvases, mask_id):
    """[B, L] the step at which each position stopped being masked (-1 for the prompt)."""
    stacked = torch.stack(canvases)  # [steps, B, L]; canvas s is the input of step s
    still_masked = (stacked == mask_id).sum(dim=0)
    return still_masked - 1


@pytest.mark.parametrize("lengths", [[5], [3, 9, 6], [1, 12]])
@pytest.mark.parametrize(
    "gen_length,block_length,steps", [(16, 16, 16), (16, 4, 8), (24, 8, 6), (12, 4, 12), (16, 8, 6), (15, 5, 6)]
)
def test_greedy_no_cache_is_token_identical_to_reference(device, lengths, gen_length, block_length, steps):
    model = tiny_model(device)
    ids, mask = prompts(device, lengths)
    fused, plain = both(model, ids, mask, gen_length=gen_length, block_length=block_length, steps=steps)
    assert torch.equal(fused.sequences, plain.sequences)
    assert fused.nfe == plain.nfe == steps
    assert not (fused.completion_ids == model.mask_token_id).any()
    assert torch.equal(fused.sequences[:, : ids.shape[1]], ids)


def test_transfer_counts_split_each_block_evenly_remainder_first():
    """LLaDA's schedule: 8 tokens over 3 steps unmask 3, 3, 2 (the remainder goes to the first steps)."""
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [4, 6])
    canvases = []
    hook = model.register_forward_pre_hook(lambda module, args: canvases.append(args[0].clone()))
    dllm_fast.generate(model, ids, mask, gen_length=16, block_length=8, steps=6)
    hook.remove()
    masked = [int((c[:, ids.shape[1]:] == model.mask_token_id).sum(dim=1).unique()) for c in canvases]
    assert masked == [16, 13, 10, 8, 5, 2]


EOS_POSITIONS, EOT_POSITIONS = [1, 7, 12], [3, 10]  # completion positions where EOS / EoT are near-certain


def eos_prone_table(prompt_length, gen_length, generator):
    """Random logits over 5 words, EoT (5) and EOS (6), with EOS or EoT near-certain at a few positions."""
    table = torch.randn(prompt_length + gen_length, 8, generator=generator, dtype=torch.float64)
    table[:, 7] = -1e4  # the mask token is never predicted (finite: hidden @ eye must not make NaNs)
    table[[prompt_length + i for i in EOS_POSITIONS], 6] += 6.0
    table[[prompt_length + i for i in EOT_POSITIONS], 5] += 6.0
    return table


@pytest.mark.parametrize("kwargs", [dict(), dict(logits_eos_inf=True), dict(confidence_eos_eot_inf=True),
                                    dict(logits_eos_inf=True, confidence_eos_eot_inf=True)])
def test_eos_options_change_what_is_sampled_and_when(kwargs):
    table = eos_prone_table(2, 16, torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 2]])
    run = dict(gen_length=16, block_length=8, steps=16, **kwargs)  # one token per step: the order is visible
    model = ScriptedModel(table)
    fused = dllm_fast.generate(model, ids, **run)
    assert torch.equal(fused.sequences, reference.generate(ScriptedModel(table), ids, **run).sequences)

    completion, when = fused.completion_ids[0], unmask_steps(model.canvases, model.mask_token_id)[0, 2:]
    assert (completion[EOS_POSITIONS] == 6).all() != kwargs.get("logits_eos_inf", False)
    assert not (completion == 6).any() or not kwargs.get("logits_eos_inf")
    assert (completion[EOT_POSITIONS] == 5).all()
    confident = torch.zeros(16, dtype=torch.bool)
    confident[EOT_POSITIONS if kwargs.get("logits_eos_inf") else EOS_POSITIONS + EOT_POSITIONS] = True
    eos_or_eot = (completion == 5) | (completion == 6)
    for block in (slice(0, 8), slice(8, 16)):
        if kwargs.get("confidence_eos_eot_inf"):  # confidence 0: unmasked after every other token of the block
            assert when[block][eos_or_eot[block]].min() > when[block][~eos_or_eot[block]].max()
        else:  # near-certain predictions: unmasked first
            assert when[block][confident[block]].max() < when[block][~confident[block]].min()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize(
    "options",
    [dict(steps=8), dict(steps=16, remasking="random"), dict(steps=8, cfg_scale=1.0),
     dict(steps=8, logits_eos_inf=True, confidence_eos_eot_inf=True),
     dict(threshold=0.7, remasking="random"), dict(threshold=0.5, cfg_scale=1.0), dict(steps=12)],
)
def test_cached_modes_match_the_reference_fast_dllm(device, cache, options):
    """Batch > 1 with left padding: the fused cached sampler reproduces the reference's cache semantics."""
    model = tiny_model(device)
    ids, mask = prompts(device, [4, 10, 7])
    fused, plain = both(model, ids, mask, gen_length=16, block_length=4, cache=cache, **options)
    assert torch.equal(fused.sequences, plain.sequences)
    assert fused.nfe == plain.nfe


@pytest.mark.parametrize("options", [dict(remasking="random"), dict(cfg_scale=2.0),
                                     dict(logits_eos_inf=True, confidence_eos_eot_inf=True)])
def test_options_without_cache_match_reference(device, options):
    model = tiny_model(device)
    ids, mask = prompts(device, [6, 3])
    fused, plain = both(model, ids, mask, gen_length=12, block_length=4, steps=6, **options)
    assert torch.equal(fused.sequences, plain.sequences)
    if options.get("logits_eos_inf"):
        assert not (fused.completion_ids == model.eos_token_id).any()


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_one_step_per_block_makes_caches_exact(device, cache):
    """With one step per block every step is a refresh, so a cache changes nothing by construction."""
    model = tiny_model(device, torch.float32)
    ids, mask = prompts(device, [5, 8])
    kwargs = dict(gen_length=16, block_length=4, steps=4, generator=None)
    plain = dllm_fast.generate(model, ids, mask, cache="none", **kwargs)
    cached = dllm_fast.generate(model, ids, mask, cache=cache, **kwargs)
    assert torch.equal(plain.sequences, cached.sequences)


def test_threshold_one_is_the_greedy_single_token_schedule(device):
    model = tiny_model(device)
    ids, mask = prompts(device, [4, 6])
    adaptive = dllm_fast.generate(model, ids, mask, gen_length=12, block_length=4, threshold=1.0)
    single = dllm_fast.generate(model, ids, mask, gen_length=12, block_length=4, steps=12)
    assert adaptive.nfe == 12  # exactly one token per step
    assert torch.equal(adaptive.sequences, single.sequences)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_threshold_decodes_in_parallel_and_matches_reference(device, cache):
    model = tiny_model(device, head_scale=6.0)
    ids, mask = prompts(device, [4, 7, 5])
    fused, plain = both(model, ids, mask, gen_length=16, block_length=8, threshold=0.7, cache=cache)
    assert torch.equal(fused.sequences, plain.sequences)
    assert fused.nfe == plain.nfe < 16  # confident tokens were unmasked together


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_sampling_is_reproducible_and_seeded(device, cache):
    model = tiny_model(device, torch.float32)
    ids, mask = prompts(device, [5, 5])

    def run(seed):
        generator = torch.Generator(device).manual_seed(seed)
        return dllm_fast.generate(model, ids, mask, gen_length=16, block_length=8, steps=8, temperature=1.0,
                                  cache=cache, generator=generator).sequences

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_sample_does_not_depend_on_the_padded_width(device, cache):
    """At T > 0, row 0 samples the same completion alone or left-padded beside a longer prompt."""
    model = tiny_model(device)
    ids, mask = prompts(device, [4, 9])
    kwargs = dict(gen_length=8, block_length=4, steps=4, temperature=1.0, cache=cache)
    batched = dllm_fast.generate(model, ids, mask, generator=torch.Generator(device).manual_seed(3), **kwargs)
    alone = dllm_fast.generate(model, ids[:1, -4:], generator=torch.Generator(device).manual_seed(3), **kwargs)
    assert torch.equal(batched.completion_ids[0], alone.completion_ids[0])


@pytest.mark.parametrize("cache, fed", [("prefix", [24, 16, 24, 12, 24, 8, 24, 4]), ("dual", [24, 4] * 4)])
def test_caches_feed_only_what_fast_dllm_recomputes(cache, fed):
    """Fast-dLLM: each block starts with a full refresh; later steps feed [block start, L) under the prefix
    cache and only the block under the dual cache (the suffix's keys and values stay as refreshed)."""
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [5, 8])
    lengths = []
    hook = model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, steps=8, cache=cache)
    hook.remove()
    assert lengths == fed  # prompt width 8 + 16 generated: 24 positions, blocks start at 8, 12, 16, 20


def test_temperature_sampling_matches_reference_in_distribution(device):
    """Different RNGs (Philox vs float64 torch.rand), same distribution: the first generated token's
    frequencies agree between the fused and the reference sampler (two-sample chi-square)."""
    model = tiny_model(device, torch.float32, head_scale=0.3)  # a flat distribution over many tokens
    ids = torch.randint(0, 120, (1, 4), device=device).expand(400, 4).contiguous()
    kwargs = dict(gen_length=1, block_length=1, steps=1, temperature=1.0)
    fused = dllm_fast.generate(model, ids, generator=torch.Generator(device).manual_seed(0), **kwargs)
    plain = reference.generate(model, ids, generator=torch.Generator(device).manual_seed(0), **kwargs)
    probs = torch.softmax(model.logits(torch.cat([ids[:1], torch.tensor([[127]], device=device)], 1))[0, -1], -1)
    counts = [torch.bincount(r.completion_ids[:, 0].cpu(), minlength=128).double() for r in (fused, plain)]
    # Group tokens into 8 bins of roughly equal probability so expected counts are large.
    order = torch.argsort(probs.cpu(), descending=True)
    bins = torch.zeros(128, dtype=torch.long)
    bins[order] = torch.clamp((torch.cumsum(probs.cpu()[order], 0) * 8).long(), max=7)
    a, b = (torch.zeros(8, dtype=torch.float64).index_add_(0, bins, c) for c in counts)
    chi2 = (((a - b) ** 2) / (a + b).clamp(min=1)).sum().item()
    assert chi2 < 24.3  # the 1e-3 upper quantile of chi-square with 7 degrees of freedom


def test_completion_mask_stops_after_the_first_eos():
    completion = torch.tensor([[3, 126, 5, 126], [1, 2, 3, 4], [126, 126, 0, 0]])
    assert completion_mask(completion, 126).tolist() == [
        [True, True, False, False], [True, True, True, True], [True, False, False, False]]


def test_kv_cache_reproduces_the_full_forward(device):
    model = tiny_model(device)
    ids, mask = prompts(device, [3, 9])
    x = torch.cat([ids, torch.randint(0, 120, (2, 8), device=device)], dim=1)
    full_mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long, device=device)], dim=1)
    with torch.no_grad():
        full = model(x, attention_mask=full_mask)
        kv = KVCache.for_model(model, 2, x.shape[1])
        torch.testing.assert_close(model(x, attention_mask=full_mask, cache=kv), full)
        start = ids.shape[1] + 4
        suffix = model(x[:, start:], attention_mask=full_mask, cache=kv, cache_start=start, attend_length=x.shape[1])
        torch.testing.assert_close(suffix, full[:, start:])
        block = model(x[:, start:start + 2], attention_mask=full_mask, cache=kv, cache_start=start,
                      attend_length=x.shape[1])
        torch.testing.assert_close(block, full[:, start:start + 2])
        # The start as a tensor (what the compiled denoising step passes): the same keys written, the same output.
        at = torch.tensor(start, device=device)
        by_tensor = model(x[:, start:start + 2], attention_mask=full_mask, cache=kv, cache_start=at,
                          attend_length=x.shape[1])
        torch.testing.assert_close(by_tensor, full[:, start:start + 2])
        fresh = KVCache.for_model(model, 2, x.shape[1])
        model(x, attention_mask=full_mask, cache=fresh)
        kv.keys[0][:, :, start:start + 2] = 0.0
        model(x[:, start:start + 2], attention_mask=full_mask, cache=kv, cache_start=at, attend_length=x.shape[1])
        torch.testing.assert_close(kv.keys[0], fresh.keys[0])  # layer 0: keys of the tokens alone
    with pytest.raises(RuntimeError, match="under torch.no_grad"):
        model(x, cache=kv)
    with torch.no_grad(), pytest.raises(ValueError, match="attend_length=3 must satisfy"):
        model(x[:, :4], cache=kv, cache_start=0, attend_length=3)
    with torch.no_grad(), pytest.raises(ValueError, match="a tensor cache_start must be a 0-d integer tensor"):
        model(x[:, :4], cache=kv, cache_start=torch.tensor([0]), attend_length=8)
    with torch.no_grad(), pytest.raises(ValueError, match="cache_start and attend_length need a cache"):
        model(x[:, :4], cache_start=torch.tensor(0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gen_length=10, block_length=4, steps=4),
         "gen_length=10 is not a multiple of block_length=4.*pass gen_length=8 or gen_length=12"),
        (dict(gen_length=3, block_length=4, steps=4), r"gen_length=3 is not .*pass gen_length=4, or a block_length"),
        (dict(gen_length=8, block_length=4, steps=3), "steps=3 is not a multiple of the number of blocks 2"),
        (dict(gen_length=8, block_length=4, steps=4, threshold=0.9), "steps=4 is ignored when threshold"),
        (dict(gen_length=8, block_length=4), "steps=None must be an int >= 1"),
        (dict(gen_length=8, block_length=4, steps=4, cache="paged"), "cache='paged' is not one of"),
        (dict(gen_length=8, block_length=4, steps=4, remasking="entropy"), "remasking='entropy' is not one of"),
        (dict(gen_length=8, block_length=4, steps=4, temperature=-0.1), "temperature=-0.1 must be >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3])
    with pytest.raises((ValueError, TypeError), match=message):
        dllm_fast.generate(model, ids, mask, **kwargs)


def test_bad_prompts_are_named():
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 5])
    kwargs = dict(gen_length=4, block_length=4, steps=4)
    bad = ids.clone()
    bad[1, 2] = model.mask_token_id
    with pytest.raises(ValueError, match=r"input_ids\[1, 2\] is the mask token 127 \(prompt\)"):
        dllm_fast.generate(model, bad, mask, **kwargs)
    with pytest.raises(ValueError, match="empty batch"):
        dllm_fast.generate(model, ids[:0], mask[:0], **kwargs)
    with pytest.raises(ValueError, match="must be left-padded"):
        dllm_fast.generate(model, ids, mask.flip(1), **kwargs)
    with pytest.raises(ValueError, match=r"prompt 0 is all padding"):
        dllm_fast.generate(model, ids, mask * torch.tensor([[0], [1]]), **kwargs)
    bad = ids.clone()
    bad[0, 4] = 128  # checked once, at the boundary (the model's check), not at every step
    with pytest.raises(ValueError, match=r"token id 128, outside the model's embedding table \[0, 128\)"):
        dllm_fast.generate(model, bad, mask, **kwargs)
    no_eot = LLaDAModel(LLaDAConfig(**{**LLaDAConfig.preset("tiny").__dict__, "eot_token_id": None}))
    with pytest.raises(ValueError, match="confidence_eos_eot_inf needs"):
        dllm_fast.generate(no_eot, ids, mask, confidence_eos_eot_inf=True, **kwargs)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        dllm_fast.generate(model, ids, mask, generator=42, **kwargs)


@pytest.mark.cuda
def test_generator_on_another_device_is_named():
    model = tiny_model("cuda", torch.float32)
    ids, mask = prompts("cuda", [3])
    with pytest.raises(ValueError, match="generator is on cpu but input_ids on cuda"):
        dllm_fast.generate(model, ids, mask, gen_length=4, block_length=4, steps=4, generator=torch.Generator())


# ---------------------------------------------------------------------------------------------------------
# Hardening (issue 10): the mask token, non-finite outputs, masks, devices, extremes, wasted forwards, noise

SAMPLERS = [dllm_fast.generate, reference.generate]


def mask_loving_table(prompt_length, gen_length, generator):
    """Random logits over 8 ids in which the mask token (7) is the top prediction at every position."""
    table = torch.randn(prompt_length + gen_length, 8, generator=generator, dtype=torch.float64)
    table[:, 7] = table.max(dim=1).values + 3.0
    return table


@pytest.mark.parametrize("schedule", [dict(steps=8), dict(threshold=0.9)])
def test_the_mask_token_is_never_decoded(schedule, one_thread):
    """LLaDA's generate.py can decode the mask id: threshold mode then looped forever, a fixed schedule left
    mask ids in the completion, and the fused and reference samplers disagreed."""
    table = mask_loving_table(2, 8, torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2]])
    results = [sampler(ScriptedModel(table), ids, gen_length=8, block_length=4, **schedule) for sampler in SAMPLERS]
    for result in results:  # context-free logits: the greedy tokens are the argmax over the other ids
        assert torch.equal(result.completion_ids[0], table[2:, :7].argmax(dim=1))
    assert torch.equal(results[0].sequences, results[1].sequences)


class NonFiniteAt(ScriptedModel):
    """A scripted model whose output is `value` at (row, position) of the canvas."""

    def __init__(self, table, row, position, value=float("nan")):
        super().__init__(table)
        self.row, self.position, self.value = row, position, value

    def forward(self, input_ids, attention_mask=None):
        hidden = super().forward(input_ids, attention_mask).clone()
        hidden[self.row, self.position] = self.value
        return hidden


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["fused", "reference"])
@pytest.mark.parametrize("schedule", [dict(steps=8), dict(threshold=0.9)])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_output_names_the_prompt_and_position(sampler, schedule, value, one_thread):
    table = eos_prone_table(2, 16, torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 2], [3, 4]])
    model = NonFiniteAt(table, row=1, position=2 + 5, value=value)
    with pytest.raises(ValueError, match="output for prompt 1 at completion position 5 is NaN or infinite"):
        sampler(model, ids, gen_length=8, block_length=4, **schedule)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["fused", "reference"])
@pytest.mark.parametrize("corrupt", ["one head row", "every weight"])
def test_a_nan_lm_head_row_is_named(sampler, corrupt, one_thread):
    """A NaN head row is never sampled but made every confidence NaN; generate ran to the end regardless. A
    model whose every weight is NaN (a diverged training step) is named the same way."""
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 5])
    with torch.no_grad():
        for parameter in model.parameters() if corrupt == "every weight" else []:
            parameter.fill_(float("nan"))
        model.lm_head_weight[13, 4] = float("nan")
    row = 13 if corrupt == "one head row" else 0
    with pytest.raises(ValueError, match=rf"lm_head_weight\[{row}\] \(the LM-head row of token {row}\) holds NaN"):
        sampler(model, ids, mask, gen_length=4, block_length=4, steps=4)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["fused", "reference"])
def test_float_and_non_binary_attention_masks_are_rejected(sampler, one_thread):
    """A 0.5 mask passed the check (read as bool) and then turned every prompt token into padding (as long)."""
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 5])
    kwargs = dict(gen_length=4, block_length=4, steps=4)
    with pytest.raises(TypeError, match="attention_mask has dtype torch.float32; it must be bool or an integer"):
        sampler(model, ids, mask.float() * 0.5, **kwargs)
    with pytest.raises(ValueError, match=r"attention_mask\[0, 0\] = 2; a mask holds only 0"):
        sampler(model, ids, mask + (mask == 0).long() * 2, **kwargs)
    as_bool = sampler(model, ids, mask.bool(), **kwargs)
    assert torch.equal(as_bool.sequences, sampler(model, ids, mask, **kwargs).sequences)
    assert as_bool.attention_mask.dtype == torch.long


def test_a_model_on_the_meta_device_is_named(one_thread):
    with torch.device("meta"):
        model = LLaDAModel(LLaDAConfig.preset("tiny"))
    ids, mask = prompts("cpu", [3])
    with pytest.raises(ValueError, match="generate: model.lm_head_weight is on the meta device"):
        dllm_fast.generate(model, ids, mask, gen_length=4, block_length=4, steps=4)
    with pytest.raises(ValueError, match="generate: attention_mask is on the meta device"):
        dllm_fast.generate(tiny_model("cpu"), ids, mask.to("meta"), gen_length=4, block_length=4, steps=4)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["fused", "reference"])
def test_temperature_extremes_are_defined(sampler, one_thread):
    """T < 1e-30 is greedy (fp32 1/T overflowed in the fused path); T = inf is rejected; a huge finite T is
    near-uniform and still never decodes a suppressed id (the reference's NaN scores used to pick EOS)."""
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 5])
    kwargs = dict(gen_length=8, block_length=4, steps=8, generator=torch.Generator().manual_seed(0))
    greedy = sampler(model, ids, mask, **kwargs)
    assert torch.equal(sampler(model, ids, mask, temperature=1e-39, **kwargs).sequences, greedy.sequences)
    with pytest.raises(ValueError, match="temperature=inf must be a finite number"):
        sampler(model, ids, mask, temperature=float("inf"), **kwargs)
    hot = sampler(model, ids, mask, temperature=1e300, logits_eos_inf=True, **kwargs)
    assert not torch.isin(hot.completion_ids, torch.tensor([model.eos_token_id, model.mask_token_id])).any()


def test_an_infinite_cfg_scale_is_named(one_thread):
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3])
    for sampler in SAMPLERS:
        with pytest.raises(ValueError, match="cfg_scale=inf must be a finite number >= 0"):
            sampler(model, ids, mask, gen_length=4, block_length=4, steps=4, cfg_scale=float("inf"))


def test_flags_must_be_bools(one_thread):
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3])
    with pytest.raises(TypeError, match="logits_eos_inf=1 must be True or False"):
        dllm_fast.generate(model, ids, mask, gen_length=4, block_length=4, steps=4, logits_eos_inf=1)
    with pytest.raises(TypeError, match="block_length=4.0 must be an int"):
        dllm_fast.generate(model, ids, mask, gen_length=4, block_length=4.0, steps=4)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_steps_beyond_the_block_run_no_forward(cache, one_thread):
    """8 steps per block of 4 tokens: the last 4 would unmask nothing. Fast-dLLM leaves a complete block, so
    they are skipped; the tokens are those of 4 steps per block and nfe counts the useful forwards only."""
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [4, 7])
    kwargs = dict(gen_length=8, block_length=4, cache=cache)
    for sampler in SAMPLERS:
        forwards = []
        hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        wasteful = sampler(model, ids, mask, steps=16, **kwargs)
        hook.remove()
        assert wasteful.nfe == len(forwards) == 8
        assert torch.equal(wasteful.sequences, sampler(model, ids, mask, steps=8, **kwargs).sequences)


def test_the_gumbel_noise_changes_between_denoising_steps(monkeypatch, one_thread):
    """A position still masked after a step is sampled again with fresh noise: its stream id (the op's row id)
    keeps its position word and changes its step word."""
    draws = {}  # position word -> [(step word, token)]
    sample_tokens = ops.sample_tokens

    def recording(hidden, weight, **kwargs):
        tokens, confidence = sample_tokens(hidden, weight, **kwargs)
        for stream, token in zip(kwargs["row_ids"].tolist(), tokens.tolist()):
            draws.setdefault(stream & 0xFFFFFFFF, []).append((stream >> 32, token))
        return tokens, confidence

    monkeypatch.setattr(ops, "sample_tokens", recording)
    table = torch.zeros(18, 8, dtype=torch.float64)  # a flat distribution over the 7 decodable ids
    dllm_fast.generate(ScriptedModel(table), torch.tensor([[1, 2]]), gen_length=16, block_length=16, steps=16,
                       temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(draws) == 16
    assert all(len({word for word, _ in seen}) == len(seen) for seen in draws.values())
    repeats = [(a, b) for seen in draws.values() for (_, a), (_, b) in zip(seen, seen[1:])]
    assert len(repeats) == 15 * 16 // 2
    assert sum(a != b for a, b in repeats) > len(repeats) // 2  # 6/7 of them when the noise is fresh


class MaskFavouringModel(torch.nn.Module):
    """Every position's logits favour the mask token (3), then token 6: an under-trained model's worst case."""

    mask_token_id, eos_token_id, eot_token_id = 3, 2, 1

    def __init__(self):
        super().__init__()
        head = torch.zeros(8, 4)
        head[3], head[6], head[7] = 2.0, 1.0, 0.5
        self.head = torch.nn.Parameter(head)

    @property
    def lm_head_weight(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        return torch.ones(*input_ids.shape, 4)


@pytest.mark.parametrize("sampler", [dllm_fast.generate, reference.generate])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_mask_token_is_never_sampled(sampler, temperature):
    """A finished rollout must hold no mask token: likelihood scoring rejects such a sequence."""
    ids = torch.tensor([[0, 4, 5]] * 16)
    result = sampler(MaskFavouringModel(), ids, gen_length=8, block_length=4, steps=8, temperature=temperature,
                     generator=torch.Generator().manual_seed(0))
    assert not (result.completion_ids == MaskFavouringModel.mask_token_id).any()
    if temperature == 0:
        assert (result.completion_ids == 6).all()
