"""The console of an entry point: the project's log records written as the lines they are, information to stdout and
warnings to stderr (as the commands printed them), set up once by each entry point's ``main``."""
from __future__ import annotations

import logging
import sys

PACKAGES = ("common", "data_prep", "pretrain", "finetune", "tools")
"""The loggers (``logging.getLogger(__name__)`` of every project module) whose records reach the console."""


class ConsoleHandler(logging.Handler):
    """A record's message alone, on the stream of its level: below WARNING to stdout, else stderr. The streams are
    looked up when a record is written (``sys.stdout`` may have been replaced since, by a test's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's contract: a failed write is reported, never raised)
            self.handleError(record)


def configure_console(level: int = logging.INFO) -> None:
    """Send the project's records of ``level`` and above to the console (`ConsoleHandler`); a second call changes
    nothing. Records still propagate to the root logger (where a test's log capture listens)."""
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, ConsoleHandler) for handler in logger.handlers):
            logger.addHandler(ConsoleHandler())
        logger.setLevel(level)
