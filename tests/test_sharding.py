"""Training and decoding on a device mesh equal one device; meshes and rules fail clearly.

The suite runs on one CPU device; the tests that need a mesh run in a child process with 8
fake CPU devices (``--xla_force_host_platform_device_count=8``), started by
``test_mesh_tests_pass_on_eight_cpu_devices``. In the parent they skip, saying so.
"""

import os
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
import xla_flags
from xla_flags import CHILD, on_mesh

from attnlab import experiment
from attnlab.devices import sharding
from attnlab.train import Trainer

REPO = pathlib.Path(__file__).resolve().parents[1]


VARIANT_TEST = "test_every_built_in_variant_trains_and_decodes_on_a_mesh_like_one_device"
# One variant of each kind (score function, gated, recurrent, latent, sparse) runs with
# .ci/run; the others run with .ci/long (tests/tiers.py LONG), for .ci/run's time.
FIRST_VARIANTS = ("fox", "gated", "mamba", "mla", "nsa")


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles every sharded program")
@pytest.mark.parametrize("part", ["layouts", "variants", "other_variants"])
def test_mesh_tests_pass_on_eight_cpu_devices(part):
    """The mesh tests in three children, which the later tiers' workers share: every test but
    the built-in variants', then the variants in two halves."""
    if part == "layouts":
        xla_flags.run_on_devices(__file__, "-k", f"not {VARIANT_TEST}")
        return
    first = part == "variants"
    mixers = [m for m in sorted(BUILT_IN_VARIANTS) if (m in FIRST_VARIANTS) == first]
    xla_flags.run_on_devices(*(f"{__file__}::{VARIANT_TEST}[{m}]" for m in mixers))


# Meshes and rules (no devices needed) --------------------------------------------------------


def test_mesh_shape_fills_one_axis_and_names_both_numbers():
    assert sharding.mesh_shape({"data": -1}, 8) == (8, 1, 1, 1, 1)
    assert sharding.mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 2, 1, 1)
    with pytest.raises(sharding.MeshError, match=r"has 6 devices but 8 are present"):
        sharding.mesh_shape({"data": 3, "tensor": 2}, 8)
    with pytest.raises(sharding.MeshError, match="at most one may be -1"):
        sharding.mesh_shape({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(sharding.MeshError, match=r"8 devices are not a multiple of 3"):
        sharding.mesh_shape({"data": -1, "tensor": 3}, 8)


def fake_mesh(**sizes):
    return types.SimpleNamespace(shape={a: sizes.get(a, 1) for a in sharding.MESH_AXES})


def test_logical_axes_come_from_the_parameter_names():
    rules = sharding.resolve_rules()
    mesh = fake_mesh(fsdp=2, tensor=4)
    key = jax.tree_util.DictKey
    path = (key("decoder"), key("layers"), key("attn"), key("q_DNH"))
    names = sharding.logical_names(path, (3, 32, 8, 4))
    assert names == ("layers", "embed", "heads", "head_dim")
    assert tuple(sharding.spec(names, (3, 32, 8, 4), mesh, rules, what="q")) == (
        None,
        "fsdp",
        "tensor",
        None,
    )
    # A dimension an axis cannot split stays whole (kv heads), or fails (heads, batch).
    assert tuple(sharding.spec(("kv_heads",), (2,), mesh, rules, what="k")) == (None,)
    with pytest.raises(sharding.MeshError, match=r"heads dimension \(6\).*\(4 devices\)"):
        sharding.spec(("heads",), (6,), mesh, rules, what="parameter q")
    # One mesh axis serves one array axis: a [D, D] matrix is split once.
    assert tuple(sharding.spec(("embed", "embed"), (32, 32), mesh, rules, what="t")) == (
        "fsdp",
        None,
    )
    with pytest.raises(sharding.MeshError, match="no shape suffix"):
        sharding.logical_names((key("weights"),), (3, 4))


def test_rules_are_data_and_unknown_names_fail():
    rules = sharding.resolve_rules({"embed": None, "mlp": ["tensor"]})
    assert rules["embed"] is None and rules["mlp"] == ("tensor",)
    with pytest.raises(sharding.MeshError, match="logical axis 'embd'"):
        sharding.resolve_rules({"embd": "fsdp"})
    with pytest.raises(sharding.MeshError, match="no mesh axis"):
        sharding.resolve_rules({"embed": "model"})


# On 8 devices ---------------------------------------------------------------------------------


def tiny(**model):
    cfg = experiment.load_config(str(REPO / "experiments" / "char_lm.py") + ":tiny")
    cfg.model.update(
        dict(
            vocab_size=64,
            d_model=32,
            n_heads=8,
            n_kv_heads=4,
            d_ff=64,
            n_layers=2,
            max_len=16,
            dropout=0.1,
            attention_dropout=0.1,
        )
        | model
    )
    cfg.data.seq_len = 16
    cfg.train.update(batch_size=8, steps=8)
    cfg.optim.warmup_steps = 2
    return cfg


def batches(n, B=8, T=16, V=64):
    rng = np.random.default_rng(0)
    return [
        {
            "inputs": rng.integers(0, V, (B, T), dtype=np.int32),
            "targets": rng.integers(0, V, (B, T), dtype=np.int32),
            "loss_mask": np.ones((B, T), np.float32),
        }
        for _ in range(n)
    ]


def run_steps(trainer, state, data):
    losses = []
    for b in data:
        state, m = trainer.train_step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def trains_on_a_mesh_like_one_device(cfg):
    """Three steps on a data x fsdp x tensor mesh give one device's losses; returns the
    state on the mesh."""
    data = batches(3)
    one = Trainer(cfg, kind="lm")
    _, want = run_steps(one, one.init_state(), data)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    many = Trainer(cfg, kind="lm", mesh=mesh)
    state, got = run_steps(many, many.init_state(), data)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    return state


def decodes_on_a_mesh_like_one_device(model):
    """Cached greedy decoding of ragged prompts on a data x tensor mesh gives one device's
    tokens and logits."""
    from attnlab import generate

    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    one = generate(model, prompts, 5, return_logits=True, eos_id=None)
    mesh = sharding.make_mesh({"data": 2, "tensor": 4})
    sharded = generate(model, prompts, 5, return_logits=True, eos_id=None, mesh=mesh)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_allclose(sharded.logits, one.logits, atol=1e-5, rtol=1e-5)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def one_device():
    """Four steps on one device: the losses, and the parameters after three."""
    cfg = tiny()
    trainer = Trainer(cfg, kind="lm")
    data = batches(4)
    state, losses = run_steps(trainer, trainer.init_state(), data[:3])
    params = host(state["params"])
    _, last = run_steps(trainer, state, data[3:])
    return types.SimpleNamespace(cfg=cfg, data=data, losses=losses + last, params=params)


@on_mesh
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)])
def test_training_on_a_mesh_equals_one_device(one_device, shape):
    mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape, strict=True)))
    many = Trainer(one_device.cfg, kind="lm", mesh=mesh)
    state8, losses8 = run_steps(many, many.init_state(), one_device.data[:3])
    np.testing.assert_allclose(losses8, one_device.losses[:3], rtol=1e-5)
    got, want = jax.tree.leaves(host(state8["params"])), jax.tree.leaves(one_device.params)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    leaf = state8["params"]["decoder"]["layers"]["attn"]["q_DNH"]
    assert len(leaf.sharding.device_set) == 8


@pytest.fixture(scope="module")
def fsdp_trainer():
    return Trainer(tiny(d_model=64, d_ff=128), kind="lm", mesh=sharding.make_mesh({"fsdp": 8}))


@on_mesh
def test_fsdp_holds_one_eighth_of_the_parameters_per_device(fsdp_trainer):
    params = fsdp_trainer.init_state()["params"]
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    replicated = sum(x.nbytes for x in jax.tree.leaves(params) if x.sharding.is_fully_replicated)
    per_device = sharding.per_device_bytes(params)
    assert per_device == (whole - replicated) // 8 + replicated
    assert replicated < whole / 20  # only vectors along no sharded axis (e.g. biases of H)
    assert per_device < whole / 6


@on_mesh
def test_initialisation_is_sharded_from_the_start(fsdp_trainer):
    """The init program's outputs are sharded: no device materialises the whole model."""
    compiled = fsdp_trainer.jitted_init.lower(np.uint32(0)).compile()
    whole = sum(
        np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(fsdp_trainer.abstract_state())
    )
    out_bytes = compiled.memory_analysis().output_size_in_bytes
    assert out_bytes < whole / 4  # per device


@on_mesh
def test_save_on_one_mesh_restore_on_another_and_continue(one_device, tmp_path):
    from attnlab.runs.checkpoint import Checkpointer

    cfg, data = one_device.cfg, one_device.data
    first = Trainer(cfg, kind="lm", mesh=sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    state, got = run_steps(first, first.init_state(), data[:2])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        second = Trainer(cfg, kind="lm", mesh=sharding.make_mesh({"fsdp": 4, "tensor": 2}))
        target = second.abstract_state()
        restored = ckpt.restore(target, 2)
    q = restored["params"]["decoder"]["layers"]["attn"]["q_DNH"]
    assert q.sharding == target["params"]["decoder"]["layers"]["attn"]["q_DNH"].sharding
    _, rest = run_steps(second, restored, data[2:])
    np.testing.assert_allclose(got + rest, one_device.losses, rtol=1e-5)


@on_mesh
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_sharded_cached_decoding_equals_one_device(arch):
    from attnlab import ModelConfig, build_model, generate

    cfg = ModelConfig(
        arch=arch, vocab_size=64, d_model=32, n_heads=8, n_kv_heads=2, n_layers=2, max_len=32,
        init_std=0.3,
    )  # fmt: skip
    model = build_model(cfg, seed=0)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]  # 3 rows: padded to the data axis
    kw = dict(start_id=1) if arch == "encoder_decoder" else {}
    want = generate(model, prompts, 6, return_logits=True, **kw)
    mesh = sharding.make_mesh({"data": 2, "tensor": 4})
    got = generate(model, prompts, 6, return_logits=True, mesh=mesh, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert got.tokens.shape == (3, 6)


@pytest.mark.slow(reason="three training processes, two of them joined through gloo")
@pytest.mark.skipif(CHILD, reason="starts its own processes; runs in the parent")
def test_two_processes_of_four_devices_train_like_one(tmp_path):
    """jax.distributed on localhost: 2 processes x 4 CPU devices (one 8-way data mesh) log
    the losses of a single-process run, and write checkpoints from both processes."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = [
        "-m", "attnlab.cli", "train", "--no-progress",
        "--config", str(REPO / "experiments" / "char_lm.py") + ":tiny",
        "--config.train.steps=3", "--config.train.batch_size=8", "--config.eval.batches=0",
        "--config.train.log_every_steps=1", "--config.checkpoint.every_steps=2",
        "--config.track.tensorboard=False",
        # Windows at shuffled offsets make the same global batch for any process count; the
        # packed pipeline packs each process's share of documents, so its rows depend on it.
        "--config.data.pipeline=index",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    env["XLA_FLAGS"] = xla_flags.devices(4)
    hosts = [
        subprocess.Popen(
            [
                sys.executable,
                *args,
                "--workdir",
                str(tmp_path / "two"),
                f"--config.distributed.coordinator_address=localhost:{port}",
                "--config.distributed.num_processes=2",
                f"--config.distributed.process_id={i}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in hosts]
    one_env = dict(env, XLA_FLAGS=xla_flags.devices(1))
    single = subprocess.run(  # after the two: gloo's start-up waits only 30 s for its peers
        [sys.executable, *args, "--workdir", str(tmp_path / "one")],
        cwd=REPO, env=one_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    for p, out in zip(hosts, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]

    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["train_loss"] for line in lines]

    assert len(losses("two")) == 3
    np.testing.assert_allclose(losses("two"), losses("one"), rtol=1e-5)
    assert "step=1" in outputs[0] and "step=1" not in outputs[1]  # process 0 speaks
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["2", "3"]


@on_mesh
def test_a_loaded_checkpoint_decodes_on_a_mesh():
    from attnlab import generate, load_pretrained

    folder = REPO.parent / "shared" / "fixtures" / "hf" / "gpt2"
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent: the Hugging Face fixtures live beside the checkout")
    lm = load_pretrained(folder)
    prompts = [[64, 90, 31], [40, 58]]
    want = generate(lm, prompts, 5, return_logits=True)
    mesh = sharding.make_mesh({"data": 2, "tensor": 4})
    got = generate(lm, prompts, 5, return_logits=True, mesh=mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)


@on_mesh
def test_accumulation_and_bfloat16_on_a_mesh_equal_one_device(one_device):
    cfg = tiny(dtype="bfloat16")
    cfg.optim.grad_accum_steps = 2
    data = one_device.data[:2]
    one = Trainer(cfg, kind="lm")
    _, want = run_steps(one, one.init_state(), data)
    many = Trainer(cfg, kind="lm", mesh=sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    _, got = run_steps(many, many.init_state(), data)
    np.testing.assert_allclose(got, want, rtol=2e-2)  # bfloat16 activations


@on_mesh
def test_resume_on_the_same_mesh_is_bitwise_and_stacked_trials_train_on_a_mesh(
    one_device, tmp_path
):
    from attnlab.runs.checkpoint import Checkpointer

    cfg, data = one_device.cfg, one_device.data
    mesh = sharding.make_mesh({"data": 4, "tensor": 2})
    whole = Trainer(cfg, kind="lm", mesh=mesh)
    end, want = run_steps(whole, whole.init_state(), data)
    first = Trainer(cfg, kind="lm", mesh=mesh)
    state, got = run_steps(first, first.init_state(), data[:2])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        state = ckpt.restore(first.abstract_state(), 2)
    state, rest = run_steps(first, state, data[2:])
    assert got + rest == want  # bitwise
    for a, b in zip(jax.tree.leaves(host(state)), jax.tree.leaves(host(end)), strict=True):
        np.testing.assert_array_equal(a, b)

    # Two stacked (vmapped) trials on the mesh: each equals its lone single-device run.
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[host(whole.init_state())] * 2)
    batch = jax.tree.map(lambda *xs: np.stack(xs), data[0], data[0])
    _, metrics = whole.stacked_train_step(stacked, batch)
    np.testing.assert_allclose(np.asarray(metrics["loss"]), [one_device.losses[0]] * 2, rtol=1e-5)


@on_mesh
def test_trials_sharing_one_initialisation_program_train_on_a_mesh(one_device):
    from compile_count import compiles

    mesh = sharding.make_mesh({"data": 4, "tensor": 2})
    Trainer(one_device.cfg, kind="lm", mesh=mesh).init_state()
    other = tiny()
    other.train.seed = int(one_device.cfg.train.seed) + 1
    other.optim.learning_rate = 3 * float(one_device.cfg.optim.learning_rate)
    trainer = Trainer(other, kind="lm", mesh=mesh)
    with compiles() as count:
        state = trainer.init_state()  # the first trainer's program, this trial's values
        assert count() == 0
    _, got = run_steps(trainer, state, one_device.data[:2])
    alone = Trainer(other, kind="lm")  # one device: a program of its own
    _, want = run_steps(alone, alone.init_state(), one_device.data[:2])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got != one_device.losses[:2]


@on_mesh
def test_muon_orthogonalising_layers_on_separate_devices_equals_one_device(one_device):
    cfg = tiny(dropout=0.0, attention_dropout=0.0)
    cfg.optim.name = "muon"
    cfg.optim.learning_rate = 0.02
    data = one_device.data[:3]
    one = Trainer(cfg, kind="lm")
    end, want = run_steps(one, one.init_state(), data)
    # 2 layers over data=2: each device runs Newton-Schulz on one layer's matrices
    many = Trainer(cfg, kind="lm", mesh=sharding.make_mesh({"data": 2, "tensor": 4}))
    state, got = run_steps(many, many.init_state(), data)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(host(state["params"])), jax.tree.leaves(host(end["params"])), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# mixer -> the model fields it runs with, besides ``mixer`` (RoPE unless they say otherwise)
BUILT_IN_VARIANTS = {
    "sinks": {},
    "gated": {"mixer_settings": {"kind": "elementwise"}},
    "differential": {},
    "mla": {"mixer_settings": {"q_lora_rank": 16}},
    "fox": dict(
        position="none", attention_impl="chunked", attention_block_q=4, attention_block_k=8
    ),
    "short_conv": {},
    "mamba": {},
    "lightning": {"mixer_settings": {"block_size": 4}},
    "kda": {"mixer_settings": {"chunk_size": 4}},
    # the sparse mixers at settings that select a part of the 16 keys
    "dsa": {"mixer_settings": {"q_lora_rank": 16, "topk": 4}},
    "moba": {"mixer_settings": {"block_size": 4, "topk": 1}},
    "nsa": {
        "mixer_settings": dict(
            compress_block=4, compress_stride=2, select_block=4, top_n=2, local_blocks=1, window=4
        )
    },
}


@on_mesh
@pytest.mark.parametrize("mixer", sorted(BUILT_IN_VARIANTS))
def test_every_built_in_variant_trains_and_decodes_on_a_mesh_like_one_device(mixer):
    """Each variant's parameters carry logical axes, so the same steps shard them; three
    steps on a data x fsdp x tensor mesh and cached decoding equal one device."""
    from attnlab import ModelConfig, build_model

    fields = dict(position="rope", dropout=0.0, attention_dropout=0.0) | BUILT_IN_VARIANTS[mixer]
    settings = fields.pop("mixer_settings", {})
    cfg = tiny(mixer=mixer, **fields)
    with cfg.unlocked():
        cfg.model.mixer_settings = settings
    trains_on_a_mesh_like_one_device(cfg)
    model = build_model(ModelConfig(**experiment.model_config(cfg).to_dict()), seed=0)
    decodes_on_a_mesh_like_one_device(model)
