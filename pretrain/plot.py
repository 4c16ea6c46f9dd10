"""Loss curves of a run: ``make plot RUN=out_dir`` → ``out_dir/loss.png``.

Left: total training loss (and eval loss, if any) per step, with each recovery from a lost rank or node
(``restarts.jsonl``) marked at the step it resumed from; right: per-objective losses.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib  # optional (extras): only plotting needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    from pretrain.metrics import read_metrics
    records = read_metrics(run_dir / "metrics.jsonl")  # a line being written by a live run is skipped
    records = [r for r in records if "loss" in r]
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no training steps yet")
    steps = [r["step"] for r in records]
    figure, (total, objectives) = plt.subplots(1, 2, figsize=(12, 4.5))
    total.plot(steps, [r["loss"] for r in records], label="train")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        total.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    from pretrain.elastic import read_restarts
    for number, restart in enumerate(read_restarts(run_dir)):
        total.axvline(restart["resume_step"], color="red", linestyle=":",
                      label="recovery (resumed here)" if number == 0 else None)
        total.annotate(f"world {restart['world_size_before']}→{restart['world_size_after']}, "
                       f"{restart['steps_redone']} redone, {restart['seconds_lost']} s lost",
                       (restart["resume_step"], 0.98), xycoords=("data", "axes fraction"), rotation=90, va="top",
                       ha="right", fontsize=7, color="red")
    total.set(title=f"{run_dir.name}: total loss", xlabel="step", ylabel="loss")
    total.legend()
    names = sorted({k[5:] for r in records for k in r if k.startswith("loss_") and k != "loss_scale"})
    for name in names:
        points = [(r["step"], r[f"loss_{name}"]) for r in records if f"loss_{name}" in r]
        objectives.plot(*zip(*points), label=name)
    objectives.set(title="per objective", xlabel="step", ylabel="loss")
    if names:
        objectives.legend()
    figure.tight_layout()
    out = Path(out) if out else run_dir / "loss.png"
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory with metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default RUN/loss.png)")
    args = parser.parse_args(argv)
    if not (Path(args.run) / "metrics.jsonl").is_file():
        parser.error(f"{args.run}: no metrics.jsonl (not a run directory, or a run that has not logged a step yet)")
    try:
        print(plot_run(args.run, args.out))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
