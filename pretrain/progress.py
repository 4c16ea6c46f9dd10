"""Rank 0's progress over optimizer steps on the console: a tqdm bar on a terminal, a plain step line elsewhere."""
from __future__ import annotations

import logging
import sys

from tqdm import tqdm

log = logging.getLogger(__name__)


class StepBar:
    """Rank 0's progress over optimizer steps: a tqdm bar on a terminal; elsewhere (cluster logs, a redirected
    output) a plain line every ``every`` steps."""

    def __init__(self, total: int, initial: int, desc: str, every: int = 10) -> None:
        self.every = every
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr, mininterval=1.0,
                        dynamic_ncols=True, disable=None)

    def update(self, step: int, loss: float, lr: float, samples_per_s: float | None = None,
               tflops: float | None = None, mfu: float | None = None) -> None:
        """Show step ``step``; ``tflops`` (per GPU) and ``mfu`` as `Throughput.per_rank` measures them, when given."""
        self.bar.n = step
        postfix = {"loss": f"{loss:.4f}", **({"samples_s": f"{samples_per_s:.1f}"} if samples_per_s else {}),
                   **({"tflops": f"{tflops:.3g}", "mfu": f"{mfu:.1%}"} if tflops and mfu else {})}
        self.bar.set_postfix(postfix)  # refreshes the bar
        if self.bar.disable and step % self.every == 0:
            log.info(f"[step {step}/{self.bar.total}] loss {loss:.4f} lr {lr:.3g}"
                     + (f" {samples_per_s:.1f} samples/s" if samples_per_s else "")
                     + (f" {tflops:.3g} TFLOP/s per GPU, MFU {mfu:.1%}" if tflops and mfu else ""))

    def close(self) -> None:
        self.bar.close()
