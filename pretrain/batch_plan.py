"""Batch arithmetic: global = micro × accumulation × data-parallel ranks, checked before any work starts.

The paper's global batch of 330 = 2·3·5·11 cannot be split over e.g. 8 ranks. Instead of silently changing
it, ``plan_batch`` fails with the feasible (micro, accumulation) pairs for this world size and the nearest
feasible global batches; the user opts into one by setting it (``train.global_batch_size=...``).

    python -m pretrain.batch_plan --global-batch 330 --world-size 8 [--micro-batch 4]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


class InfeasibleBatchError(ValueError):
    """The requested global batch cannot be split over this many ranks (the message lists the choices)."""


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    """Sequences per optimizer step over all ranks."""
    micro_batch_size: int
    """Sequences per rank per forward pass."""
    gradient_accumulation_steps: int
    """Forward/backward passes per optimizer step on each rank."""
    data_parallel_size: int
    """Number of data-parallel ranks."""

    def __post_init__(self) -> None:
        product = self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size
        if product != self.global_batch_size:
            raise InfeasibleBatchError(
                f"global {self.global_batch_size} != micro {self.micro_batch_size} × accumulation "
                f"{self.gradient_accumulation_steps} × data-parallel {self.data_parallel_size} = {product}")

    @property
    def samples_per_rank(self) -> int:
        """Sequences each rank processes per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    def per_micro_batch(self, count: int) -> float:
        """``max(count, 1)`` over the step's micro-batches on all ranks: what each micro-batch divides its
        summed loss by so that, once DeepSpeed averages the micro-batch losses over the accumulation steps and the
        ranks, the step minimises the mean over the ``count`` items (tokens, samples) of its whole global batch,
        whatever its (micro-batch, accumulation, ranks) split."""
        return max(count, 1) / (self.global_batch_size // self.micro_batch_size)

    def deepspeed_fields(self) -> dict[str, int]:
        """The batch keys injected into the DeepSpeed config (they never live in the JSON)."""
        return {"train_batch_size": self.global_batch_size,
                "train_micro_batch_size_per_gpu": self.micro_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}


def feasible_pairs(global_batch_size: int, data_parallel_size: int) -> list[tuple[int, int]]:
    """All (micro, accumulation) with micro × accumulation × dp == global, smallest accumulation first."""
    per_rank, remainder = divmod(global_batch_size, data_parallel_size)
    if remainder or per_rank < 1:
        return []
    return [(per_rank // accumulation, accumulation) for accumulation in _divisors(per_rank)]


def _divisors(number: int) -> list[int]:
    """The divisors of ``number`` >= 1, ascending, built from its prime factors. Trial division stops at the square
    root of what is left to factor, so a mistyped 20-digit global batch with small factors takes milliseconds and no
    number takes more than √number / 2 divisions (under a second for a 12-digit prime), where trying every
    accumulation up to ``number`` would run for hours."""
    result, remaining, factor = [1], number, 2
    while remaining > 1:
        if factor * factor > remaining:
            factor = remaining  # no factor up to its square root: what is left is prime
        power = 0
        while remaining % factor == 0:
            remaining //= factor
            power += 1
        if power:
            result = [divisor * factor ** k for divisor in result for k in range(power + 1)]
        factor += 1 if factor == 2 else 2
    return sorted(result)


def nearest_feasible_globals(global_batch_size: int, data_parallel_size: int,
                             micro_batch_size: int | None = None) -> list[int]:
    """The feasible global batches just below and above ``global_batch_size`` (a multiple of dp, or of
    micro × dp when the micro-batch is fixed)."""
    unit = data_parallel_size * (micro_batch_size or 1)
    below = (global_batch_size // unit) * unit
    candidates = [below, below + unit] if below != global_batch_size else [below]
    return [c for c in candidates if c > 0]


PRETRAINING_KEYS = ("train.global_batch_size", "train.micro_batch_size")


def plan_batch(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
               keys: tuple[str, str] = PRETRAINING_KEYS) -> BatchPlan:
    """Split the global batch over ``data_parallel_size`` ranks with the given micro-batch, or explain why not,
    naming the settings ``keys`` (global batch, micro-batch) the user sets them with."""
    if min(global_batch_size, micro_batch_size, data_parallel_size) < 1:
        raise InfeasibleBatchError("global batch, micro-batch and data-parallel size must all be >= 1")
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step == 0:
        return BatchPlan(global_batch_size, micro_batch_size, global_batch_size // per_step, data_parallel_size)
    pairs = feasible_pairs(global_batch_size, data_parallel_size)
    lines = [f"global batch {global_batch_size} does not split into micro-batches of {micro_batch_size} on "
             f"{data_parallel_size} data-parallel ranks (global = micro × accumulation × ranks)."]
    if pairs:
        lines.append(f"Feasible (micro, accumulation) pairs for {global_batch_size} on {data_parallel_size} ranks: "
                     + ", ".join(f"({m}, {a})" for m, a in pairs)
                     + f" -> set {keys[1]} accordingly.")
    else:
        lines.append(f"No (micro, accumulation) pair reaches {global_batch_size} on {data_parallel_size} ranks "
                     f"({global_batch_size} is not a multiple of {data_parallel_size}).")
    nearest = nearest_feasible_globals(global_batch_size, data_parallel_size)
    lines.append("Nearest feasible global batches: " + ", ".join(
        f"{g} (micro×accumulation = {g // data_parallel_size} per rank)" for g in nearest))
    with_micro = nearest_feasible_globals(global_batch_size, data_parallel_size, micro_batch_size)
    if with_micro != nearest:
        lines.append(f"Keeping micro-batch {micro_batch_size}: " + ", ".join(map(str, with_micro)))
    lines.append((f"Set {keys[1]} to a micro-batch of a pair above, or opt" if pairs else "Opt")
                 + f" into another global batch with {keys[0]}=N (or change the number of ranks).")
    raise InfeasibleBatchError("\n".join(lines))


def plan_for_world(global_batch_size: int, micro_batch_size: int, world_size: int, saved_world_size: int | None,
                   policy: str) -> tuple[BatchPlan, str | None]:
    """The batch plan of a run on ``world_size`` ranks that resumes a checkpoint saved on ``saved_world_size`` (None:
    nothing resumed), under ``train.on_world_change`` = ``policy``; and a note when the policy chose another global
    batch. Raises `InfeasibleBatchError`, naming the feasible batches and the setting that accepts one, where the
    policy stops the run."""
    changed = saved_world_size is not None and saved_world_size != world_size
    if changed and policy == "stop":
        raise InfeasibleBatchError(
            f"the checkpoint was saved on {saved_world_size} ranks and this run has {world_size}: "
            "train.on_world_change=stop refuses a change of world size. Run on "
            f"{saved_world_size} ranks, or set train.on_world_change=keep_global_batch (or nearest_batch)")
    try:
        return plan_batch(global_batch_size, micro_batch_size, world_size), None
    except InfeasibleBatchError as error:
        if not changed:
            raise
        if policy == "keep_global_batch":
            raise InfeasibleBatchError(
                f"the world changed from {saved_world_size} to {world_size} ranks and {error}\n"
                "train.on_world_change=keep_global_batch keeps the global batch or stops; "
                "train.on_world_change=nearest_batch goes on with the nearest feasible one") from None
    nearest = min(nearest_feasible_globals(global_batch_size, world_size, micro_batch_size),
                  key=lambda candidate: (abs(candidate - global_batch_size), candidate))
    note = (f"[batch] the world changed from {saved_world_size} to {world_size} ranks and global batch "
            f"{global_batch_size} does not split into micro-batches of {micro_batch_size} on {world_size}: "
            f"train.on_world_change=nearest_batch goes on with global batch {nearest}")
    return plan_batch(nearest, micro_batch_size, world_size), note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.batch_plan", description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=330,
                        help="sequences per optimizer step over all ranks (train.global_batch_size; default: the "
                             "paper's 330)")
    parser.add_argument("--world-size", type=int, required=True,
                        help="data-parallel ranks: nodes × GPUs per node")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per rank per forward pass (train.micro_batch_size); without it, every "
                             "(micro, accumulation) choice is listed")
    args = parser.parse_args(argv)
    for flag in ("global_batch", "world_size", "micro_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    pairs = feasible_pairs(args.global_batch, args.world_size)
    try:
        plan = plan_batch(args.global_batch, args.micro_batch or (pairs[0][0] if pairs else 1), args.world_size)
    except InfeasibleBatchError as error:
        message = str(error)
        if args.micro_batch is None:  # the reason is the ranks, not a micro-batch the user did not give
            message = f"global batch {args.global_batch} does not split over {args.world_size} data-parallel " \
                      "ranks.\n" + message.split("\n", 1)[1]
        print(message, file=sys.stderr)
        return 1
    if args.micro_batch is not None:
        print(f"global batch {plan.global_batch_size} = micro {plan.micro_batch_size} × accumulation "
              f"{plan.gradient_accumulation_steps} × {plan.data_parallel_size} data-parallel ranks")
    print(f"every (micro, accumulation) for global batch {args.global_batch} on {args.world_size} ranks: "
          + ", ".join(f"({micro}, {accumulation})" for micro, accumulation in pairs)
          + "; set train.micro_batch_size to the largest micro that fits in memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
