"""``attnlab lower``: an experiment's steps lowered for a chip from this CPU host, the path
each layer reaches, and one line per failure with exit 2 (the lowering tier,
tests/test_lowering.py, runs it on every experiment)."""

import pathlib

import jax
import jax.numpy as jnp

from attnlab.cli import main
from attnlab.ops import flex, paths
from attnlab.ops.masks import MaskSpec

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "experiments" / "char_lm.py:tiny")


def test_a_config_the_tpu_cannot_tile_is_one_line_per_failure_naming_layer_argument_and_fix(
    capsys,
):
    """Block size 64 for the Mosaic TPU kernel: the layer falls off the kernel the config asks
    for; each step says so in one line (layer, argument, the field to change), exit 2."""
    status = main(["lower", "--config", TINY, "--platform", "tpu",
                   "--config.model.attention_impl=pallas_tpu",
                   "--config.model.attention_block_k=64"])  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    for program, line in zip(("train_step", "decode_step"), lines, strict=True):
        assert line.startswith(f"attnlab lower: error: {program}: layers.0.attn: pallas_tpu ")
        assert "block_k=64: Mosaic TPU blocks are multiples of 128" in line
        assert "change model.attention_block_k" in line
    assert "train_step: layers.0.attn: chunked" in out


def test_a_config_that_lowers_lists_the_kernel_each_layer_reaches(capsys):
    """For cuda the tiny decoder's training reaches the Pallas GPU kernel and its decoding
    the decode kernel; both programs lower (exit 0)."""
    assert main(["lower", "--config", TINY, "--platform", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "train_step: layers.0.attn: pallas_gpu" in out
    assert "decode_step: layers.0.attn: decode" in out
    assert "train_step: lowered for cuda" in out and "decode_step: lowered for cuda" in out


def test_plan_says_what_auto_runs_for_the_target_without_running_it():
    """``flex.plan`` on abstract inputs: the chip's kernel for the target platform, the
    chunked path on a CPU, and for a call no kernel takes, the fallback line."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    causal = MaskSpec.for_sequence(256, causal=True)
    assert flex.plan(q, kv, kv, mask=causal, backend="gpu").path == "pallas_gpu"
    assert flex.plan(q, kv, kv, mask=causal, backend="tpu").path == "splash"
    assert flex.plan(q, kv, kv, mask=causal, backend="cpu").path == "chunked"
    with paths.target("tpu"):  # a model built for the TPU takes the backend from the target
        assert flex.plan(q, kv, kv, mask=causal).path == "splash"
    odd = flex.plan(q, kv, kv, mask=causal, backend="tpu", implementation="pallas_tpu",
                    block_k=64)  # fmt: skip
    assert odd.path == "chunked" and not odd.kernel
    assert odd.fallbacks == (
        "block_k=64: Mosaic TPU blocks are multiples of 128; falling back to chunked",
    )
