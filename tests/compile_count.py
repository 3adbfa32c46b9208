"""Counting XLA compilations: ``with compiles() as count: ...; assert count() == 0``.

``compiles()`` counts every program built, including those read back from JAX's persistent
compilation cache; ``compiles(from_disk=False)`` counts only the programs XLA really compiled.
"""

import contextlib

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def compiles(*, from_disk=True):
    """Yields a function returning how many backend compiles ran inside the block so far."""
    seen, hits = [], []

    def listen(event, duration, **kwargs):
        if event == _EVENT:
            seen.append(duration)

    def listen_hits(event, **kwargs):
        if event == _HIT:
            hits.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.monitoring.register_event_listener(listen_hits)
    try:
        yield lambda: len(seen) - (0 if from_disk else len(hits))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        jax.monitoring.unregister_event_listener(listen_hits)
