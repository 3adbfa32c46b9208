"""The persistent compilation cache: ``attnlab.compilation_cache()`` turns it on, and a second
process of the same shapes (here: the same process with JAX's in-memory caches cleared)
reads every program back from disk and compiles nothing."""

import pathlib

import jax
import pytest
from compile_count import compiles
from jax.experimental.compilation_cache import compilation_cache as jax_cache

import attnlab
from attnlab.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache directory of the test's own; the session's cache settings come back after."""
    saved = {name: getattr(jax.config, name) for name in SETTINGS}
    where = tmp_path / "jax"
    monkeypatch.setenv("ATTNLAB_COMPILATION_CACHE", str(where))
    # Every program is written (.ci/run's later tiers set a floor that writes none).
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    yield where
    for name, value in saved.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def test_off_by_default_and_off_when_asked(monkeypatch):
    # Importing the library changes nothing: only the test session's own setting is there.
    monkeypatch.setenv("ATTNLAB_COMPILATION_CACHE", "off")
    before = jax.config.jax_compilation_cache_dir
    assert attnlab.compilation_cache() is None
    assert attnlab.compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir == before


def test_the_argument_then_the_environment_name_the_directory(own_cache, tmp_path):
    assert attnlab.compilation_cache() == str(own_cache)
    assert jax.config.jax_compilation_cache_dir == str(own_cache)
    assert attnlab.compilation_cache(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")


@pytest.mark.slow(reason="trains the tiny run twice, first with a cold cache of its own")
def test_a_warm_run_compiles_nothing(own_cache, tmp_path, capsys):
    argv = ["train", "--config", TINY, "--no-progress", "--config.eval.sample_tokens=0"]
    # Programs earlier tests compiled in this process would be taken from memory, never
    # written to the new cache, and compiled again after the clear below.
    jax.clear_caches()
    with compiles(from_disk=False) as cold:
        assert main([*argv, "--workdir", str(tmp_path / "cold")]) == 0
    assert cold() > 0 and any(own_cache.iterdir())
    jax.clear_caches()  # what a new process starts with
    with compiles() as built, compiles(from_disk=False) as compiled:
        assert main([*argv, "--workdir", str(tmp_path / "warm")]) == 0
    assert built() > 0 and compiled() == 0, f"{compiled()} of {built()} programs compiled"
