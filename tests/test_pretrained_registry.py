"""The family registry: a family defined here, not built in, loads and exports through the
generic path (``attnlab.pretrained.family``).

``toy_lm`` is a decoder of its own tensor names and config.json keys (RMSNorm, RoPE, GQA,
a plain GELU FFN, which no built-in family writes). A random checkpoint in its layout loads
with logits equal to a float64 forward computed from the stored tensors; ``export_model``
writes it back under the same names, bit for bit.
"""

import json

import numpy as np
import pytest
import safetensors.numpy
from reference import apply_rope, attention, feed_forward, rms_norm

from attnlab.errors import PretrainedError
from attnlab.pretrained import (
    Family,
    export_model,
    get_family,
    load_pretrained,
    read_tensors,
    register_family,
    registered_families,
    unregister_family,
)
from attnlab.pretrained.mappings import Mapping, table

V, D, N, K, H, F, L, THETA, EPS = 40, 16, 4, 2, 4, 24, 2, 100.0, 1e-6


def toy_config(c: dict) -> dict:
    return dict(
        arch="decoder",
        vocab_size=c["vocab"],
        d_model=c["width"],
        n_layers=c["depth"],
        n_heads=c["heads"],
        n_kv_heads=c["kv_heads"],
        head_dim=c["width"] // c["heads"],
        d_ff=c["hidden"],
        max_len=c["context"],
        position="rope",
        rope_theta=c["theta"],
        norm="rmsnorm",
        norm_eps=c["eps"],
        ffn="gelu",
        tie_embeddings=False,
    )


def toy_write(cfg) -> dict:
    if cfg.ffn != "gelu":
        raise ValueError(f"ffn={cfg.ffn!r}: toy_lm's FFN is a plain GELU")
    return {
        "model_type": "toy_lm",
        "architectures": ["ToyLmForCausalLM"],
        "vocab": cfg.vocab_size,
        "width": cfg.d_model,
        "depth": cfg.n_layers,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "hidden": cfg.d_ff,
        "context": cfg.max_len,
        "theta": cfg.rope_theta,
        "eps": cfg.norm_eps,
    }


_B, _A = "blk.{i}", "decoder.layers.{i}"
TOY = Family(
    "toy_lm",
    config=toy_config,
    mapping=Mapping(
        rules=table(
            ("tok.weight", "embed.tokens.embedding_VD"),
            (f"{_B}.n1.weight", f"{_A}.attn_norm.scale_D"),
            (f"{_B}.wq.weight", f"{_A}.attn.q_DNH", "linear_to_heads"),
            (f"{_B}.wk.weight", f"{_A}.attn.k_DKH", "linear_to_heads"),
            (f"{_B}.wv.weight", f"{_A}.attn.v_DKH", "linear_to_heads"),
            (f"{_B}.wo.weight", f"{_A}.attn.o_NHD", "linear_from_heads"),
            (f"{_B}.n2.weight", f"{_A}.ffn_norm.scale_D"),
            (f"{_B}.up.weight", f"{_A}.ffn.w_in_DF", "linear"),
            (f"{_B}.down.weight", f"{_A}.ffn.w_out_FD", "linear"),
            ("final.weight", "decoder.final_norm.scale_D"),
            ("out.weight", "head.head_DV", "linear"),
        )
    ),
    write=toy_write,
    architectures=("ToyLm",),
)
CONFIG = toy_write(
    type("Cfg", (), dict(ffn="gelu", vocab_size=V, d_model=D, n_layers=L, n_heads=N,
                         n_kv_heads=K, d_ff=F, max_len=32, rope_theta=THETA, norm_eps=EPS))
)  # fmt: skip


@pytest.fixture
def toy():
    register_family(TOY)
    yield TOY
    unregister_family("toy_lm")


def random_checkpoint(folder, config=CONFIG, seed=0) -> dict:
    """A folder of random tensors in toy_lm's layout (``nn.Linear``: ``[out, in]``)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    t = {"tok.weight": r(V, D), "final.weight": 1 + r(D), "out.weight": r(V, D)}
    for i in range(L):
        t |= {
            f"blk.{i}.n1.weight": 1 + r(D), f"blk.{i}.n2.weight": 1 + r(D),
            f"blk.{i}.wq.weight": r(N * H, D), f"blk.{i}.wk.weight": r(K * H, D),
            f"blk.{i}.wv.weight": r(K * H, D), f"blk.{i}.wo.weight": r(D, N * H),
            f"blk.{i}.up.weight": r(F, D), f"blk.{i}.down.weight": r(D, F),
        }  # fmt: skip
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(t, str(folder / "model.safetensors"))
    return t


def float64_logits(t: dict, ids_BT) -> np.ndarray:
    """toy_lm's forward in float64 NumPy from its stored tensors."""
    B, T = ids_BT.shape
    pos_BT = np.broadcast_to(np.arange(T), (B, T))
    causal = np.tril(np.ones((T, T), bool))
    x = t["tok.weight"].astype(np.float64)[ids_BT]
    for i in range(L):
        w = lambda n: t[f"blk.{i}.{n}.weight"].astype(np.float64)  # noqa: B023
        h = rms_norm(x, w("n1"), eps=EPS)
        q = apply_rope((h @ w("wq").T).reshape(B, T, N, H), pos_BT, theta=THETA)
        k = apply_rope((h @ w("wk").T).reshape(B, T, K, H), pos_BT, theta=THETA)
        v = (h @ w("wv").T).reshape(B, T, K, H)
        y, _ = attention(q, k, v, mask=causal)
        x = x + y.reshape(B, T, N * H) @ w("wo").T
        x = x + feed_forward(rms_norm(x, w("n2"), eps=EPS), w("up").T, w("down").T, kind="gelu")
    return rms_norm(x, t["final.weight"], eps=EPS) @ t["out.weight"].astype(np.float64).T


def test_a_family_defined_outside_loads_and_exports_through_the_registry(toy, tmp_path):
    stored = random_checkpoint(tmp_path / "ckpt")
    handle = load_pretrained(tmp_path / "ckpt")
    assert handle.family == "toy_lm"
    # Export finds the family by its writer and writes its own names, bit for bit.
    assert export_model(handle.model, tmp_path / "out") == "toy_lm"
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == CONFIG
    back = read_tensors(tmp_path / "out")
    assert sorted(back) == sorted(stored)
    assert all(np.array_equal(back[n], stored[n]) for n in stored)


@pytest.mark.slow(reason="compiles the loaded model's forward (about 3 s)")
def test_the_family_loaded_computes_its_float64_forward(toy, tmp_path):
    stored = random_checkpoint(tmp_path / "ckpt")
    handle = load_pretrained(tmp_path / "ckpt")
    ids = np.random.default_rng(1).integers(0, V, (2, 7)).astype(np.int32)
    logits = np.asarray(handle.logits(ids, np.ones_like(ids)), np.float64)
    np.testing.assert_allclose(logits, float64_logits(stored, ids), rtol=0, atol=2e-5)


def test_a_config_without_model_type_finds_the_family_by_class_name(toy, tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "model_type"}
    random_checkpoint(tmp_path / "ckpt", config)
    assert load_pretrained(tmp_path / "ckpt").family == "toy_lm"


def test_registering_and_removing_a_family(toy):
    assert list(registered_families())[-1] == "toy_lm"  # after the built-ins: tried last
    with pytest.raises(ValueError, match="'toy_lm' is registered; pass overwrite=True"):
        register_family(Family("toy_lm", config=toy_config, mapping=TOY.mapping))
    unregister_family("toy_lm")
    with pytest.raises(PretrainedError, match="model_type='toy_lm' is not supported"):
        get_family("toy_lm")
