"""Fused q/k/v and gate/up projections (models/layers.py): one GEMM each, while the official names stay what
checkpoints and PEFT see. The oracle is test_llada_model's float64 recomputation from the official weight names,
extended here with a LoRA delta on any of them."""

import copy
import importlib
import math

import pytest
import torch
from torch import nn

import dllm_fast
from dllm_fast.models import LLaDAModel
from dllm_fast.models.layers import FusedLinear, ProjectionSlice, rms_norm
from dllm_fast.models.llada import LORA_TARGETS
from test_llada_model import OFFICIAL_CONFIG, P, official_weights, write_official_checkpoint

peft = pytest.importorskip("peft")


def recompute(w, config, ids, lora=None):
    """test_llada_model.recompute_logits in float64, each projection x @ W.T plus, for the official keys in
    `lora` ({key: (A, B, scaling)}), the LoRA delta scaling * (x @ A.T) @ B.T."""
    w = {k: v.double() for k, v in w.items()}  # a float64 leaf stays itself: its gradient is autograd's
    H, Hkv = config["n_heads"], config["n_kv_heads"]
    D = config["d_model"] // H
    B, L = ids.shape
    lora = lora or {}

    def linear(x, key):
        out = x @ w[key].T
        if key in lora:
            A, Bm, scaling = lora[key]
            out = out + scaling * (x @ A.T) @ Bm.T
        return out

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config["rms_norm_eps"])

    inv_freq = config["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()

    def rope(x):
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    x = w[P + "wte.weight"][ids]
    for i in range(config["n_layers"]):
        b = f"{P}blocks.{i}."
        n = rms(x, w[b + "attn_norm.weight"])
        q = linear(n, b + "q_proj.weight").view(B, L, H, D).transpose(1, 2)
        k = linear(n, b + "k_proj.weight").view(B, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        v = linear(n, b + "v_proj.weight").view(B, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        att = ((rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ v).transpose(1, 2).reshape(B, L, -1)
        h = x + linear(att, b + "attn_out.weight")
        m = rms(h, w[b + "ff_norm.weight"])
        gate, up = linear(m, b + "ff_proj.weight"), linear(m, b + "up_proj.weight")
        x = h + linear(gate * torch.sigmoid(gate) * up, b + "ff_out.weight")
    return rms(x, w[P + "ln_f.weight"]) @ w[P + "ff_out.weight"].T


@pytest.fixture
def loaded(tmp_path):
    """(official weights, float64 model loaded from them as a checkpoint)."""
    weights = official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(1))
    write_official_checkpoint(tmp_path / "ckpt", OFFICIAL_CONFIG, weights)
    return weights, LLaDAModel.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)


def with_lora(model, names, seed=0, **options):
    """PEFT LoRA (rank 2) on the block projections `names`, with random A and B (B is zero at PEFT's default
    init, which would hide a delta added to the wrong rows)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=2, target_modules=LLaDAModel.lora_target_pattern(names), init_lora_weights=False,
                             **{"lora_dropout": 0.0, "lora_alpha": 3, **options})
    return peft.get_peft_model(model, config)


def unfused_twin(model):
    """A copy of `model` whose fused parts are plain nn.Linear layers holding copies of their rows, which the
    block then calls one by one: the separate projections of the official model."""
    twin = copy.deepcopy(model)
    for block in twin.transformer["blocks"]:
        for name in ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj"):
            part = getattr(block, name)
            plain = nn.Linear(part.in_features, part.out_features, bias=False, dtype=part.fused.weight.dtype)
            with torch.no_grad():
                plain.weight.copy_(part.fused.weight[part.start:part.stop])
            setattr(block, name, plain)
    return twin


def lora_factors(model) -> dict:
    """{official key: (A, B, scaling)} of every LoRA wrapper in `model` (the live parameters)."""
    factors = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            key = P + name.split("transformer.", 1)[1] + ".weight"
            factors[key] = (module.lora_A["default"].weight, module.lora_B["default"].weight,
                            module.scaling["default"])
    return factors


def test_one_parameter_per_fused_group_and_official_state_dict_keys(loaded):
    weights, model = loaded
    block = model.transformer["blocks"][0]
    assert isinstance(block.fused_qkv, FusedLinear) and isinstance(block.q_proj, ProjectionSlice)
    assert isinstance(block.q_proj, nn.Linear) and block.q_proj.weight.shape == (32, 32)
    assert "transformer.blocks.0.fused_qkv.weight" in dict(model.named_parameters())
    assert not any("q_proj" in name for name, _ in model.named_parameters())
    state = model.state_dict()
    assert set(state) == {k.removeprefix("model.") for k in weights}
    assert [k.split(".", 3)[-1] for k in list(state)[1:10]] == [  # the order of separate nn.Linear parts
        "attn_norm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "attn_out.weight", "ff_norm.weight",
        "ff_proj.weight", "up_proj.weight", "ff_out.weight"]
    for key, value in weights.items():
        assert state[key.removeprefix("model.")].shape == value.shape
        assert torch.equal(state[key.removeprefix("model.")], value.double())
    # the parts are views of the fused weight: writing one writes the fused weight
    with torch.no_grad():
        block.k_proj.weight.zero_()
    assert block.fused_qkv.weight[32:48].abs().sum() == 0 and block.fused_qkv.weight[:32].abs().sum() > 0


def test_a_block_draws_its_initial_weights_as_separate_linear_layers_do(loaded):
    """Seeded construction (torch.manual_seed, then the constructor: what many tests and scripts do) gives each
    part the kaiming-uniform weights an nn.Linear of its own would get, and leaves the generator where separate
    layers leave it, so the whole model's seeded weights are unchanged by the fusing."""
    from dllm_fast.models.llada import LLaDABlock

    config = loaded[1].config
    d, kv, hidden = config.d_model, config.n_kv_heads * config.head_dim, config.mlp_hidden_size
    torch.manual_seed(5)
    block = LLaDABlock(config)
    after_block = torch.get_rng_state()
    torch.manual_seed(5)
    shapes = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "attn_out": (d, d), "ff_proj": (d, hidden),
              "up_proj": (d, hidden), "ff_out": (hidden, d)}
    separate = {name: nn.Linear(*shape, bias=False) for name, shape in shapes.items()}
    assert torch.equal(after_block, torch.get_rng_state())
    for name, linear in separate.items():
        assert torch.equal(getattr(block, name).weight, linear.weight), name


@pytest.mark.parametrize("name", LORA_TARGETS)
def test_lora_on_each_official_name_adapts_exactly_that_projection(loaded, name):
    """LoRA on one official name: logits equal the recomputation with the delta on that projection alone (a
    delta on another projection's rows, or none, would differ); disable_adapter gives the base model."""
    weights, model = loaded
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(3))
    base = recompute(weights, OFFICIAL_CONFIG, ids)
    torch.testing.assert_close(model.logits(ids), base, rtol=1e-10, atol=1e-10)
    adapted = with_lora(model, [name])
    factors = lora_factors(model)
    assert sorted(k.split(".")[-2] for k in factors) == [name] * OFFICIAL_CONFIG["n_layers"]
    inner = adapted.get_base_model()
    with torch.no_grad():
        expected = recompute(weights, OFFICIAL_CONFIG, ids, lora=factors)
    assert (expected - base).abs().max() > 1e-3
    torch.testing.assert_close(inner.logits(ids), expected, rtol=1e-10, atol=1e-10)
    with adapted.disable_adapter():
        torch.testing.assert_close(inner.logits(ids), base, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merged_weights_equal_the_official_weights_plus_the_delta(loaded, safe_merge):
    """merge_and_unload writes each delta into the fused weight's rows of its projection (safe_merge assigns
    `weight.data`, which the parts write through), so the state dict and the logits are the merged model's."""
    weights, model = loaded
    ids = torch.randint(0, 90, (2, 7), generator=torch.Generator().manual_seed(4))
    adapted = with_lora(model, ["q_proj", "v_proj", "up_proj", "ff_out"])
    factors = {k: (a.detach().clone(), b.detach().clone(), s) for k, (a, b, s) in lora_factors(model).items()}
    unmerged = adapted.get_base_model().logits(ids)
    merged_model = adapted.merge_and_unload(safe_merge=safe_merge)
    assert isinstance(merged_model.transformer["blocks"][0].q_proj, ProjectionSlice)
    state = merged_model.state_dict()
    for key, value in weights.items():
        want = value.double()
        if key in factors:
            A, B, scaling = factors[key]
            want = want + scaling * B @ A
        torch.testing.assert_close(state[key.removeprefix("model.")], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_model.logits(ids), unmerged, rtol=1e-10, atol=1e-10)


def test_lora_gradients_equal_the_unfused_models_in_float64(loaded):
    """Gradients of the LoRA factors on every projection (fused GEMMs with deltas on their rows) equal autograd
    through the unfused recomputation."""
    weights, model = loaded
    ids = torch.randint(0, 90, (2, 8), generator=torch.Generator().manual_seed(5))
    probe = torch.randn(2, 8, OFFICIAL_CONFIG["embedding_size"], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(6))
    adapted = with_lora(model, list(LORA_TARGETS))
    factors = lora_factors(model)
    (adapted.get_base_model().logits(ids) * probe).sum().backward()
    leaves = {k: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_(), s)
              for k, (a, b, s) in factors.items()}
    (recompute(weights, OFFICIAL_CONFIG, ids, lora=leaves) * probe).sum().backward()
    for key, (A, B, _) in factors.items():
        torch.testing.assert_close(A.grad, leaves[key][0].grad, rtol=1e-10, atol=1e-12, msg=key)
        torch.testing.assert_close(B.grad, leaves[key][1].grad, rtol=1e-10, atol=1e-12, msg=key)
    assert all(p.grad is None for name, p in model.named_parameters() if "lora_" not in name)


def test_dora_with_dropout_matches_the_unfused_twin(loaded):
    """DoRA (which reads the base weight, and calls the base layer itself under dropout) on fused parts: outputs in
    training mode with dropout, gradients, disable_adapter and a safe merge equal those on separate nn.Linear
    parts."""
    weights, model = loaded
    twin = unfused_twin(model)
    assert isinstance(twin.transformer["blocks"][0].q_proj, nn.Linear)
    assert not isinstance(twin.transformer["blocks"][0].q_proj, ProjectionSlice)
    ids = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(twin.logits(ids), model.logits(ids), rtol=1e-10, atol=1e-10)
    options = dict(use_dora=True, lora_dropout=0.25)
    adapted, adapted_twin = (with_lora(m, ["q_proj", "v_proj", "up_proj"], **options) for m in (model, twin))
    outputs = []
    for peft_model in (adapted, adapted_twin):
        peft_model.train()
        torch.manual_seed(12)  # the same dropout masks, drawn in the same order
        logits = peft_model.get_base_model().logits(ids)
        logits.square().mean().backward()
        grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
        peft_model.eval()
        with peft_model.disable_adapter():
            base = peft_model.get_base_model().logits(ids)
        merged = peft_model.merge_and_unload(safe_merge=True).logits(ids)
        outputs.append((logits, grads, base, merged))
    (logits, grads, base, merged), (logits_twin, grads_twin, base_twin, merged_twin) = outputs
    torch.testing.assert_close(logits, logits_twin, rtol=1e-10, atol=1e-10)
    assert grads.keys() == grads_twin.keys() and any("magnitude" in name for name in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_twin[name], rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(base, base_twin, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(merged, merged_twin, rtol=1e-10, atol=1e-10)
    assert (merged - base).abs().max() > 1e-3


def test_full_fine_tune_gradients_equal_the_unfused_models_in_float64(loaded):
    """The fused weight's gradient holds each part's gradient in its rows."""
    weights, model = loaded
    ids = torch.randint(0, 90, (2, 8), generator=torch.Generator().manual_seed(7))
    probe = torch.randn(2, 8, OFFICIAL_CONFIG["embedding_size"], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(8))
    (model.logits(ids) * probe).sum().backward()
    leaves = {k: v.double().clone().requires_grad_() for k, v in weights.items()}
    (recompute(leaves, OFFICIAL_CONFIG, ids) * probe).sum().backward()
    for i, block in enumerate(model.transformer["blocks"]):
        for name in ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj"):
            part = getattr(block, name)
            got = part.fused.weight.grad[part.start:part.stop]
            torch.testing.assert_close(got, leaves[f"{P}blocks.{i}.{name}.weight"].grad, rtol=1e-10, atol=1e-12)


def test_peft_state_dict_names_the_base_rows_like_an_nn_linear(loaded):
    """Inside a PEFT wrapper a part saves its rows as `<name>.base_layer.weight`, as an nn.Linear would; the
    adapted state dict loads back into a fresh adapted model."""
    weights, model = loaded
    ids = torch.randint(0, 90, (1, 6))
    adapted = with_lora(model, ["q_proj", "ff_proj"])
    state = adapted.get_base_model().state_dict()
    assert "transformer.blocks.0.q_proj.base_layer.weight" in state
    assert "transformer.blocks.0.k_proj.weight" in state and "transformer.blocks.0.fused_qkv.weight" not in state
    fresh = with_lora(LLaDAModel(model.config).double(), ["q_proj", "ff_proj"], seed=9)
    fresh.get_base_model().load_state_dict(state)
    torch.testing.assert_close(fresh.get_base_model().logits(ids), adapted.get_base_model().logits(ids))


def test_load_state_dict_reports_official_names_and_shapes(loaded):
    weights, model = loaded
    state = {k.removeprefix("model."): v.double() for k, v in weights.items()}
    missing = dict(state)
    del missing["transformer.blocks.1.v_proj.weight"]
    missing["transformer.blocks.1.q_proj.extra"] = torch.zeros(1)
    result = model.load_state_dict(missing, strict=False)  # what separate nn.Linear parts would report
    assert result.missing_keys == ["transformer.blocks.1.v_proj.weight"]
    assert result.unexpected_keys == ["transformer.blocks.1.q_proj.extra"]
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(missing)
    assert "transformer.blocks.1.v_proj.weight" in str(error.value) and "fused" not in str(error.value)
    assert "transformer.blocks.1.q_proj.extra" in str(error.value)
    wrong = dict(state)
    wrong["transformer.blocks.0.k_proj.weight"] = torch.zeros(3, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"size mismatch for transformer.blocks.0.k_proj.weight.*\(3, 32\)"):
        model.load_state_dict(wrong)


def test_assign_loading_gives_the_fused_weight_the_parts_dtype(loaded):
    """load_state_dict(assign=True) into a meta skeleton (what from_pretrained does): the fused weight takes the
    parts' dtype and device, and every row is written."""
    weights, model = loaded
    state = {k.removeprefix("model."): v.to(torch.bfloat16) for k, v in weights.items()}
    with torch.device("meta"):
        skeleton = LLaDAModel(model.config)
    skeleton.load_state_dict(state, assign=True)
    fused = skeleton.transformer["blocks"][1].fused_gate_up.weight
    assert fused.dtype == torch.bfloat16 and fused.device.type == "cpu" and fused.requires_grad
    assert not fused.isnan().any()
    assert torch.equal(fused[48:], state["transformer.blocks.1.up_proj.weight"])


def test_rms_norm_rounds_before_the_scale_in_bf16():
    """bf16: normalized in fp32, rounded, then scaled in bf16 (LLaDA's order), which differs from scaling in fp32
    and rounding once on some elements; fp32 and fp64: one op, the same values."""
    x = torch.randn(64, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    weight = (1 + torch.randn(256, generator=torch.Generator().manual_seed(1)) / 3).to(torch.bfloat16)
    wide = x.float()
    official = weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-5), official)
    assert not torch.equal(torch.nn.functional.rms_norm(x, (256,), weight, 1e-5), official)
    for dtype in (torch.float32, torch.float64):
        wide, w = x.to(dtype), weight.to(dtype)
        torch.testing.assert_close(rms_norm(wide, w, 1e-5),
                                   w * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)),
                                   rtol=0, atol=0)


@pytest.mark.compile
@pytest.mark.slow  # torch.compile, about 15 s on 2 cores
def test_lora_rollouts_compile_whole_and_equal_eager(loaded, one_thread):
    """A LoRA-adapted model's denoising step still compiles whole (fullgraph; the wrappers get their base rows
    as a keyword) and gives eager's tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from dllm_fast.rollout.step import denoise_step

    weights, model = loaded
    adapted = with_lora(model, ["q_proj", "k_proj", "up_proj"])
    inner = adapted.get_base_model().eval()
    ids = torch.randint(0, 90, (2, 5), generator=torch.Generator().manual_seed(10))
    run = dict(gen_length=8, block_length=4, steps=4, cache="dual")
    generate_module = importlib.import_module("dllm_fast.rollout.sampler")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    original = generate_module.compiled_step
    generate_module.compiled_step = lambda device_type: step
    try:
        compiled = dllm_fast.generate(inner, ids, compile=True, **run)
    finally:
        generate_module.compiled_step = original
        torch._dynamo.reset()
    assert counter.frame_count == 2
    assert torch.equal(compiled.sequences, dllm_fast.generate(inner, ids, **run).sequences)


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_wrapping_leaves_no_hook_on_the_input_embeddings(family, checkpointing):
    """PEFT hooks the input embeddings with a requires_grad_ call when it finds (or assumes) checkpointing, and
    torch 2.11's dynamo cannot trace that call: the compiled LoRA rollouts broke on the H200 and in CI's CUDA build.
    The models report their checkpointing state, so a plain PEFT wrap adds no hook without checkpointing, and the
    trainer's add_lora takes back the one it adds with checkpointing on (the models checkpoint non-reentrantly)."""
    from types import SimpleNamespace

    from dllm_fast.models import LLaDAConfig, SDARConfig, SDARModel
    from dllm_fast.train.precision import add_lora
    from dllm_fast.train.settings import LoraSettings

    def fresh():
        model = (LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny")) if family == "llada"
                 else SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny")))
        model.set_gradient_checkpointing(checkpointing)
        return model

    options = SimpleNamespace(lora=LoraSettings(enabled=True, rank=2, alpha=4, dropout=0.0, targets=None))
    wrapped = add_lora(fresh(), options)
    assert not wrapped.get_input_embeddings()._forward_hooks
    plain = fresh()
    assert plain.is_gradient_checkpointing is checkpointing
    peft_wrapped = peft.get_peft_model(plain, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert bool(peft_wrapped.get_input_embeddings()._forward_hooks) is checkpointing


def forward_and_grads(model, ids, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model(ids)
        (hidden.float() ** 2).mean().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("alpha", [3, 1])  # scaling 1.5, and 0.5 (a power of two, applied on the rank-wide side)
@pytest.mark.parametrize("base, autocast", [(torch.bfloat16, True), (torch.float64, False),
                                            (torch.bfloat16, False)])
def test_plain_lora_deltas_give_peft_forwards_values_bit_for_bit(loaded, monkeypatch, base, autocast, alpha):
    """The lean LoRA path (layers.lora_deltas: deltas added in place into the fused GEMM's rows, x not copied to
    the adapters' fp32 under autocast) against PEFT's own forward on every target: the same hidden states and
    gradients, bit for bit, with fp32 adapters on a bf16 base under autocast (as train runs LoRA on a GPU) and in
    fp64; without autocast, adapters of another dtype than x take PEFT's forward."""
    from dllm_fast.models import layers

    model = with_lora(loaded[1].to(base), LORA_TARGETS, lora_alpha=alpha)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.float64 if base == torch.float64 else torch.float32)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    calls = []
    original = layers.lora_deltas
    monkeypatch.setattr(layers, "lora_deltas", lambda *args: calls.append(1) or original(*args))
    got = forward_and_grads(model, ids, autocast)
    lean = autocast or base == torch.float64
    assert len(calls) == (7 if lean else 4) * OFFICIAL_CONFIG["n_layers"]  # every target took the lean path, or
    # each fused projection's first part and each plain linear found it does not apply
    monkeypatch.setattr(layers, "lora_deltas", lambda *args: None)  # PEFT's forward
    want = forward_and_grads(model, ids, autocast)
    assert torch.equal(got[0], want[0]) and got[0].abs().sum() > 0
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def test_lean_lora_path_steps_aside_for_merged_disabled_and_dropout(loaded):
    """Merged adapters, disabled adapters and active dropout go through PEFT's forward (lora_deltas is None)."""
    from dllm_fast.models.layers import lora_deltas

    model = with_lora(loaded[1], ["q_proj"], lora_dropout=0.5)
    wrapper = model.base_model.model.transformer["blocks"][0].q_proj
    x = torch.randn(3, OFFICIAL_CONFIG["d_model"], dtype=torch.float64)
    assert lora_deltas(wrapper, x) is None  # training mode: dropout draws
    model.eval()
    assert len(lora_deltas(wrapper, x)) == 1
    with model.disable_adapter():
        assert lora_deltas(wrapper, x) is None
    model.merge_adapter()
    assert lora_deltas(wrapper, x) is None
