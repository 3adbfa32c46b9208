"""JAX's persistent compilation cache: a program compiled once for a shape is read back from
disk by every later process (the `attnlab` command, notebooks, scripts, the test session).

Off in library use until ``compilation_cache()`` turns it on; the `attnlab` command and the
notebooks turn it on. ``ATTNLAB_COMPILATION_CACHE=DIR`` moves it, ``=off`` keeps it off.
"""

import os

ENV = "ATTNLAB_COMPILATION_CACHE"
_OFF = ("off", "0", "false", "no")


def compilation_cache(where: str | os.PathLike | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on for this process; returns its directory.

    ``where`` defaults to ``$ATTNLAB_COMPILATION_CACHE``, else ``jax/`` in attnlab's user
    cache directory; ``"off"`` leaves the cache as it is and returns None. Every program is
    kept, however quick to compile, so a second run of the same shapes compiles nothing
    (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``, JAX's variable, keeps only slower ones).
    Call it before the first ``jit``; a call after it also works (JAX re-reads the setting).
    """
    where = os.fspath(where) if where is not None else os.environ.get(ENV, "")
    if where.lower() in _OFF:
        return None
    if not where:
        from attnlab.data.fetch import cache_dir

        where = str(cache_dir() / "jax")
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    jax.config.update("jax_compilation_cache_dir", where)
    # Every program is kept, unless JAX's own variable asks for a least compile time.
    least = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", least)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax_cache.reset_cache()  # a process that compiled before this call picks the setting up
    return where
