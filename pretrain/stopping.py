"""When a training run should save and exit: a scheduler's SIGTERM, a first Ctrl-C, or its time limit."""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

log = logging.getLogger(__name__)


class StopRequest:
    """Whether this process should save and exit: SIGTERM received (a scheduler's preemption), a first Ctrl-C
    (SIGINT; a second one stops at once, without saving), or ``train.exit_after_minutes`` passed."""

    def __init__(self, started: float, exit_after_minutes: float | None) -> None:
        self.started, self.exit_after_minutes = started, exit_after_minutes
        self.signalled = False
        self.previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, *_: Any) -> None:
        self.signalled = True

    def _on_sigint(self, *_: Any) -> None:
        if self.signalled:
            raise KeyboardInterrupt
        self.signalled = True
        if os.environ.get("RANK", "0") == "0":
            log.warning("\n[stop] Ctrl-C: saving the step in progress, then exiting (Ctrl-C again stops at once, "
                        "without saving)")

    def __bool__(self) -> bool:
        out_of_time = (self.exit_after_minutes is not None
                       and time.monotonic() - self.started > 60 * self.exit_after_minutes)
        return out_of_time or self.signalled

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous_handler)
        signal.signal(signal.SIGINT, self.previous_sigint)
