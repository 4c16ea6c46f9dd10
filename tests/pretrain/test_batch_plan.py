"""Batch planner: global = micro × accumulation × data-parallel, with the paper's 330 on 1, 2, 3, 5, 8 ranks."""
import pytest

from pretrain.batch_plan import BatchPlan, InfeasibleBatchError, feasible_pairs, main, plan_batch


@pytest.mark.parametrize("world, micro, accumulation", [(1, 11, 30), (2, 11, 15), (3, 11, 10), (5, 11, 6),
                                                        (2, 165, 1), (1, 1, 330)])
def test_330_splits_exactly(world: int, micro: int, accumulation: int) -> None:
    plan = plan_batch(330, micro, world)
    assert plan == BatchPlan(330, micro, accumulation, world)
    assert plan.deepspeed_fields() == {"train_batch_size": 330, "train_micro_batch_size_per_gpu": micro,
                                       "gradient_accumulation_steps": accumulation}
    assert plan.samples_per_rank * world == 330


def test_330_on_8_ranks_is_refused_with_the_choices() -> None:
    with pytest.raises(InfeasibleBatchError) as error:
        plan_batch(330, 4, 8)
    message = str(error.value)
    assert "No (micro, accumulation) pair reaches 330 on 8 ranks" in message
    assert "328 (micro×accumulation = 41 per rank)" in message and "336 (micro×accumulation = 42 per rank)" in message
    assert "Keeping micro-batch 4: 320, 352" in message
    assert "train.global_batch_size" in message
    plan_batch(336, 6, 8)  # opting into a listed choice works


def test_wrong_micro_lists_feasible_pairs() -> None:
    with pytest.raises(InfeasibleBatchError) as error:
        plan_batch(330, 4, 5)  # 330 / 5 = 66 per rank, 4 does not divide it
    assert "Feasible (micro, accumulation) pairs for 330 on 5 ranks: (66, 1), (33, 2), (22, 3), (11, 6), (6, 11)" \
        in str(error.value)
    assert feasible_pairs(330, 5)[-1] == (1, 66)
    assert feasible_pairs(330, 8) == []


def test_batch_plan_checks_its_own_product() -> None:
    with pytest.raises(InfeasibleBatchError):
        BatchPlan(330, 4, 10, 8)


def test_cli(capsys: pytest.CaptureFixture) -> None:
    assert main(["--world-size", "8", "--micro-batch", "2"]) == 1
    assert "Nearest feasible global batches" in capsys.readouterr().err
    assert main(["--world-size", "3", "--micro-batch", "11"]) == 0
    assert capsys.readouterr().out == ("global batch 330 = micro 11 × accumulation 10 × 3 data-parallel ranks\n"
                                       "every (micro, accumulation) for global batch 330 on 3 ranks: (110, 1), "
                                       "(55, 2), (22, 5), (11, 10), (10, 11), (5, 22), (2, 55), (1, 110); set "
                                       "train.micro_batch_size to the largest micro that fits in memory\n")


def test_cli_without_a_micro_batch_speaks_of_the_ranks_only(capsys: pytest.CaptureFixture) -> None:
    assert main(["--global-batch", "330", "--world-size", "16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("global batch 330 does not split over 16 data-parallel ranks.\nNo (micro, accumulation) "
                          "pair reaches 330 on 16 ranks") and "micro-batches of" not in err
    assert main(["--world-size", "10"]) == 0
    assert capsys.readouterr().out.startswith("every (micro, accumulation) for global batch 330 on 10 ranks: (33, 1), "
                                              "(11, 3), (3, 11), (1, 33);")
    with pytest.raises(SystemExit) as stopped:
        main(["--world-size", "0"])
    assert stopped.value.code == 2 and "--world-size must be >= 1, got 0" in capsys.readouterr().err


def test_feasible_pairs_are_every_split_smallest_accumulation_first() -> None:
    for world in (1, 2, 3, 8):
        for global_batch in range(1, 1500):
            per_rank = global_batch // world
            tried = [(per_rank // a, a) for a in range(1, per_rank + 1) if per_rank % a == 0] \
                if global_batch % world == 0 else []
            assert feasible_pairs(global_batch, world) == tried, (global_batch, world)
    assert feasible_pairs(2**40 * 3**5, 1) == [(2**40 * 3**5 // a, a) for a in sorted(
        2**i * 3**j for i in range(41) for j in range(6))]


def test_a_huge_global_batch_is_split_without_trying_every_accumulation() -> None:
    """Trying every accumulation up to a mistyped global batch ran for hours before the first line of a run."""
    assert feasible_pairs(200_000_001, 1) == [(200_000_001, 1), (66_666_667, 3), (3, 66_666_667), (1, 200_000_001)]
    assert feasible_pairs(1_000_000_000_039, 1) == [(1_000_000_000_039, 1), (1, 1_000_000_000_039)]  # a prime
    huge = 99_999_999_999_999_999_999  # 3² · 11 · 41 · 101 · 271 · 3541 · 9091 · 27961
    pairs = feasible_pairs(huge, 3)
    assert len(pairs) == 2**8 and pairs[0] == (huge // 3, 1) and pairs[-1] == (1, huge // 3)
    assert all(micro * accumulation * 3 == huge for micro, accumulation in pairs)
    with pytest.raises(InfeasibleBatchError, match=f"Feasible .* pairs for {huge} on 3 ranks: \\({huge // 3}, 1\\)"):
        plan_batch(huge, 2, 3)
