"""ModelConfig validation and parameter counting from shapes alone."""

import pytest

from attnlab import ModelConfig, count_params

QWEN3_4B = dict(
    arch="decoder",
    vocab_size=151936,
    d_model=2560,
    n_layers=36,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=9728,
    ffn="swiglu",
    norm="rmsnorm",
    qk_norm=True,
    tie_embeddings=True,
    position="rope",
    max_len=4096,
    norm_bias=False,
)


def test_qwen3_4b_count_without_allocating():
    assert count_params(ModelConfig(**QWEN3_4B)) == 4_022_468_096


def closed_form_decoder(V, D, L, N, K, H, F, *, max_len, learned, gated, biases, ln, tied):
    norm = 2 * D if ln else D
    attn = D * N * H + 2 * D * K * H + N * H * D + (biases and (N * H + 2 * K * H + D))
    ffn = (3 if gated else 2) * D * F + (biases and (F + D))
    total = V * D + L * (attn + ffn + 2 * norm) + norm
    total += max_len * D if learned else 0
    total += 0 if tied else D * V
    return total


@pytest.mark.parametrize(
    "kw,gated,biases,ln",
    [
        (dict(ffn="gelu", norm="layernorm", position="learned"), False, False, True),
        (dict(ffn="swiglu", norm="rmsnorm", position="rope", n_kv_heads=2), True, False, False),
        (
            dict(
                ffn="relu",
                position="alibi",
                attn_bias=True,
                out_bias=True,
                ffn_bias=True,
                tie_embeddings=False,
                n_kv_heads=1,
                head_dim=12,
            ),
            False,
            True,
            True,
        ),
    ],
)
def test_decoder_count_matches_closed_form(kw, gated, biases, ln):
    cfg = ModelConfig(vocab_size=37, d_model=24, n_layers=3, n_heads=4, d_ff=40, max_len=11, **kw)
    expected = closed_form_decoder(
        37,
        24,
        3,
        4,
        cfg.n_kv_heads,
        cfg.head_dim,
        40,
        max_len=11,
        learned=cfg.position == "learned",
        gated=gated,
        biases=biases,
        ln=ln,
        tied=cfg.tie_embeddings,
    )
    assert count_params(cfg) == expected


def post_norm_with_biases(arch, V, D, L, F, max_len, **fields):
    """Two heads, post-norm layers and a bias on every projection, as the original
    Transformer and BERT."""
    biases = dict(attn_bias=True, out_bias=True, ffn_bias=True)
    shape = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=2, d_ff=F, max_len=max_len)
    return ModelConfig(arch=arch, **shape, norm_placement="post", **biases, **fields)


def test_encoder_decoder_count_matches_closed_form():
    V, D, L, F, max_len = 31, 16, 2, 32, 9
    cfg = post_norm_with_biases(
        "encoder_decoder", V, D, L, F, max_len, position="sinusoidal", ffn="relu"
    )
    attn = 4 * D * D + 3 * D + D
    ffn = 2 * D * F + F + D
    ln = 2 * D
    enc = L * (attn + ffn + 2 * ln)
    dec = L * (2 * attn + ffn + 3 * ln)
    assert count_params(cfg) == V * D + enc + dec


def test_encoder_count_matches_closed_form():
    V, D, L, F, max_len, types = 29, 16, 2, 32, 10, 2
    cfg = post_norm_with_biases(
        "encoder", V, D, L, F, max_len, embedding_norm=True, type_vocab_size=types, logits_bias=True
    )
    block = (4 * D * D + 4 * D) + (2 * D * F + F + D) + 2 * (2 * D)
    embeddings = V * D + max_len * D + types * D + 2 * D
    head = D * D + D + 2 * D + V
    assert count_params(cfg) == embeddings + L * block + head


INVALID = [
    (dict(d_model=30, n_heads=4), "d_model"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(position="spiral"), "position"),
    (dict(norm="batchnorm"), "norm"),
    (dict(ffn="tanh"), "ffn"),
    (dict(arch="rnn"), "arch"),
    (dict(norm_placement="middle"), "norm_placement"),
    (dict(attention_impl="flash9"), "attention_impl"),
    (dict(attention_impl="chunked", attention_block_q=0), "attention_block_q"),
    (dict(attention_impl="xla", attention_block_k=64), "attention_block_k"),
    (dict(attention_impl="chunked", attention_dropout=0.1), "attention_dropout"),
    (dict(attention_fn="nope"), "attention_fn"),
    (dict(d_model=0), "d_model"),
    (dict(n_layers=-1), "n_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(d_ff=0), "d_ff"),
    (dict(head_dim=-2), "head_dim"),
    (dict(dropout=1.5), "dropout"),
    (dict(position="rope", head_dim=7), "head_dim"),
    (dict(pad_id=300, vocab_size=256), "pad_id"),
    (dict(arch="encoder", causal=False), "causal"),
    (dict(dtype="float8"), "dtype"),
]


@pytest.mark.parametrize("kw,field", INVALID)
def test_invalid_config_names_field(kw, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=") as err:
        ModelConfig(**kw)
    assert "invalid" in str(err.value)


def test_head_dim_independent_of_d_model():
    cfg = ModelConfig(d_model=30, n_heads=4, head_dim=8)  # 30 % 4 != 0 is fine with head_dim
    assert cfg.head_dim == 8


def test_from_dict_rejects_unknown_field():
    with pytest.raises(ValueError, match="n_layer"):
        ModelConfig.from_dict({"n_layer": 2})


def test_config_is_frozen_and_round_trips():
    cfg = ModelConfig(n_layers=2)
    with pytest.raises(AttributeError):
        cfg.n_layers = 3
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
