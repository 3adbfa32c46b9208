"""Patching named intermediates (``attnlab.inspect``): replacing one with its own value is
the identity, bitwise; zeroing a head equals zeroing that head's rows of the output
projection; adding a vector to the embeddings' residual equals adding it to the position
table; the patching sweep at layer 0 equals running the corrupted tokens with one token
swapped for the clean one; and patches of the wrong shape or of read-only names fail on one
line naming the shapes or the name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model
from attnlab import inspect as ins
from attnlab.errors import InspectError

# test_inspect.py's decoder: the capture of every layer compiles once for both files.
CFG = ModelConfig(vocab_size=13, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
                  n_layers=2, max_len=16, init_std=0.3)  # fmt: skip


def tokens(seed=0, B=2, T=7):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 13, (B, T)), jnp.int32)


def test_replacing_every_intermediate_with_its_own_value_is_bitwise_the_identity():
    model = build_model(CFG, seed=1)
    ids = tokens()
    out, acts = ins.run(model, ids, capture=["layers.*"])
    read_only = ("scores", "weights")
    patches = [ins.replace(n, v) for n, v in acts.items() if not n.endswith(read_only)]
    assert len(patches) == 2 * 10  # resid x 3, q k v z out, ffn hidden and out: per layer
    again, _ = ins.run(model, ids, patches=patches)
    np.testing.assert_array_equal(np.asarray(again.logits), np.asarray(out.logits))


@pytest.mark.slow(reason="compiles the ablated program and the edited model (~2 s)")
def test_zeroing_a_head_equals_zeroing_its_rows_of_the_output_projection():
    model = build_model(CFG, seed=1)
    ids = tokens()
    ablated, _ = ins.run(model, ids, patches=ins.zero("layers.1.attn.z", heads=2))
    plain, _ = ins.run(model, ids)
    assert not np.allclose(np.asarray(ablated.logits), np.asarray(plain.logits), atol=1e-3)
    graphdef, state = nnx.split(model)  # edited in place below: the model's own arrays
    o = state["decoder"]["layers"]["attn"]["o_NHD"]
    o[...] = o[...].at[1, 2].set(0.0)
    edited = nnx.merge(graphdef, state)
    want, _ = ins.run(edited, ids)
    np.testing.assert_allclose(np.asarray(ablated.logits), np.asarray(want.logits), rtol=1e-6,
                               atol=1e-6)  # fmt: skip


@pytest.mark.slow(reason="compiles the sweep's batched program and two references (~5 s)")
def test_sweep_at_layer_zero_is_the_corrupted_run_with_one_clean_token(tmp_path):
    model = build_model(CFG, seed=2)
    clean, corrupted = tokens(3, B=1), tokens(4, B=1)
    answer = int(clean[0, -1])
    metric = lambda logits: logits[0, -1, answer] - jnp.mean(logits[0, -1])
    table = ins.patching_sweep(model, clean, corrupted, metric, name="resid_pre")
    assert table.values.shape == (CFG.n_layers, clean.shape[1]) and table.layers == (0, 1)
    for t in range(clean.shape[1]):  # layer 0's resid_pre is the embedding of token t
        swapped = corrupted.at[0, t].set(clean[0, t])
        np.testing.assert_allclose(table.values[0, t], metric(model(swapped).logits), atol=1e-5)
    np.testing.assert_allclose(table.clean, metric(model(clean).logits), atol=1e-5)
    np.testing.assert_allclose(table.corrupted, metric(model(corrupted).logits), atol=1e-5)
    fig = table.plot(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and fig.axes
    assert len(table.rows()) == table.values.size
    heads = ins.patching_sweep(model, clean, corrupted, metric, name="attn.z", by="head")
    assert heads.values.shape == (CFG.n_layers, CFG.n_heads)


@pytest.mark.slow(reason="compiles two patched programs (~3 s)")
def test_a_steering_vector_on_the_embeddings_equals_shifting_the_position_table():
    model = build_model(CFG, seed=3)
    ids = tokens()
    v = jnp.linspace(-1.0, 1.0, CFG.d_model)
    steered, _ = ins.run(model, ids, patches=ins.add("layers.0.resid_pre", v))
    graphdef, state = nnx.split(model)
    table = state["decoder"]["positions"]["table_PD"]
    table[...] = table[...] + v[None, :]
    want = nnx.merge(graphdef, state)(ids).logits
    np.testing.assert_allclose(np.asarray(steered.logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Mean ablation with the batch mean: both rows then see the same layer-1 input.
    _, acts = ins.run(model, ids, capture="layers.1.resid_pre",
                      patches=ins.mean_ablate("layers.1.resid_pre"))  # fmt: skip
    x = np.asarray(acts["layers.1.resid_pre"])
    np.testing.assert_allclose(x[0], x[1], rtol=1e-6)


def test_a_patch_of_the_wrong_shape_or_a_read_only_name_fails_on_one_line():
    model = build_model(CFG, seed=0)
    ids = jax.ShapeDtypeStruct((2, 7), jnp.int32)
    run = lambda patch: ins.cost(model, ids, patches=patch)  # traced only: nothing runs
    with pytest.raises(InspectError) as e:
        run(ins.replace("layers.1.resid_post", jnp.zeros((2, 6, 16))))
    msg = str(e.value)
    assert "\n" not in msg and "(2, 6, 16)" in msg and "(2, 7, 16)" in msg
    assert "layers.1.resid_post" in msg
    with pytest.raises(InspectError, match="layers.0.attn.weights is read-only"):
        run(ins.zero("layers.0.attn.weights"))
    with pytest.raises(InspectError, match="has no heads axis"):
        run(ins.zero("layers.0.resid_pre", heads=1))
    with pytest.raises(InspectError, match="close matches: layers.1.attn.z"):
        run(ins.zero("layers.1.attn.zz"))
