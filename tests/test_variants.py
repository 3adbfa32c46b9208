"""Attention variants: the contract is checked at registration, the function is resolved
when a model is built, and every path of a model (forward, cached decoding) runs it."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from attnlab import ModelConfig, build_model, ops

CFG = dict(
    vocab_size=30, d_model=32, n_layers=2, n_heads=4, max_len=32, position="rope", init_std=0.3
)


def capped(cap):
    def attend(q, k, v, **kw):
        return ops.dot_product_attention(q, k, v, logits_fn=lambda s: cap * jnp.tanh(s / cap), **kw)

    return attend


def test_registration_checks_the_contract():
    with pytest.raises(TypeError, match=r"dropout_rate.*dropout_key"):
        attnlab.register_attention(
            "no_dropout_args",
            lambda q, k, v, *, mask, bias, scale, return_weights, implementation: q,
        )
    with pytest.raises(TypeError, match="q, k, v"):
        attnlab.register_attention("two_args", lambda q, k, **kw: q)
    with pytest.raises(TypeError, match="callable"):
        attnlab.register_attention("not_callable", 3)
    assert "no_dropout_args" not in attnlab.attention_variants()
    attnlab.register_attention("full_signature", ops.dot_product_attention)  # the reference


@pytest.mark.slow(reason="compiles cached decoding twice, before and after re-registering")
def test_reregistering_changes_what_cached_decoding_runs():
    """A variant re-registered under the same name: models built afterwards run the new
    function in the forward pass and in cached decoding alike, and so agree."""
    prompt = np.array([[3, 7, 1, 4, 9, 2]])
    attnlab.register_attention("cap_under_test", capped(30.0), overwrite=True)
    cfg = ModelConfig(**CFG, attention_fn="cap_under_test")
    first = build_model(cfg, seed=0)
    before = attnlab.generate(first, prompt, 6, return_logits=True)

    attnlab.register_attention("cap_under_test", capped(0.05), overwrite=True)
    second = build_model(cfg, seed=0)  # the same weights, the new function
    after = attnlab.generate(second, prompt, 6, return_logits=True)
    full = second(np.asarray(after.sequences[0])[None, :-1]).logits[0, prompt.shape[1] - 1 :]
    np.testing.assert_allclose(after.logits[0], full, atol=1e-5, rtol=1e-5)
    assert np.abs(after.logits - before.logits).max() > 1e-3  # the new function ran

    # The model built before keeps the function it was built with, on every path.
    again = attnlab.generate(first, prompt, 6, return_logits=True)
    np.testing.assert_allclose(again.logits, before.logits, atol=1e-6)
    full_first = first(np.asarray(again.sequences[0])[None, :-1]).logits[0, prompt.shape[1] - 1 :]
    np.testing.assert_allclose(again.logits[0], full_first, atol=1e-5, rtol=1e-5)


def test_attention_dropout_reaches_the_variant():
    seen = {}

    def spy(q, k, v, **kw):
        seen.update(rate=kw["dropout_rate"], keyed=kw["dropout_key"] is not None)
        return ops.dot_product_attention(q, k, v, **kw)

    attnlab.register_attention("dropout_spy", spy, overwrite=True)
    model = build_model(ModelConfig(**CFG, attention_fn="dropout_spy", attention_dropout=0.25))
    ids = jnp.array([[1, 2, 3, 4]])
    train_out = model(ids, key=jax.random.key(0)).logits
    assert seen == {"rate": 0.25, "keyed": True}
    eval_out = model(ids).logits
    assert seen == {"rate": 0.25, "keyed": False}
    assert np.abs(np.asarray(train_out - eval_out)).max() > 1e-4  # dropout really applied


def test_import_attnlab_is_light():
    code = (
        "import sys, attnlab; "
        "print(sorted(m for m in sys.modules if m.startswith('attnlab.pretrained') "
        "or m == 'safetensors'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import attnlab; print(attnlab.load_pretrained.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "attnlab.pretrained.loader"


def test_count_params_and_cache_bytes_take_a_model_config():
    with pytest.raises(TypeError, match="model_config_from_hf"):
        attnlab.count_params({"model_type": "gpt2"})
    with pytest.raises(TypeError, match="model_config_from_hf"):
        attnlab.kv_cache_bytes("config.json", 1, 8)
