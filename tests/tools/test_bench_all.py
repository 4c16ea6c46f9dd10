"""`make bench`'s table: one row per measured ratio, from each benchmark's own result dict."""
from __future__ import annotations

from tools.bench_all import render_table, table_rows

RESULTS = {
    "data": {"tokens_per_s": {"raw": 1000.0, "raw_fast": 1100.0, "build_1": 900.0, "build_2": 1700.0},
             "ratio_build_vs_raw": 0.9, "ratio_build_vs_raw_cpu": 0.95, "ratio_build_vs_raw_fast": 0.8,
             "speedup_2_workers": 1.9, "identical_bytes_1_vs_2_workers": True},
    "model": {"rows": {f"{clock}_{name}": {"step_s": s, "tokens_per_s": 1024 / s, "useful_gflops": 80 / s,
                                           "percent_of_peak": 8000 / s / 100}
                       for clock in ("wall", "cpu") for name, s in (("ours", 1.0), ("transformers", 1.5))},
              "matmul_peak_gflops": {"wall": 100.0, "cpu": 50.0}},
    "train": {"loader_samples_per_s_per_rank": 5000.0, "model_samples_per_s": {"tiny": 100.0, "bert-base": 2.0},
              "data_wait": {"data_wait_share": 0.001, "step_time_s": 0.3, "samples_per_s": 80.0},
              "zero_memory": [{"stage": s, "parameters": 10**8, "measured_gb_per_rank": g, "no_zero_16P_gb": 1.6,
                               "zero2_4P_12P_N_gb": 1.0, "zero3_16P_N_gb": 0.8, "zero3_16P_N_plus_prefetch_gb": 0.82}
                              for s, g in ((1, 1.1), (2, 0.9), (3, 0.8205))]},
    "decode": {"beam_size": 5, "target_length": 64, "speedup": 12.0, "identical_outputs": True,
               "cache": {"seconds": 1.0}, "no_cache": {"seconds": 12.0}},
}


def test_every_benchmark_gives_its_rows_with_verdicts() -> None:
    rows = table_rows(RESULTS)
    by_name = {r["benchmark"]: r for r in rows}
    assert len(rows) == 3 + 4 + 2 + 1 + 3 + 1
    build = by_name["shard build (1 worker) vs raw tokenizers encode_batch, tokens/s"]
    assert (build["ratio"], build["met"]) == (0.9, True)
    step = by_name["train step ours vs transformers BertForPreTraining (bert-base fp32), tokens/s, wall clock"]
    assert abs(step["ratio"] - 1.5) < 1e-12 and step["met"]
    memory = [r for r in rows if r["benchmark"].startswith("ZeRO-")]
    assert [r["met"] for r in memory] == [False, True, True]
    assert by_name["beam-5 decoding with vs without KV cache (64 tokens)"]["met"]
    table = render_table(rows)
    assert table.count("\n") == len(rows) + 1 and "NOT met" in table


def test_missing_or_failed_benchmarks_leave_their_rows_out() -> None:
    assert table_rows({"decode": {"skipped": "tools.bench_decode is not in this tree"}}) == []
    assert len(table_rows({"data": RESULTS["data"]})) == 3


def test_gpu_rows_judge_the_model_and_training_steps_against_their_targets() -> None:
    variants = {"eager": 0.445, "chunked_loss": 0.45, "compiled": 0.5, "fast": 0.61, "transformers": 0.43}
    model = {"peak_tflops": {"bf16": 787.0, "fp16": 789.0},
             "rows": {f"{dtype}_{name}": {"tflops": 787 * mfu, "mfu": mfu - (dtype == "fp16") * 0.02,
                                          "samples_per_s": 770 * mfu}
                      for name, mfu in variants.items() for dtype in ("bf16", "fp16")}}
    train = {"samples_per_s": 430.0, "tflops": 400.0, "mfu": 0.508, "peak_tflops": 787.0}
    rows = table_rows({"gpu": {"device": "H200", "model": model,
                               "train": {"bf16": {"512": train, "128": train}, "fp16": {"512": train}}}})
    by_name = {r["benchmark"]: r for r in rows}
    assert len(rows) == 2 * (5 + 1) + 3 + 1 + 3
    assert by_name["model step fast fp16 (unilm-large 32 x 512) on H200, MFU"]["met"] is False  # 0.59 < 0.60
    assert by_name["pretrain.train step fp16 ZeRO-2, batch 330 x 512 tokens, samples/s vs 420"]["met"]
    assert by_name["model step fast bf16 (unilm-large 32 x 512) on H200, MFU"]["met"] is True
    assert by_name["model step eager bf16 (unilm-large 32 x 512) on H200, MFU"]["met"] is None
    versus = by_name["model step ours (fast paths) vs transformers BertForPreTraining bf16, samples/s"]
    assert abs(versus["ratio"] - 0.61 / 0.43) < 1e-12 and versus["met"]
    share = by_name["pretrain.train step bf16 ZeRO-2, batch 330 x 512 tokens vs the model step, samples/s"]
    assert abs(share["ratio"] - 430 / (770 * 0.61)) < 1e-12 and share["met"]  # 430 >= 0.9 x 469.7
    assert by_name["pretrain.train step bf16 ZeRO-2, batch 330 x 512 tokens, samples/s vs 420"]["met"]
    packing = table_rows({"gpu": {"device": "H200", "train": {"bf16": {"512": train}},
                                  "train_unpacked": {"bf16": {"512": dict(train, samples_per_s=410.0)}}}})[-1]
    assert packing["benchmark"] == "pretrain.train step bf16 x 512: packed rows vs one sample per row, samples/s"
    assert abs(packing["ratio"] - 430 / 410) < 1e-12 and packing["met"]
    slower = table_rows({"gpu": {"device": "H200", "model": model,
                                 "train": {"bf16": {"512": dict(train, samples_per_s=400.0)}}}})
    assert [r["met"] for r in slower if r["benchmark"].startswith("pretrain.train")] == [False, False, None]


def test_training_rows_stand_without_the_model_step() -> None:
    train = {"samples_per_s": 430.0, "tflops": 400.0, "mfu": 0.508, "peak_tflops": 787.0}
    rows = table_rows({"gpu": {"device": "H200", "train": {"fp16": {"512": train}}, "errors": {"model step": "x"}}})
    assert [r["benchmark"] for r in rows] == [
        "pretrain.train step fp16 ZeRO-2, batch 330 x 512 tokens, samples/s vs 420",
        "pretrain.train step fp16 ZeRO-2, batch 330 x 512 tokens, MFU (metrics.jsonl)"]
