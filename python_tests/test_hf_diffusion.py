"""HFDiffusionLM: a tiny random Dream-style HF model (shifted logits, its own mask id, Dream's 4-D attention mask
and position ids), saved and loaded in HF format, behind the model contract: sampling and scoring agree with the
reference sampler and with log-softmax over the HF model's own logits."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import MaskedLMOutput  # noqa: E402

import dllm_fast  # noqa: E402
from dllm_fast import likelihood, reference  # noqa: E402
from dllm_fast.models import HFDiffusionLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, MASK, EOS = 64, 63, 62


class TinyDreamConfig(PretrainedConfig):
    model_type = "Dream"

    def __init__(self, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.max_position_embeddings, self.mask_token_id = max_position_embeddings, mask_token_id
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)


class TinyDreamBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)

    def forward(self, x, mask):
        B, S, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # bidirectional
        x = x + self.out(attended.transpose(1, 2).reshape(B, S, d))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class TinyDreamModel(PreTrainedModel):
    """Dream's interface in miniature: forward(input_ids, attention_mask="full" | bool [B, 1, S, S], position_ids)
    -> MaskedLMOutput(logits), logits at i read as predicting token i + 1. Absolute position embeddings make
    position ids matter, so a wrong padding convention changes the output."""

    config_class = TinyDreamConfig

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, d)
        self.layers = nn.ModuleList(TinyDreamBlock(d, config.num_attention_heads)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        with torch.no_grad():
            if module is getattr(self, "lm_head", None):
                module.weight.normal_(0, 2 / math.sqrt(module.in_features))  # logits with a std of about 2
            elif isinstance(module, nn.Linear):
                module.weight.normal_(0, 1 / math.sqrt(module.in_features))
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0, 1)

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 4:
            raise ValueError("Dream takes attention_mask='full' or a 4-D [B, 1, S, S] mask")
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return MaskedLMOutput(logits=self.lm_head(self.norm(x)))


AutoConfig.register("Dream", TinyDreamConfig, exist_ok=True)
AutoModel.register(TinyDreamConfig, TinyDreamModel, exist_ok=True)


@pytest.fixture(scope="module")
def saved_dream(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_dream")
    TinyDreamModel(TinyDreamConfig()).save_pretrained(path)
    return path


@pytest.fixture
def dream(saved_dream):
    return HFDiffusionLM.from_pretrained(saved_dream, dtype=torch.float64).eval()


def prompts(rows=3, length=5, seed=1):
    ids = torch.randint(0, EOS, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids.masked_fill(mask == 0, EOS), mask


def test_loading_reads_the_dream_conventions_from_the_config(dream):
    assert isinstance(dream, dllm_fast.DiffusionLM)
    assert (dream.logit_shift, dream.attention_mask_style) == (1, "dream")
    assert (dream.mask_token_id, dream.eos_token_id, dream.eot_token_id) == (MASK, EOS, None)
    assert dream.lm_head_weight is dream.model.lm_head.weight and dream.dtype == torch.float64


def test_hidden_states_are_the_lm_heads_input(dream):
    ids, mask = prompts()
    hidden = dream(ids, attention_mask=mask)
    with torch.no_grad():
        full = dream.model(ids, attention_mask=mask.bool()[:, None, None, :].expand(-1, 1, 5, 5),
                           position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    torch.testing.assert_close(dream.logits(ids, attention_mask=mask), full, rtol=1e-12, atol=1e-12)
    assert hidden.shape == (3, 5, 32)


def test_skipping_the_lm_head_changes_nothing(saved_dream):
    model = AutoModel.from_pretrained(saved_dream, dtype=torch.float64).eval()
    ids, mask = prompts()
    skipped = HFDiffusionLM(model)(ids, attention_mask=mask)
    full = HFDiffusionLM(model, skip_lm_head=False)(ids, attention_mask=mask)
    assert torch.equal(skipped, full)


def test_greedy_generate_matches_the_reference_sampler(dream):
    ids, mask = prompts()
    kwargs = dict(gen_length=8, block_length=4, steps=8, temperature=0.0)
    fused = dllm_fast.generate(dream, ids, mask, **kwargs)
    naive = reference.generate(dream, ids, mask, **kwargs)
    assert torch.equal(fused.sequences, naive.sequences)
    assert not (fused.completion_ids == MASK).any()


def test_left_padding_follows_dreams_positions(dream):
    """With Dream's convention (padding hidden from attention, positions counted from the first real token) a
    padded prompt decodes exactly like the same prompt alone."""
    ids, mask = prompts()
    kwargs = dict(gen_length=8, block_length=8, steps=8)
    batched = dllm_fast.generate(dream, ids, mask, **kwargs)
    alone = dllm_fast.generate(dream, ids[1:2, 2:], **kwargs)
    assert torch.equal(batched.completion_ids[1], alone.completion_ids[0])


def shifted_logprobs(model, sequences, masks):
    """lp[n, j, i] straight from the HF model's logits: log_softmax(logits at P + i - 1)[token P + i]."""
    N, n_t, L = masks.scored.shape
    P = masks.prompt_length
    lp = torch.zeros(N, n_t, L, dtype=torch.float64)
    for n in range(N):
        for j in range(n_t):
            noisy = sequences[n].masked_fill(masks.masked[n, j], MASK)[None]
            logits = model(noisy, attention_mask="full").logits[0]
            logp = logits[P - 1:-1].log_softmax(-1).gather(-1, sequences[n, P:, None])[:, 0]
            lp[n, j] = torch.where(masks.scored[n, j], logp, 0.0)
    return lp


def test_scoring_matches_log_softmax_of_the_shifted_logits(dream):
    sequences = torch.randint(0, EOS, (3, 9), generator=torch.Generator().manual_seed(2))
    sequences[0, 7] = EOS
    masks = likelihood.sample_masks(sequences, prompt_length=4, n_t=3, sampler="stratified_l",
                                    eos_token_id=EOS, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = likelihood.score(dream, sequences, masks, micro_batch=2)
        want = shifted_logprobs(dream.model, sequences, masks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert got.abs().sum() > 0


def test_streaming_backward_reaches_the_hf_parameters(dream):
    sequences = torch.randint(0, EOS, (2, 8), generator=torch.Generator().manual_seed(3))
    masks = likelihood.sample_masks(sequences, prompt_length=3, n_t=2, sampler="stratified_l", count="all",
                                    generator=torch.Generator().manual_seed(1))
    weights = torch.tensor([0.5, -1.0], dtype=torch.float64)

    def objective(lp):
        return -(weights * likelihood.elbo(lp, masks)).sum()

    likelihood.streaming_backward(dream, sequences, masks, objective, micro_batch=1)
    got = [p.grad.clone() for p in dream.parameters()]
    dream.zero_grad(set_to_none=True)
    objective(shifted_logprobs(dream.model, sequences, masks)).backward()
    for fused, direct in zip(got, (p.grad for p in dream.parameters())):
        torch.testing.assert_close(fused, direct, rtol=1e-9, atol=1e-12)


def test_cache_modes_are_rejected(dream):
    ids, _ = prompts()
    with pytest.raises(ValueError, match="logit_shift=0|new_cache"):
        dllm_fast.generate(dream, ids, gen_length=4, block_length=4, steps=4, cache="prefix")
    with pytest.raises(ValueError, match="no KV cache"):
        dream(ids, cache=object())


def test_conventions_and_ids_are_checked(saved_dream):
    model = AutoModel.from_pretrained(saved_dream)
    model.config.model_type = "my_diffusion_lm"
    with pytest.raises(ValueError, match="pass logit_shift=1"):
        HFDiffusionLM(model)
    plain = HFDiffusionLM(model, logit_shift=0)
    assert plain.attention_mask_style == "hf"
    with pytest.raises(ValueError, match="logit_shift=2"):
        HFDiffusionLM(model, logit_shift=2)
    del model.config.mask_token_id
    with pytest.raises(ValueError, match="mask_token_id is not in the model config; pass mask_token_id="):
        HFDiffusionLM(model, logit_shift=1)
    assert HFDiffusionLM(model, logit_shift=1, mask_token_id=MASK).mask_token_id == MASK
    model.config.eos_token_id = [EOS, 3]
    with pytest.raises(ValueError, match=r"eos_token_id=\[62, 3\], several ids"):
        HFDiffusionLM(model, logit_shift=1, mask_token_id=MASK)
    with pytest.raises(ValueError, match="attention_mask_style='causal'"):
        HFDiffusionLM(model, logit_shift=1, mask_token_id=MASK, eos_token_id=EOS, attention_mask_style="causal")


def test_a_model_without_an_lm_head_is_rejected(saved_dream):
    model = AutoModel.from_pretrained(saved_dream)
    model.lm_head = None
    with pytest.raises(ValueError, match="has no LM head"):
        HFDiffusionLM(model)
