"""The variant API (``attnlab.contracts.mixer``): a variant defined here, outside the library, with
a parameter and a cache entry that is neither keys nor values, trains, checkpoints, resumes
exactly, decodes and loads back; per-layer patterns; one-line errors for bad settings."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import ModelConfig, build_model, experiment, runs
from attnlab.contracts.mixer import CacheEntry, MixerCall, MixerSettings, register_mixer
from attnlab.nn.mixers.mha import Attention

REPO = pathlib.Path(__file__).resolve().parents[1]


@register_mixer("running_mean", overwrite=True)
class RunningMean(Attention):
    """Softmax attention plus a learned gate on the running mean of the layer's inputs: the
    mean's sum is fixed-size state in the cache (``"sum"``, [D] float32 per row)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        init: float = 0.5

        def validate(self, cfg):
            if not 0 <= self.init <= 1:
                self.fail("init", "a gate in [0, 1]")

    def __init__(self, cfg, settings, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.mix_D = nnx.Param(jnp.full((cfg.d_model,), settings.init, jnp.float32))

    @classmethod
    def cache_entries(cls, cfg, settings):
        entries = super().cache_entries(cfg, settings)
        return {**entries, "sum": CacheEntry((cfg.d_model,), "float32", ("act_embed",))}

    def __call__(self, x_BTD, call: MixerCall):
        out_BTD, cache, weights = super().__call__(x_BTD, call)
        B, T, _ = x_BTD.shape
        x32_BTD = x_BTD.astype(jnp.float32)
        if cache is None:
            sums_BTD = jnp.cumsum(x32_BTD, axis=1)
            counts_BT = call.positions_BT + 1
        else:  # only each row's real new tokens join the state
            real_BT = jnp.arange(T)[None, :] < cache.count_B[:, None]
            sums_BTD = cache.read("sum")[:, None] + jnp.cumsum(x32_BTD * real_BT[..., None], 1)
            cache = cache.put("sum", sums_BTD[jnp.arange(B), jnp.maximum(cache.count_B - 1, 0)])
            counts_BT = call.positions_BT + 1
        mean_BTD = sums_BTD / counts_BT[..., None].astype(jnp.float32)
        return (
            out_BTD + (self.mix_D[...][None, None] * mean_BTD).astype(out_BTD.dtype),
            cache,
            weights,
        )


TINY = dict(mixer_checks.TINY, position="rope", mixer="running_mean")


def running_mean_reference(x_BTD, mix_D):
    x = np.asarray(x_BTD, np.float64)
    return np.cumsum(x, 1) / np.arange(1, x.shape[1] + 1)[None, :, None] * np.asarray(mix_D)


def test_a_variant_defined_outside_the_library_runs_its_own_maths():
    cfg = ModelConfig(**TINY)
    block = build_model(cfg, seed=0).decoder.layers
    mixer = nnx.merge(*nnx.split(block))  # stacked: take layer 0's parameters
    params = jax.tree.map(lambda a: a[0], nnx.state(mixer.attn))
    attn = nnx.merge(nnx.graphdef(mixer.attn), params)
    x_BTD = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
    call = MixerCall(positions_BT=jnp.broadcast_to(jnp.arange(5)[None], (2, 5)),
                     mask=attnlab.ops.MaskSpec.for_sequence(5, causal=True))  # fmt: skip
    got, _, _ = attn(x_BTD, call)
    plain, _, _ = Attention.__call__(attn, x_BTD, call)
    extra = np.asarray(got) - np.asarray(plain)
    np.testing.assert_allclose(
        extra, running_mean_reference(x_BTD, params["mix_D"][...]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow(
    reason="compiles a model of its own; the recurrent layers' tests check fixed-size state "
    "entries through cached decoding in the fast tier"
)
def test_its_cache_holds_its_state_and_decoding_equals_the_forward_pass():
    cfg = ModelConfig(**TINY)
    cache = attnlab.init_cache(cfg, 2, 8)
    assert set(cache.layers) == {"keys", "values", "sum"}
    assert cache.layers["sum"].shape == (2, 2, cfg.d_model) and cache.layers["sum"].dtype == (
        jnp.float32
    )
    assert attnlab.kv_cache_bytes(cfg, 2, 8, "float32") == sum(
        x.nbytes for x in cache.layers.values()
    )
    mixer_checks.prefill_then_steps(cfg)
    mixer_checks.prefill_then_steps(
        ModelConfig(**{**TINY, "n_layers": 1, "n_decoder_layers": 2}, arch="encoder_decoder")
    )
    mixer_checks.generate_matches_recompute(cfg)
    mixer_checks.beam_scores_match_forward(cfg)
    mixer_checks.grads_finite_with_masked_rows(cfg)


@pytest.mark.slow(
    reason="trains, resumes and reloads a run of its own; the recurrent layers' cached state "
    "and the runs tests cover the same paths"
)
def test_it_trains_resumes_exactly_and_loads_back(tmp_path):
    overrides = [
        "--config.model.mixer=running_mean",
        "--config.train.steps=6",
        "--config.eval.every_steps=3",
        "--config.eval.sample_tokens=0",
        "--config.train.log_every_steps=3",
        "--config.checkpoint.every_steps=3",
    ]
    tiny = lambda: experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", overrides)
    runs.train(tiny(), tmp_path / "straight", progress=False)
    runs.train(tiny(), tmp_path / "resumed", progress=False, stop_after=3)
    runs.train(tiny(), tmp_path / "resumed", progress=False)
    rows = lambda d: [
        {k: r[k] for k in ("step", "train_loss", "eval_loss") if k in r}
        for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
    ]
    assert rows(tmp_path / "straight") == rows(tmp_path / "resumed")
    run = runs.load_run(tmp_path / "resumed")
    assert run.step == 6 and run.config.model.mixer == "running_mean"
    straight = runs.load_run(tmp_path / "straight")
    for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(straight.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model = run.model
    assert float(jnp.abs(model.decoder.layers.attn.mix_D[...] - 0.5).max()) > 0  # it trained
    out = attnlab.generate(model, [[1, 2, 3]], 4, eos_id=None)
    again = attnlab.generate(model, [[1, 2, 3]], 4, eos_id=None, recompute=True)
    np.testing.assert_array_equal(out.tokens, again.tokens)


def test_layer_pattern_sets_each_layers_window_and_rope_base():
    base = dict(mixer_checks.TINY, position="rope", n_layers=2)
    pattern = [{"window": 3, "rope_theta": 500.0}, {"rope_theta": 1e6}]
    cfg = ModelConfig(**base, layer_pattern=pattern)
    assert cfg.layer_windows(4) == (3, None, 3, None)
    assert cfg.layer_rope_thetas(3) == (500.0, 1e6, 500.0)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    mixer_checks.prefill_then_steps(cfg)
    # One base for every layer through the pattern equals the model-wide base.
    ids = jnp.array([[3, 4, 5, 6, 7, 8, 9, 10]])
    same = build_model(ModelConfig(**base, layer_pattern=[{"rope_theta": 500.0}]), seed=1)
    wide = build_model(ModelConfig(**base, rope_theta=500.0), seed=1)
    np.testing.assert_allclose(same(ids).logits, wide(ids).logits, atol=1e-6)
    # A window on layer 0 alone through the pattern equals sliding_window_layers=(0,).
    local = build_model(ModelConfig(**base, layer_pattern=[{"window": 2}, "global"]), seed=1)
    old = build_model(ModelConfig(**base, sliding_window=2, sliding_window_layers=(0,)), seed=1)
    np.testing.assert_allclose(local(ids).logits, old(ids).logits, atol=1e-6)
    per_layer = build_model(cfg, seed=1)
    assert float(jnp.abs(per_layer(ids).logits - wide(ids).logits).max()) > 1e-4


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(mixer="no_such_variant"), ["mixer='no_such_variant'", "register_mixer"]),
        (dict(mixer="running_mean", mixer_settings={"init": 2.0}), ["mixer_settings.init"]),
        (dict(mixer="running_mean", mixer_settings={"gate": 1}), ["mixer_settings", "'gate'"]),
        (dict(layer_pattern=[{"width": 3}]), ["layer_pattern", "width"]),
        (dict(layer_pattern=[{"window": 2}], sliding_window=2), ["layer_pattern"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.one_line_config_error(words, **{**mixer_checks.TINY, **changes})


def test_registration_checks_the_class():
    with pytest.raises(TypeError, match="not a subclass of Mixer"):
        register_mixer("not_a_mixer", object)

    class Loose(Attention):
        class Settings:  # not the frozen MixerSettings dataclass the config needs
            pass

    with pytest.raises(TypeError, match="frozen MixerSettings dataclass"):
        register_mixer("loose", Loose)
    assert {"running_mean", "mha"} <= set(attnlab.registered_mixers())


SLOW = pytest.mark.slow(reason="compiles three models per variant; mha stands for them")
BUILT_INS = [
    "mha",
    *(pytest.param(m, marks=SLOW) for m in ("sinks", "gated", "differential", "mla")),
]


@pytest.mark.parametrize("mixer", BUILT_INS)
def test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients(mixer):
    """In a bidirectional encoder, tokens at padded positions change nothing at real ones;
    rematerialising each layer (``remat="full"``) leaves the gradients as they were."""
    base = dict(mixer_checks.TINY, position="rope", mixer=mixer, arch="encoder")
    model = build_model(ModelConfig(**base), seed=0)
    valid = jnp.array([[True] * 5 + [False] * 3])
    ids = jnp.array([[3, 4, 5, 6, 7, 8, 9, 10]])
    other = ids.at[0, 5:].set(jnp.array([11, 12, 13]))
    a = model(ids, valid_BT=valid).logits[0, :5]
    b = model(other, valid_BT=valid).logits[0, :5]
    np.testing.assert_allclose(a, b, atol=1e-5)

    def grads(remat):
        cfg = ModelConfig(**{**base, "arch": "decoder"}, remat=remat)
        graphdef, params = nnx.split(build_model(cfg, seed=0))
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids).logits[..., :4] ** 2)
        return jax.tree.leaves(jax.grad(loss)(params))

    for g, h in zip(grads("none"), grads("full"), strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)
