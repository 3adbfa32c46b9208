"""Experiment configs, objectives, the optimiser and the train step."""

import math
import pathlib

import jax
import numpy as np
import pytest
from tiers import cases

from attnlab import experiment, train
from attnlab.data import make_task
from attnlab.train import lora

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((REPO / "experiments").glob("*.py"))


def tiny(name, *overrides):
    return experiment.load_config(f"{REPO / 'experiments' / name}:tiny", list(overrides))


@pytest.mark.parametrize(
    "path",
    cases(
        EXPERIMENTS,
        slow={
            p: "each experiment compiles a model of its own; char_lm, the main one, stands for them"
            for p in EXPERIMENTS
            if p.stem != "char_lm"
        },
    ),
    ids=lambda p: p.stem,
)
def test_every_experiment_builds_and_takes_a_step(path, tmp_path):
    cfg = experiment.load_config(f"{path}:tiny")
    if cfg.data.path:  # text experiments read a file; use a small one made here
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("To be, or not to be, that is the question.\n" * 200)
        cfg.data.path = str(corpus)
    mcfg = experiment.validate(cfg)
    task = make_task(cfg.data, tmp_path)
    trainer = train.Trainer(cfg, mcfg, kind=task.kind)
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, lora.trained(state))  # with LoRA (lora.rank), adapters
    state, metrics = trainer.train_step(state, task.train_batch(0, 0, int(cfg.train.batch_size)))
    assert math.isfinite(float(metrics["loss"])) and int(state["step"]) == 1
    after = jax.tree.leaves(lora.trained(state))
    moved = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before), after, strict=True)
    ]
    assert any(moved)


def test_every_experiment_accepts_the_common_keys():
    keys = [
        "train.steps=7",
        "train.batch_size=4",
        "train.seed=3",
        "optim.learning_rate=0.01",
        "eval.every_steps=5",
        "checkpoint.every_steps=5",
        "model.n_layers=1",
        "data.path=somewhere.txt",
    ]
    for path in EXPERIMENTS:
        cfg = experiment.load_config(f"{path}:tiny", [f"--config.{k}" for k in keys])
        assert (cfg.train.steps, cfg.train.seed, cfg.model.n_layers) == (7, 3, 1)
        assert cfg.optim.learning_rate == 0.01 and cfg.data.path == "somewhere.txt"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("--config.train.stepz=5", "stepz"),
        ("--config.train.steps=abc", "train.steps"),
        ("--config.train.steps=1.5", "train.steps"),
        ("--config.nosuchgroup.x=1", "nosuchgroup"),
    ],
)
def test_invalid_overrides_name_the_key(override, needle):
    with pytest.raises(experiment.ExperimentError, match=needle):
        tiny("char_lm.py", override)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("--config.train.steps=0", "train.steps"),
        ("--config.model.position=spiral", "model.position"),
        ("--config.model.n_kv_heads=3", "model.n_kv_heads"),
        ("--config.data.kind=poetry", "data.kind"),
        ("--config.optim.grad_accum_steps=3", "optim.grad_accum_steps"),
        ("--config.data.seq_len=64", "data.seq_len"),
        ("--config.model.arch=encoder", "model.arch"),
    ],
)
def test_invalid_values_name_the_key(override, needle):
    with pytest.raises(experiment.ExperimentError, match=needle):
        experiment.validate(tiny("char_lm.py", override))


def test_cli_reports_bad_override_cleanly(tmp_path, capsys):
    from attnlab.cli import main

    code = main(
        [
            "train",
            "--config",
            str(REPO / "experiments" / "char_lm.py:tiny"),
            "--workdir",
            str(tmp_path),
            "--config.model.n_layer=2",
        ]
    )
    assert code == 2
    assert "n_layer" in capsys.readouterr().err


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    cfg1 = tiny("char_lm.py", "--config.train.batch_size=4")
    cfg2 = tiny("char_lm.py", "--config.train.batch_size=4", "--config.optim.grad_accum_steps=2")
    task = make_task(cfg1.data, tmp_path)
    batch = task.train_batch(0, 0, 4)
    results = []
    for cfg in (cfg1, cfg2):
        trainer = train.Trainer(cfg, kind="lm")
        state, m = trainer.train_step(trainer.init_state(), batch)
        results.append((float(m["loss"]), jax.tree.leaves(state["params"])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[0][1], results[1][1], strict=True):  # Adam amplifies rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_weight_decay_mask_spares_norms_biases_and_embeddings():
    cfg = tiny("mlm_encoder.py")
    trainer = train.Trainer(cfg, kind="mlm")
    mask = train.decay_mask(trainer.init_state()["params"])
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert any(v for k, v in flat.items() if "q_DNH" in k)
    assert any(v for k, v in flat.items() if "w_in_DF" in k)
    for k, v in flat.items():
        if any(s in k for s in ("scale_D", "bias", "embedding_VD", "table_PD")):
            assert not v, k


def test_schedule_is_warmup_then_cosine():
    o = experiment.base_config().optim
    o.update(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    f = train.lr_multiplier(o, 110)
    assert float(f(0)) == pytest.approx(0.1)
    assert float(f(9)) == pytest.approx(1.0)
    for step in (10, 35, 60, 110):
        frac = (step - 10) / 100
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        assert float(f(step)) == pytest.approx(expected, rel=1e-5)


def test_an_experiment_file_runs_once_so_its_variants_register_once(tmp_path):
    from attnlab import sweep
    from attnlab.contracts.score_function import attention_variants

    source = tmp_path / "once.py"
    source.write_text(
        "import attnlab\n"
        "from attnlab.experiment import base_config\n"
        "attnlab.register_attention('once_only', lambda q, k, v, **kw: "
        "attnlab.ops.dot_product_attention(q, k, v, **kw))\n"
        "def get_config(variant=None):\n"
        "    c = base_config()\n"
        "    c.model.attention_fn = 'once_only'\n"
        "    return c\n"
        "def sweep(variant=None):\n"
        "    return [{'train.seed': 0}, {'train.seed': 1}]\n"
    )
    cfg = experiment.load_config(str(source))  # a second execution would fail to register
    fn = attention_variants()["once_only"]
    again = experiment.load_config(f"{source}:tiny", ["--config.train.steps=5"])
    plan = sweep.load_sweep(str(source))
    assert attention_variants()["once_only"] is fn
    assert cfg.experiment_file == again.experiment_file == str(source.resolve())
    assert [t.cfg.model.attention_fn for t in plan.trials] == ["once_only"] * 2
    saved = tmp_path / "config.json"
    saved.write_text(experiment.to_json(again))
    assert experiment.load_config(str(saved)).to_dict() == again.to_dict()


@pytest.mark.slow(reason="compiles optax's muon beside ours for every layer shape (about 15 s)")
def test_muon_orthogonalises_each_layer_matrix_as_plain_optax_muon_does():
    """Stacked ``q_DNH [L, D, N, H]`` and ``o_NHD``: layer ``l``'s update equals
    ``optax.contrib.muon`` on the 2-D matrix ``[D, N*H]`` (``[N*H, D]``) alone; the
    embedding and norms go to Adam."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from attnlab import ModelConfig, build_model

    model = build_model(ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=11, d_ff=24))
    params = nnx.state(model, nnx.Param)
    c = experiment.base_config()
    c.optim.update(name="muon", clip_norm=0.0, warmup_steps=0, weight_decay=0.0)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params)
    tx = train.make_optimizer(c.optim, 10, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    plain = optax.contrib.muon(learning_rate=c.optim.learning_rate, beta=c.optim.muon_beta)
    attn_g, attn_u = grads["decoder"]["layers"]["attn"], updates["decoder"]["layers"]["attn"]
    for name, rows in (("q_DNH", 16), ("o_NHD", 16)):
        for layer in range(2):
            g = jnp.asarray(attn_g[name][...][layer])
            g2 = g.reshape(rows, -1) if name == "q_DNH" else g.reshape(-1, 16)
            want, _ = plain.update(g2, plain.init(g2), g2)
            got = np.asarray(attn_u[name][...][layer]).reshape(g2.shape)
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-6)
    # Nesterov Adam's first step moves every entry by lr * (1 + b1 / (1 + b1)), whatever
    # the gradient (the bias-corrected moments are g and g^2).
    emb = np.abs(np.asarray(updates["embed"]["tokens"]["embedding_VD"][...]))
    b1 = c.optim.b1
    np.testing.assert_allclose(emb, c.optim.adam_learning_rate * (1 + b1 / (1 + b1)), rtol=1e-3)


def _lm_batch(trainer, seed, batch=4, T=16, vocab=None):
    rng = np.random.default_rng(seed)
    vocab = vocab or trainer.mcfg.vocab_size
    ids = rng.integers(0, vocab, (batch, T + 1), dtype=np.int32)
    return {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "loss_mask": np.ones((batch, T), np.float32),
    }


def test_trials_differing_in_seed_and_optimiser_values_share_one_initialisation():
    from compile_count import compiles

    train.steps._INIT_PROGRAMS.clear()
    first = train.Trainer(tiny("char_lm.py", "--config.train.seed=0"))
    with compiles() as count:
        first.init_state()
        assert count() >= 1
    second_cfg = tiny("char_lm.py", "--config.train.seed=7", "--config.optim.learning_rate=0.02")
    second = train.Trainer(second_cfg)
    with compiles() as count:
        shared = second.init_state()
        assert count() == 0
    train.steps._INIT_PROGRAMS.clear()  # the same trainer with a program of its own
    alone = train.Trainer(second_cfg).init_state()
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(shared), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hyper = train.injected_hyperparams(shared["opt_state"])
    assert float(hyper["learning_rate"]) == pytest.approx(0.02)
    # a different seed gives different parameters
    p0, p7 = (jax.tree.leaves(s["params"]) for s in (first.init_state(), shared))
    assert any(not np.array_equal(a, b) for a, b in zip(p0, p7, strict=True))


def test_the_initialisation_program_compiled_without_backend_optimisation_keeps_its_values():
    """On CPU the initial state is compiled without XLA's backend optimisations (a quarter
    of the compile time): the same state as the optimised program, to float32 rounding."""
    assert train.steps.init_compiler_options() == {"xla_backend_optimization_level": 0}
    trainer = train.Trainer(tiny("shakespeare_speedrun.py"))
    quick = trainer.init_state()
    optimised = jax.jit(trainer._init_state)(np.uint32(trainer.seed))
    leaves = jax.tree.leaves(optimised)
    assert sum(x.size for x in leaves) > 1000
    for a, b in zip(leaves, jax.tree.leaves(quick), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-7, atol=1e-9)


@pytest.mark.slow(reason="compiles the stacked steps twice; test_sweep's vmapped trials cover them")
def test_stacked_steps_mapped_or_vmapped_equal_each_trial_alone():
    cfgs = [
        tiny("char_lm.py", f"--config.train.seed={s}", f"--config.optim.learning_rate={lr}")
        for s, lr in ((0, 1e-3), (1, 3e-3), (2, 1e-2))
    ]
    trainers = [train.Trainer(c) for c in cfgs]
    states = [t.init_state() for t in trainers]
    batches = [_lm_batch(t, i) for i, t in enumerate(trainers)]
    want = [
        t.train_step(jax.tree.map(np.asarray, s), b)
        for t, s, b in zip(trainers, states, batches, strict=True)
    ]
    stacked_batch = jax.tree.map(lambda *xs: np.stack(xs), *batches)
    for how in ("map", "vmap"):
        t = train.Trainer(cfgs[0], stack_by=how)
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
        got_state, got_metrics = t.stacked_train_step(stacked, stacked_batch)
        for i, (w_state, w_metrics) in enumerate(want):
            for a, b in zip(
                jax.tree.leaves(w_state["params"]),
                jax.tree.leaves(got_state["params"]),
                strict=True,
            ):
                np.testing.assert_allclose(np.asarray(b)[i], a, rtol=1e-5, atol=1e-6, err_msg=how)
            # The metrics nest (the registered step metrics sit under "metrics"): leaf by leaf.
            w_flat = jax.tree_util.tree_flatten_with_path(w_metrics)[0]
            g_flat = jax.tree_util.tree_flatten_with_path(got_metrics)[0]
            assert [p for p, _ in w_flat] == [p for p, _ in g_flat], how
            for (path, v), (_, g) in zip(w_flat, g_flat, strict=True):
                key = jax.tree_util.keystr(path)
                np.testing.assert_allclose(np.asarray(g)[i], v, rtol=1e-5, err_msg=key)
    with pytest.raises(ValueError, match="stack_by"):
        train.Trainer(cfgs[0], stack_by="pmap")
