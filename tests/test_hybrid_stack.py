"""Hybrid stacks (``ModelConfig.block_pattern``): a prefix and a repeating block of layer kinds.

Checked with the mixers that exist (``mha``, ``sinks``, ``mla``: per-token entries of two
layouts) and ``ShortConvDecay``, a fixed-size-state test mixer defined here (a short causal
convolution and a decaying sum, the cache roles of the recurrent layers: ``"conv"`` and
``"state"``), whose maths is checked against a float64 NumPy recurrence first. Then: scanned
== unrolled for training and decoding, full forward == prefill + decode on ragged batches,
a parallel layer == the sum of its mixers, the cache's bytes == the sum over its kinds, a
program flat in the number of repeats, 8 fake devices == one, and the config's errors.
"""

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import xla_flags
from flax import nnx
from tiers import cases
from xla_flags import on_mesh

import attnlab
from attnlab import ModelConfig, build_model, init_cache, kv_cache, ops
from attnlab.contracts.mixer import CacheEntry, Mixer, MixerCall, MixerSettings
from attnlab.decode import Decoder
from attnlab.errors import ConfigError
from attnlab.nn.layers import normal
from attnlab.ops.linear import dense

REPO = pathlib.Path(__file__).resolve().parents[1]


@attnlab.register_mixer("short_conv_decay", overwrite=True)
class ShortConvDecay(Mixer):
    """``u = x V``; ``c_t = sum_j w_j u_{t-j}`` (a causal convolution of width ``width``);
    ``h_t = a * h_{t-1} + c_t`` per head and channel; ``out = h O``. Its cache: the state
    ``h`` and the last ``width - 1`` inputs ``u`` of the convolution, both float32."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        width: int = 3

        def validate(self, cfg):
            if self.width < 2:
                self.fail("width", "at least 2")

    def __init__(self, cfg, settings, *, rngs):
        N, H, D = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.width = settings.width
        self.v_DNH = normal(rngs, (D, N, H), cfg.init_std, cfg.param_dtype)
        self.o_NHD = normal(rngs, (N, H, D), cfg.init_std, cfg.param_dtype)
        self.conv_PNH = normal(rngs, (settings.width, N, H), 0.5, cfg.param_dtype)
        self.decay_NH = nnx.Param(jnp.full((N, H), 0.8, jnp.dtype(cfg.param_dtype)))

    @classmethod
    def cache_entries(cls, cfg, settings):
        N, H = cfg.n_heads, cfg.head_dim
        return {
            "state": CacheEntry((N, H), "float32", ("act_kv_heads", None)),
            "conv": CacheEntry((settings.width - 1, N, H), "float32", (None, "act_kv_heads", None)),
        }

    def __call__(self, x_BTD, call: MixerCall):
        B, T, _ = x_BTD.shape
        K, cache = self.width, call.cache
        u_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, self.v_DNH[...]).astype(jnp.float32)
        N, H = u_BTNH.shape[2:]
        if cache is None:
            before_BKNH, h_BNH = jnp.zeros((B, K - 1, N, H)), jnp.zeros((B, N, H))
            real_BT = jnp.ones((B, T), bool)
        else:
            before_BKNH, h_BNH = cache.read("conv"), cache.read("state")
            real_BT = jnp.arange(T)[None, :] < cache.count_B[:, None]
        ext_BTNH = jnp.concatenate([before_BKNH, u_BTNH], axis=1)  # [B, K - 1 + T, N, H]
        w_PNH = self.conv_PNH[...].astype(jnp.float32)
        c_BTNH = sum(
            w_PNH[j][None, None] * ext_BTNH[:, K - 1 - j : K - 1 - j + T] for j in range(K)
        )
        a_11NH = self.decay_NH[...].astype(jnp.float32)[None]

        def step(h_BNH, xs):
            c_BNH, real_B = xs
            h_BNH = jnp.where(real_B[:, None, None], a_11NH * h_BNH + c_BNH, h_BNH)
            return h_BNH, h_BNH

        h_BNH, h_TBNH = jax.lax.scan(step, h_BNH, (jnp.swapaxes(c_BTNH, 0, 1), real_BT.T))
        h_BTNH = jnp.swapaxes(h_TBNH, 0, 1).astype(x_BTD.dtype)
        out_BTD = jnp.einsum("BTNH,NHD->BTD", h_BTNH, self.o_NHD[...])
        if cache is not None:  # the last K - 1 real inputs, after those before the call
            at_BK = cache.count_B[:, None] + jnp.arange(K - 1)[None, :]
            conv_BKNH = jnp.take_along_axis(ext_BTNH, at_BK[:, :, None, None], axis=1)
            cache = cache.put("state", h_BNH).put("conv", conv_BKNH)
        return out_BTD, cache, None


def short_conv_decay_reference(x_BTD, p):
    """The recurrence of ``ShortConvDecay`` token by token, float64."""
    f = lambda a: np.asarray(a, np.float64)
    x, V, Wo, w, a = f(x_BTD), f(p["v_DNH"]), f(p["o_NHD"]), f(p["conv_PNH"]), f(p["decay_NH"])
    u = np.einsum("btd,dnh->btnh", x, V)
    B, T = x.shape[:2]
    h, out = np.zeros(u.shape[:1] + u.shape[2:]), np.zeros_like(x)
    for t in range(T):
        c = sum(w[j] * u[:, t - j] for j in range(w.shape[0]) if t - j >= 0)
        h = a * h + c
        out[:, t] = np.einsum("bnh,nhd->bd", h, Wo)
    return out


BASE = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, max_len=16, init_std=0.3,
            position="rope", norm="rmsnorm")  # fmt: skip
CONV = {"mixer": "short_conv_decay"}
# 1 + 2 x 2 layers: an MLA prefix, then [a recurrent layer, attention + recurrent side by
# side], with a RoPE base per layer (ModelConfig.layer_pattern).
HYBRID = dict(
    BASE,
    n_layers=5,
    block_pattern={"prefix": ["mla"], "block": [CONV, {"mixers": ["mha", CONV]}]},
    layer_pattern=[{"rope_theta": 100.0}, {"rope_theta": 10000.0}],
)


def _p(module):
    return {k: v[...] for k, v in vars(module).items() if isinstance(v, nnx.Param)}


def test_the_test_mixer_equals_its_float64_recurrence_in_training_and_decoding():
    cfg = ModelConfig(**BASE, n_layers=1, mixer="short_conv_decay")
    mixer = ShortConvDecay(cfg, ShortConvDecay.Settings(), rngs=nnx.Rngs(0))
    x_BTD = jax.random.normal(jax.random.key(0), (2, 6, 16))
    positions_BT = jnp.broadcast_to(jnp.arange(6)[None], (2, 6))
    want = short_conv_decay_reference(x_BTD, _p(mixer))
    got, _, _ = mixer(x_BTD, MixerCall(positions_BT=positions_BT))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# Scanned == unrolled ---------------------------------------------------------------------


def loss_and_grads(cfg, params_from=None):
    model = build_model(cfg, seed=1)
    graphdef, params = nnx.split(model)
    if params_from is not None:
        params = params_from
    ids_BT = jax.random.randint(jax.random.key(2), (2, 7), 1, cfg.vocab_size)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids_BT[:, :-1]).logits
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return params, value, grads


def test_scanned_hybrid_equals_unrolled_for_loss_and_gradients_with_remat():
    cfg = ModelConfig(**HYBRID, remat="dots")
    params, want, want_g = loss_and_grads(cfg.replace(scan_layers=False, remat="none"))
    # The same parameters (the layout is the same) scanned, rematerialised.
    _, got, got_g = loss_and_grads(cfg, params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(*map(jax.tree.leaves, (want_g, got_g)), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5)
    layers = params["decoder"]["layers"]["blocks"]
    assert layers[1]["attn"][1]["decay_NH"].shape == (2, 2, 8)  # [repeats, N, H]


def cached_logits(cfg, params, *, unstack=False):
    """Prefill of 4 ragged prompt tokens, then 3 decode steps: every step's logits."""
    decoder = Decoder(nnx.graphdef(build_model(cfg, seed=0)), cfg)
    ids_BT = jax.random.randint(jax.random.key(5), (2, 7), 1, cfg.vocab_size)
    lengths_B = jnp.array([2, 4])

    @jax.jit
    def run(params):
        cache = init_cache(cfg, 2, cfg.max_len)
        first, cache = decoder.prefill_fn(params, cache, ids_BT[:, :4], lengths_B)
        step = decoder.step_fn(params, unstack=unstack)
        if unstack:
            cache = kv_cache.split_layers(cache)
        out = [first]
        for i in range(3):
            logits, cache = step(ids_BT[jnp.arange(2), lengths_B + i][:, None], cache)
            out.append(logits[:, 0])
        return jnp.stack(out)

    return np.asarray(run(params))


@pytest.mark.parametrize(
    "mode",
    cases(
        ["unstacked", "unrolled"],
        slow={
            "unstacked": "the fast tier's prefill-and-decode and scanned training checks cover it",
            "unrolled": "the same check, unrolled again",
        },
    ),
)
def test_scanned_hybrid_decoding_equals_unrolled(mode):
    """Scanned prefill and steps against the unstacked loop (separate blocks over a split
    cache) or ``scan_layers=False``: the same logits."""
    cfg = ModelConfig(**HYBRID)
    params = nnx.state(build_model(cfg, seed=0))
    want = cached_logits(cfg, params)
    if mode == "unstacked":
        got = cached_logits(cfg, params, unstack=True)
    else:
        got = cached_logits(cfg.replace(scan_layers=False), params)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_cached_decoding_is_scanned_over_the_repeats():
    """The decode step's program holds the block's layers once, whatever the repeats."""
    sizes = {}
    for n in (5, 17):  # 2 and 8 repeats
        cfg = ModelConfig(**{**HYBRID, "n_layers": n})
        decoder = Decoder(nnx.graphdef(build_model(cfg, seed=0)), cfg)
        params = jax.eval_shape(lambda cfg=cfg: nnx.state(build_model(cfg, seed=0)))
        cache = jax.eval_shape(lambda cfg=cfg: init_cache(cfg, 2, cfg.max_len))
        lowered = jax.jit(decoder.decode_step_fn).lower(params, cache, jnp.zeros((2,), jnp.int32))
        sizes[n] = len(lowered.as_text())
    assert sizes[17] < 1.05 * sizes[5], sizes


# Full forward == prefill + decode ----------------------------------------------------------


def test_full_forward_equals_prefill_and_decode_on_ragged_batches():
    mixer_checks.prefill_then_steps(ModelConfig(**HYBRID))


def test_generate_with_the_cache_equals_recomputation_on_ragged_prompts():
    """``attnlab.generate`` over ragged prompts: the cached path (prefill, then the steps)
    equals a full forward pass at every token."""
    mixer_checks.generate_matches_recompute(ModelConfig(**HYBRID))


@pytest.mark.slow(reason="beam search compiles its own loop, and a full pass per row")
def test_beam_scores_are_the_full_forward_log_probabilities():
    """Beams reorder every entry's rows (the recurrent state with the keys): each beam's
    score is its sequence's log-probability under a full forward pass."""
    model = build_model(ModelConfig(**HYBRID), seed=2)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    beams = attnlab.generate(model, prompts, 5, num_beams=3, length_penalty=0.0, eos_id=None)
    for b, prompt in enumerate(prompts):
        seq = np.r_[prompt, beams.tokens[b]]
        logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(seq)[None]).logits[0], -1))
        at = len(prompt) - 1 + np.arange(len(beams.tokens[b]))
        np.testing.assert_allclose(beams.scores[b], logp[at, beams.tokens[b]].sum(), atol=1e-4)


@pytest.mark.slow(reason="a second hybrid compiled: every attention layer slides, a ring cache")
def test_a_ring_cache_serves_a_hybrid_whose_attention_slides():
    cfg = ModelConfig(**{**HYBRID, "layer_pattern": None}, sliding_window=3)
    cache = init_cache(cfg, 2, cfg.max_len)
    assert cache.ring and cache.layers["mha.keys"].shape[3] == 3  # [n, B, K, W, H]
    assert cache.layers["short_conv_decay.state"].shape == (4, 2, 2, 8)
    mixer_checks.prefill_then_steps(cfg)


@pytest.mark.slow(reason="three generations of three batch shapes")
def test_generate_handles_left_padded_ragged_prompts():
    """``attnlab.generate`` over prompts of three lengths equals each prompt alone."""
    model = build_model(ModelConfig(**HYBRID), seed=3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    together = attnlab.generate(model, prompts, 4, eos_id=None, return_logits=True)
    for b, prompt in enumerate(prompts):
        alone = attnlab.generate(model, [prompt], 4, eos_id=None, return_logits=True)
        np.testing.assert_array_equal(together.tokens[b], alone.tokens[0])
        np.testing.assert_allclose(together.logits[b], alone.logits[0], atol=1e-5)


# Parallel mixers, the cache --------------------------------------------------------------


def test_a_parallel_layer_is_the_sum_of_its_mixers():
    cfg = ModelConfig(**HYBRID)
    model = build_model(cfg, seed=0)
    period = nnx.merge(*nnx.split(model.decoder.layers))
    block = nnx.merge(nnx.graphdef(period.blocks[1]),
                      jax.tree.map(lambda a: a[0], nnx.state(period.blocks[1])))  # fmt: skip
    attn, conv = block.attn[0], block.attn[1]
    x_BTD = jax.random.normal(jax.random.key(0), (2, 5, 16))
    positions_BT = jnp.broadcast_to(jnp.arange(5)[None], (2, 5))
    call = MixerCall(positions_BT=positions_BT, mask=ops.MaskSpec.for_sequence(5, causal=True),
                     rope_theta=100.0)  # fmt: skip
    got, _, _ = block.mix(x_BTD, call)
    # Each mixer against its own reference: jax.nn.dot_product_attention, the recurrence.
    q, k, v = (ops.apply_rope(dense(x_BTD, w[...]), positions_BT, theta=100.0) if i < 2
               else dense(x_BTD, w[...]) for i, w in enumerate((attn.q_DNH, attn.k_DKH,
                                                                 attn.v_DKH)))  # fmt: skip
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    want = np.einsum("btnh,nhd->btd", att, attn.o_NHD[...]) + short_conv_decay_reference(
        x_BTD, _p(conv)
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_each_kind_keeps_its_own_entries_and_the_bytes_sum_over_kinds():
    cfg = ModelConfig(**HYBRID)
    B, S, K, H = 3, 12, 2, 8
    cache = init_cache(cfg, B, S)
    mla = attnlab.contracts.mixer.get_mixer("mla").Settings().resolved(cfg)
    R, Hr = mla.kv_lora_rank, mla.qk_rope_head_dim
    shapes = {name: x.shape for name, x in cache.layers.items()}
    assert shapes == {
        "mla.latent": (1, B, S, R),
        "mla.rope_keys": (1, B, S, Hr),
        "short_conv_decay.state": (4, B, K, H),
        "short_conv_decay.conv": (4, B, 2, K, H),
        "mha.keys": (2, B, K, S, H),
        "mha.values": (2, B, K, S, H),
    }
    assert cache.layers["short_conv_decay.state"].dtype == jnp.float32
    per_kind = {  # bytes by hand: layers x rows x the entry's elements x itemsize
        "mla": 1 * B * S * (R + Hr) * 2,
        "short_conv_decay": 4 * B * (K * H + 2 * K * H) * 4,
        "mha": 2 * B * 2 * K * S * H * 2,
    }
    assert attnlab.kv_cache_bytes(cfg, B, S) == sum(per_kind.values())
    assert attnlab.kv_cache_bytes(cfg, B, S, "float32") == sum(
        x.nbytes for x in cache.layers.values()
    )
    # The homogeneous layout stands: the roles alone, every layer stacked.
    plain = init_cache(ModelConfig(**BASE, n_layers=3), B, S)
    assert {n: x.shape for n, x in plain.layers.items()} == {
        "keys": (3, B, K, S, H),
        "values": (3, B, K, S, H),
    }


def test_phases_and_row_reordering_work_on_every_entry_of_a_hybrid_cache():
    cfg = ModelConfig(**HYBRID)
    cache = init_cache(cfg, 2, 8)
    cache = cache.replace(
        layers={
            n: x + jnp.arange(x.shape[1], dtype=x.dtype).reshape(1, -1, *[1] * (x.ndim - 2))
            for n, x in cache.layers.items()
        }  # fmt: skip
    )
    cut = kv_cache.truncate(cache, 3)
    assert cut.layers["mha.keys"].shape[3] == 3 and cut.layers["mla.latent"].shape[2] == 3
    assert (
        cut.layers["short_conv_decay.state"].shape == cache.layers["short_conv_decay.state"].shape
    )
    back = kv_cache.paste(cache, kv_cache.truncate(cache, 3, split=True))
    for n in cache.layers:
        np.testing.assert_array_equal(back.layers[n], cache.layers[n])
    swapped = kv_cache.take_rows(cache, jnp.array([1, 0]))
    for n, x in cache.layers.items():
        np.testing.assert_array_equal(swapped.layers[n], x[:, ::-1])
    assert kv_cache.repeat_rows(cache, 2).layers["short_conv_decay.conv"].shape[1] == 4
    joined = kv_cache.join_layers(kv_cache.split_layers(cache))
    assert all(np.array_equal(joined.layers[n], x) for n, x in cache.layers.items())


def test_hybrid_parameters_carry_logical_axes_with_a_leading_layer_axis():
    from attnlab.devices import sharding

    params = nnx.state(build_model(ModelConfig(**HYBRID), seed=0), nnx.Param)
    flat = {
        ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    path, leaf = flat["decoder.layers.blocks.1.attn.1.decay_NH.value"]
    assert sharding.logical_names(path, leaf.shape) == ("layers", "heads", "head_dim")
    path, leaf = flat["decoder.prefix.attn.kv_down_DR.value"]
    assert sharding.logical_names(path, leaf.shape) == ("layers", "embed", "latent")
    # Muon reads the same rule: each layer's [D, R] matrix, not the stacked array.
    tree = {"decoder": {"prefix": {"attn": {"kv_down_DR": leaf}}}}
    got = attnlab.contracts.optimizer.muon_dimensions(tree)["decoder"]["prefix"]["attn"][
        "kv_down_DR"
    ]
    assert (got.reduction_axis, got.output_axis) == ((1,), (2,))


# Compile time flat in depth -----------------------------------------------------------------


def trace_and_compile_seconds(n_layers: int, *, compile=True) -> tuple[float, float, int]:
    """(trace seconds, compile seconds, HLO characters) of the hybrid's loss gradient
    (``compile=False``: traced and lowered only)."""
    cfg = ModelConfig(**{**HYBRID, "n_layers": n_layers})
    model = build_model(cfg, seed=0)
    graphdef, params = nnx.split(model)
    ids_BT = jnp.ones((2, 8), jnp.int32)
    f = jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(ids_BT).logits)))
    t0 = time.perf_counter()
    lowered = f.lower(params)
    t1 = time.perf_counter()
    if compile:
        lowered.compile()
    return t1 - t0, time.perf_counter() - t1, len(lowered.as_text())


def test_the_training_program_does_not_grow_with_the_repeats():
    _, _, two = trace_and_compile_seconds(5, compile=False)
    _, _, eight = trace_and_compile_seconds(17, compile=False)
    assert eight < 1.05 * two, (two, eight)


# The config ---------------------------------------------------------------------------------


def test_the_pattern_round_trips_through_dicts_json_and_replace():
    cfg = ModelConfig(**HYBRID)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.block_pattern == cfg.block_pattern
    assert cfg.to_dict()["block_pattern"]["block"][1]["mixers"][0]["mixer"] == "mha"
    assert cfg.replace(n_layers=7).n_layers == 7
    from attnlab import experiment

    tiny = str(REPO / "experiments" / "char_lm.py") + ":tiny"
    assert experiment.model_config(experiment.load_config(tiny)).block_pattern is None
    overrides = [
        """--config.model.block_pattern.block=("mha", {"mixer": "sinks", "mixer_settings": """
        """{"init": 1.0}})""",
        "--config.model.n_layers=4",
    ]
    base = experiment.load_config(tiny, overrides)
    got = experiment.model_config(base)
    assert [k.mixers[0].mixer for k in got.block_pattern.block] == ["mha", "sinks"]
    assert got.block_pattern.block[1].mixers[0].mixer_settings.init == 1.0
    # A work directory's config.json reads back to the same model.
    saved = json.dumps({**base.to_dict(), "model": got.to_dict()})
    assert experiment.model_config(experiment.from_json(saved)) == got


@pytest.mark.parametrize(
    "change, words",
    [
        ({"block_pattern": {"block": ["nope"]}}, ["block_pattern.block[0].mixer='nope'", "known"]),
        ({"n_layers": 6}, ["block_pattern.block", "n_layers=6", "len(prefix)=1", "2 layers"]),
        ({"block_pattern": {"blocks": ["mha"]}}, ["block_pattern", "'block'"]),
        ({"block_pattern": {"block": []}}, ["block_pattern.block=[]", "non-empty"]),
        ({"block_pattern": {"block": [{"mixer": "mha", "mixers": ["mha"]}]}}, ["not both"]),
        ({"block_pattern": {"block": [{"mixers": []}]}}, ["block[0].mixers=[]"]),
        ({"block_pattern": {"block": [{"mixer": "sinks", "mixer_settings": {"x": 1}}]}},
         ["block_pattern.block[0]", "unknown field", "'x'"]),
        ({"block_pattern": {"block": [{"mixer": "short_conv_decay",
                                       "mixer_settings": {"width": 1}}]}},
         ["block_pattern.block[0]", "width=1", "at least 2"]),
        ({"block_pattern": {"block": [{"ffn_variant": "nope"}]}}, ["block[0].ffn_variant"]),
        ({"arch": "encoder_decoder"}, ["encoder_decoder", "block_pattern"]),
        ({"ffn_variant": "moe", "ffn_settings": {"dense_layers": 1}},
         ["dense_layers=1", "prefix"]),
    ],
)  # fmt: skip
def test_bad_patterns_get_one_line_errors_naming_the_field(change, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**HYBRID, **change})
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message


# On 8 devices ---------------------------------------------------------------------------------


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles sharded programs")
def test_hybrid_on_eight_cpu_devices():
    xla_flags.run_on_devices(__file__, "-m", "", "-k", "mesh_like_one_device")


@on_mesh
def test_hybrid_trains_and_decodes_on_a_mesh_like_one_device():
    from test_sharding import (
        decodes_on_a_mesh_like_one_device,
        tiny,
        trains_on_a_mesh_like_one_device,
    )

    from attnlab import experiment

    cfg = tiny(position="rope", dropout=0.0, attention_dropout=0.0, n_layers=5)
    with cfg.unlocked():
        cfg.model.block_pattern = {
            "prefix": [{"mixer": "mla", "mixer_settings": {"q_lora_rank": 16}}],
            "block": [CONV, {"mixers": ["mha", CONV]}],
        }
    state = trains_on_a_mesh_like_one_device(cfg)
    leaf = state["params"]["decoder"]["layers"]["blocks"][1]["attn"][0]["q_DNH"]
    assert len(leaf.sharding.device_set) == 8
    decodes_on_a_mesh_like_one_device(build_model(experiment.model_config(cfg), seed=0))
