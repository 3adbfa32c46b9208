"""ModelConfig's fields by group: the groups partition the fields, a config built or read by
group is the flat one, and the flat names, ``replace`` and the serialised form are unchanged."""

import dataclasses
import json
import pathlib
import re

import pytest

from attnlab import ModelConfig
from attnlab.config import (
    GROUPS,
    AttentionConfig,
    FFNConfig,
    NormConfig,
    PositionConfig,
)
from attnlab.errors import ConfigError
from attnlab.experiment import base_config, model_config

REPO = pathlib.Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(ModelConfig) if f.init]

# A config off the defaults in every group, with fields left to be derived.
FLAT = dict(
    arch="decoder",
    d_model=64,
    n_layers=3,
    vocab_size=97,
    tie_embeddings=False,
    position="rope",
    rope_theta=500000.0,
    rope_scaling={"kind": "linear", "factor": 2.0},
    max_len=512,
    n_heads=8,
    n_kv_heads=2,
    qk_norm=True,
    sliding_window=32,
    sliding_window_layers=(0, 2),
    ffn="swiglu",
    d_ff=96,
    norm="rmsnorm",
    norm_bias=False,
    dropout=0.1,
    init_std=0.01,
    attention_impl="chunked",
    attention_block_q=16,
    remat="dots",
)


def by_group(flat: dict) -> dict:
    """``flat`` with every field of a group given as that group (a config of it)."""
    out = {}
    for name, cls in GROUPS.items():
        own = {f.name: flat[f.name] for f in dataclasses.fields(cls) if f.name in flat}
        if own:
            out[name] = cls(**own)
    return out


def test_the_groups_partition_the_fields():
    grouped = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(grouped) == len(set(grouped)), "a field declared in two groups"
    assert grouped == FIELDS  # every field in one group, in the groups' order


def test_a_group_has_the_flat_fields_types_and_defaults():
    flat = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for cls in GROUPS.values():
        assert dataclasses.fields(cls) and cls.__dataclass_params__.frozen
        for f in dataclasses.fields(cls):
            assert (f.type, f.default) == (flat[f.name].type, flat[f.name].default), f.name


def test_built_by_group_equals_built_flat():
    flat, grouped = ModelConfig(**FLAT), ModelConfig(**by_group(FLAT))
    assert grouped == flat and hash(grouped) == hash(flat)
    assert grouped.to_dict() == flat.to_dict()  # derived fields stay derived
    mixed = ModelConfig(attention=AttentionConfig(n_heads=8, n_kv_heads=2), d_model=64)
    assert mixed == ModelConfig(n_heads=8, n_kv_heads=2, d_model=64)
    assert ModelConfig(norms={"norm": "rmsnorm"}) == ModelConfig(norm="rmsnorm")


def test_group_views_read_the_flat_values():
    cfg = ModelConfig(**FLAT)
    for name, cls in GROUPS.items():
        group = getattr(cfg, name)
        assert type(group) is cls
        for f in dataclasses.fields(cls):
            assert getattr(group, f.name) == getattr(cfg, f.name), f"{name}.{f.name}"
    assert cfg.attention.head_dim == cfg.head_dim == 8  # a derived value, as read flat
    assert ModelConfig(**{name: getattr(cfg, name) for name in GROUPS}) == cfg
    assert hash(cfg.attention) == hash(ModelConfig(**FLAT).attention)


def test_a_field_given_flat_and_by_its_group_is_one_line():
    with pytest.raises(ConfigError) as e:
        ModelConfig(attention=AttentionConfig(n_heads=8), n_heads=8, d_model=64)
    message = str(e.value)
    assert "\n" not in message and "n_heads" in message and "attention" in message
    with pytest.raises(ConfigError, match="head_dim, n_heads given twice"):
        ModelConfig(attention=AttentionConfig(), n_heads=8, head_dim=16)
    with pytest.raises(ConfigError, match="d_ff in feedforward"):
        ModelConfig(attention={"d_ff": 64})
    with pytest.raises(ConfigError, match="takes a NormConfig"):
        ModelConfig(norms=FFNConfig())


def test_replace_by_field_and_by_group():
    cfg = ModelConfig(**FLAT)
    assert dataclasses.replace(cfg, qk_norm=False) == ModelConfig(**{**FLAT, "qk_norm": False})
    assert dataclasses.replace(cfg, n_heads=4).head_dim == 8  # given values stay as given
    wider = cfg.replace(d_model=128)
    assert wider.head_dim == 16 and wider.n_heads == 8  # derived again
    fewer = cfg.replace(attention=dataclasses.replace(cfg.attention, n_heads=4))
    assert fewer == cfg.replace(n_heads=4) and fewer.to_dict() == cfg.replace(n_heads=4).to_dict()
    plain = cfg.replace(positions=PositionConfig())  # a whole group back to its defaults
    positions = {f.name for f in dataclasses.fields(PositionConfig)}
    assert plain == ModelConfig(**{k: v for k, v in FLAT.items() if k not in positions})
    with pytest.raises(ConfigError, match="given twice"):
        cfg.replace(norms=NormConfig(), norm="layernorm")


def test_to_dict_from_dict_and_json_round_trip():
    cfg = ModelConfig(**by_group(FLAT))
    values = json.loads(json.dumps(cfg.to_dict()))
    assert sorted(values) == sorted(FIELDS)  # the stored form stays flat
    assert ModelConfig.from_dict(values) == cfg
    nested = {name: dataclasses.asdict(group) for name, group in by_group(FLAT).items()}
    assert ModelConfig.from_dict(json.loads(json.dumps(nested))) == cfg
    with pytest.raises(ValueError, match="no field"):
        ModelConfig.from_dict({"attentoin": {}})


def test_an_experiment_config_stays_flat():
    c = base_config()
    assert sorted(c.model.keys()) == sorted(FIELDS)
    c.model.n_heads, c.model.d_model = 8, 64
    assert model_config(c) == ModelConfig(attention=AttentionConfig(n_heads=8), d_model=64)


def test_the_docs_table_lists_each_group():
    text = (REPO / "docs" / "concepts" / "architectures.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| (.+) \|$", text, re.M)
    table = {name: (cls, re.findall(r"`(\w+)`", fields)) for name, cls, fields in rows}
    expected = {
        name: (cls.__name__, [f.name for f in dataclasses.fields(cls)])
        for name, cls in GROUPS.items()
    }
    assert table == expected
