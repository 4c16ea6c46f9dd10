"""SIGTERM taken as Ctrl-C by the long one-process commands (a shard build, decoding): a scheduler's time limit or
`kill` then ends them as an interrupt does, with their own message and what they finished kept, instead of a
silent death (Python's default for SIGTERM)."""
from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt."""


def _raise_terminated(*_: object) -> None:
    raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated` (a KeyboardInterrupt); the handler before it is restored."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def describe(stop: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the command, in words, and its exit code (128 + the signal number, as a shell reports it)."""
    if isinstance(stop, Terminated):
        return "stopped by SIGTERM", 128 + signal.SIGTERM
    return "interrupted", 128 + signal.SIGINT
