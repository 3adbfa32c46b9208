"""Capturing named intermediates (``attnlab.inspect``, ``attnlab.nn.probe``).

Each layer's captured values are checked against the layer's formulas in float64 NumPy
(``tests/reference.py``) applied to the parameters and to that layer's captured input, so a
wrong name, a layer off by one or a value taken at the wrong point fails: a decoder (GQA),
an encoder-decoder (cross-attention over the encoder output computed by hand) and a hybrid
(attention + gated DeltaNet, whose state is checked against the cache a prefill writes; the
recurrence itself is checked against its reference in test_mixer_recurrent.py). Then:
scanned == unrolled, no parameters added, nothing selected == the plain program, the cost
of attention weights at long T and the refusal above ``max_bytes``, unknown names.
"""

import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from flax import nnx

from attnlab import ModelConfig, build_model, init_cache
from attnlab import inspect as ins
from attnlab.errors import InspectError

TOL = dict(rtol=2e-5, atol=2e-5)  # float32 model against float64 formulas
BASE = dict(vocab_size=13, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
            n_layers=2, max_len=16, init_std=0.3)  # fmt: skip


def tokens(B=2, T=7, vocab=13, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (B, T)), jnp.int32)


def f64(x):
    return np.asarray(x, np.float64)


def at(tree, i):
    """Layer ``i``'s parameters (NumPy) from a stacked state."""
    return jax.tree.map(lambda a: np.asarray(a[i], np.float64), tree)


def norm(p, x, cfg):
    return reference.layer_norm(x, p["scale_D"], p.get("bias_D"), eps=cfg.norm_eps)


def attention_by_hand(p, x_q, x_kv, cfg, *, causal):
    """Captured-name -> float64 value of one attention sub-layer from its parameters."""
    q = np.einsum("BTD,DNH->BTNH", x_q, p["q_DNH"])
    k = np.einsum("BSD,DKH->BSKH", x_kv, p["k_DKH"])
    v = np.einsum("BSD,DKH->BSKH", x_kv, p["v_DKH"])
    T, S = x_q.shape[1], x_kv.shape[1]
    mask = np.tril(np.ones((T, S), bool)) if causal else None
    z, w = reference.attention(q, k, v, mask=mask)
    G = q.shape[2] // k.shape[2]
    scores = np.einsum("BTNH,BSNH->BNTS", q, np.repeat(k, G, axis=2)) * q.shape[-1] ** -0.5
    if causal:
        scores = np.where(mask, scores, -np.inf)
    out = np.einsum("BTNH,NHD->BTD", z, p["o_NHD"])
    return {"q": q, "k": k, "v": v, "z": z, "weights": w, "scores": scores, "out": out}


def ffn_by_hand(p, x, cfg):
    hidden = reference.ACTIVATIONS[cfg.ffn](x @ p["w_in_DF"])
    return {"hidden": hidden, "out": hidden @ p["w_out_FD"]}


def check_layer(acts, prefix, i, p, cfg, *, causal, enc=None):
    """Every captured value of layer ``i`` against the formulas applied to its input."""
    name = lambda n: f"{prefix}layers.{i}.{n}"
    x = f64(acts[name("resid_pre")])
    want = {f"attn.{k}": v for k, v in attention_by_hand(
        p["attn"], norm(p["attn_norm"], x, cfg), norm(p["attn_norm"], x, cfg), cfg, causal=causal
    ).items()}  # fmt: skip
    mid = x + want["attn.out"]
    want["resid_mid"] = mid
    if enc is not None:
        cross = attention_by_hand(p["cross_attn"], norm(p["cross_norm"], mid, cfg), enc, cfg,
                                  causal=False)  # fmt: skip
        want.update({f"cross_attn.{k}": v for k, v in cross.items()})
        mid = mid + cross["out"]
        want["resid_cross"] = mid
    ffn = ffn_by_hand(p["ffn"], norm(p["ffn_norm"], mid, cfg), cfg)
    want.update({f"ffn.{k}": v for k, v in ffn.items()})
    want["resid_post"] = mid + ffn["out"]
    for n, v in want.items():
        got = f64(acts[name(n)])
        finite = np.isfinite(v)
        assert (np.isfinite(got) == finite).all(), name(n)
        np.testing.assert_allclose(got[finite], v[finite], **TOL, err_msg=name(n))
    return want["resid_post"]


def embed_by_hand(state, stack, ids, cfg):
    table = f64(state["embed"]["tokens"]["embedding_VD"])
    return table[np.asarray(ids)] + f64(state[stack]["positions"]["table_PD"])[: ids.shape[1]]


def layers_by_hand(acts, prefix, state, stack, ids, n_layers, cfg, **kw):
    """``stack``'s ``n_layers`` layers applied by hand to its embedded ``ids``, each one's
    captures (``{prefix}layers.{i}.*``) checked on the way; the last layer's output."""
    x = embed_by_hand(state, stack, ids, cfg)
    for i in range(n_layers):
        np.testing.assert_allclose(f64(acts[f"{prefix}layers.{i}.resid_pre"]), x, **TOL)
        x = check_layer(acts, prefix, i, at(state[stack]["layers"], i), cfg, **kw)
    return x


def test_decoder_captures_match_float64_formulas_and_add_nothing():
    cfg = ModelConfig(**BASE)
    model = build_model(cfg, seed=1)
    before = nnx.to_pure_dict(nnx.state(model))
    ids = tokens()
    out, acts = ins.run(model, ids, capture=["layers.*"])
    state = nnx.to_pure_dict(nnx.state(model))
    x = layers_by_hand(acts, "", state, "decoder", ids, cfg.n_layers, cfg, causal=True)
    final = norm(state["decoder"]["final_norm"], x, cfg)
    logits = final @ f64(state["embed"]["tokens"]["embedding_VD"]).T
    np.testing.assert_allclose(f64(out.logits), logits, **TOL)
    # Capture adds no parameters (nor any other state) and changes none.
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(nnx.state(build_model(cfg)))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)), before)


@pytest.mark.slow(reason="compiles the lens's program (~1 s)")
def test_the_logit_lens_reads_each_layer_through_the_final_norm_and_the_unembedding():
    cfg = ModelConfig(**BASE)
    model = build_model(cfg, seed=1)
    ids = tokens()
    lens, logits = ins.logit_lens(model, ids)
    _, acts = ins.run(model, ids, capture=["layers.*"])
    state = nnx.to_pure_dict(nnx.state(model))
    assert lens.shape == (cfg.n_layers, *logits.shape)
    unembed = f64(state["embed"]["tokens"]["embedding_VD"]).T
    for i in range(cfg.n_layers):
        x = norm(state["decoder"]["final_norm"], f64(acts[f"layers.{i}.resid_post"]), cfg)
        np.testing.assert_allclose(f64(lens[i]), x @ unembed, **TOL)
    np.testing.assert_allclose(f64(lens[-1]), f64(logits), **TOL)  # the last is the model's


@pytest.mark.slow(reason="compiles an encoder-decoder with every intermediate captured (~4 s)")
def test_encoder_decoder_captures_match_float64_formulas():
    cfg = ModelConfig(**BASE, arch="encoder_decoder", n_decoder_layers=2)
    model = build_model(cfg, seed=2)
    src, tgt = tokens(T=6, seed=3), tokens(T=5, seed=4)
    _, acts = ins.run(model, src, tgt, capture=["encoder.layers.*", "decoder.layers.*"])
    state = nnx.to_pure_dict(nnx.state(model))
    x = layers_by_hand(acts, "encoder.", state, "encoder", src, cfg.n_layers, cfg, causal=False)
    enc = norm(state["encoder"]["final_norm"], x, cfg)
    n = cfg.n_decoder_layers
    layers_by_hand(acts, "decoder.", state, "decoder", tgt, n, cfg, causal=True, enc=enc)


@pytest.mark.slow(reason="compiles a hybrid twice (capture, prefill) with gated DeltaNet (~6 s)")
def test_hybrid_captures_attention_by_hand_and_the_recurrent_state_of_the_cache():
    cfg = ModelConfig(**{**BASE, "n_kv_heads": None}, block_pattern={"block": [
        {"mixer": "gated_deltanet", "mixer_settings": {"num_k_heads": 2, "head_v_dim": 4,
                                                       "chunk_size": 4}},
        "mha"]}, position="none")  # fmt: skip
    model = build_model(cfg, seed=3)
    ids = tokens(T=8)
    _, acts = ins.run(model, ids, capture=["layers.*"])
    state = nnx.to_pure_dict(nnx.state(model))
    period = state["decoder"]["layers"]["blocks"]  # the block's two layers, stacked on R = 1
    x = f64(state["embed"]["tokens"]["embedding_VD"])[np.asarray(ids)]
    np.testing.assert_allclose(f64(acts["layers.0.resid_pre"]), x, **TOL)
    gdn = at(period[0], 0)
    mid = x + f64(acts["layers.0.attn.out"])
    np.testing.assert_allclose(f64(acts["layers.0.resid_mid"]), mid, **TOL)
    ffn = ffn_by_hand(gdn["ffn"], norm(gdn["ffn_norm"], mid, cfg), cfg)
    np.testing.assert_allclose(f64(acts["layers.0.resid_post"]), mid + ffn["out"], **TOL)
    np.testing.assert_allclose(f64(acts["layers.1.resid_pre"]), mid + ffn["out"], **TOL)
    check_layer(acts, "", 1, at(period[1], 0), cfg, causal=True)
    # The recurrent state: what a prefill of the same tokens leaves in the cache.
    cache = model(ids, cache=init_cache(cfg, 2, 16)).cache
    (entry,) = [v for k, v in cache.layers.items() if k.endswith("state")]
    np.testing.assert_allclose(f64(acts["layers.0.attn.state"]), f64(entry[0]), **TOL)
    assert "layers.1.attn.state" not in ins.names(model, ids)  # attention keeps no state


@pytest.mark.slow(reason="compiles the stack scanned and unrolled, with remat (~4 s)")
def test_capture_under_the_scanned_stack_equals_unrolled():
    ids = tokens()
    got = {}
    for scan in (True, False):
        cfg = ModelConfig(**{**BASE, "n_layers": 3}, scan_layers=scan, remat="full")
        model = build_model(cfg, seed=5)
        out, acts = ins.run(model, ids, capture=["layers.1.*", "layers.2.attn.weights"])
        got[scan] = (out.logits, dict(acts))
    assert list(got[True][1]) == list(got[False][1])
    assert "layers.0.attn.q" not in got[True][1] and "layers.1.attn.q" in got[True][1]
    for name, value in got[True][1].items():
        np.testing.assert_allclose(value, got[False][1][name], rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got[True][0], got[False][0], rtol=1e-6, atol=1e-6)


def test_nothing_selected_traces_the_plain_program():
    cfg = ModelConfig(**BASE)
    model = build_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    ids = tokens()

    def plain(state, ids):
        return nnx.merge(graphdef, state)(ids).logits

    def probed(state, ids):
        with ins.Probe(()) as probe:
            logits = nnx.merge(graphdef, state)(ids).logits
        return logits, probe.captured

    want = str(jax.make_jaxpr(plain)(state, ids))
    got = jax.make_jaxpr(probed)(state, ids)
    assert str(got) == want  # the same equations, and no output beyond the logits
    assert len(got.out_avals) == 1


def scan_outputs(model, ids, capture):
    """The shapes of what the scans of a probed forward pass return (traced, not run)."""
    graphdef, state = nnx.split(model)

    def forward(state, ids):
        with ins.Probe(capture) as probe:
            nnx.merge(graphdef, state)(ids)
        return probe.captured

    def scans(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                yield from (tuple(v.aval.shape) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from scans(sub)

    return list(scans(jax.make_jaxpr(forward)(state, ids).jaxpr))


def test_weights_at_long_context_report_their_bytes_and_are_refused_above_the_limit():
    cfg = ModelConfig(**{**BASE, "max_len": 4096}, attention_impl="chunked")
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))  # shapes only
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    cost = ins.cost(model, ids, capture="layers.1.attn.weights")
    per_layer = 1 * 4 * 4096 * 4096 * 4  # [B, N, T, S] float32
    assert cost.per_name == {"layers.1.attn.weights": per_layer}
    assert cost.total == per_layer
    # Inside the compiled program too, the scan over the layers carries layer 1's alone.
    shapes = scan_outputs(model, ids, "layers.1.attn.weights")
    assert (1, 1, 4, 4096, 4096) in shapes and (2, 1, 4, 4096, 4096) not in shapes
    # run refuses while tracing, before anything is compiled or allocated.
    small = build_model(ModelConfig(**BASE), seed=1)
    with pytest.raises(InspectError, match=r"needs 3\.1 KiB \(> max_bytes=1\.0 KiB\)") as e:
        ins.run(small, tokens(), capture="layers.*.attn.weights", max_bytes=1024)
    assert "\n" not in str(e.value)


def test_an_unknown_name_lists_the_close_ones_on_one_line():
    model = build_model(ModelConfig(**BASE), seed=0)
    ids = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    with pytest.raises(InspectError) as e:
        ins.cost(model, ids, capture="layers.1.attn.weight")
    msg = str(e.value)
    assert "\n" not in msg and "'layers.1.attn.weight'" in msg
    assert "close matches: layers.1.attn.weights" in msg
    with pytest.raises(InspectError, match=r"close matches: .*resid_post"):
        ins.cost(model, ids, capture="blocks.9.resid_posts")


GPT2 = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "hf" / "gpt2"


@pytest.mark.slow(reason="loads transformers and torch and compiles GPT-2's capture (~6 s)")
def test_a_loaded_checkpoint_captures_what_transformers_reports_per_layer():
    if not (GPT2 / "model.safetensors").is_file():
        pytest.skip(f"{GPT2} is absent (the shared Hugging Face fixtures)")
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    torch = pytest.importorskip("torch", reason="transformers runs on torch")
    from attnlab import load_pretrained

    handle = load_pretrained(GPT2)
    ids = np.load(GPT2 / "reference.npz")["input_ids"][:1]
    _, acts = ins.run(handle, jnp.asarray(ids), capture=["layers.*.resid_pre", "*.attn.weights"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(GPT2, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True,
                 output_attentions=True)  # fmt: skip
    n = handle.config.n_layers
    assert len(ref.attentions) == n
    for i in range(n):
        np.testing.assert_allclose(acts[f"layers.{i}.resid_pre"], ref.hidden_states[i].numpy(),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        np.testing.assert_allclose(acts[f"layers.{i}.attn.weights"], ref.attentions[i].numpy(),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.slow(reason="compiles a mixture-of-experts model with its router captured (~3 s)")
def test_the_router_choices_are_the_top_k_of_the_captured_router_logits():
    cfg = ModelConfig(**BASE, ffn_variant="moe", ffn_settings={"n_experts": 4, "top_k": 2,
                                                               "renormalize": True})  # fmt: skip
    model = build_model(cfg, seed=4)
    ids = tokens()
    _, acts = ins.run(model, ids, capture=["layers.1.ffn.router.*", "layers.1.resid_mid"])
    state = nnx.to_pure_dict(nnx.state(model))
    p = at(state["decoder"]["layers"], 1)
    x = norm(p["ffn_norm"], f64(acts["layers.1.resid_mid"]), cfg)
    logits = x @ p["ffn"]["router_DE"]
    np.testing.assert_allclose(f64(acts["layers.1.ffn.router.logits"]), logits, **TOL)
    choices = np.sort(np.asarray(acts["layers.1.ffn.router.choices"]), axis=-1)
    np.testing.assert_array_equal(choices, np.sort(np.argsort(-logits, axis=-1)[..., :2], -1))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    top = np.take_along_axis(probs, np.argsort(-logits, axis=-1)[..., :2], -1)
    gates = np.sort(f64(acts["layers.1.ffn.router.gates"]), -1)
    np.testing.assert_allclose(gates, np.sort(top / top.sum(-1, keepdims=True), -1), **TOL)


@pytest.mark.slow(reason="compiles its own program; the decoder test checks causal scores fast")
def test_scores_are_the_scaled_biased_capped_logits_masked_at_minus_infinity():
    from attnlab.ops.scores import attention_scores

    rng = np.random.default_rng(7)
    q, k = rng.normal(size=(2, 5, 4, 3)), rng.normal(size=(2, 6, 2, 3))  # GQA: G = 2
    bias = rng.normal(size=(1, 4, 5, 6))
    mask = rng.random((2, 1, 5, 6)) < 0.7
    both = jax.jit(lambda q, k: (  # one program: eager ops would each compile
        attention_scores(q, k, mask=mask, bias=bias, scale=0.5, softcap=2.0),
        jax.nn.softmax(attention_scores(q, k, mask=mask, bias=bias), axis=-1),
    ))  # fmt: skip
    got, softmax = both(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32))
    want = np.einsum("BTNH,BSNH->BNTS", q, np.repeat(k, 2, axis=2)) * 0.5 + bias
    want = np.where(np.broadcast_to(mask, want.shape), 2.0 * np.tanh(want / 2.0), -np.inf)
    np.testing.assert_allclose(f64(got), want, rtol=1e-5, atol=1e-6)
    # Uncapped, their softmax is the reference attention's weights.
    _, weights = reference.attention(q, k, np.zeros((2, 6, 2, 3)), mask=mask, bias=bias)
    np.testing.assert_allclose(f64(softmax), weights, atol=1e-6)
