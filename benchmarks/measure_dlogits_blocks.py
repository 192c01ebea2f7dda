"""How much of the LM head's gradient is below bf16's precision, block by block, on trained models (issue 28 item 3).

Cut Cross-Entropy skips the gradient GEMMs of every (row block x vocabulary block) of d(logits) whose softmax is
below bf16's precision. Whether a block skip would pay for dllm_fast depends on how often a WHOLE block is
negligible, which depends on the model's distributions. This script measures it on CPU for

- ``sudoku4``: the embedded model (dllm_fast/assets), on its own fine-tuning task (masked completions);
- ``small``: the ``small`` preset (LLaDA's 126464-row head, d = 512, 4 layers) trained here with masked-diffusion
  SFT (dllm_fast.sft, the prompt empty: LLaDA's pretraining loss) for --train-steps steps on English technical
  prose, the docstrings of the installed Python packages, tokenized by a byte-level BPE trained on them with
  126336 entries (ids 126336.. are LLaDA's special tokens; the mask is 126336). The checkpoint is cached under
  --cache-dir; nothing here touches the repository but the results file.

For each scored row (a masked position), d(logits) = g (onehot(target) - softmax(logits)) (g = 1: the criteria
are scale-free). What a skip would cost is measured too: the relative error of grad_hidden and grad_weight (in
fp64) when the entries of the skippable 128 x 128 blocks (token-id order) are dropped, to be read against the
bf16 path's own error (about 2e-3, benchmarks/measure_lm_head_precision.py). A block of R rows x C vocabulary columns is below precision when

- ``relative``: every entry is below 2**-8 (bf16's unit roundoff) times its row's largest |d(logits)|: adding it
  to the row's largest would not change a bf16 value;
- ``cce``: Cut Cross-Entropy's filter (filter_eps="auto" = bf16's eps / 32 = 2**-12): every softmax value is
  below 2**-12 and no row's target falls in the block.

Blocks are counted over the rows in the order the model scores them (sequences one after another) and the
vocabulary in three orders: the tokenizer's ids (a BPE's ids follow its merge order, roughly by frequency),
sorted by frequency in the training data, and a random permutation. The skippable share of blocks is the share
of the two gradient GEMMs' work a block skip could remove (the logits GEMM always runs).

    python benchmarks/measure_dlogits_blocks.py --model sudoku4
    python benchmarks/measure_dlogits_blocks.py --model small --train-steps 300 --measure-every 50
    python benchmarks/measure_dlogits_blocks.py --model small --device cuda --cache-dir .gpu/dlogits_cache
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402

from dllm_fast.sft import draw_sft_masks, encode_sft_batch, sft_loss  # noqa: E402

RELATIVE = 2.0**-8  # bf16's unit roundoff
CCE_EPS = torch.finfo(torch.bfloat16).eps / 32  # 2**-12
# (rows, columns) per block: Cut Cross-Entropy's tile sizes, and row blocks as large as a cuBLAS GEMM's (every
# scored row of a chunk: "all"), the granularity a skip between cuBLAS calls could have.
BLOCKS = [(128, 128), (128, 256), (256, 128), (256, 256), (512, 128), ("all", 128)]
SMALL_TEXT_VOCAB = 126336  # below LLaDA's mask token id: every text id is an ordinary row of the head


# -- the models and their scored rows --------------------------------------------------------------------------


def sudoku4_rows(examples: int, seed: int):
    """(hidden rows [M, d], targets [M], head [V, d], token counts [V]) of the embedded model on masked
    completions of its training puzzles, and its description."""
    from dllm_fast.assets import SUDOKU4_GENERATION, load_sudoku4

    model, tokenizer, task = load_sudoku4()
    model.eval()
    data = task.train_examples(seed=seed)[:examples]
    prompts = [task.prompt(e, tokenizer) for e in data]
    completions = [task.demonstration(e) for e in data]
    config = model.config
    batch = encode_sft_batch(tokenizer, prompts, completions, completion_length=SUDOKU4_GENERATION["gen_length"],
                             eos_token_id=config.eos_token_id, eot_token_id=config.eot_token_id)
    counts = torch.bincount(batch.sequences.reshape(-1), minlength=model.lm_head_weight.shape[0]).double()
    hidden, targets = scored_rows(model, batch.sequences, batch.prompt_length, batch.attention_mask, seed)
    return hidden, targets, model.lm_head_weight.detach(), counts, {"model": "sudoku4 (embedded)",
                                                                    "sequences": len(data)}


def scored_rows(model, sequences, prompt_length, attention_mask, seed):
    """The hidden states of the masked positions of one SFT mask draw, and their target tokens."""
    masks = draw_sft_masks(sequences, prompt_length=prompt_length, generator=torch.Generator().manual_seed(seed))
    masked = masks.masked[:, 0]
    noisy = torch.where(masked, torch.full_like(sequences, model.mask_token_id), sequences)
    with torch.no_grad():
        hidden = model(noisy, attention_mask=attention_mask) if attention_mask is not None else model(noisy)
    return hidden[masked].float(), sequences[masked]


def docstring_corpus(max_chars: int) -> str:
    """English technical prose: the docstrings of the installed Python packages, in a fixed file order."""
    import site

    roots = sorted({Path(p) for p in site.getsitepackages()})
    texts, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or total >= max_chars:
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80:
                        texts.append(doc)
                        total += len(doc)
    return "\n\n".join(texts)[:max_chars]


def bpe_tokenizer(text: str, cache: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SMALL_TEXT_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer


def small_checkpoints(train_steps: int, measure_every: int, batch: int, length: int, lr: float, cache: Path,
                      corpus_chars: int, eval_sequences: int, seed: int, device: str = "cpu"):
    """The `small` preset trained with masked-diffusion SFT on the docstring corpus (tokenizer and token ids
    cached), yielding (hidden rows, targets, head, token counts, description) of held-out windows scored at
    step 0 and every `measure_every` steps up to `train_steps`. The model trains on `device`; the windows
    and masks are drawn on the CPU, as on every device."""
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    cache.mkdir(parents=True, exist_ok=True)
    ids_path = cache / "ids.pt"
    started = time.time()
    if ids_path.exists():
        ids = torch.load(ids_path)
    else:
        text = docstring_corpus(corpus_chars)
        tokenizer = bpe_tokenizer(text, cache)
        ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
        torch.save(ids, ids_path)
    windows = ids[: ids.numel() // length * length].view(-1, length)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(windows.shape[0], generator=generator)
    held_out, train = windows[order[:eval_sequences]], windows[order[eval_sequences:]]
    config = LLaDAConfig.preset("small")
    counts = torch.bincount(train.reshape(-1), minlength=config.vocab_size).double()
    torch.manual_seed(seed)
    model = LLaDAModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    log = []
    for step in range(train_steps + 1):
        if step % measure_every == 0 or step == train_steps:
            model.eval()
            hidden, targets = scored_rows(model, held_out.to(device), 0, None, seed + 1)
            model.train()
            yield hidden, targets, model.lm_head_weight.detach().clone(), counts, {
                "model": "small preset, masked-diffusion SFT on docstrings", "train_steps": step, "batch": batch,
                "length": length, "lr": lr, "corpus_tokens": int(ids.numel()), "loss_log": list(log),
                "held_out_sequences": eval_sequences, "seconds": round(time.time() - started)}
        if step == train_steps:
            return
        sequences = train[torch.randint(0, train.shape[0], (batch,), generator=generator)].to(device)
        masks = draw_sft_masks(sequences, prompt_length=0, generator=generator)
        loss = sft_loss(model, sequences, masks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        log.append((step, round(loss.item(), 4)))
        print(f"step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)


# -- the measurement ---------------------------------------------------------------------------------------------


def block_shares(hidden, targets, weight, counts, row_chunk: int = 256) -> tuple[list[dict], dict]:
    """Per vocabulary order and block shape, the share of blocks below precision under both criteria; and the
    share of single entries below the relative criterion (an upper bound on any skip)."""
    V, device = weight.shape[0], weight.device
    counts = counts.to(device)
    orders = {"token id": torch.arange(V, device=device),
              "by frequency": torch.argsort(counts, descending=True, stable=True),
              "random": torch.randperm(V, generator=torch.Generator().manual_seed(0)).to(device)}
    M = hidden.shape[0]
    widths = sorted({c for _, c in BLOCKS})
    # Per row and column block: the largest relative |d(logits)| and the largest softmax off the target, and
    # whether the block holds the target; then rows are grouped into row blocks.
    per_order = {name: {c: {"relative": [], "cce": []} for c in widths} for name in orders}
    # What skipping costs: the gradients with the skipped (128 x 128, token-id order) blocks' entries dropped,
    # against the full ones, in fp64: sum over rows of |dropped part|^2 and of |full|^2.
    zeros = dict(dtype=torch.float64, device=device)
    dropped = {criterion: {"hidden": 0.0, "weight": torch.zeros(V, hidden.shape[1], **zeros)}
               for criterion in ("relative", "cce")}
    full = {"hidden": 0.0, "weight": torch.zeros(V, hidden.shape[1], **zeros)}
    entries_below, entropy, max_p, target_p = 0, 0.0, 0.0, 0.0
    for start in range(0, M, row_chunk):
        h, t = hidden[start:start + row_chunk], targets[start:start + row_chunk]
        p = torch.softmax(h @ weight.float().T, dim=-1)
        entropy += float(-(p * p.clamp_min(1e-30).log()).sum())
        max_p += float(p.amax(1).sum())
        target_p += float(p.gather(1, t[:, None]).sum())
        onehot = torch.zeros_like(p).scatter_(1, t[:, None], 1.0)
        d = (onehot - p).abs()
        relative = d / d.amax(dim=1, keepdim=True)
        entries_below += int((relative < RELATIVE).sum())
        off_target = p.masked_fill(onehot.bool(), 1.0)  # the target's column never counts as negligible for CCE
        signed = (onehot - p).double()
        full["hidden"] += float((signed @ weight.double()).square().sum())
        full["weight"] += signed.T @ h.double()
        for criterion, values, threshold in (("relative", relative, RELATIVE), ("cce", off_target, CCE_EPS)):
            skip = skipped_entries(values, threshold, 128, 128)
            part = signed * skip
            dropped[criterion]["hidden"] += float((part @ weight.double()).square().sum())
            dropped[criterion]["weight"] += part.T @ h.double()
        for name, order in orders.items():
            rel, cce = relative[:, order], off_target[:, order]
            for c in widths:
                blocks = -(-V // c)
                pad = blocks * c - V
                rel_b = torch.nn.functional.pad(rel, (0, pad)).view(-1, blocks, c).amax(-1)
                cce_b = torch.nn.functional.pad(cce, (0, pad)).view(-1, blocks, c).amax(-1)
                per_order[name][c]["relative"].append(rel_b)
                per_order[name][c]["cce"].append(cce_b)
    rows = []
    for name in orders:
        for r, c in BLOCKS:
            entry = {"vocab order": name, "rows": r, "cols": c}
            r = M if r == "all" else r
            for criterion, threshold in (("relative", RELATIVE), ("cce", CCE_EPS)):
                per_row = torch.cat(per_order[name][c][criterion])  # [M, blocks]
                usable = per_row.shape[0] // r * r
                grouped = per_row[:usable].view(-1, r, per_row.shape[1]).amax(1)  # [row blocks, blocks]
                entry[f"{criterion}_skippable"] = float((grouped < threshold).double().mean())
            rows.append(entry)
    errors = {f"skip_error_{criterion}_{part}": (
        math.sqrt(dropped[criterion]["hidden"] / full["hidden"]) if part == "grad_hidden"
        else float(dropped[criterion]["weight"].norm() / full["weight"].norm()))
        for criterion in ("relative", "cce") for part in ("grad_hidden", "grad_weight")}
    summary = {"rows_scored": M, "vocab": V, "entries_below_relative": entries_below / (M * V), **errors,
               "mean_entropy_nats": entropy / M, "mean_max_prob": max_p / M, "mean_target_prob": target_p / M}
    return rows, summary


def skipped_entries(values, threshold, rows, cols) -> torch.Tensor:
    """[M, V] bool: the entries of the (rows x cols) blocks, rows grouped as they come within this batch of rows
    (a partial last group counts as a block), whose every value is below the threshold."""
    M, V = values.shape
    pad_rows, pad_cols = -(-M // rows) * rows - M, -(-V // cols) * cols - V
    padded = torch.nn.functional.pad(values, (0, pad_cols, 0, pad_rows))
    blocks = padded.view(-1, rows, padded.shape[1] // cols, cols).amax(dim=(1, 3)) < threshold
    return blocks.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:M, :V]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["sudoku4", "small"], required=True)
    parser.add_argument("--examples", type=int, default=512, help="sudoku4: training puzzles scored")
    parser.add_argument("--train-steps", type=int, default=300, help="small: SFT steps")
    parser.add_argument("--measure-every", type=int, default=50, help="small: measure (and write) every N steps")
    parser.add_argument("--batch", type=int, default=4, help="small: sequences per step")
    parser.add_argument("--length", type=int, default=64, help="small: tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--corpus-chars", type=int, default=15_000_000)
    parser.add_argument("--eval-sequences", type=int, default=32, help="small: held-out sequences scored")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/dllm_fast_dlogits_blocks"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's default)")
    parser.add_argument("--device", default="cpu", help="small: where the model trains and the blocks are counted "
                        "(cuda: 300 steps in seconds; the corpus and tokenizer come from --cache-dir either way)")
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "sudoku4":
        points = [sudoku4_rows(args.examples, args.seed)]
    else:
        points = small_checkpoints(args.train_steps, args.measure_every, args.batch, args.length, args.lr,
                                   args.cache_dir, args.corpus_chars, args.eval_sequences, args.seed, args.device)
    rows = []
    for hidden, targets, weight, counts, about in points:  # the small model's rows, step by step: all kept
        point_rows, summary = block_shares(hidden, targets, weight, counts)
        step = {"train_steps": about["train_steps"]} if "train_steps" in about else {}
        rows += [{**step, **row} for row in point_rows]
        print(json.dumps({k: v for k, v in {**about, **summary}.items() if k != "loss_log"}), flush=True)
        print_table(point_rows, ["vocab order", "rows", "cols", "relative_skippable", "cce_skippable"])
        config = {**about, **summary, "relative_threshold": RELATIVE, "cce_threshold": CCE_EPS,
                  "threads": torch.get_num_threads(), "device": args.device}
        print(f"wrote {write_results(f'dlogits_blocks_{args.model}', config, rows, args.results_dir)}", flush=True)


if __name__ == "__main__":
    main()
