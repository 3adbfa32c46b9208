"""Counting XLA compilations: ``with compiles() as count: ...; assert count() == 0``."""

import contextlib

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiles():
    """Yields a function returning how many backend compiles ran inside the block so far."""
    seen = []

    def listen(event, duration, **kwargs):
        if event == _EVENT:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lambda: len(seen)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
