"""The long one-process commands (a shard build, decoding) stop on SIGTERM as on Ctrl-C: a scheduler's time limit or
`kill` then ends them as an interrupt does, with their own message and what they finished kept, instead of a
silent death (Python's default for SIGTERM). They stop once: a second signal (Ctrl-C pressed twice, a signal sent
to the process group by several of its processes) does not cut that cleanup short with a traceback."""
from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt."""


@contextmanager
def stop_once() -> Iterator[None]:
    """Within the block the first SIGTERM raises `Terminated` and the first SIGINT KeyboardInterrupt (where Python
    handles SIGINT: a background job that ignores it keeps ignoring it); after that first one, both are ignored
    until the block ends, so the stop's cleanup (a worker pool's shutdown, saying what was kept) runs to its end.
    The handlers before the block are restored after it."""
    raised: dict[int, type[BaseException]] = {signal.SIGTERM: Terminated}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        raised[signal.SIGINT] = KeyboardInterrupt
    previous = {number: signal.getsignal(number) for number in raised}

    def stop(number: int, _frame: object) -> None:
        for handled in raised:
            signal.signal(handled, signal.SIG_IGN)
        raise raised[number]

    for number in raised:
        signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def describe(stop: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the command, in words, and its exit code (128 + the signal number, as a shell reports it)."""
    if isinstance(stop, Terminated):
        return "stopped by SIGTERM", 128 + signal.SIGTERM
    return "interrupted", 128 + signal.SIGINT
