"""The training engine end to end: 2 ranks on gloo, tiny model, real unilm shards.

One module fixture runs the scenarios once (each launch costs ~10 s of start-up on 2 cores); the tests read
their outputs:
  full     2 ranks, ZeRO-2 fp32, dropout on, 24 steps, checkpoints every 4 (keep 3)
  stopped  the same command with train.exit_at_step=10, then junk planted (an incomplete newer tag and a
           truncated one), then the same command again (auto-resume) to step 24
  nodrop   2 ranks, dropout off, 12 steps (a data-order seed that packs some micro-batches); then resumed from
           its step-8 checkpoint on 1 rank in micro-batches of 8 (universal), with half the learning rate, under
           ZeRO-1 to step 10, and refused under ZeRO-3
  unpacked nodrop with train.pack_samples=false (one sample per row)
  fast     nodrop on 1 rank to step 6 with compiled blocks, chunked loss and activation checkpointing (with the
           packed rows, CUDA's defaults), reporting what torch.compile did (tests/compile_report.py)
"""
from __future__ import annotations

import csv
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.model import preset, training_flops
from training_runs import check, launch, losses, metrics, preempt, train_command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(unilm_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The module's 11 launches (the module docstring lists them), once for all its tests: 2-3 minutes on 2 cores,
    ~10 s of start-up per launch plus the compiled run's first torch.compile build (~35 s with a cold cache)."""
    base = tmp_path_factory.mktemp("train")
    common = [f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", "train.max_steps=24",
              "train.save_interval=4", "train.keep_last=3"]
    out: dict = {"base": base, "common": common}

    out["full"] = base / "full"
    out["full_log"] = check(launch(common + [f"out_dir={out['full']}", "train.peak_tflops=0.5"], nproc=2))

    stopped = base / "stopped"
    out["stopped"] = stopped
    out["stop_log"] = check(launch(common + [f"out_dir={stopped}", "train.exit_at_step=10"], nproc=2))
    checkpoints = stopped / "checkpoints"
    out["tags_after_stop"] = sorted(p.name for p in checkpoints.iterdir() if p.is_dir())
    out["latest_after_stop"] = (checkpoints / "latest").read_text()
    # A newer save that died half-way (no marker) and one whose file got truncated after its marker.
    shutil.copytree(checkpoints / "global_step10", checkpoints / "global_step12")
    (checkpoints / "global_step12" / "complete.json").unlink()
    shutil.copytree(checkpoints / "global_step10", checkpoints / "global_step11")
    with open(checkpoints / "global_step11" / "mp_rank_00_model_states.pt", "r+b") as handle:
        handle.truncate(100)
    out["resume_log"] = check(launch(common + [f"out_dir={stopped}"], nproc=2))

    out["seed"] = packing_seed(unilm_shards)
    nodrop = common[:2] + ["train.max_steps=12", "train.save_interval=4", "train.keep_last=5",
                           f"train.seed={out['seed']}", "model.overrides.hidden_dropout=0.0",
                           "model.overrides.attention_dropout=0.0"]
    out["nodrop"] = base / "nodrop"
    out["nodrop_log"] = check(launch(nodrop + [f"out_dir={out['nodrop']}"], nproc=2))
    out["fast"] = base / "fast"  # what a CUDA run does by default, forced on the CPU
    out["fast_log"] = check(launch(nodrop + [f"out_dir={out['fast']}", "train.exit_at_step=6", "train.compile=true",
                                             "train.chunked_loss=true", "train.activation_checkpointing=true"],
                                   nproc=1, module="compile_report"))
    out["unpacked"] = base / "unpacked"
    check(launch(nodrop + [f"out_dir={out['unpacked']}", "train.pack_samples=false"], nproc=2))
    step8 = f"train.resume={out['nodrop'] / 'checkpoints' / 'global_step8'}"
    out["one_rank"] = base / "one_rank"  # 24 = 8 × 3 on one rank, where the run split it 4 × 3 × 2 ranks
    out["one_rank_log"] = check(launch(nodrop + [f"out_dir={out['one_rank']}", step8, "train.micro_batch_size=8"],
                                       nproc=1))
    out["half_lr"] = base / "half_lr"
    out["half_lr_log"] = check(launch(nodrop + [f"out_dir={out['half_lr']}", step8, "optim.lr=1.0e-3",
                                                "train.exit_at_step=9"], nproc=1))
    out["zero1"] = base / "zero1"
    out["zero1_log"] = check(launch(nodrop + [f"out_dir={out['zero1']}", step8, "train.exit_at_step=10",
                                              "deepspeed_config=ds_configs/zero1_fp32_cpu.json"], nproc=1))
    out["zero3_log"] = launch(nodrop + [f"out_dir={base / 'zero3'}", step8,
                                        "deepspeed_config=ds_configs/zero3_fp32_cpu.json"], nproc=1)
    return out


def test_loss_falls_and_metrics_are_complete(runs: dict) -> None:
    records = metrics(runs["full"])
    assert [r["step"] for r in records] == list(range(1, 25))
    first, last = [r["loss"] for r in records[:4]], [r["loss"] for r in records[-4:]]
    assert sum(last) / 4 < sum(first) / 4 - 0.3, (first, last)
    for record in records:
        assert record["consumed_samples"] == 24 * record["step"]
        for key in ("lr", "samples_per_s", "tokens_per_s", "tflops", "data_wait_s", "loss_bidirectional_mlm",
                    "loss_nsp", "loss_left_to_right", "loss_right_to_left", "loss_seq2seq"):
            assert key in record, key
    assert records[-1]["lr"] < max(r["lr"] for r in records)  # warm-up then decay (DeepSpeed WarmupDecayLR)
    assert any((runs["full"] / "monitor").rglob("events.out.tfevents*"))  # DeepSpeed's TensorBoard monitor


def test_throughput_is_per_rank_and_mfu_is_over_the_configured_peak(runs: dict) -> None:
    cfg = dataclasses.replace(preset("tiny"), vocab_size=4000)
    for record in metrics(runs["full"]):
        assert record["peak_tflops"] == 0.5 and record["mfu"] == record["tflops"] / 0.5
        tokens = record["tokens_per_s"] * record["step_time_s"]  # of both ranks
        rank_flops = record["tflops"] * 1e12 * record["step_time_s"]
        # between the encoder matmuls alone and everything at 512 tokens per sample, every token predicted
        assert training_flops(cfg, tokens, 0, 0, 0) / 2 < rank_flops
        assert rank_flops < training_flops(cfg, tokens, 512 * tokens, tokens, 24) / 2
    # the console's step line says the same as the step's record
    said = re.search(r"\[step 10/24\] loss \S+ lr \S+ \S+ samples/s (\S+) TFLOP/s per GPU, MFU (\S+)%",
                     runs["full_log"].stdout)
    step_10 = next(r for r in metrics(runs["full"]) if r["step"] == 10)
    assert said and (said[1], said[2]) == (f"{step_10['tflops']:.3g}", f"{step_10['mfu'] * 100:.1f}"), \
        runs["full_log"].stdout[-3000:]
    measured = metrics(runs["nodrop"])
    assert measured[0]["peak_tflops"] > 0 and all(r["mfu"] == r["tflops"] / r["peak_tflops"] for r in measured)
    for before, record in zip(measured, measured[1:]):  # the start's probe holds, unless a step beat it and re-probed
        assert record["peak_tflops"] == before["peak_tflops"] or (
            record.get("peak_remeasured") and record["peak_tflops"] > before["peak_tflops"] and record["mfu"] <= 1)
    # both ranks measured together; the median of two is their mean, between them
    said = re.search(r"\[mfu\] measured fp32 matmul peak of cpu: (\S+) TFLOP/s, median of 2 ranks measured "
                     r"together: (\S+)–(\S+) \(", runs["nodrop_log"].stdout)
    assert said, runs["nodrop_log"].stdout[-3000:]
    low, high = float(said[2]), float(said[3])
    assert f"{measured[0]['peak_tflops']:.3g}" == said[1] and low <= measured[0]["peak_tflops"] * 1.01
    assert measured[0]["peak_tflops"] <= high * 1.01


def test_the_monitor_gets_losses_throughput_and_mfu_per_step(runs: dict) -> None:
    records = metrics(runs["full"])
    for key in ("loss", "loss_bidirectional_mlm", "loss_nsp", "loss_seq2seq", "tflops", "mfu", "samples_per_s"):
        with open(runs["full"] / "monitor" / "train" / f"Train_Steps_{key}.csv") as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", key]
        assert [(int(step), float(value)) for step, value in rows[1:]] == [(r["step"], r[key]) for r in records]


def test_checkpoints_are_complete_self_describing_and_pruned(runs: dict) -> None:
    checkpoints = runs["full"] / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step24"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == \
        ["global_step16", "global_step20", "global_step24"]
    marker = json.loads((checkpoints / "global_step24" / "complete.json").read_text())
    assert marker["consumed_samples"] == 24 * 24 and marker["world_size"] == 2 and marker["zero_stage"] == 2
    assert marker["model_config"]["vocab_size"] == 4000 and marker["manifest_hash"] and marker["vocab_hash"]
    assert marker["code_version"] != "unknown" and marker["optimizer_class"] == "torch.optim.adamw.AdamW"
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in marker["files"]
    state = torch.load(checkpoints / "global_step24" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["consumed_samples"] == 576 and state["step"] == 24
    assert len(state["rng_states"]) == 2 and set(state["rng_states"][1]) == {"torch", "numpy", "python"}
    assert state["run_config"]["train"]["max_steps"] == 24


def test_stop_and_auto_resume_reproduce_the_uninterrupted_losses(runs: dict) -> None:
    assert runs["tags_after_stop"] == ["global_step10", "global_step4", "global_step8"]
    assert runs["latest_after_stop"] == "global_step10"
    assert "[exit] exit_at_step" in runs["stop_log"].stdout
    # the incomplete global_step12 and the truncated global_step11 were passed over
    assert "[resume] global_step10: step 10, consumed_samples 240" in runs["resume_log"].stdout
    full, resumed = losses(runs["full"]), losses(runs["stopped"])
    assert sorted(resumed) == list(range(1, 25))
    assert resumed == full  # bit for bit, dropout on
    assert (runs["stopped"] / "checkpoints" / "latest").read_text() == "global_step24"


def test_resume_on_another_world_size_continues_at_the_exact_sample(runs: dict) -> None:
    log = runs["one_rank_log"].stdout
    assert "world size 2 -> 1" in log and "[resume] global_step8: step 8, consumed_samples 192" in log
    two_ranks, one_rank = losses(runs["nodrop"]), losses(runs["one_rank"])
    assert sorted(one_rank) == [9, 10, 11, 12]
    assert [r["consumed_samples"] for r in metrics(runs["one_rank"])] == [216, 240, 264, 288]
    for step in one_rank:  # same samples, same weights and optimizer state; only the reduction order differs
        assert one_rank[step] == pytest.approx(two_ranks[step], rel=1e-5, abs=1e-5), step
    marker = json.loads((runs["one_rank"] / "checkpoints" / "global_step12" / "complete.json").read_text())
    assert marker["world_size"] == 1


def test_the_objective_is_the_global_batchs_mean_whatever_its_split(runs: dict) -> None:
    """A step minimises the mean loss over the global batch's predicted tokens plus the mean NSP loss over its NSP
    samples: resumed with 8 × 3 micro-batches on one rank, the run split 4 × 3 × 2 ranks trains the same losses
    (a mean per micro-batch weighed NSP by how many micro-batches held an NSP sample)."""
    two_ranks, other_split = losses(runs["nodrop"]), losses(runs["one_rank"])
    assert json.loads((runs["one_rank"] / "run_config.json").read_text())["train"]["micro_batch_size"] == 8
    assert sorted(other_split) == [9, 10, 11, 12]
    for step in other_split:
        assert other_split[step] == pytest.approx(two_ranks[step], rel=1e-5, abs=1e-5), step


def test_a_resume_with_another_learning_rate_applies_it_from_its_first_step(runs: dict) -> None:
    assert "optim.lr: 0.002 -> 0.001" in runs["half_lr_log"].stdout
    original = {r["step"]: r["lr"] for r in metrics(runs["nodrop"])}
    [record] = metrics(runs["half_lr"])
    assert record["step"] == 9 and original[9] > 0
    assert record["lr"] == pytest.approx(original[9] / 2, rel=1e-9)  # the new schedule's rate at step 9, not the old


def test_a_checkpoint_moves_between_zero_stages_1_and_2_and_other_changes_are_refused(runs: dict) -> None:
    assert "world size 2 -> 1, ZeRO stage 2 -> 1: converting" in runs["zero1_log"].stdout
    two_ranks, zero1 = losses(runs["nodrop"]), losses(runs["zero1"])
    assert sorted(zero1) == [9, 10]
    for step in zero1:
        assert zero1[step] == pytest.approx(two_ranks[step], rel=1e-5, abs=1e-5), step
    refused = runs["zero3_log"]
    assert refused.returncode != 0
    assert "global_step8 was saved under ZeRO stage 2 and this run's DeepSpeed config uses stage 3" in refused.stderr
    assert "converting" not in refused.stdout


def rows_saved_by_packing(shards: Path, seed: int, steps: int) -> int:
    """Rows that packing saves over the first `steps` steps of tiny.yaml's batch 24 = 4 × 3 × 2 ranks."""
    from data_prep.shard_format import ShardDataset
    from pretrain.batch_plan import plan_batch
    from pretrain.data import SampleOrder, collate, sample_objectives

    dataset = ShardDataset(shards)
    order, plan = SampleOrder(sample_objectives(dataset), seed), plan_batch(24, 4, 2)
    return sum(len(indices) - len(collate([dataset[int(i)] for i in indices], 0, 64, pack=True)["input_ids"])
               for step in range(steps) for rank in range(2)
               for indices in order.rank_step_indices(24 * step, plan, rank))


def packing_seed(shards: Path) -> int:
    """The first data-order seed from tiny.yaml's 1234 on whose 12 steps pack some micro-batch into fewer rows
    (short samples are rare at 64 tokens), so the packed and unpacked runs really differ in layout."""
    return next(seed for seed in range(1234, 1334) if rows_saved_by_packing(shards, seed, 12) > 0)


def test_packed_rows_train_with_the_losses_of_one_sample_per_row(runs: dict, unilm_shards: Path) -> None:
    # the run used the seed `packing_seed` chose, one whose steps pack some micro-batches
    assert json.loads((runs["nodrop"] / "run_config.json").read_text())["train"]["seed"] == runs["seed"]
    packed, unpacked = losses(runs["nodrop"]), losses(runs["unpacked"])
    assert sorted(packed) == sorted(unpacked) == list(range(1, 13))
    for step in packed:  # fp32, dropout off: the same sums in another order
        assert packed[step] == pytest.approx(unpacked[step], rel=1e-5, abs=1e-6), step


def test_the_fast_paths_together_train_with_the_plain_paths_losses(runs: dict) -> None:
    assert "[fast paths] train.compile=off, train.chunked_loss=off, train.pack_samples=on" in runs["nodrop_log"].stdout
    assert "[fast paths] train.compile=on, train.chunked_loss=on, train.pack_samples=on" in runs["fast_log"].stdout
    # The blocks really ran compiled: one graph serves every block (a second at most, when a micro-batch's shape
    # first changes and dynamo recompiles with dynamic sizes), traced without a graph break; one graph more is the
    # probe that tells torch.compile works here (`pretrain.setup_checks.compiler_works`).
    report = json.loads(runs["fast_log"].stdout.split("[compile report] ", 1)[1].splitlines()[0])
    assert report["frames"] >= 2 and 2 <= report["unique_graphs"] <= 3 and report["graph_breaks"] == 0, report
    plain, fast = losses(runs["nodrop"]), losses(runs["fast"])
    assert sorted(fast) == list(range(1, 7))
    for step in fast:  # fp32, dropout off: compiled sums and chunked log-softmax round differently, 1 rank vs 2
        assert fast[step] == pytest.approx(plain[step], rel=1e-5, abs=1e-5), step


def test_mismatched_resume_is_refused_naming_the_field(runs: dict) -> None:
    process = launch(runs["common"] + [f"out_dir={runs['full']}", "model.overrides.hidden_size=128"], nproc=1)
    assert process.returncode == 2  # a setup problem: said in one line, no traceback
    assert "model.hidden_size=64" in process.stderr and "model.hidden_size=128" in process.stderr
    assert "[stop] " in process.stderr and "refusing to resume" in process.stderr
    assert "Traceback" not in process.stderr


def test_resuming_on_another_build_of_the_shards_is_refused_naming_both(runs: dict, unilm_shards: Path,
                                                                        tmp_path: Path) -> None:
    rebuilt = tmp_path / "rebuilt"  # the same samples, another manifest file: another build as far as a run can tell
    shutil.copytree(unilm_shards, rebuilt)
    manifest = rebuilt / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=4) + "\n")
    process = launch([f"data.shards={rebuilt}", *runs["common"][1:], f"out_dir={runs['full']}"], nproc=1)
    assert process.returncode == 2 and "another build of its shards" in process.stderr, process.stderr[-2000:]
    assert f"trained on {unilm_shards}, these are {rebuilt})" in process.stderr
    marker = json.loads((runs["full"] / "checkpoints" / "global_step24" / "complete.json").read_text())
    assert marker["run_config"]["data"]["shards"] == str(unilm_shards) and "shards" not in marker


def test_export_of_a_corrupted_checkpoint_is_one_line_naming_it(runs: dict, tmp_path: Path, capsys) -> None:
    from pretrain.export import main

    tag = tmp_path / "global_step24"
    shutil.copytree(runs["full"] / "checkpoints" / "global_step24", tag)
    with open(tag / "model_weights.safetensors", "r+b") as handle:
        handle.seek(5000)
        byte = handle.read(1)[0]
        handle.seek(5000)
        handle.write(bytes([byte ^ 0xFF]))  # a changed byte, whatever it was
    with pytest.raises(SystemExit) as stopped:
        main([str(tag), str(tmp_path / "hf")])
    assert stopped.value.code == 2 and not (tmp_path / "hf").exists()
    assert f"{tag} is not a valid checkpoint: model_weights.safetensors" in capsys.readouterr().err


def test_export_writes_a_hugging_face_bert(runs: dict, tmp_path: Path) -> None:
    from transformers import BertForPreTraining

    from pretrain.export import load_consolidated, main
    from pretrain.hf import load_hf_bert

    main([str(runs["full"] / "checkpoints"), str(tmp_path / "hf")])
    ours = load_consolidated(runs["full"] / "checkpoints" / "global_step24")
    assert ours.cfg.vocab_size == 4000
    hf = BertForPreTraining.from_pretrained(tmp_path / "hf")
    assert torch.equal(hf.bert.embeddings.word_embeddings.weight, ours.embeddings.token.weight)
    reloaded = load_hf_bert(tmp_path / "hf").state_dict()
    for name, value in ours.state_dict().items():
        if "segment" not in name:  # HF BERT keeps 2 of our 6 segment rows
            assert torch.equal(reloaded[name], value), name


def test_export_writes_the_tokenizer_the_shards_were_built_with(runs: dict, unilm_shards: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from data_prep.vocab import load_encoder, load_vocab
    from pretrain.export import main

    main([str(runs["full"] / "checkpoints"), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "vocab.txt").read_bytes() == (unilm_shards / "vocab.txt").read_bytes()
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    vocab = load_vocab(unilm_shards / "vocab.txt")
    ours = load_encoder(str(vocab.path), vocab.sha256, False)
    text = "The Dutch East India Company traded in Asia; Zürich and ZÜRICH differ here."
    assert hf.do_lower_case is False
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_special_tokens=False).ids


def test_nan_loss_stops_with_a_diagnostic_and_keeps_the_last_checkpoint(unilm_shards: Path, tmp_path: Path) -> None:
    process = launch([f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path}",
                      "train.max_steps=8", "train.save_interval=2", "train.global_batch_size=8",
                      "optim.lr=1e30", "optim.warmup_steps=1"], nproc=1)
    assert process.returncode == 3, process.stderr[-3000:]
    assert "[stop] non-finite loss nan at step 3" in process.stderr  # step 2 applied lr 5e29
    assert "the last complete checkpoint (global_step2) is intact" in process.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step2"
    assert metrics(tmp_path)[-1]["event"] == "nonfinite_loss"


def test_time_limit_saves_and_exits_cleanly(unilm_shards: Path, tmp_path: Path) -> None:
    process = check(launch([f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path}",
                            "train.max_steps=20", "train.exit_after_minutes=0.0001"], nproc=1))
    assert "[exit] time limit" in process.stdout
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step1"
    assert [r["step"] for r in metrics(tmp_path)] == [1]


def test_a_corrupt_shard_stops_training_before_it_starts(unilm_shards: Path, tmp_path: Path) -> None:
    """Two ranks share the hashing (rank r every second shard); the corrupt shard is rank 1's, and every rank
    stops, rank 0 naming it once for both."""
    corrupt = tmp_path / "shards"
    shutil.copytree(unilm_shards, corrupt)
    shard = sorted(corrupt.glob("shard-*.bin"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the last sample's payload: sizes and header still look right
    shard.write_bytes(bytes(data))
    process = launch([f"data.shards={corrupt}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path / 'run'}",
                      "train.max_steps=8", "train.global_batch_size=8"], nproc=2)
    assert process.returncode != 0
    assert process.stderr.count(f"sha256 mismatch (modified or corrupt): {shard}") == 1, process.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_a_first_ctrl_c_asks_for_a_save_and_a_second_stops_at_once(caplog) -> None:
    """Ctrl-C in a terminal run: the first SIGINT is handled as SIGTERM (save the step in progress, exit 0), so
    an interactive stop loses no steps; a second one interrupts at once."""
    import signal
    import time

    from pretrain.stopping import StopRequest
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest(time.monotonic(), None)
    try:
        assert not stop
        signal.raise_signal(signal.SIGINT)  # runs the Python handler before it returns
        assert stop and "Ctrl-C again stops at once" in caplog.text
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_saves_a_checkpoint_and_the_rerun_continues(unilm_shards: Path, tmp_path: Path) -> None:
    """What a cluster scheduler's preemption does: SIGTERM mid-run, then the same command again."""
    overrides = [f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path}",
                 "train.max_steps=400", "train.save_interval=1000", "train.global_batch_size=8"]
    process = preempt(train_command(overrides), tmp_path, steps=2)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "[exit] time limit / SIGTERM" in process.stdout
    stopped_at = metrics(tmp_path)[-1]["step"]
    assert stopped_at < 400
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"global_step{stopped_at}"
    rerun = check(launch([*overrides, f"train.exit_at_step={stopped_at + 2}"], nproc=1))
    assert f"saved global_step{stopped_at + 2}" in rerun.stdout
    steps = [record["step"] for record in metrics(tmp_path)]
    assert steps == list(range(1, stopped_at + 3))  # nothing repeated, nothing skipped
    # the same run with a changed setting that leaves nothing to train: both are said
    done = check(launch([*overrides[:-2], f"train.max_steps={stopped_at + 2}", "train.global_batch_size=8",
                         "optim.warmup_steps=1"], nproc=1))
    assert f"train.max_steps: 400 -> {stopped_at + 2}" in done.stdout and "train.save_interval" not in done.stdout
    assert "[done] this run already reached train.max_steps" in done.stdout


def test_saved_weights_equal_deepspeeds_fp32_consolidation(runs: dict) -> None:
    """model_weights.safetensors (gathered at save time from the ZeRO-2 partitions of 2 ranks) holds exactly the
    fp32 weights DeepSpeed's own zero_to_fp32 consolidates from the pickled optimizer shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from pretrain import checkpoint as ckpt

    checkpoints = runs["full"] / "checkpoints"
    meta, ours = ckpt.load_weights(checkpoints / "global_step24")
    assert meta["zero_stage"] == 2 and ckpt.WEIGHTS in meta["files"] and ckpt.WEIGHTS in meta["sha256"]
    reference = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag="global_step24")
    assert set(reference) <= set(ours)
    for name, value in reference.items():
        assert torch.equal(ours[name], value.float()), name
