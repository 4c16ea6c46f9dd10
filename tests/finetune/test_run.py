"""`python -m finetune.run` end to end on DeepSpeed (1 rank, in process): classify and seq2seq on real BBC
slices, the HF export + summary.json, exact resume after a stop, `finetune.decode` on the result, bad inputs."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from finetune import decode, run
from finetune.model_io import load_finetuned, load_init
from pretrain import checkpoint as ckpt

COMMON = ["--batch-size", "8", "--micro-batch-size", "4", "--lr", "1e-3", "--seed", "3"]


def classify_args(small_tasks, tiny_init, out, *extra):
    return ["--task", "classify", "--train", str(small_tasks["bbc_topic.train"]), "--dev",
            str(small_tasks["bbc_topic.dev"]), "--init", str(tiny_init), "--out", str(out), "--max-seq-len", "64",
            *COMMON, *extra]


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_classify_run_exports_the_best_model_and_metrics(small_tasks, tiny_init, tmp_path):
    summary = run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "2", "--set", "metric=mcc"))
    metrics = json.loads((tmp_path / "summary.json").read_text())
    assert metrics["finished"] and len(metrics["epochs"]) == 2 and metrics["primary_metric"] == "mcc"
    assert {"accuracy", "macro_f1", "mcc", "train_loss"} <= set(metrics["best"]) and "f1" not in metrics["best"]
    assert metrics["best"]["mcc"] == max(epoch["mcc"] for epoch in metrics["epochs"])
    assert summary["best"] == metrics["best"]
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the rate each step applied: 0 first, the peak after the warm-up, a last step above 0 before the decay's end
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-3) and 0 < lrs[-1] < lrs[-2]
    finetuned = load_finetuned(tmp_path)
    assert finetuned.task == "classify" and finetuned.meta["labels"] == sorted(
        {"business", "entertainment", "politics", "sports", "tech"})
    assert set(finetuned.head_state) == {"weight", "bias"} and finetuned.head_state["weight"].shape == (5, 32)
    assert (tmp_path / "vocab.txt").read_bytes() == (tiny_init / "vocab.txt").read_bytes()
    assert_transformers_runs_the_task_head(tmp_path, small_tasks["bbc_topic.dev"])


def assert_transformers_runs_the_task_head(out, dev) -> None:
    """The output loads as transformers' BertForSequenceClassification (no missing or unexpected weights, the
    labels named) and gives our classifier's logits on dev inputs tokenized by its own AutoTokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune import classify
    from finetune.task_files import read_jsonl
    finetuned = load_finetuned(out)
    kept = load_file(out / "finetune_extra.safetensors")  # the heads the HF class has no place for come back
    assert {"mlm_head.dense.weight", "nsp_head.weight"} <= set(kept)
    torch.testing.assert_close(finetuned.model.mlm_head.dense.weight, kept["mlm_head.dense.weight"], rtol=0, atol=0)
    hf, info = AutoModelForSequenceClassification.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.config.id2label[0] == "business" and hf.config.num_labels == 5
    records = read_jsonl(dev)[:6]
    encoded = AutoTokenizer.from_pretrained(str(out))([r["text"] for r in records], truncation=True, max_length=64,
                                                       padding=True, return_tensors="pt")
    labels = classify.LabelSpace(classes=tuple(finetuned.meta["labels"]))
    ours = classify.ClassifierModel(finetuned.model, labels, dropout=0.1)
    ours.head.load_state_dict(finetuned.head_state)
    examples, _ = classify.encode_examples(records, finetuned.tokenizer, labels, 64, False, where="dev")
    batch = classify.collate(examples, finetuned.tokenizer.pad_id, regression=False)
    assert encoded["input_ids"][:, :batch["input_ids"].shape[-1]].tolist() == batch["input_ids"][:, 0].tolist()
    with torch.no_grad():
        expected = ours.eval().scores(batch["input_ids"], batch["len_a"], batch["length"])[0]
        got = hf.eval()(**encoded).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_stopped_run_resumes_to_the_same_losses(small_tasks, tiny_init, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run.main(classify_args(small_tasks, tiny_init, straight, "--epochs", "2"))
    run.main(classify_args(small_tasks, tiny_init, stopped, "--epochs", "2", "--set", "exit_at_step=3"))
    assert len(losses(stopped)) == 3 and not json.loads((stopped / "summary.json").read_text())["finished"]
    # a run killed while logging step 5: steps past the save, one torn
    with open(stopped / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "epoch": 1, "loss": 9.0, "lr": 0.001}\n{"step": 5, "epoch": 2, "loss": 9.0, "lr"')
    run.main(classify_args(small_tasks, tiny_init, stopped, "--epochs", "2", "--set", "exit_at_step=3"))
    assert losses(stopped) == losses(straight)  # dropout on: RNG states travel in the checkpoint
    epochs = [json.loads((d / "summary.json").read_text())["epochs"] for d in (straight, stopped)]
    assert epochs[0] == epochs[1]  # per-epoch train loss and dev scores too
    a, b = load_finetuned(straight), load_finetuned(stopped)
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(x, y, msg=name)


def test_a_driver_running_fine_tuning_in_process_stops_when_a_signal_stops_the_run(small_tasks, tiny_init, tmp_path,
                                                                                      monkeypatch, capsys):
    """`make ablation` and the fine-tuning demo run `finetune.run` in their own process, where the run takes SIGTERM
    to save and return unfinished. The driver must stop then, not train and score the next run with the signal
    unheeded; run again, it resumes the run and goes on."""
    import os
    import signal

    from finetune import engine as finetune_engine
    from tools.stages import finetune_in_process

    plain_step, signalled = finetune_engine.train_step, []

    def step_then_sigterm(*args, **kwargs):  # a scheduler's preemption after the first step
        result = plain_step(*args, **kwargs)
        if not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(finetune_engine, "train_step", step_then_sigterm)
    argv = classify_args(small_tasks, tiny_init, tmp_path / "run", "--epochs", "2")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        finetune_in_process(argv, "ablation")
    assert stopped.value.code == 0 and signal.getsignal(signal.SIGTERM) == handler
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not summary["finished"] and summary["steps"] == 2  # the step under way when the signal came is saved
    assert "[ablation] stopped: the fine-tuning run saved step 2 of" in capsys.readouterr().out
    finished = finetune_in_process(argv, "ablation")
    assert finished["finished"] and finished["steps"] == summary["total_steps"]
    assert len(losses(tmp_path / "run")) == summary["total_steps"]


def test_a_failure_in_dev_evaluation_loses_no_training(small_tasks, tiny_init, tmp_path, monkeypatch):
    """An epoch's checkpoint is saved before its dev evaluation: a run that fails there (out of memory in decoding,
    say) resumes at the epoch's end and evaluates it, ending as a run that never failed."""
    from finetune import engine as finetune_engine

    straight, failed = tmp_path / "straight", tmp_path / "failed"
    run.main(classify_args(small_tasks, tiny_init, straight, "--epochs", "2"))
    first_epoch_end = json.loads((straight / "summary.json").read_text())["epochs"][0]["step"]

    def evaluation_fails(*args, **kwargs):
        raise RuntimeError("dev evaluation failed")
    evaluate = finetune_engine.end_epoch
    monkeypatch.setattr(finetune_engine, "end_epoch", evaluation_fails)
    with pytest.raises(RuntimeError, match="dev evaluation failed"):
        run.main(classify_args(small_tasks, tiny_init, failed, "--epochs", "2"))
    assert (failed / "checkpoints" / f"global_step{first_epoch_end}").is_dir()
    monkeypatch.setattr(finetune_engine, "end_epoch", evaluate)
    run.main(classify_args(small_tasks, tiny_init, failed, "--epochs", "2"))
    assert losses(failed) == losses(straight)
    epochs = [json.loads((d / "summary.json").read_text())["epochs"] for d in (straight, failed)]
    assert epochs[0] == epochs[1]
    assert_same_export(straight, failed)


def assert_same_export(a, b, rel: float = 1e-5) -> None:
    x, y = load_finetuned(a), load_finetuned(b)
    for (name, u), (_, v) in zip(x.model.state_dict().items(), y.model.state_dict().items()):
        torch.testing.assert_close(u, v, rtol=rel, atol=rel, msg=name)
    for name in x.head_state:
        torch.testing.assert_close(x.head_state[name], y.head_state[name], rtol=rel, atol=rel, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_adamax_under_zero_trains_and_exports_as_without(small_tasks, tiny_init, tmp_path, stage):
    """The paper's GLUE optimiser is a client torch.optim.Adamax, outside DeepSpeed's ZeRO-tested list: under
    ZeRO-2/3 (a GPU run's default is ZeRO-2) it must train and give ZeRO-0's losses (1 rank, fp32); the exported
    best model is gathered whole from ZeRO-3's partitions and equals ZeRO-0's."""
    plain, zero = tmp_path / "zero0", tmp_path / f"zero{stage}"
    for out, config in ((plain, "zero0_fp32_cpu"), (zero, f"zero{stage}_fp32_cpu")):
        run.main(classify_args(small_tasks, tiny_init, out, "--epochs", "1", "--set", "optimizer=adamax",
                               "--deepspeed-config", f"ds_configs/{config}.json"))
    assert len(losses(zero)) == 5
    assert losses(zero) == pytest.approx(losses(plain), rel=1e-5)
    assert_same_export(zero, plain)
    initial = load_init(tiny_init)[0].state_dict()["layers.0.ffn_in.weight"]
    assert not torch.equal(load_finetuned(zero).model.state_dict()["layers.0.ffn_in.weight"], initial)  # trained


def test_a_bf16_run_exports_its_fp32_master_weights(small_tasks, tiny_init, tmp_path):
    """Under bf16 the module DeepSpeed trains holds bf16 copies; the export is the optimizer's fp32 master copy."""
    run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "1",
                           "--deepspeed-config", "ds_configs/zero2_bf16_cpu.json"))
    finetuned = load_finetuned(tmp_path)
    weights = [*finetuned.model.state_dict().values(), *finetuned.head_state.values()]
    assert all(w.dtype == torch.float32 for w in weights)
    rounded = [w for w in weights if torch.equal(w, w.bfloat16().float())]
    assert len(rounded) < len(weights) // 4, f"{len(rounded)} of {len(weights)} tensors hold only bf16 values"


def test_a_changed_run_is_refused_on_resume(small_tasks, tiny_init, tmp_path):
    """An --out holding a run this one cannot continue (another seed, another label space: its head has another
    shape) is one line naming the difference and the way out, in fine-tuning's own terms."""
    run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "1", "--set", "exit_at_step=1"))
    fix = f"use another --out, or delete {tmp_path / 'checkpoints'} to start afresh there"
    with pytest.raises(run.InputError, match="seed") as refused:
        run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "1", "--seed", "4"))
    assert fix in str(refused.value) and "data.shards" not in str(refused.value)
    # AdamW's state (the JSON's optimizer block) does not load into the paper's Adamax, a client optimizer
    with pytest.raises(run.InputError, match=r"was stepped by torch.optim.adamw.AdamW, whose state "
                                             r"torch.optim.adamax.Adamax, which this run builds, cannot take over\. "
                                             r".*in fine-tuning, also the optimizer setting$"):
        run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "1", "--set", "optimizer=adamax"))
    # the no-pre-training baseline in the same --out would continue the pre-trained weights it finds there
    with pytest.raises(run.InputError, match=r"was trained with init=\{'path': .*'from_scratch': False\}, this run "
                                             r"has init=\{'path': .*'from_scratch': True\}"):
        run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "1", "--from-scratch"))
    regression = tmp_path / "scores.jsonl"  # integer labels: classes by default, scores with regression=true
    regression.write_text("".join(json.dumps({"text": f"text number {i}", "label": i % 3}) + "\n" for i in range(16)))
    scored = tmp_path / "scored"
    args = ["--task", "classify", "--train", str(regression), "--dev", str(regression), "--init", str(tiny_init),
            "--out", str(scored), "--max-seq-len", "16", *COMMON, "--epochs", "1"]
    run.main(args + ["--set", "exit_at_step=1"])
    with pytest.raises(run.InputError, match=r"was trained with task=\{'task': 'classify', 'labels': \['0', '1', "
                                             r"'2'\], 'regression': False"):
        run.main(args + ["--set", "regression=true"])


def test_settings_that_need_no_model_are_refused_before_it_loads(small_tasks, tmp_path):
    """A batch that does not split, or a missing DeepSpeed JSON, is found before the model and data are read (the
    --init here does not even exist), named by fine-tuning's own flags."""
    args = ["--task", "classify", "--train", str(small_tasks["bbc_topic.train"]), "--dev",
            str(small_tasks["bbc_topic.dev"]), "--init", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]
    with pytest.raises(run.InputError, match=r"set --micro-batch-size accordingly") as refused:
        run.main(args + ["--batch-size", "8", "--micro-batch-size", "3"])
    assert "train." not in str(refused.value)
    with pytest.raises(run.InputError, match="nothing.json: no such file or directory"):
        run.main(args + ["--deepspeed-config", str(tmp_path / "nothing.json")])
    missing = [*args[:3], str(tmp_path / "trian.jsonl"), *args[4:]]  # a mistyped --train, named before --init
    with pytest.raises(run.InputError, match=r"trian.jsonl: no such file or directory \(the train file\)"):
        run.main(missing)


def test_init_from_a_fine_tuning_runs_checkpoints_points_at_its_output(small_tasks, tiny_init, tmp_path):
    run.main(classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "1", "--set", "exit_at_step=1"))
    with pytest.raises(ValueError, match=rf"a fine-tuning run's checkpoint \(task classify\); fine-tune from that "
                                         rf"run's output directory {tmp_path}"):
        load_init(tmp_path / "checkpoints")
    for given in (tmp_path / "checkpoints", tmp_path / "checkpoints" / ckpt.tag_for_step(1)):  # predict / decode
        with pytest.raises(ValueError, match=rf"^{given} is a fine-tuning run's checkpoint \(task classify\), kept "
                                             rf"to resume that run: give its output directory {tmp_path},"):
            load_finetuned(given)


def test_seq2seq_run_then_decode_with_and_without_cache(small_tasks, tiny_init, tmp_path, capsys):
    out = tmp_path / "model"
    run.main(["--task", "seq2seq", "--train", str(small_tasks["bbc_headline.train"]), "--dev",
              str(small_tasks["bbc_headline.dev"]), "--init", str(tiny_init), "--out", str(out), "--epochs", "1",
              "--max-src-len", "96", "--max-tgt-len", "16", "--set", "max_position_embeddings=300", *COMMON])
    metrics = json.loads((out / "summary.json").read_text())
    assert {"rouge1", "rouge2", "rougeL", "bleu"} <= set(metrics["best"])
    assert metrics["truncated"]["sources"] > 0  # BBC articles are longer than 96 word pieces: counted
    finetuned = load_finetuned(out, expect_task="seq2seq")
    trained_segments = finetuned.model.embeddings.segment.weight
    assert not torch.equal(trained_segments[4], trained_segments[0])  # rows 4/5 survive the HF export
    # the init's 256 positions extended to 300: kept by the output, and decoding gives a source all it leaves
    assert finetuned.model.cfg.max_position_embeddings == 300
    capsys.readouterr()
    decode.main(["--model", str(out), "--input", str(small_tasks["bbc_headline.dev"]), "--output",
                 str(tmp_path / "long.jsonl"), "--beam-size", "1", "--max-src-len", "290", "--max-tgt-len", "4"])
    assert "sources truncated to 290 word pieces" in capsys.readouterr().out  # 256 positions would leave 249
    predictions = {}
    for flag in ([], ["--no-cache"]):
        output = tmp_path / f"pred{len(flag)}.jsonl"
        decode.main(["--model", str(out), "--input", str(small_tasks["bbc_headline.dev"]), "--output", str(output),
                     "--beam-size", "3", "--max-tgt-len", "12", "--batch-size", "4", *flag])
        records = [json.loads(line) for line in output.read_text().splitlines()]
        assert all({"src", "tgt", "prediction"} <= set(r) for r in records)
        predictions[bool(flag)] = [r["prediction"] for r in records]
        assert "rougeL" in json.loads(decode.metrics_path(output).read_text())
    assert predictions[False] == predictions[True]
    # no --max-tgt-len: the run's (16 word pieces) bounds the predictions, not a fixed 64
    decoded = {}
    for flag in ([], ["--max-tgt-len", "16"], ["--max-tgt-len", "64"]):
        output = tmp_path / f"default{len(flag)}{''.join(flag[1:])}.jsonl"
        decode.main(["--model", str(out), "--input", str(small_tasks["bbc_headline.dev"]), "--output", str(output),
                     "--beam-size", "1", "--no-repeat-ngram", "0", *flag])
        decoded[" ".join(flag)] = [json.loads(line)["prediction"] for line in output.read_text().splitlines()]
    assert decoded[""] == decoded["--max-tgt-len 16"] != decoded["--max-tgt-len 64"]
    # a run's eval_max_tgt_len (its dev decoding's, CNN/DM's 128 beside training's 200) is the default instead
    shorter = tmp_path / "shorter"
    shutil.copytree(out, shorter)
    meta = json.loads((shorter / "finetune.json").read_text())
    meta["settings"]["eval_max_tgt_len"] = 3
    (shorter / "finetune.json").write_text(json.dumps(meta))
    decode.main(["--model", str(shorter), "--input", str(small_tasks["bbc_headline.dev"]), "--output",
                 str(tmp_path / "shorter.jsonl"), "--beam-size", "1", "--no-repeat-ngram", "0"])
    predictions3 = [json.loads(line)["prediction"] for line in (tmp_path / "shorter.jsonl").read_text().splitlines()]
    assert predictions3 != decoded[""] and all(len(p.split()) <= 3 for p in predictions3)
    # no --length-penalty / --no-repeat-*: the run's eval_* decoding settings (CNN/DM's length penalty 1.0, ...)
    tuned = tmp_path / "tuned"
    shutil.copytree(out, tuned)
    meta = json.loads((tuned / "finetune.json").read_text())
    meta["settings"].update(eval_length_penalty=1.0, eval_no_repeat_ngram=1, eval_no_repeat_ignore="")
    (tuned / "finetune.json").write_text(json.dumps(meta))
    settled = {}
    for name, flags in (("run's", []), ("same", ["--length-penalty", "1.0", "--no-repeat-ngram", "1",
                                                  "--no-repeat-ignore", ""]), ("cli", ["--no-repeat-ngram", "3"])):
        output = tmp_path / f"tuned-{name}.jsonl"
        decode.main(["--model", str(tuned), "--input", str(small_tasks["bbc_headline.dev"]), "--output", str(output),
                     "--beam-size", "3", *flags])
        settled[name] = [json.loads(line)["prediction"] for line in output.read_text().splitlines()]
    assert settled["run's"] == settled["same"] != settled["cli"]
    with pytest.raises(ValueError, match="fine-tuned for 'seq2seq', not 'classify'"):
        load_finetuned(out, expect_task="classify")


@pytest.mark.parametrize("task", ["seq2seq", "classify"])
def test_a_token_loss_is_the_mean_over_its_global_batchs_tokens_whatever_its_split(small_tasks, tiny_init, tmp_path,
                                                                                    task):
    """Examples mask different numbers of targets (seq2seq) or have different lengths (the auxiliary LM's next
    tokens): one micro-batch of 8 and four of 2 train the same steps (a mean per micro-batch would weigh a token by
    its micro-batch's count and change the first step's loss already)."""
    no_dropout = tmp_path / "init"
    shutil.copytree(tiny_init, no_dropout)
    config = json.loads((no_dropout / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (no_dropout / "config.json").write_text(json.dumps(config))
    files, flags = {"seq2seq": ("bbc_headline", ["--max-src-len", "48", "--max-tgt-len", "16"]),
                    "classify": ("rotten", ["--max-seq-len", "64", "--aux-lm-weight", "0.5",
                                            "--set", "dropout=0"])}[task]
    runs = {}
    for micro in (8, 2):
        out = tmp_path / f"micro{micro}"
        run.main(["--task", task, "--train", str(small_tasks[f"{files}.train"]), "--dev",
                  str(small_tasks[f"{files}.dev"]), "--init", str(no_dropout), "--out", str(out), *flags,
                  "--batch-size", "8", "--micro-batch-size", str(micro), "--lr", "1e-3", "--seed", "3",
                  "--max-steps", "4", "--set", "eval_max_examples=2"])
        runs[micro] = losses(out)
    assert len(runs[8]) == 4
    assert runs[2] == pytest.approx(runs[8], rel=1e-5)


def test_bad_inputs_get_clear_messages(tiny_init, minilm_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="not a model directory"):
        load_finetuned(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a loadable BERT model"):
        load_init(tmp_path, vocab=tiny_init / "vocab.txt")
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        load_init(tiny_init, vocab=minilm_dir / "vocab.txt")  # 30,522 pieces for a 1,500-row model
    with pytest.raises(ValueError, match="vocab.txt: a file; give a model directory"):
        load_init(tiny_init / "vocab.txt")
    by_name, _ = load_init(tiny_init / "model.safetensors")  # a weights file beside its config: that model
    assert all(torch.equal(tensor, load_init(tiny_init)[0].state_dict()[name])
               for name, tensor in by_name.state_dict().items())
    from finetune import predict
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(SystemExit, match="2"):
        predict.main(["--model", str(tiny_init), "--input", str(tmp_path / "in.jsonl"), "--output",
                      str(tmp_path / "p.tsv")])
    assert f"--model {tiny_init} is not a fine-tuning output (no finetune.json)" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["classify", "qa"])
def test_inputs_longer_than_the_position_table_are_refused_before_training(small_tasks, tiny_init, tmp_path, task):
    files = {"classify": ("bbc_topic.train", "bbc_topic.dev"), "qa": ("squad", "squad")}[task]
    with pytest.raises(ValueError, match="max_seq_len = 300 exceeds the model's 256 positions"):
        run.main(["--task", task, "--train", str(small_tasks[files[0]]), "--dev", str(small_tasks[files[1]]),
                  "--init", str(tiny_init), "--out", str(tmp_path), "--max-seq-len", "300", *COMMON])


def test_a_seq2seq_file_without_targets_is_refused_by_record(tiny_init, tmp_path):
    (tmp_path / "sources.jsonl").write_text("".join(json.dumps({"src": f"text {i} [X_SEP] more"}) + "\n"
                                                    for i in range(4)))
    with pytest.raises(ValueError, match=r"record 1 has an empty or missing 'tgt' \(its fields: src; name them"):
        run.main(["--task", "seq2seq", "--train", str(tmp_path / "sources.jsonl"), "--dev",
                  str(tmp_path / "sources.jsonl"), "--init", str(tiny_init), "--out", str(tmp_path / "out"), *COMMON])


def test_a_directory_given_as_the_training_file_is_refused_in_one_line(small_tasks, tiny_init, tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(run.InputError, match=f"{tmp_path / 'data'}: Is a directory"):
        run.main(["--task", "seq2seq", "--train", str(tmp_path / "data"), "--dev", str(small_tasks["bbc_headline.dev"]),
                  "--init", str(tiny_init), "--out", str(tmp_path / "out"), *COMMON])


def test_an_engine_json_in_a_precision_the_machine_lacks_is_refused_before_the_model_loads(small_tasks, tmp_path):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or get_accelerator().is_fp16_supported():
        pytest.skip("this machine trains in fp16")
    with pytest.raises(run.InputError, match=r"zero2_fp16\.json: fp16 is enabled, but DeepSpeed's cpu accelerator "
                                             r"cannot train in fp16.*ds_configs/zero2_fp32_cpu\.json"):
        run.main(["--task", "seq2seq", "--train", str(small_tasks["bbc_headline.train"]), "--dev",
                  str(small_tasks["bbc_headline.dev"]), "--init", str(tmp_path / "no-model"),
                  "--out", str(tmp_path / "out"), "--deepspeed-config", "ds_configs/zero2_fp16.json", *COMMON])


def test_a_dev_beam_wider_than_the_vocabulary_is_refused_before_training(small_tasks, tiny_init, tmp_path):
    with pytest.raises(ValueError, match=r"eval_beam_size = 100000: more beams than the \d+ word pieces"):
        run.main(["--task", "seq2seq", "--train", str(small_tasks["bbc_headline.train"]), "--dev",
                  str(small_tasks["bbc_headline.dev"]), "--init", str(tiny_init), "--out", str(tmp_path / "out"),
                  "--set", "eval_beam_size=100000", *COMMON])
    assert not (tmp_path / "out").exists()


def test_qa_run_on_the_squad_sample(small_tasks, tiny_init, tmp_path):
    squad = str(small_tasks["squad"])  # five real questions: a smoke run (train = dev)
    run.main(["--task", "qa", "--train", squad, "--dev", squad, "--init", str(tiny_init), "--out", str(tmp_path),
              "--max-seq-len", "96", "--set", "doc_stride=48", "--batch-size", "4", "--micro-batch-size", "2",
              "--epochs", "1"])
    metrics = json.loads((tmp_path / "summary.json").read_text())
    assert metrics["primary_metric"] == "f1" and {"exact_match", "f1"} <= set(metrics["best"])
    assert metrics["windows"]["train"] > 5 and not metrics["version_2"]
    finetuned = load_finetuned(tmp_path)
    assert finetuned.head_state["weight"].shape == (2, 32)
    # transformers runs the span head: BertForQuestionAnswering with our start/end logits on a window
    from transformers import AutoModelForQuestionAnswering

    from finetune import qa
    hf, info = AutoModelForQuestionAnswering.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    questions, _ = qa.read_squad(squad)
    windows = qa.make_windows(questions[:2], finetuned.tokenizer, 96, 48, 64)
    batch = qa.collate(windows, finetuned.tokenizer.pad_id)
    ours = qa.SpanModel(finetuned.model)
    ours.head.load_state_dict(finetuned.head_state)
    positions = torch.arange(batch["input_ids"].shape[1])
    with torch.no_grad():
        start, end = ours.eval().span_logits(batch["input_ids"], batch["len_a"], batch["length"])
        out = hf.eval()(input_ids=batch["input_ids"], attention_mask=positions < batch["length"][:, None],
                        token_type_ids=(positions >= batch["len_a"][:, None]).long())
    inside = positions < batch["length"][:, None]
    torch.testing.assert_close(out.start_logits[inside], start[inside], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.end_logits[inside], end[inside], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 2 ranks under torchrun, twice
def test_two_ranks_train_stop_and_resume_under_torchrun(small_tasks, tiny_init, tmp_path):
    """The same command on 2 data-parallel ranks (gloo): stops at a step, resumes, finishes every step once; the
    logged loss is the mean over ranks, so (dropout off) it is the 1-rank run's loss."""
    import subprocess
    import sys

    from conftest import subprocess_env

    init = tmp_path / "init"  # the backbone without dropout, as the head (dropout=0)
    shutil.copytree(tiny_init, init)
    config = json.loads((init / "config.json").read_text())
    (init / "config.json").write_text(json.dumps(dict(config, hidden_dropout_prob=0.0,
                                                      attention_probs_dropout_prob=0.0)))
    args = classify_args(small_tasks, init, tmp_path / "two", "--epochs", "2", "--set", "dropout=0")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "finetune.run", *args]
    for extra in (["--set", "exit_at_step=3"], []):
        process = subprocess.run(command + extra, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-4000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == 10  # 2 epochs × 40 examples / batch 8
    run.main(classify_args(small_tasks, init, tmp_path / "one", "--epochs", "2", "--set", "dropout=0"))
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    tmp_path = tmp_path / "two"
    metrics = json.loads((tmp_path / "summary.json").read_text())
    assert metrics["finished"] and len(metrics["epochs"]) == 2
    assert load_finetuned(tmp_path).task == "classify"


@pytest.mark.slow  # 2 ranks under torchrun
def test_a_file_one_rank_does_not_see_stops_every_rank_naming_it_once(small_tasks, tiny_init, tmp_path):
    """Across nodes no launcher stops the ranks that did see it: they must stop by themselves, not wait at the
    rendezvous. Rank 1 runs in a directory without the training file (given as a relative path)."""
    import socket

    from conftest import launch_node_local

    (tmp_path / "node0").mkdir()
    shutil.copy(small_tasks["bbc_topic.train"], tmp_path / "node0" / "train.jsonl")
    args = classify_args(small_tasks, tiny_init, tmp_path / "out")
    args[args.index("--train") + 1] = "train.jsonl"
    done, exit_codes = launch_node_local(tmp_path, "finetune.run", args)
    message = f"[finetune] train.jsonl: no such file or directory (the train file) (rank 1 on {socket.gethostname()})"
    assert done.stderr.count(message) == 1, done.stderr[-4000:]
    assert exit_codes == ["2", "2"]  # rank 0 stopped by itself
    assert not (tmp_path / "out").exists()


def test_sigterm_saves_the_step_and_the_rerun_continues(small_tasks, tiny_init, tmp_path):
    """What a scheduler's preemption does mid-epoch: SIGTERM saves that step and exits 0 (save_interval checkpoints
    on the way); the same command then continues with the next step, none repeated or skipped."""
    import sys

    from training_runs import preempt

    args = classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "40", "--set", "save_interval=3",
                         "--set", "keep_last=50")
    process = preempt([sys.executable, "-m", "finetune.run", *args], tmp_path, steps=4)
    assert process.returncode == 0, process.stderr[-3000:]
    stopped_at = len(losses(tmp_path))
    assert 4 <= stopped_at < 200
    assert (f"[finetune] time limit / SIGTERM / Ctrl-C: saved global_step{stopped_at} at step {stopped_at}"
            in process.stdout)
    tags = {p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("global_step")}
    assert {"global_step3", f"global_step{stopped_at}"} <= tags  # save_interval's and the stop's
    assert not json.loads((tmp_path / "summary.json").read_text())["finished"]
    run.main(args + ["--set", f"exit_at_step={stopped_at + 2}"])
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, stopped_at + 3))


def test_a_run_that_stopped_before_its_first_checkpoint_can_be_rerun_without_force(tmp_path):
    from finetune.run import check_run_output
    from pretrain.outputs import OutputExistsError
    for name in ("run.lock", "run_config.json", "metrics.jsonl"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "checkpoints").mkdir()
    check_run_output(str(tmp_path), [], force=False)  # what a failed first attempt leaves: rerun it
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="pass --force"):
        check_run_output(str(tmp_path), [], force=False)


def test_predict_writes_squad_predictions_and_scores_them_as_fine_tuning_did(small_tasks, tiny_init, tmp_path):
    """`finetune.predict` on a QA model: run_squad's predictions.json ({id: answer}), scored as the run's dev
    evaluation scored them; a model fine-tuned on SQuAD 2.0 also writes the null odds; a file without answers is
    predicted, not scored."""
    from finetune import predict

    def fine_tune(data: Path, out: Path) -> dict:
        return run.main(["--task", "qa", "--train", str(data), "--dev", str(data), "--init", str(tiny_init), "--out",
                         str(out), "--max-seq-len", "96", "--set", "doc_stride=48", "--batch-size", "4",
                         "--micro-batch-size", "2", "--epochs", "1", "--lr", "1e-3"])

    def without_answers(data: dict, path: Path) -> Path:
        bare = json.loads(json.dumps(data))
        for article in bare["data"]:
            for paragraph in article["paragraphs"]:
                for q in paragraph["qas"]:
                    q.pop("answers", None), q.pop("is_impossible", None)
        path.write_text(json.dumps(bare))
        return path

    squad = small_tasks["squad"]
    summary = fine_tune(squad, tmp_path / "v1")
    scores = predict.main(["--model", str(tmp_path / "v1"), "--input", str(squad),
                           "--output", str(tmp_path / "p.json")])
    assert scores == pytest.approx({k: summary["best"][k] for k in ("exact_match", "f1")})
    answers = json.loads((tmp_path / "p.json").read_text())
    data = json.loads(squad.read_text())
    ids = [q["id"] for article in data["data"] for paragraph in article["paragraphs"] for q in paragraph["qas"]]
    assert list(answers) == ids and all(isinstance(a, str) and a for a in answers.values())
    assert not (tmp_path / "p.null_odds.json").exists()
    bare = without_answers(data, tmp_path / "bare.json")
    assert predict.main(["--model", str(tmp_path / "v1"), "--input", str(bare), "--output",
                         str(tmp_path / "bare_p.json")]) == {"predictions": len(ids)}
    assert json.loads((tmp_path / "bare_p.json").read_text()) == answers
    assert not (tmp_path / "bare_p.metrics.json").exists()

    for article in data["data"]:  # the same questions as SQuAD 2.0, the first one unanswerable
        for paragraph in article["paragraphs"]:
            for q in paragraph["qas"]:
                q["is_impossible"] = q["id"] == ids[0]
                q["answers"] = [] if q["is_impossible"] else q["answers"]
    (tmp_path / "v2.json").write_text(json.dumps(data))
    summary = fine_tune(tmp_path / "v2.json", tmp_path / "v2")
    scores = predict.main(["--model", str(tmp_path / "v2"), "--input", str(tmp_path / "v2.json"), "--output",
                           str(tmp_path / "v2_p.json")])
    assert scores == pytest.approx({k: summary["best"][k] for k in scores})
    assert {"has_ans_f1", "no_ans_exact", "best_f1_threshold"} <= set(scores)
    assert list(json.loads((tmp_path / "v2_p.null_odds.json").read_text())) == ids
    # bare questions carry no is_impossible: SQuAD 2.0 is still the model's, so it may answer "" and gives odds
    predict.main(["--model", str(tmp_path / "v2"), "--input", str(without_answers(data, tmp_path / "bare2.json")),
                  "--output", str(tmp_path / "bare2_p.json")])
    assert json.loads((tmp_path / "bare2_p.json").read_text()) == json.loads((tmp_path / "v2_p.json").read_text())
    assert (tmp_path / "bare2_p.null_odds.json").exists()


def test_a_nan_loss_stops_before_the_update_naming_the_step_and_keeping_the_last_checkpoint(
        small_tasks, tiny_init, tmp_path, capsys):
    args = classify_args(small_tasks, tiny_init, tmp_path, "--epochs", "20", "--set", "save_interval=2")
    args[args.index("--lr") + 1] = "1e30"  # the first update at a large rate makes every later loss NaN
    with pytest.raises(SystemExit) as stopped:
        run.main(args)
    assert stopped.value.code == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = records[-1]["step"]
    assert records[-1]["event"] == "nonfinite" and [r["step"] for r in records[:-1]] == list(range(1, step))
    assert all(math.isfinite(r["loss"]) for r in records[:-1])
    kept = f"global_step{step - 1 - (step - 1) % 2}"  # the last save_interval checkpoint before the NaN step
    err = capsys.readouterr().err
    assert f"[stop] non-finite loss (this rank's micro-batches: [nan, nan]) at step {step} (epoch " in err
    assert f"the last complete checkpoint ({kept}) in {tmp_path / 'checkpoints'} is intact" in err
    assert (tmp_path / "checkpoints" / "latest").read_text() == kept
    summary = tmp_path / "summary.json"
    assert not summary.exists() or not json.loads(summary.read_text())["finished"]



def _save_seq2seq_output(tiny_init: Path, out: Path, shift: float = 0.0) -> None:
    """A fine-tuning output (seq2seq: no head) of the tiny model, every tensor moved by ``shift``."""
    from finetune.model_io import save_finetuned

    model, tokenizer = load_init(tiny_init)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(shift)
    save_finetuned(out, model, None, tokenizer, "seq2seq", {})


def test_an_interrupted_save_is_refused_rather_than_loaded_as_two_models(tiny_init, tmp_path, monkeypatch):
    from finetune import model_io

    out = tmp_path / "out"
    _save_seq2seq_output(tiny_init, out)
    replace, renamed = model_io.os.replace, []

    def dies_after_two_files(source, target):  # config.json and finetune_extra.safetensors, not model.safetensors
        if len(renamed) == 2:
            raise KeyboardInterrupt
        renamed.append(target)
        replace(source, target)

    monkeypatch.setattr(model_io.os, "replace", dies_after_two_files)
    with pytest.raises(KeyboardInterrupt):
        _save_seq2seq_output(tiny_init, out, shift=1.0)  # another model's save over it
    monkeypatch.undo()
    assert [path.name for path in renamed] == ["config.json", "finetune_extra.safetensors"]
    assert not (out / "finetune.json").exists()
    for load in (load_finetuned, load_init):
        with pytest.raises(ValueError, match=rf"^{out}: finetune_extra.safetensors without finetune.json: the save "
                                             "of this fine-tuning output was interrupted.*re-run the fine-tuning, or "
                                             "use an earlier output"):
            load(out)


def test_init_from_a_fine_tuning_output_checks_the_hashes_it_records(tiny_init, tmp_path):
    out, other = tmp_path / "out", tmp_path / "other"
    _save_seq2seq_output(tiny_init, out, shift=1.0)
    _save_seq2seq_output(tiny_init, other)
    shutil.copy(other / "model.safetensors", out / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{out}: model.safetensors is missing or is not the file finetune.json "
                                         "records"):
        load_init(out)
    lfs_pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n"  # a clone without git-lfs
    (out / "model.safetensors").write_bytes(lfs_pointer)
    for load in (load_finetuned, load_init):
        with pytest.raises(ValueError, match=rf"^{out / 'model.safetensors'} is a git-lfs pointer.*git lfs pull"):
            load(out)


def test_an_unreadable_extra_file_is_named(tiny_init, tmp_path):
    from common.files import sha256_file

    out = tmp_path / "out"
    _save_seq2seq_output(tiny_init, out)
    extra = out / "finetune_extra.safetensors"
    extra.write_bytes(extra.read_bytes()[:-100])  # cut short before its sha256 was recorded
    meta = json.loads((out / "finetune.json").read_text())
    meta["files"]["finetune_extra.safetensors"] = sha256_file(extra)
    (out / "finetune.json").write_text(json.dumps(meta))
    for load in (load_finetuned, load_init):
        with pytest.raises(ValueError, match=rf"^{extra} \({extra.stat().st_size:,} bytes\) cannot be read as "
                                             r"model weights \(Error while deserializing header: incomplete metadata"):
            load(out)
