"""tools.finetune_demo: the table (best dev epoch per run, mean ± sd over seeds, per-seed paired differences), and
which finished runs it keeps."""
from __future__ import annotations

import hashlib
import shutil

from tools.finetune_demo import best_over_epochs, table


def run(accuracy: list[float], dev_loss: list[float] | None = None) -> dict:
    """A summary.json with one entry per epoch (both tasks' metrics, so one helper serves the whole table)."""
    dev_loss = dev_loss or [7.0] * len(accuracy)
    return {"epochs": [{"accuracy": a, "macro_f1": a / 2, "rouge1": 1.0, "rouge2": 0.0, "rougeL": 1.0,
                        "dev_loss": loss} for a, loss in zip(accuracy, dev_loss)]}


def test_best_epoch_is_the_highest_score_or_the_lowest_loss() -> None:
    metrics = run([0.5, 0.7, 0.6], [6.9, 6.5, 6.7])
    assert best_over_epochs(metrics, "accuracy") == 0.7
    assert best_over_epochs(metrics, "dev_loss") == 6.5


def test_rows_give_mean_sd_and_per_seed_differences() -> None:
    results = {
        ("topic", "pretrained"): [run([0.5, 0.6]), run([0.7]), run([0.8])],  # best 0.6, 0.7, 0.8
        ("topic", "scratch"): [run([0.5]), run([0.75]), run([0.4, 0.7])],  # best 0.5, 0.75, 0.7
        ("headline", "pretrained"): [run([0.0], [6.4]), run([0.0], [6.6]), run([0.0], [6.5])],
        ("headline", "scratch"): [run([0.0], [6.5]), run([0.0], [6.5]), run([0.0], [6.5])],
    }
    rows = {line.split(" | ")[1]: line for line in table(results).splitlines()[2:]}
    assert rows["accuracy"] == ("| BBC topic | accuracy | 70.00 ± 10.00 | 65.00 ± 13.23 "
                                "| +5.00 (+10.00, -5.00, +10.00) |")
    assert rows["dev loss (lower is better)"].endswith("| 6.50 ± 0.10 | 6.50 ± 0.00 | +0.00 (-0.10, +0.10, +0.00) |")


def test_one_seed_gives_plain_values() -> None:
    results = {(task, init): [run([0.6])] for task in ("topic", "headline") for init in ("pretrained", "scratch")}
    assert "| BBC topic | accuracy | 60.00 | 60.00 | +0.00 |" in table(results)


def test_runs_fine_tuned_from_another_checkpoint_are_redone(tmp_path, capsys) -> None:
    """A finished run is kept only while --pretrained is the model it was fine-tuned from."""
    import json

    from pretrain import checkpoint as ckpt
    from tools.finetune_demo import forget_runs_of_another_model, model_identity

    def save(checkpoints, step: int, weights: bytes) -> dict:
        tag_dir = checkpoints / ckpt.tag_for_step(step)
        tag_dir.mkdir(parents=True)
        (tag_dir / ckpt.WEIGHTS).write_bytes(weights)
        ckpt.write_marker(tag_dir, {"step": step})
        ckpt.update_latest(checkpoints, tag_dir.name)
        return model_identity(str(checkpoints))

    out = tmp_path / "demo"
    first = save(tmp_path / "run" / "checkpoints", 600, b"weights of the first pre-training")
    assert first["step"] == 600 and first["checkpoint"].endswith("global_step600")
    forget_runs_of_another_model(out, first)
    for name in ("topic-pretrained-seed42", "headline-scratch-seed43"):
        (out / name).mkdir()
        (out / name / "summary.json").write_text(json.dumps({"finished": True}))
    forget_runs_of_another_model(out, model_identity(str(tmp_path / "run" / "checkpoints")))
    assert (out / "topic-pretrained-seed42" / "summary.json").is_file()  # same model: finished runs are kept
    assert "fine-tuning again" not in capsys.readouterr().out
    shutil.rmtree(tmp_path / "run")  # pre-trained again into the same place, to the same step
    again = save(tmp_path / "run" / "checkpoints", 600, b"weights of the second pre-training")
    assert again != first
    forget_runs_of_another_model(out, again)
    assert "the 2 run(s) in" in capsys.readouterr().out and not list(out.glob("*-seed*"))
    assert json.loads((out / "pretrained.json").read_text()) == again
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"exported weights")
    expected = {"model.safetensors": hashlib.sha256(b"exported weights").hexdigest()}
    assert model_identity(str(model))["sha256"] == expected


def test_a_checkpoint_shorter_than_the_comparison_is_warned_about() -> None:
    from tools.finetune_demo import short_pretraining_note

    note = short_pretraining_note({"checkpoint": "runs/tiny/checkpoints/global_step40", "step": 40}, 600)
    assert note.startswith("this checkpoint has 40 pre-training steps, the comparison is meant for 600")
    assert "Continue that run to 600 steps first (train.max_steps=600)" in note
    assert short_pretraining_note({"checkpoint": "c", "step": 600}, 600) is None
    assert short_pretraining_note({"model": "hf_out"}, 600) is None  # a model directory: no step to compare
    assert short_pretraining_note({"checkpoint": "c", "step": 40}, None) is None
