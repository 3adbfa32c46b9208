"""The lowering tier (``-m lowering``): every fused kernel, through the public API, lowered
for the real chips from this CPU host, forward and backward, and ``attnlab lower`` on every
experiment.

``flex_attention(..., backend="gpu"|"tpu", interpret=False)`` builds the kernel for that chip
whatever the host; ``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` is where
Pallas lowers it: Mosaic TPU checks its block tiling, the Triton lowering its shapes. Each
case asserts that the lowered module holds the kernel's custom call, so a silent fall back to
XLA fails. Values are the interpret-mode tests' business (tests/test_ops_pallas_*.py); the
chip's own compiler runs only on the chip.

Inputs are abstract (``jax.ShapeDtypeStruct``): nothing of T = 32k is allocated.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from attnlab.ops import flex, paths, score_mods
from attnlab.ops.masks import MaskSpec

pytestmark = pytest.mark.lowering

REPO = pathlib.Path(__file__).resolve().parents[1]
N, K = 8, 2  # query heads, kv heads (grouped, G = 4)
WINDOW, CAP, DOC = 4096, 50.0, 1024  # Gemma 2's window and cap; packed documents' length
# What a lowered module holds for each chip's Pallas kernels.
CUSTOM_CALLS = {"cuda": ("__gpu$xla.gpu.triton",), "tpu": ("tpu_custom_call",)}
BACKENDS = {"cuda": "gpu", "tpu": "tpu"}


def _case(name, T):
    """``(call keyword arguments, closed-over float arrays)`` of one attention variant at T
    (the arrays are arguments of the lowered function, so their gradients are lowered too)."""
    if name == "causal":
        return lambda arrays: dict(mask=MaskSpec.for_sequence(T, causal=True)), ()
    if name == "gemma2":  # sliding window + soft-cap + sinks
        return lambda arrays: dict(
            mask=MaskSpec.for_sequence(T, causal=True, window=min(WINDOW, T // 2)),
            softcap=CAP, sinks=arrays[0],
        ), (jax.ShapeDtypeStruct((N,), jnp.float32),)  # fmt: skip
    if name == "alibi":  # a closed-over score function with learned slopes
        return lambda arrays: dict(
            mask=MaskSpec.for_sequence(T, causal=True), score_mod=score_mods.alibi(arrays[0])
        ), (jax.ShapeDtypeStruct((N,), jnp.float32),)  # fmt: skip
    if name == "packed":  # packed documents: segment ids
        seg = (jnp.arange(T, dtype=jnp.int32) // min(DOC, T // 2) + 1)[None]
        return lambda arrays: dict(mask=MaskSpec.for_sequence(T, causal=True, segment_ids=seg)), ()
    if name == "prefix_lm":
        return lambda arrays: dict(
            mask=MaskSpec.for_sequence(T, causal=True, prefix_length=jnp.array([T // 4]))
        ), ()  # fmt: skip
    if name == "fox":  # the Forgetting Transformer: a [B, N, S] array in the score function
        return lambda arrays: dict(
            mask=MaskSpec.for_sequence(T, causal=True), score_mod=score_mods.forget_gate(arrays[0])
        ), (jax.ShapeDtypeStruct((1, N, T), jnp.float32),)  # fmt: skip
    raise AssertionError(name)


CASES = ("causal", "gemma2", "alibi", "packed", "prefix_lm", "fox")
KERNELS = {"cuda": ("pallas_gpu",), "tpu": ("pallas_tpu", "splash")}


def _lowered_text(platform, implementation, case, T, H):
    build, arrays = _case(case, T)
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.bfloat16)
    kwargs = dict(implementation=implementation, backend=BACKENDS[platform], interpret=False)

    def loss(q, k, v, arrays):
        out = flex.flex_attention(q, k, v, **build(arrays), **kwargs)
        return out.astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    with paths.recording() as plan:  # the path the call reached, and why
        lowered = jax.jit(grad).trace(q, kv, kv, arrays).lower(lowering_platforms=(platform,))
    (step,) = plan.steps
    return step, lowered.as_text()


# The shapes .ci/run lowers every kernel and case at: the smallest sequence with the smaller
# head, and both block sizes (128 up to 8k tokens, 256 beyond) with the larger one. The other
# shapes are `long` (bash .ci/long).
CI_SHAPES = ((256, 64), (8192, 128), (32768, 128))


def _params():
    for platform, impls in KERNELS.items():
        for impl in impls:
            for case in CASES:
                for T in (256, 8192, 32768):
                    for H in (64, 128):
                        marks = () if (T, H) in CI_SHAPES else pytest.mark.long(
                            reason="a fourth to sixth shape of a kernel .ci/run lowers at three")
                        yield pytest.param(platform, impl, case, T, H, marks=marks,
                                           id=f"{platform}-{impl}-{case}-T{T}-H{H}")  # fmt: skip


def _splash_takes(case):
    """Splash covers static masks without a score function or a prefix."""
    return case in ("causal", "gemma2", "packed")


@pytest.mark.parametrize("platform, implementation, case, T, H", list(_params()))
def test_each_kernel_lowers_for_the_chip_forward_and_backward(platform, implementation, case,
                                                               T, H):  # fmt: skip
    """The kernel asked for takes the call (its plan names it, no fallback) and the lowered
    program of the loss's gradient holds the chip's kernel calls, forward and backward."""
    if implementation == "splash" and not _splash_takes(case):
        pytest.skip(f"splash takes no {case} (the pallas_tpu rows lower it)")
    plan, text = _lowered_text(platform, implementation, case, T, H)
    assert plan.path == implementation and plan.kernel, str(plan)
    calls = sum(text.count(c) for c in CUSTOM_CALLS[platform])
    assert calls >= 2, f"{calls} kernel calls for the forward and backward passes: {plan}"


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", ["causal", "gemma2", "alibi"])
def test_auto_picks_a_kernel_that_lowers(platform, case):
    """``implementation="auto"`` for the chip reaches a fused kernel, and it lowers."""
    plan, text = _lowered_text(platform, "auto", case, 8192, 128)
    assert plan.kernel, str(plan)
    assert any(c in text for c in CUSTOM_CALLS[platform]), str(plan)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", ["causal", "gemma2", "alibi"])
def test_one_query_decoding_against_a_32k_cache_lowers(platform, case):
    """A decoding step (one query per row) against a 32k cache half written."""
    S, H = 32768, 128
    q = jax.ShapeDtypeStruct((2, 1, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, S, K, H), jnp.bfloat16)
    arrays = (jax.ShapeDtypeStruct((N,), jnp.float32),)
    impl = {"cuda": "auto", "tpu": "pallas_tpu"}[platform]

    def step(q, k, v, start, arrays):
        window = min(WINDOW, S) if case == "gemma2" else None
        extra = {}
        if case == "gemma2":
            extra = dict(softcap=CAP, sinks=arrays[0])
        elif case == "alibi":
            extra = dict(score_mod=score_mods.alibi(arrays[0]))
        mask = MaskSpec.for_cache(1, S, start, window=window)
        backend = BACKENDS[platform]
        return flex.flex_attention(q, k, v, mask=mask, implementation=impl, backend=backend,
                                   interpret=False, **extra)  # fmt: skip

    start = jax.ShapeDtypeStruct((2,), jnp.int32)
    lowered = jax.jit(step).trace(q, kv, kv, start, arrays).lower(lowering_platforms=(platform,))
    assert any(c in lowered.as_text() for c in CUSTOM_CALLS[platform])


EXPERIMENTS = sorted(p.name for p in (REPO / "experiments").glob("*.py"))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_attnlab_lower_takes_every_experiment(experiment, platform, capsys):
    """``attnlab lower`` on each experiment's config: both steps lower for the chip (in this
    process: nothing is compiled or run, so the worker's JAX serves every experiment)."""
    from attnlab.cli import main

    status = main(["lower", "--config", str(REPO / "experiments" / experiment),
                   "--platform", platform])  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 0, out + err
    assert "train_step: lowered for" in out, out


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_attnlab_lower_on_a_mesh_shards_the_kernels(platform):
    """On a data x fsdp x tensor mesh of fake devices the kernels run inside ``shard_map``
    (a Mosaic TPU kernel cannot be partitioned by the compiler), and both steps lower."""
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "lower", "--config", "experiments/char_lm.py",
         "--platform", platform, "--mesh", "data=2,fsdp=2,tensor=2",
         "--config.model.attention_impl=" + {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}[platform],
         "--config.model.attention_block_q=128", "--config.model.attention_block_k=128"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kernel = {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}[platform]
    assert f"train_step: layers.0-3.attn: {kernel}" in proc.stdout, proc.stdout
    assert "train_step: lowered for" in proc.stdout, proc.stdout
