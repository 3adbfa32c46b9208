"""A variant in one's own file, used from the command line: ``--import FILE`` and an
experiment file that imports its neighbour, each registering the variant once and recording
it so another process reloads the run; and the cache each step of a mixer's call sees."""

import os
import pathlib
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import experiment, ops
from attnlab.cli import main
from attnlab.config import ModelConfig
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.errors import ConfigError
from attnlab.kv_cache import LayerCache
from attnlab.nn.mixers.mha import Attention

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"

VARIANT = """
import dataclasses

import jax.numpy as jnp
from flax import nnx

import attnlab
from attnlab.contracts.mixer import MixerSettings
from attnlab.nn.mixers.mha import Attention


@attnlab.register_mixer("{name}")
class Scaled(Attention):
    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        init: float = 1.0

    def __init__(self, cfg, settings, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.scale_N = nnx.Param(jnp.full((cfg.n_heads,), settings.init))

    def output(self, out_BTNH, x_BTD=None):
        return super().output(out_BTNH * self.scale_N[...][None, None, :, None], x_BTD)
"""

EXPERIMENT = """
from {stem} import Scaled  # noqa: F401  (the file beside this one registers "{name}")

from attnlab.experiment import base_config


def get_config(variant=None):
    c = base_config()
    c.model.update(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_len=16)
    c.model.mixer = "{name}"
    c.data.update(kind="copy", seq_len=8)
    return c
"""


@pytest.fixture
def variant(tmp_path, monkeypatch):
    """A variant file and an experiment file beside it, under names no other test uses."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder joins it for this test only
    tag = uuid.uuid4().hex[:8]
    stem, name = f"my_variant_{tag}", f"scaled_{tag}"
    (tmp_path / f"{stem}.py").write_text(VARIANT.format(name=name))
    (tmp_path / "my_experiment.py").write_text(EXPERIMENT.format(stem=stem, name=name))
    yield tmp_path / f"{stem}.py", tmp_path / "my_experiment.py", name
    sys.modules.pop(stem, None)


def test_an_experiment_file_imports_its_neighbour_as_a_script_would(variant):
    path, experiment_file, name = variant
    cfg = experiment.load_config(str(experiment_file))
    assert experiment.validate(cfg).mixer == name
    assert sys.modules[path.stem].Scaled is get_mixer(name)
    # the same file through --import is the same module: registered once, no clash
    again = experiment.load_config(str(experiment_file), imports=[path])
    assert tuple(again.imports) == (str(path.resolve()),)


def test_import_registers_before_the_overrides_and_is_recorded(variant):
    path, _, name = variant
    overrides = [f"--config.model.mixer={name}", "--config.model.mixer_settings.init=0.5"]
    cfg = experiment.load_config(TINY, overrides, imports=[path])
    mcfg = experiment.validate(cfg)
    assert (mcfg.mixer, mcfg.mixer_settings.init) == (name, 0.5)
    saved = experiment.from_json(experiment.to_json(cfg))  # as config.json holds it
    assert tuple(saved.imports) == (str(path.resolve()),)
    module = sys.modules[path.stem]
    experiment.register_variants(saved)  # imports it (here: again, as the same module)
    assert sys.modules[path.stem] is module and module.Scaled is get_mixer(name)


def test_an_import_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "json.py").write_text("")  # the standard library's json is imported already
    with pytest.raises(ConfigError, match="'json' is already taken"):
        experiment.import_file(tmp_path / "json.py")
    with pytest.raises(ConfigError, match="no such Python file"):
        experiment.import_file(tmp_path / "nothing.py")


SEEN = {}


class Probe(Attention):
    """mha, recording what ``attend`` is handed."""

    def attend(self, q_BTNH, k_BSKH, v_BSKH, call, **extra):
        SEEN["cache"], SEEN["keys"] = call.cache.read("keys"), k_BSKH
        return super().attend(q_BTNH, k_BSKH, v_BSKH, call, **extra)


@pytest.mark.slow(
    reason="builds and compiles a mixer call of its own (1-2.5 s); the fast tier "
    "keeps the import tests"
)
def test_attend_sees_the_cache_before_the_call_and_keys_with_the_call():
    cfg = ModelConfig(
        vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=6, position="none",
        attention_impl="reference",
    )  # fmt: skip
    mixer = Probe(cfg, rngs=nnx.Rngs(0))
    B, S, K, H = 2, cfg.max_len, cfg.n_kv_heads, cfg.head_dim
    start_B = jnp.array([2, 4], jnp.int32)
    written_BS = np.arange(S)[None, :] < np.asarray(start_B)[:, None]
    mask_1BKSH = written_BS[None, :, None, :, None]
    old = {  # [L=1, B, K, S, H], zero past each row's tokens
        r: jax.random.normal(jax.random.key(i), (1, B, K, S, H)) * mask_1BKSH
        for i, r in enumerate(("keys", "values"))
    }
    axes = (("keys", 1), ("values", 1))
    x_BTD = jax.random.normal(jax.random.key(7), (B, 1, cfg.d_model))

    @jax.jit  # one program: what attend saw, the cache returned and the one given
    def call_once(old, x_BTD):
        cache = LayerCache(old, jnp.int32(0), start_B, jnp.ones((B,), jnp.int32), slot_axes=axes)
        mask = ops.MaskSpec.for_cache(1, S, start_B)
        call = MixerCall(positions_BT=start_B[:, None], mask=mask, cache=cache)
        _, after, _ = mixer(x_BTD, call)
        return SEEN["cache"], SEEN["keys"], after.read("keys"), call.cache.read("keys")

    before_BKSH, k_BSKH, after_BKSH, given_BKSH = call_once(old, x_BTD)
    # the new key by hand: x k_DKH in float64 (no bias, norm or positions in this config)
    new_BKH = np.einsum("bd,dkh->bkh", np.asarray(x_BTD[:, 0], np.float64), mixer.k_DKH[...])
    rows = np.arange(B)
    # attend's call.cache is the cache before the call: the slot of the call's token empty
    np.testing.assert_array_equal(before_BKSH, old["keys"][0])
    assert not np.asarray(before_BKSH)[rows, :, np.asarray(start_B)].any()
    # the keys it is handed hold the earlier tokens and the call's own, in its slot
    expected_BKSH = np.array(old["keys"][0], np.float64)
    expected_BKSH[rows, :, np.asarray(start_B)] = new_BKH
    np.testing.assert_allclose(np.swapaxes(k_BSKH, 1, 2), expected_BKSH, rtol=1e-5, atol=1e-6)
    # the cache the call returns holds them too; the one it was given is unchanged
    np.testing.assert_allclose(after_BKSH, expected_BKSH, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(given_BKSH, old["keys"][0])


@pytest.mark.slow(reason="trains the tiny run and samples it in a new interpreter (~10 s)")
def test_train_with_import_then_sample_in_another_process(variant, tmp_path, capsys):
    path, _, name = variant
    workdir = tmp_path / "runs" / "scaled"
    argv = ["train", "--import", str(path), "--config", TINY, "--workdir", str(workdir)]
    argv += [f"--config.model.mixer={name}", "--config.eval.batches=0", "--no-progress"]
    argv += ["--config.train.steps=1", "--config.checkpoint.every_steps=1"]
    assert main(argv) == 0, capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sample = [sys.executable, "-m", "attnlab.cli", "sample", "--workdir", str(workdir)]
    done = subprocess.run(
        [*sample, "--prompt", "def ", "--max-new-tokens", "4"],
        env=env,
        cwd=tmp_path / "runs",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def ")
