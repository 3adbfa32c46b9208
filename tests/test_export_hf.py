"""``attnlab export-hf`` and ``export_model``: attnlab models written as Hugging Face folders.

Each round trip builds a tiny attnlab model of one family's shape (every parameter moved off
its init, so a dropped or transposed tensor shows), writes it with ``export_model`` and
loads the folder in transformers: its logits must equal attnlab's to 1e-4 at the real
positions of a left-padded batch. The command itself is checked on tiny trained runs
(Llama-, Gemma 2- and Qwen3-Next-shaped). ``export_round_trips`` is the check the
checkpoint families' tests run on their loaded tiny checkpoints (Qwen3-Next, Mamba-2,
Bamba): transformers reads the export with the original's logits, attnlab with the same
parameters bit for bit.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from hf_reference import hf_logits, torch, transformers
from test_pretrained import max_diff  # noqa: E402
from test_pretrained_open import left_padded  # noqa: E402
from tiers import cases  # noqa: E402

from attnlab.cli import main  # noqa: E402
from attnlab.config import ModelConfig  # noqa: E402
from attnlab.nn.models import build_model  # noqa: E402
from attnlab.pretrained import load_pretrained  # noqa: E402
from attnlab.pretrained.export import ExportError, export_model, hf_config_of  # noqa: E402

TOL = 1e-4
_LLAMA = dict(
    arch="decoder",
    vocab_size=96,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=128,
    max_len=64,
    position="rope",
    norm="rmsnorm",
    norm_eps=1e-6,
    ffn="swiglu",
    tie_embeddings=False,
)
_GEMMA = dict(
    _LLAMA,
    head_dim=24,
    norm_placement="sandwich",
    ffn="geglu_tanh",
    embed_scale=True,
    tie_embeddings=True,
    attn_scale=16**-0.5,
)
SHAPES = {
    "llama": (dict(_LLAMA, rope_theta=500.0), "llama"),
    "qwen3": (dict(_LLAMA, head_dim=24, qk_norm=True), "qwen3"),
    # Soft caps that bind on a tiny random model; local and global layers.
    "gemma2": (
        dict(
            _GEMMA,
            layer_pattern=[{"window": 5}, {"window": None}],
            mixer_settings={"softcap": 1.0},
            logits_softcap=2.0,
        ),
        "gemma2",
    ),
    # QK-norm; the local layers with a RoPE base of their own.
    "gemma3": (
        dict(
            _GEMMA,
            n_layers=3,
            qk_norm=True,
            rope_theta=1e6,
            layer_pattern=[{"window": 5, "rope_theta": 10.0}, {"window": None}],
        ),
        "gemma3_text",
    ),
}


# The fast tier exports Gemma 2 (sandwich norms, soft caps, local and global layers).
EXPORT_SLOW = "one more exported family, built, written and read by transformers"


def perturbed(cfg: ModelConfig, seed: int):
    """A model of ``cfg`` whose every parameter is its init plus noise."""
    model = build_model(cfg, seed=seed)
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        a + 0.2 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(tree, noisy))
    return model


def transformers_logits(folder, ids, mask):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    )
    return hf_logits(model, ids, mask)


def equal_to_transformers(model, folder, seed: int, vocab_size: int | None = None):
    """``model``'s logits equal transformers' reading of ``folder`` to ``TOL`` at the real
    positions of a left-padded batch drawn with ``seed`` (its ids wrapped below
    ``vocab_size`` if given); returns the ids, the mask and ``model``'s logits."""
    ids, mask = left_padded(np.random.default_rng(seed))
    if vocab_size is not None:
        ids = ids % vocab_size
    real = mask.astype(bool)
    ours = np.asarray(model(ids, valid_BT=real).logits)
    assert max_diff(ours[real], transformers_logits(folder, ids, mask)[real]) <= TOL
    return ids, mask, ours


def export_run(run, out) -> dict:
    """``attnlab export-hf`` of the run in ``run`` into ``out``; the config it wrote."""
    assert main(["export-hf", "--workdir", str(run), "--out", str(out)]) == 0
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize(
    "name",
    cases(
        list(SHAPES),
        slow={n: EXPORT_SLOW for n in ("llama", "qwen3", "gemma3")},
    ),
)
def test_exported_model_loads_in_transformers_with_equal_logits(tmp_path, name):
    fields, family = SHAPES[name]
    model = perturbed(ModelConfig(**fields), seed=3)
    assert export_model(model, tmp_path / "hf") == family
    ids, mask, ours = equal_to_transformers(model, tmp_path / "hf", seed=5)
    real = mask.astype(bool)
    # And back: load_pretrained reads the folder as the same model.
    back = load_pretrained(tmp_path / "hf")
    assert max_diff(np.asarray(back.logits(ids, mask))[real], ours[real]) <= TOL


def same_params_bitwise(a, b) -> bool:
    """Every parameter of attnlab models ``a`` and ``b`` equal bit for bit."""
    leaves = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
    pairs = zip(leaves(a), leaves(b), strict=True)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


def export_round_trips(model, folder, out):
    """``export_model`` of ``load_pretrained(folder)`` into ``out``: transformers reads the
    export with the original's logits (≤ 1e-4 at the real positions of a left-padded
    batch), and ``load_pretrained`` reads it back with every parameter bit for bit."""
    handle = load_pretrained(folder)
    assert export_model(handle.model, out) == handle.family
    exported = type(model).from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    ids, mask = left_padded(np.random.default_rng(3))
    real = mask.astype(bool)
    expected = hf_logits(model, ids, mask)[real]
    got = hf_logits(exported.eval(), ids, mask)[real]
    assert max_diff(got, expected) <= TOL
    assert same_params_bitwise(load_pretrained(out).model, handle.model)


def test_a_model_no_family_describes_is_refused_naming_the_supported_ones(tmp_path):
    cfg = ModelConfig(**dict(_LLAMA, position="learned", norm="layernorm"))
    with pytest.raises(ExportError, match=r"supported: \[.*'gemma2'.*'llama'"):
        export_model(build_model(cfg), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# The char_lm run as it is (Llama-shaped), and made Gemma 2-shaped by overrides.
RUNS = {
    "llama": [],
    "gemma2": [
        "--config.model.norm_placement=sandwich",
        "--config.model.ffn=geglu_tanh",
        "--config.model.embed_scale=True",
    ],
}


@pytest.mark.slow(reason="trains a tiny run, then reads the exported folder with transformers")
@pytest.mark.parametrize("family", list(RUNS))
def test_export_hf_command_round_trips_a_trained_run(tmp_path, capsys, family):
    from test_cli import exp

    from attnlab.runs.loading import load_run

    run = tmp_path / "lm"
    argv = ["train", "--no-progress", "--config", exp("char_lm"), "--workdir", str(run)]
    assert main(argv + ["--config.eval.sample_tokens=0", *RUNS[family]]) == 0
    out = tmp_path / "hf"
    assert export_run(run, out)["model_type"] == family
    assert family in capsys.readouterr().out
    model = load_run(run).model
    equal_to_transformers(model, out, seed=6, vocab_size=model.cfg.vocab_size)
    # A second export into the now non-empty folder is refused.
    assert main(["export-hf", "--workdir", str(run), "--out", str(out)]) != 0


# The MoE run made Qwen3-Next-shaped: three Gated DeltaNet layers and an elementwise-gated
# attention layer (QK-norm, RoPE on a quarter of each head), experts with a gated shared one.
QWEN3_NEXT_RUN = [
    "--config.data.pipeline=index",  # unpacked rows: recurrent state never crosses documents
    "--config.model.n_layers=4",
    """--config.model.block_pattern.block=("gated_deltanet", "gated_deltanet", """
    """"gated_deltanet", {"mixer": "gated", "mixer_settings": {"kind": "elementwise"}})""",
    "--config.model.qk_norm=True",
    "--config.model.rotary_dim=4",
    "--config.model.ffn_settings.n_shared=1",
    "--config.model.ffn_settings.shared_gate=True",
]


@pytest.mark.slow(reason="trains a tiny hybrid MoE run, then reads the export with transformers")
def test_a_qwen3_next_shaped_run_exports_with_equal_logits(tmp_path):
    from test_cli import exp

    from attnlab.runs.loading import load_run

    run = tmp_path / "lm"
    argv = ["train", "--no-progress", "--config", exp("moe_lm"), "--workdir", str(run)]
    assert main(argv + ["--config.eval.batches=0", *QWEN3_NEXT_RUN]) == 0
    config = export_run(run, tmp_path / "hf")
    assert config["model_type"] == "qwen3_next"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    equal_to_transformers(load_run(run).model, tmp_path / "hf", seed=6)


def test_a_hybrid_no_family_describes_is_refused_naming_the_layer_that_does_not_map():
    # hf_config_of decides before export_model builds or writes anything.
    gated = {"mixer": "gated", "mixer_settings": {"kind": "elementwise"}}
    moe = {"n_experts": 4, "top_k": 2, "n_shared": 1, "shared_gate": True}
    shape = dict(_LLAMA, d_model=32, n_layers=2, qk_norm=True, ffn_variant="moe", ffn_settings=moe)
    for block, where in (
        (["gated_deltanet", "mha"], r"layer 1's mixers \['mha'\]: Qwen3-Next layers hold"),
        (["gated_deltanet", "gated"], r"layer 1 gated.kind='headwise' \(read back 'elementwise'\)"),
        (
            [{"mixers": ["gated_deltanet", gated]}],
            r"layer 0's mixers \['gated_deltanet', 'gated'\]",
        ),
    ):
        cfg = ModelConfig(**shape, block_pattern={"block": block})
        with pytest.raises(ExportError, match=f"qwen3_next: {where}") as error:
            hf_config_of(cfg)
        assert "\n" not in str(error.value)


def test_mamba2_and_bamba_shaped_configs_find_their_families():
    mamba = {"mixer": "mamba2", "mixer_settings": {"head_dim": 16, "state_size": 8}}
    shape = dict(_LLAMA, n_layers=2, position="none", ffn_variant="none", **mamba)
    family, config = hf_config_of(ModelConfig(**shape))
    assert family == "mamba2" and (config["num_heads"], config["head_dim"]) == (8, 16)
    assert config["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    # Bamba: attention (half rotary) at layer 1 of 3 after a Mamba-2 layer, SwiGLU FFNs.
    blocks = {"prefix": [mamba], "block": ["mha", mamba]}
    shape = dict(_LLAMA, n_layers=3, rotary_dim=8, block_pattern=blocks)
    family, config = hf_config_of(ModelConfig(**shape))
    assert family == "bamba" and config["attn_layer_indices"] == [1]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    # Learned positions in a stack without attention: no family keeps them.
    learned = dict(_LLAMA, n_layers=2, position="learned", ffn_variant="none", **mamba)
    with pytest.raises(ExportError, match="mamba2: position='learned' \\(read back 'none'\\)"):
        hf_config_of(ModelConfig(**learned))


@pytest.mark.slow(reason="trains a tiny gated-attention MoE run, a surgery run from it, then reads")
def test_a_surgery_run_into_qwen3_next_shape_exports_with_equal_logits(tmp_path):
    # Gated attention in all four layers, then 3 of every 4 turned into Gated DeltaNet by a
    # surgery run: the result is Qwen3-Next's layout and exports as any run does.
    from test_cli import exp

    from attnlab.runs.loading import load_run

    shape = [a for a in QWEN3_NEXT_RUN if "block_pattern" not in a]
    shape += ["--config.model.mixer=gated", "--config.model.mixer_settings.kind=elementwise"]
    base = ["train", "--no-progress", "--config", exp("moe_lm"), "--config.eval.batches=0"]
    source, run = tmp_path / "source", tmp_path / "surgery"
    assert main(base + ["--workdir", str(source), *shape]) == 0
    surgery = [
        f"--config.surgery.run={source}",
        "--config.surgery.mixer=gated_deltanet",
        "--config.surgery.layers.every=4",
        "--config.surgery.layers.positions=(0, 1, 2)",
    ]
    assert main(base + ["--workdir", str(run), *shape, *surgery]) == 0
    config = export_run(run, tmp_path / "hf")
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    equal_to_transformers(load_run(run).model, tmp_path / "hf", seed=7)
