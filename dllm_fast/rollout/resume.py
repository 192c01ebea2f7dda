"""Resuming a rollout part-way (d-TreeRPO's branching): `generate(..., resume=Resume(canvas, start_step, num_steps))`
decodes a partly decoded canvas from step `start_step` of the call's global schedule, for `num_steps` steps.
Shared by the fused sampler and its reference twin.

The global schedule numbers the steps of a fixed-schedule call 0 .. steps - 1, block by block: step g is step
g mod steps_per_block of block g div steps_per_block (the plan's unmask_schedule: LLaDA's even split or ASS's
2^s tokens; rollout.plan.unmask_counts).
A canvas "at step g" holds exactly what the steps before g left: every earlier block decoded, every later one
masked, and the current block with the schedule's count of its first (g mod steps_per_block) steps decoded.
That is checked (one host sync), so a canvas from another schedule is refused instead of decoded wrongly.

Resuming changes nothing a step computes: it runs the same steps with the same noise words (the call's key, the
schedule's step, the row, the position), so a run stopped at step b and resumed there with a generator in the
state the first call started from decodes the uninterrupted run's tokens, at every temperature (random remasking
excepted: its uniforms are drawn from the generator step by step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.contracts import block_length as block_length_of
from dllm_fast.rollout.plan import DecodingPlan, unmask_counts
from dllm_fast.validation import check_int, data_checks_enabled


@dataclass(frozen=True, eq=False)
class Resume:
    """generate's `resume` option. canvas: [B, P + gen_length] the sequences a call with the same settings returned
    after start_step steps of the global schedule (None: the prompts followed by masks, with start_step 0);
    start_step: the global steps already decoded; num_steps: the steps to run (None: to the end). Checked when the
    call runs (errors name each field as resume.<field>)."""

    canvas: torch.Tensor | None = None
    start_step: int = 0
    num_steps: int | None = None


@dataclass(frozen=True)
class ResumePoint:
    """The global steps [start, stop) a call runs, and the canvas it starts from ([B, P + G], or None: the prompts
    followed by masks, start 0). steps_per_block is the plan's (None under threshold decoding: every step)."""

    start: int
    stop: int | None
    canvas: torch.Tensor | None
    steps_per_block: int | None

    def block_steps(self, block: int, limit: int) -> tuple[int, int]:
        """The steps [begin, end) of block `block` this call runs (begin == end: none), `limit` the block's step
        limit (DecodingPlan.step_limit)."""
        spb = self.steps_per_block
        if spb is None:
            return 0, limit
        begin = min(max(self.start - block * spb, 0), spb)
        end = spb if self.stop is None else min(max(self.stop - block * spb, 0), spb)
        return min(begin, limit), min(end, limit)

    def finishes(self, block: int) -> bool:
        """Whether this call runs block `block` to its end (so the block's completion checks apply)."""
        return self.steps_per_block is None or self.stop is None or self.stop >= (block + 1) * self.steps_per_block


FROM_START = ResumePoint(0, None, None, None)


def check_resume(model, plan: DecodingPlan, input_ids: torch.Tensor, gen_length: int, block_length: int,
                 resume: Resume | None) -> ResumePoint:
    """The checked `resume` option of a generate call; each bad value refused naming it and the fix. None: the
    call decodes from the start."""
    if resume is None:
        return ResumePoint(0, None, None, plan.steps_per_block)
    if not isinstance(resume, Resume):
        raise TypeError(f"resume must be a dllm_fast.rollout.Resume(canvas, start_step, num_steps) or None, got "
                        f"{type(resume).__name__}.")
    start_canvas, start_step, num_steps = resume.canvas, resume.start_step, resume.num_steps
    if plan.steps_per_block is None:
        raise ValueError("resume=Resume(...) resumes the fixed schedule's global steps; threshold decoding has no "
                         "fixed schedule: pass steps=... and threshold=None.")
    if block_length_of(model) is not None:
        raise ValueError("resuming a rollout (resume=Resume(...)) is supported on bidirectional models (LLaDA, "
                         "Dream); this block-diffusion model decodes prompt-aligned blocks: drop it.")
    if plan.record_unmask_step:
        raise ValueError("record_unmask_step=True numbers the forwards of one uninterrupted call; a resumed call "
                         "(resume=Resume(...)) cannot: pass record_unmask_step=False.")
    if getattr(plan, "record_step_predictions", False):
        raise ValueError("record_step_predictions=True records every forward of one uninterrupted call; a resumed "
                         "call (resume=Resume(...)) cannot: pass record_step_predictions=False.")
    if plan.compile:
        raise ValueError("compile=True keeps its buffers for a whole call; resumed calls (resume=Resume(...)) run "
                         "eagerly: pass compile=False.")
    spb = plan.steps_per_block
    steps = spb * (gen_length // block_length)
    check_int("resume.start_step", start_step, minimum=0, maximum=steps,
              hint=f"the global steps already decoded, of steps={steps}")
    stop = None
    if num_steps is not None:
        check_int("resume.num_steps", num_steps, minimum=0, maximum=steps - start_step,
                  hint=f"steps to run from start_step={start_step}, at most steps - start_step = {steps - start_step}")
        stop = start_step + num_steps
    in_block = start_step % spb
    if plan.cache.uses_cache and 0 < in_block < plan.step_limit(block_length):
        raise ValueError(f"cache={plan.cache.name!r} refreshes its keys and values at each block's first step, so a "
                         f"call resumed inside a block (resume.start_step={start_step} is step {in_block} of block "
                         f"{start_step // spb}, {spb} steps per block) would not decode the uninterrupted run's "
                         "tokens; resume at a block boundary (a multiple of steps_per_block) or use cache='none'.")
    B, P = input_ids.shape
    if start_canvas is None:
        if start_step != 0:
            raise ValueError(f"resume.start_step={start_step} resumes a partly decoded canvas: pass it as "
                             "resume.canvas (the sequences the call that stopped there returned).")
        return ResumePoint(0, stop, None, spb)
    if not isinstance(start_canvas, torch.Tensor) or tuple(start_canvas.shape) != (B, P + gen_length):
        shape = tuple(start_canvas.shape) if isinstance(start_canvas, torch.Tensor) else type(start_canvas).__name__
        raise ValueError(f"resume.canvas must be the [B, P + gen_length] = [{B}, {P + gen_length}] sequences a call "
                         f"stopped at start_step returned (its prompts are input_ids), got {shape}.")
    if start_canvas.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"resume.canvas must hold integer token ids, got {start_canvas.dtype}.")
    if start_canvas.device != input_ids.device:
        raise ValueError(f"resume.canvas is on {start_canvas.device} but input_ids on {input_ids.device}; move it.")
    canvas = start_canvas.long()
    if data_checks_enabled(canvas, input_ids):
        check_canvas_at(canvas, input_ids, model.mask_token_id, start_step, spb, plan.step_limit(block_length),
                        block_length, plan.unmask_schedule)
    return ResumePoint(start_step, stop, canvas, spb)


def expected_masked(start_step: int, steps_per_block: int, limit: int, block_length: int, num_blocks: int,
                    unmask_schedule: str = "even") -> list[int]:
    """The masked positions each block holds at global step `start_step` of the schedule."""
    block, in_block = divmod(start_step, steps_per_block)
    done = sum(unmask_counts(block_length, limit, unmask_schedule)[:min(in_block, limit)])
    return [0 if b < block else block_length if b > block else block_length - done for b in range(num_blocks)]


def check_canvas_at(canvas: torch.Tensor, input_ids: torch.Tensor, mask_id: int, start_step: int,
                    steps_per_block: int, limit: int, block_length: int, unmask_schedule: str = "even") -> None:
    """A canvas at `start_step`: its prompts are input_ids, and every block holds the masked count the schedule
    leaves there (one host sync; a failure reads more, to name the row and block)."""
    P = input_ids.shape[1]
    completion = canvas[:, P:]
    num_blocks = completion.shape[1] // block_length
    expected = torch.tensor(expected_masked(start_step, steps_per_block, limit, block_length, num_blocks,
                                            unmask_schedule), device=canvas.device)
    masked = (completion == mask_id).view(canvas.shape[0], num_blocks, block_length).sum(-1)  # [B, blocks]
    prompt_differs = (canvas[:, :P] != input_ids.long()).any(dim=1)
    count_differs = (masked != expected).any(dim=1)
    if not bool(torch.stack([prompt_differs.any(), count_differs.any()]).any()):
        return
    if prompt_differs.any():
        row = int(prompt_differs.nonzero()[0])
        raise ValueError(f"resume.canvas[{row}, :{P}] differs from input_ids[{row}]: a resumed canvas must start with "
                         "the prompts it was decoded from (pass the sequences the earlier call returned, and its "
                         "input_ids).")
    row = int(count_differs.nonzero()[0])
    block = int((masked[row] != expected).nonzero()[0])
    raise ValueError(f"resume.canvas[{row}] holds {int(masked[row, block])} mask tokens in block {block}, but at "
                     f"resume.start_step={start_step} ({steps_per_block} steps per block of {block_length}) the "
                     "schedule "
                     f"leaves {int(expected[block])}: pass the canvas a call with the same gen_length, block_length "
                     "and steps returned after start_step steps.")
