"""Plain-PyTorch twins of the objectives: each paper's formula written as loops over sequences and samples,
independently of dllm_fast.objectives (its own advantages, estimators and normalisations). They are the test
oracle for the vectorised losses: same value, same gradient with respect to lp.

Every function takes lp [N, n_t, L] (differentiable), the masks it was scored on (any object with `scored`,
`weight`, `n_t`, `completion_length` and `counted` like MonteCarloMasks; `target` where a sampler narrows the
positions an estimate reads), the rewards [N] and the group size G; lp_old=None means on-policy (old = lp
detached). `rows`: sequences per micro-batch for the options that normalise per micro-batch (None: the whole
batch is one).
"""

from __future__ import annotations

import math

import torch


def advantages(rewards, group_size, *, baseline="mean", scale="none", std_epsilon=1e-6, unbiased=True) -> list[float]:
    values = [float(r) for r in rewards]
    out = []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        mean = sum(group) / len(group)
        dof = len(group) - 1 if unbiased else len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / dof) if len(group) > 1 else 0.0
        for i, r in enumerate(group):
            if len(group) == 1:
                a = 0.0
            elif baseline == "leave_one_out":
                a = r - (sum(group) - r) / (len(group) - 1)
            else:
                a = r - mean
            if scale == "std":
                a = a / (std + std_epsilon) if std_epsilon > 0 else (a / std if std > 0 else 0.0)
            out.append(a)
    return out


def reads(masks, n, j, i) -> bool:
    """Whether sample j's estimate reads position i: scored, and a target where the masks narrow them."""
    target = getattr(masks, "target", None)
    return bool(masks.scored[n, j, i] if target is None else target[n, j, i])


def micro_batches(N, rows):
    """The micro-batches of `rows` consecutive sequences (one of all N when rows is None)."""
    rows = N if rows is None else rows
    return [list(range(start, min(start + rows, N))) for start in range(0, N, rows)]


def position_weight(masks, n, j, i) -> float:
    """The ELBO weight of position i in sample j: the sample's, or the position's for per-position weights."""
    return float(masks.weight[n, j] if masks.weight.dim() == 2 else masks.weight[n, j, i])


def sample_elbo(lp, masks, n, j):
    """sum over the scored positions of sample j of w_nj(i) lp: one term of the Monte Carlo ELBO."""
    total = lp.new_zeros(())
    for i in range(lp.shape[2]):
        if reads(masks, n, j, i):
            total = total + position_weight(masks, n, j, i) * lp[n, j, i]
    return total


def mc_elbo(lp, masks, n):
    return sum(sample_elbo(lp, masks, n, j) for j in range(masks.n_t)) / masks.n_t


def mc_eubo(lp, masks, n, beta, mean_over_positions=False):
    """SPG's EUBO of sequence n: (1/beta) sum_i log (1/n_t) sum_j w_j 1[scored] p^beta, unscored positions dropped."""
    total, present = lp.new_zeros(()), 0
    for i in range(lp.shape[2]):
        terms = [position_weight(masks, n, j, i) * torch.exp(beta * lp[n, j, i])
                 for j in range(masks.n_t) if masks.scored[n, j, i]]
        if terms:
            total = total + torch.log(sum(terms) / masks.n_t) / beta
            present += 1
    return total / max(present, 1) if mean_over_positions else total


def diffu_grpo(lp, masks, rewards, group_size, lp_old=None, lp_ref=None, *, epsilon=0.5, beta=0.04,
               normalization="token", normalize_per="batch", rows=None, dual_clip=None, scale_rewards=False,
               std_epsilon=1e-6):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std" if scale_rewards else "none", std_epsilon=std_epsilon)
    N, n_t, L = lp.shape
    per_sequence, counts = [], []
    for n in range(N):
        total, count = lp.new_zeros(()), 0
        for j in range(n_t):
            for i in range(L):
                if not masks.scored[n, j, i]:
                    continue
                ratio = torch.exp(lp[n, j, i] - old[n, j, i])
                gain = torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon, 1 + epsilon) * adv[n])
                if dual_clip is not None and adv[n] < 0:
                    gain = torch.maximum(gain, torch.tensor(dual_clip * adv[n], dtype=lp.dtype))
                term = -gain
                if beta > 0:
                    x = lp_ref[n, j, i] - lp[n, j, i]
                    term = term + beta * (torch.exp(x) - x - 1)
                total, count = total + term, count + 1
        per_sequence.append(total)
        counts.append(count)
    chunks = micro_batches(N, rows if normalize_per == "micro_batch" else None)
    loss = lp.new_zeros(())
    for chunk in chunks:
        if normalization == "token":
            loss = loss + sum(per_sequence[n] for n in chunk) / sum(counts[n] for n in chunk)
        else:
            loss = loss + sum(per_sequence[n] / counts[n] for n in chunk) / len(chunk)
    return loss / len(chunks)


def wd1(lp, masks, rewards, group_size, *, psi=1.0, negative_term=True):
    adv = advantages(rewards, group_size)
    N, n_t, L = lp.shape
    loss = lp.new_zeros(())
    groups = N // group_size
    for g in range(groups):
        members = range(g * group_size, (g + 1) * group_size)
        positive = torch.softmax(torch.tensor([psi * adv[n] for n in members], dtype=torch.float64), 0)
        negative = torch.softmax(torch.tensor([-psi * adv[n] for n in members], dtype=torch.float64), 0)
        for k, n in enumerate(members):
            log_pi = sum(lp[n, j, i] for j in range(n_t) for i in range(L) if masks.scored[n, j, i]) / n_t
            loss = loss - float(positive[k]) * log_pi
            if negative_term:
                loss = loss + float(negative[k]) * log_pi
    return loss / groups


def vrpo_ol(lp, masks, rewards, group_size, lp_old=None, *, std_epsilon=1e-6, scale_rewards=True):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std" if scale_rewards else "none", std_epsilon=std_epsilon)
    N = lp.shape[0]
    return -sum(torch.exp(mc_elbo(lp, masks, n) - mc_elbo(old, masks, n)) * adv[n] for n in range(N)) / N


def bgpo(lp, masks, rewards, group_size, lp_old=None, *, std_epsilon=1e-6, scale="none", clip_epsilon=None,
         dual_clip=None, aggregation="mean", rows=None):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std", std_epsilon=std_epsilon)
    N, n_t, L = lp.shape
    bound = []  # R_lb per sequence: the mean over samples of g_nj * n_t
    for n in range(N):
        divisor = {"none": 1.0, "padded_length": float(L), "response_length": float(masks.counted[n].sum())}[scale]
        total = lp.new_zeros(())
        for j in range(n_t):
            d = (sample_elbo(lp, masks, n, j) - sample_elbo(old, masks, n, j)) / divisor
            ratio = 1 + d if adv[n] >= 0 else torch.exp(d)
            gain = ratio * adv[n]
            if clip_epsilon is not None:
                gain = torch.minimum(gain, ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * adv[n])
            if dual_clip is not None and adv[n] < 0:
                gain = torch.maximum(gain, torch.tensor(dual_clip * adv[n], dtype=lp.dtype))
            total = total + gain / n_t
        bound.append(total)
    if aggregation == "mean":
        return -sum(bound) / N
    chunks = micro_batches(N, rows)  # verl's token-mean per micro-batch: weights L_n / sum L, then averaged
    loss = lp.new_zeros(())
    for chunk in chunks:
        lengths = [float(masks.counted[n].sum()) for n in chunk]
        loss = loss - sum(c * bound[n] for c, n in zip(lengths, chunk)) / sum(lengths)
    return loss / len(chunks)


def spg(lp, masks, rewards, group_size, *, bound="mix", beta=1.5, omega=0.5, normalization="paper",
        normalize_per="batch", rows=None):
    adv = advantages(rewards, group_size)
    N = lp.shape[0]
    token = normalization == "token"
    values, lengths = [], []
    for n in range(N):
        length = float(masks.counted[n].sum())
        lower = mc_elbo(lp, masks, n) / (length if token else 1.0)
        if adv[n] >= 0 or bound == "elbo":
            value = lower
        elif bound == "zero":
            value = lp.new_zeros(())
        else:
            upper = mc_eubo(lp, masks, n, beta, mean_over_positions=token)
            value = upper if bound == "eubo" else omega * upper + (1 - omega) * lower
        values.append(adv[n] * value)
        lengths.append(length if token else 1.0)
    chunks = micro_batches(N, rows if normalize_per == "micro_batch" else None)
    loss = lp.new_zeros(())
    for chunk in chunks:
        loss = loss - sum(values[n] * lengths[n] for n in chunk) / sum(lengths[n] for n in chunk)
    return loss / len(chunks)


def espo(lp, masks, rewards, group_size, lp_old=None, lp_ref=None, *, epsilon_low=0.2, epsilon_high=0.2,
         beta=1e-3, advantage="mean", scale_rewards=False, kl_estimator="k2", length="fixed"):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, baseline=advantage, scale="std" if scale_rewards else "none",
                     std_epsilon=1e-4)
    N, _, L = lp.shape
    loss = lp.new_zeros(())
    for n in range(N):
        norm = float(masks.counted[n].sum()) if length == "counted" else float(L)
        ratio = torch.exp((mc_elbo(lp, masks, n) - mc_elbo(old, masks, n)) / norm)
        loss = loss - torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv[n]) / N
        if beta > 0:
            current = mc_elbo(lp, masks, n)
            d = current - mc_elbo(lp_ref, masks, n)
            if kl_estimator == "k2":
                k = d**2 / 2
            elif kl_estimator == "k1":  # ESPO's compute_approx_kl: log ratio plus its gradient correction
                k = d + (current - current.detach()) * d.detach()
            else:
                k = torch.exp(-d) - (-d) - 1
            loss = loss + beta * k / (N * norm)
    return loss


def rspo(lp, masks, rewards, group_size, lp_ref=None, *, lam=0.01, center="batch", scale_rewards=False, rows=None):
    adv = advantages(rewards, group_size, scale="std" if scale_rewards else "none", std_epsilon=1e-4)
    N = lp.shape[0]
    delta = [(mc_elbo(lp, masks, n) - mc_elbo(lp_ref, masks, n)) / float(masks.counted[n].sum()) for n in range(N)]
    chunks = micro_batches(N, rows if center == "micro_batch" else None)
    loss = lp.new_zeros(())
    for n in range(N):
        if center == "group":
            start = n - n % group_size
            members = delta[start:start + group_size]
        else:
            members = [delta[m] for m in next(c for c in chunks if n in c)]
        centre = (sum(members) / len(members)).detach()
        delta_hat = delta[n] - centre
        weight = adv[n] - lam * float(delta_hat.detach())
        loss = loss - weight * delta_hat / N
    return loss


def token_estimate(lp, masks, n, i):
    """(1/n_t) sum_j w_j lp[n, j, i] over the samples that read position i: the per-token log-likelihood
    estimate (DiffuCoder's Eq. 13 for the coupled sampler)."""
    total = lp.new_zeros(())
    for j in range(masks.n_t):
        if reads(masks, n, j, i):
            total = total + position_weight(masks, n, j, i) * lp[n, j, i]
    return total / masks.n_t


def coupled_grpo(lp, masks, rewards, group_size, lp_old=None, lp_ref=None, *, epsilon=0.5, beta=0.01,
                 advantage="leave_one_out", scale_rewards=False, normalize_per="batch", rows=None):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, baseline=advantage, scale="std" if scale_rewards else "none",
                     std_epsilon=1e-4)
    N, _, L = lp.shape
    chunks = micro_batches(N, rows if normalize_per == "micro_batch" else None)
    loss = lp.new_zeros(())
    for chunk in chunks:
        total, tokens = lp.new_zeros(()), 0
        for n in chunk:
            for i in range(L):
                if not masks.counted[n, i]:
                    continue
                estimate = token_estimate(lp, masks, n, i)
                ratio = torch.exp(estimate - token_estimate(old, masks, n, i))
                term = -torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon, 1 + epsilon) * adv[n])
                if beta > 0:
                    x = token_estimate(lp_ref, masks, n, i) - estimate
                    term = term + beta * (torch.exp(x) - x - 1)
                total, tokens = total + term, tokens + 1
        loss = loss + total / tokens
    return loss / len(chunks)


def gdpo(lp, masks, rewards, group_size, lp_old=None, *, epsilon_low=0.2, epsilon_high=0.2, scale_rewards=False):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std" if scale_rewards else "none")
    N = lp.shape[0]
    loss = lp.new_zeros(())
    for n in range(N):
        ratio = torch.exp((mc_elbo(lp, masks, n) - mc_elbo(old, masks, n)) / float(masks.counted[n].sum()))
        loss = loss - torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv[n]) / N
    return loss


def tracerl(lp, masks, rewards, group_size, lp_old=None, *, epsilon=0.2, beta=0.01):
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std", std_epsilon=0.0, unbiased=False)
    N, n_t, L = lp.shape
    states = []
    for n in range(N):
        for j in range(n_t):
            tokens = [i for i in range(L) if reads(masks, n, j, i)]
            if not tokens:
                continue
            surrogate, kl = lp.new_zeros(()), lp.new_zeros(())
            for i in tokens:
                ratio = torch.exp(lp[n, j, i] - old[n, j, i])
                surrogate = surrogate + torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon, 1 + epsilon) * adv[n])
                x = old[n, j, i] - lp[n, j, i]
                kl = kl + torch.exp(x) - x - 1
            states.append(-surrogate / len(tokens) + beta * kl)
    return sum(states) / len(states)


# ---------------------------------------------------------------------------------------------------------
# EBPO, JustGRPO and offline VRPO (DPO): the likelihood engine's family


def ebpo(lp, masks, rewards, group_size, lp_old=None, lp_ref=None, *, epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
         kl_estimator="k2", std_epsilon=1e-6):
    """PPO's min(rho A, clip(rho) A) on the sequence ratio rho = exp(E - E_old) of composite ELBOs, written directly
    (the objective computes it in log space); KL k1/k2/k3 on E - E_ref."""
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std", std_epsilon=std_epsilon)
    N = lp.shape[0]
    loss = lp.new_zeros(())
    for n in range(N):
        current = mc_elbo(lp, masks, n)
        ratio = torch.exp(current - mc_elbo(old, masks, n))
        loss = loss - torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv[n]) / N
        if beta > 0:
            d = current - mc_elbo(lp_ref, masks, n)
            k = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) + d - 1}[kl_estimator]
            loss = loss + beta * k / N
    return loss


def justgrpo(lp, masks, rewards, group_size, lp_old=None, *, epsilon=0.2, normalization="official", dual_clip=None,
             std_epsilon=1e-4):
    """The official per-position loop: each read position's clipped surrogate, summed and divided by
    L (v + 1e-5) per group (v: the mean over groups of the rows with A != 0), or averaged per row then over rows."""
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std", std_epsilon=std_epsilon)
    N, n_t, L = lp.shape
    groups = N // group_size
    valid_mean = sum(a != 0 for a in adv) / groups
    loss = lp.new_zeros(())
    for n in range(N):
        terms = []
        for j in range(n_t):
            for i in range(L):
                if not reads(masks, n, j, i):
                    continue
                ratio = torch.exp(lp[n, j, i] - old[n, j, i])
                gain = torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon, 1 + epsilon) * adv[n])
                if dual_clip is not None and adv[n] < 0:
                    gain = torch.maximum(gain, torch.tensor(dual_clip * adv[n], dtype=lp.dtype))
                terms.append(-gain)
        if normalization == "official":  # mean over groups (devices) of sum_group / (L (v + 1e-5))
            loss = loss + sum(terms) / (L * (valid_mean + 1e-5)) / groups
        else:
            loss = loss + sum(terms) / len(terms) / N
    return loss


def vrpo_dpo(lp, masks, rewards, group_size, lp_ref=None, *, beta=0.2, normalization="padded"):
    """-mean over pairs of log sigmoid(beta [(B(y_w) - B_ref(y_w)) - (B(y_l) - B_ref(y_l))] / R): rows 2k and
    2k + 1 a pair, y_w the one with the larger reward, every ELBO on the same masks."""
    N, _, L = lp.shape
    width = float(L) if normalization == "padded" else 1.0
    loss = lp.new_zeros(())
    for k in range(N // group_size):
        w, l = (2 * k, 2 * k + 1) if float(rewards[2 * k]) > float(rewards[2 * k + 1]) else (2 * k + 1, 2 * k)
        chosen = mc_elbo(lp, masks, w) - mc_elbo(lp_ref, masks, w)
        rejected = mc_elbo(lp, masks, l) - mc_elbo(lp_ref, masks, l)
        loss = loss - torch.nn.functional.logsigmoid(beta * (chosen - rejected) / width)
    return loss / (N // group_size)


def autoregressive_logprob(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """log of the probability that one-token-per-step left-to-right decoding at temperature 1 emits `completion`
    [L] after `prompt` [P]: sum_t log softmax(model([prompt, y_<t, MASK^(L - t)]))[t][y_t], one plain forward and
    a full log-softmax over the LM head's rows per position (a model whose head has no row for the mask token
    decodes exactly this distribution: generate never emits the mask)."""
    L = completion.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    for t in range(L):
        canvas = torch.cat([prompt, completion[:t], torch.full((L - t,), model.mask_token_id, dtype=prompt.dtype)])
        logits = torch.nn.functional.linear(model(canvas[None]), model.lm_head_weight)[0, prompt.shape[0] + t]
        total = total + torch.log_softmax(logits.double(), -1)[completion[t]]
    return total


# ---------------------------------------------------------------------------------------------------------
# CJ-GRPO


def cj_grpo(lp, masks, rewards, group_size, lp_old=None, lp_ref=None, *, unmask_step, epsilon=0.5, beta=0.04,
            normalization="step", rows=None, scale_rewards=False, std_epsilon=1e-6, dual_clip=None):
    """CJ-GRPO on the trajectory states: each read token's clipped surrogate and k3 term; "step" pools each step's
    tokens over a micro-batch's rows (the step: the forward `unmask_step` [N, L] records), averages the steps
    holding a token, then the micro-batches; "transition" averages each (row, state)'s tokens, then the row's
    states, then the rows."""
    old = lp.detach() if lp_old is None else lp_old
    adv = advantages(rewards, group_size, scale="std" if scale_rewards else "none", std_epsilon=std_epsilon)
    N, n_t, L = lp.shape

    def token_loss(n, j, i):
        ratio = torch.exp(lp[n, j, i] - old[n, j, i])
        gain = torch.minimum(ratio * adv[n], ratio.clamp(1 - epsilon, 1 + epsilon) * adv[n])
        if dual_clip is not None and adv[n] < 0:
            gain = torch.maximum(gain, lp.new_tensor(dual_clip * adv[n]))
        loss = -gain
        if beta:
            x = lp_ref[n, j, i] - lp[n, j, i]
            loss = loss + beta * (torch.exp(x) - x - 1)
        return loss

    states = {(n, j): [i for i in range(L) if reads(masks, n, j, i)] for n in range(N) for j in range(n_t)}
    states = {key: tokens for key, tokens in states.items() if tokens}
    if normalization == "transition":
        per_row = []
        for n in range(N):
            means = [sum(token_loss(n, j, i) for i in tokens) / len(tokens)
                     for (m, j), tokens in states.items() if m == n]
            per_row.append(sum(means) / len(means) if means else lp.new_zeros(()))
        return sum(per_row) / N
    losses = []
    for chunk in micro_batches(N, rows):
        by_step = {}
        for (n, j), tokens in states.items():
            if n in chunk:
                step = min(int(unmask_step[n, i]) for i in tokens)
                by_step.setdefault(step, []).extend((n, j, i) for i in tokens)
        means = [sum(token_loss(*t) for t in members) / len(members) for members in by_step.values()]
        losses.append(sum(means) / len(means) if means else lp.new_zeros(()))
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------------------------------------------
# MDPO: the rollout's step record (one-step predictions rewarded at every denoising step)


def mdpo_step_advantages(step_rewards, group_size, *, variant="official", std_epsilon=1e-4) -> list[list[float]]:
    """The official advantage loop (mdpo_trainer.py L849-858) on [N][K] step rewards: a_t from r_t, r_t-1 (0
    before the first step) and the mean of the later rewards (r_K-1 itself at the last step), then each step's a
    z-scored over the group (unbiased std + std_epsilon; 0 for a group of one or of equal a)."""
    rows = [[float(r) for r in row] for row in step_rewards]
    N, K = len(rows), len(rows[0])
    a = []
    for r in rows:
        values = []
        for t in range(K):
            previous = r[t - 1] if t > 0 else 0.0
            later = r[t + 1:]
            if variant == "reward":
                values.append(r[t])
            elif variant == "future_mean":
                values.append(sum(r[t:]) / (K - t))
            elif variant == "difference":
                values.append(r[t] - previous + 1.0)
            else:
                values.append(r[t] - previous + 1.0 + (sum(later) / len(later) if later else r[t]))
        a.append(values)
    out = [[0.0] * K for _ in range(N)]
    for t in range(K):
        column = advantages([a[n][t] for n in range(N)], group_size, scale="std", std_epsilon=std_epsilon)
        for n in range(N):
            out[n][t] = column[n]
    return out


def mdpo_select_steps(step_advantages, k, *, per="rollout") -> list[list[int]]:
    """Each row's k steps of largest |A| (per "rollout"), or the batch's k of largest sum_n |A| (per "batch"),
    in step order; ties to the earlier step."""
    K = len(step_advantages[0])
    if per == "batch":
        size = [sum(abs(row[t]) for row in step_advantages) for t in range(K)]
        chosen = sorted(sorted(range(K), key=lambda t: (-size[t], t))[:k])
        return [list(chosen) for _ in step_advantages]
    return [sorted(sorted(range(K), key=lambda t: (-abs(row[t]), t))[:k]) for row in step_advantages]


def mdpo(lp, masks, step_advantages, rollouts, lp_old=None, lp_ref=None, *, epsilon=0.2, beta=0.02,
         confidence=None):
    """The official per-step loss (mdpo_trainer.py L1487-1532) summed over the step rows and divided by the
    rollouts: row n is a recorded state x_t (its read positions M_t) with advantage step_advantages[n];
    sum_{i in M_t} conf_i [-min(rho A, clip(rho) A) L / (|M_t| + 1e-4) + beta (lp_ref - lp)^2 / 2] / (|M_t| + 1e-4),
    conf = exp(lp_old) (confidence None: the policy's probability of its sample) or the given [N, L] values."""
    old = lp.detach() if lp_old is None else lp_old
    N, n_t, L = lp.shape
    loss = lp.new_zeros(())
    for n in range(N):
        for j in range(n_t):
            tokens = [i for i in range(L) if reads(masks, n, j, i)]
            masked = len(tokens) + 1e-4
            A = float(step_advantages[n])
            for i in tokens:
                ratio = torch.exp(lp[n, j, i] - old[n, j, i])
                gain = torch.minimum(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon) * A)
                term = -gain * (L / masked)
                if beta > 0:
                    term = term + beta * 0.5 * (lp_ref[n, j, i] - lp[n, j, i]) ** 2
                weight = torch.exp(old[n, j, i]) if confidence is None else confidence[n, i]
                loss = loss + weight * term / masked
    return loss / rollouts


# ---------------------------------------------------------------------------------------------------------
# d-TreeRPO (tree rollouts)


def d_treerpo(lp, masks, advantages, groups, tokens, lp_old=None, lp_ref=None, *, epsilon=0.4, beta=0.01,
              sd_lambda=0.0, sd_tau=1.0):
    """The official loop over edges: each edge's clipped token surrogate and k3 KL to the reference averaged over
    its act tokens (masks.target), the edges averaged; plus sd_lambda times the self-distillation term, for each
    parent (groups[e]: the edge's parent) and position j active in one of its children with A > 0, the KL from
    q_j (softmax(A / sd_tau) over those children, summed per token) to p(. | parent), averaged over the (parent,
    j) pairs. log p(v | parent) is read off the children holding v at j (the same value in a real tree, all of
    them scored on the parent's canvas; here their weighted mean). tokens: [E, L] the children's completions."""
    old = lp.detach() if lp_old is None else lp_old
    E, _, L = lp.shape
    loss = lp.new_zeros(())
    for e in range(E):
        act = [i for i in range(L) if bool(masks.target[e, 0, i])]
        if not act:
            continue
        term = lp.new_zeros(())
        for i in act:
            ratio = torch.exp(lp[e, 0, i] - old[e, 0, i])
            a = float(advantages[e])
            term = term - torch.minimum(ratio * a, ratio.clamp(1 - epsilon, 1 + epsilon) * a)
            if beta:
                x = lp_ref[e, 0, i] - lp[e, 0, i]
                term = term + beta * (torch.exp(x) - x - 1)
        loss = loss + term / len(act)
    loss = loss / E
    if not sd_lambda:
        return loss
    total, pairs = lp.new_zeros(()), 0
    for group in sorted({int(g) for g in groups}):
        children = [e for e in range(E) if int(groups[e]) == group and float(advantages[e]) > 0]
        if not children:
            continue
        top = max(float(advantages[e]) / sd_tau for e in children)
        weight = {e: math.exp(float(advantages[e]) / sd_tau - top) for e in children}
        for j in range(L):
            active = [e for e in children if bool(masks.target[e, 0, j])]
            if not active:
                continue
            norm = sum(weight[e] for e in active)
            by_token: dict[int, list[int]] = {}
            for e in active:
                by_token.setdefault(int(tokens[e, j]), []).append(e)
            for holders in by_token.values():
                q = sum(weight[e] for e in holders) / norm
                log_p = sum(weight[e] * lp[e, 0, j] for e in holders) / sum(weight[e] for e in holders)
                total = total + q * (math.log(q) - log_p)
            pairs += 1
    return loss + sd_lambda * total / max(pairs, 1)
