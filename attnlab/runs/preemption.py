"""Preemption: ``PreemptionGuard`` turns SIGTERM and SIGINT into a flag that the training loop
polls once per step (``stop_signal()`` names the signal afterwards, for the exit status
``attnlab`` gives: 130 for SIGINT, 143 for SIGTERM)::

    with Checkpointer(workdir) as ckpt, PreemptionGuard() as guard:
        for step in range(start, num_steps):
            state = train_step(state, next(batches))
            if guard.requested or step % save_every == 0:
                ckpt.save(step, state, metadata=config_dict)
            if guard.requested:
                break  # the checkpoint is durable; the caller reports stop_signal()
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any

from attnlab.errors import Interrupted

_RECEIVED: list[str] = []  # the signal the last guard received, for stop_signal()


def stop_signal() -> str | None:
    """The name of the signal (``"SIGINT"``, ``"SIGTERM"``) that stopped the latest guarded
    loop of this process, or None when none did."""
    return _RECEIVED[-1] if _RECEIVED else None


def raise_if_stopped(where: str) -> None:
    """Raises ``Interrupted`` when a signal stopped the latest guarded loop (after its
    checkpoint was written); ``where`` completes the message."""
    name = stop_signal()
    if name is not None:
        raise Interrupted(f"{name} stopped the run {where}; run the same command to resume", name)


class PreemptionGuard:
    """Turns SIGTERM/SIGINT into a flag while active; restores the previous handlers on exit.

    The handlers only record the signal, so the training loop decides when to stop: it polls
    ``requested`` once per step, saves a checkpoint and returns normally (see the module
    docstring); ``stop_signal()`` tells its caller which signal it was. Enter it from the
    main thread, as Python only installs handlers there.
    """

    def __init__(self, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)):
        self._signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        """True once one of the signals has arrived."""
        return self.signal_name is not None

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            _RECEIVED[:] = [self.signal_name]

    def __enter__(self) -> PreemptionGuard:
        _RECEIVED.clear()
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            # None means the handler was installed outside Python; the default is the best
            # approximation available.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
