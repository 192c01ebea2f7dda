"""The rule between a rollout on a copy of the weights gathered once a step and one on FSDP2's per-layer gathers,
and whether the copy's storage is kept between steps (train/rollout_weights.py holds the copy itself): train's,
and the planner's (planning/parallel.py prices a plan by it). It imports nothing, so that the planner, which
train asks back (rollout_weights, micro_batch), takes it without an import circle (python_tests/
test_import_direction.py guards it)."""

from __future__ import annotations

ROLLOUT_MARGIN = 0.9  # of the GPU's memory: the most the rollout with the copy (or a step with it kept) may take
PATHS = ("gathered", "sharded")  # settings.ROLLOUT_WEIGHTS less "auto"


def rollout_path(choice: str, copy_bytes: int, peak_with_copy: int, capacity: int | None) -> tuple[str, str]:
    """(path, why) for a rollout under FSDP2: `choice` "gathered" or "sharded" as asked, or "auto": gathered when
    the rollout's peak with the copy of `copy_bytes` (`peak_with_copy`) stays within ROLLOUT_MARGIN of
    `capacity` (None: no limit known), else sharded."""
    copy_gb = f"{copy_bytes / 1e9:.2f} GB"
    if choice in PATHS:
        return choice, f"--rollout-weights {choice}"
    if choice != "auto":
        raise ValueError(f"--rollout-weights {choice!r} is not one of auto, {', '.join(PATHS)}.")
    if capacity is None:
        return "gathered", f"a {copy_gb} copy; no memory limit known here"
    limit = ROLLOUT_MARGIN * capacity
    if peak_with_copy <= limit:
        return "gathered", (f"the rollout's peak with the {copy_gb} copy, {peak_with_copy / 1e9:.2f} GB, is within "
                            f"{ROLLOUT_MARGIN:.0%} of {capacity / 1e9:.1f} GB")
    return "sharded", (f"the rollout's peak with a {copy_gb} copy would be {peak_with_copy / 1e9:.2f} GB, over "
                       f"{ROLLOUT_MARGIN:.0%} of {capacity / 1e9:.1f} GB")


def keep_copy(peak_without_copy: int | None, copy_bytes: int, capacity: int | None) -> tuple[bool, str]:
    """(keep, why): keep the copy's storage between steps when the step's peak without it plus the copy stays
    within ROLLOUT_MARGIN of `capacity`; unmeasured (None), free it."""
    if peak_without_copy is None or capacity is None:
        return False, "no measured peak to keep it by"
    total, limit = peak_without_copy + copy_bytes, ROLLOUT_MARGIN * capacity
    if total <= limit:
        return True, (f"the step's peak without it plus the copy, {total / 1e9:.2f} GB, is within "
                      f"{ROLLOUT_MARGIN:.0%} of {capacity / 1e9:.1f} GB")
    return False, (f"the step's peak without it plus the copy, {total / 1e9:.2f} GB, exceeds {ROLLOUT_MARGIN:.0%} "
                   f"of {capacity / 1e9:.1f} GB")
