"""Strict JAX for the whole suite, the two tiers, and the location of the shared fixtures.

``python -m pytest`` runs the fast tier; ``-m slow`` runs the tests marked
``@pytest.mark.slow(reason=...)``, ``-m ""`` both; ``.ci/run`` leaves the ``long`` ones
(``tests/tiers.py``) to ``.ci/long``. A property test draws its first few
examples in the fast tier and all of them in the slow tier (``test_fuzz.py``).
"""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

import xla_flags  # noqa: E402  (tests/ is on the path)

os.environ["XLA_FLAGS"] = xla_flags.session()  # one CPU device unless asked, fast compiles
# One persistent compilation cache that the test sessions own, shared with the processes the
# tests start (the CLI, notebooks, sweeps): a tiny program compiles once, and the next
# session (the slow tier after the fast one, a second run) reads it back. Never the user's.
_CACHE = os.environ.setdefault("ATTNLAB_COMPILATION_CACHE", str(REPO / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The tests' programs are tiny: XLA's backend (LLVM) optimisations cost more compile time than
# they save in run time. Measured on the 2-core machine, tests/test_models.py cold: 193 s of CPU
# with them, 90 s without. Numerics stay within every test's tolerance; the CLI and library keep
# the full optimisation level.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


# The files that take longest, started first: the README's command runs the tests on one
# worker per core (pytest-xdist, ``--dist loadfile``), which hands out whole files in
# collection order, and a long file collected last would run alone at the end.
LONGEST_FIRST = (
    "test_train.py",
    "test_runs.py",
    "test_notebooks.py",
    "test_models.py",
    "test_ops_chunked.py",
    "test_mixer_recurrent.py",
    "test_sweep.py",
    "test_recompute.py",
    "test_layer_stack.py",
    "test_sharding.py",
    "test_context_parallel.py",
    "test_moe_mesh.py",
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(items):
    import tiers

    moved = set(tiers.MOVED)
    for item in items:
        if item.nodeid in moved:
            item.add_marker(pytest.mark.slow(reason=tiers.MOVED_REASON))
        if tiers.in_long(item.nodeid):
            item.add_marker(pytest.mark.long(reason=tiers.LONG_REASON))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.fixture
def shared_dir():
    """``../shared`` beside the checkout; tests that need it skip when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(
            "extra checks against stored reference data (Hugging Face reference logits for "
            "gpt2/llama/bert/marian, the tiny Shakespeare text): they read "
            f"{SHARED}, which only the maintainers' checkouts have; nothing is missing from "
            "your install, and the rest of the suite covers the same code"
        )
    return SHARED


@pytest.fixture(scope="session")
def tiny_lm_run(tmp_path_factory):
    """A finished tiny ``char_lm`` run (checkpoints at steps 1, 2 and 3); copy it to change it."""
    from attnlab import experiment, runs

    workdir = tmp_path_factory.mktemp("tiny_lm") / "run"
    overrides = ["--config.checkpoint.every_steps=1", "--config.checkpoint.max_to_keep=3"]
    overrides += ["--config.eval.sample_tokens=4"]
    cfg = experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", overrides)
    runs.train(cfg, workdir, progress=False)
    return workdir
