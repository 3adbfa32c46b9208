"""experiments/attention_zoo.py: variants matched in size, the sweep it plans, the results
table; its tiny sweep end to end (slow)."""

import dataclasses
import importlib.util
import json
import pathlib

import jax.numpy as jnp
import pytest
from flax import nnx

from attnlab import sweep
from attnlab.mixers import MixerSettings, register_mixer
from attnlab.nn.attention import Attention

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "attention_zoo", REPO / "experiments/attention_zoo.py"
)
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)


@register_mixer("wide_gate", overwrite=True)
class WideGate(Attention):
    """Attention with an extra [D, 4D] parameter (unused): more parameters at one d_model."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        pass

    def __init__(self, cfg, settings, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.extra_DF = nnx.Param(jnp.zeros((cfg.d_model, 4 * cfg.d_model)))


def test_matched_sizes_bring_a_bigger_variant_within_ten_percent():
    model = zoo.get_config().model
    sizes = zoo.matched_sizes(model, ["mha", "wide_gate"])
    assert sizes["mha"] == {"d_model": 64, "params": sizes["mha"]["params"], "ratio": 1.0}
    wide = sizes["wide_gate"]
    assert wide["d_model"] < 64 and wide["d_model"] % 8 == 0
    assert abs(wide["ratio"] - 1) < 0.1


def test_the_sweep_covers_every_builtin_variant_and_the_table_reads():
    plan = sweep.load_sweep(f"{REPO / 'experiments' / 'attention_zoo.py'}:tiny", [])
    mixers = {t.overrides["model.mixer"] for t in plan.trials}
    assert mixers == set(zoo.builtin_mixers()) and "mha" in mixers
    assert len(plan.trials) == len(mixers) * 2  # one pair count and length, two seeds
    assert all(t.cfg.data.kind == "mqar" for t in plan.trials)
    table = [
        {"mixer": "mha", "params": 1234, "pairs": 2, "seq_len": 16, "seeds": 2,
         "lengths": [16, 32], "mean": [0.5, 0.25], "std": [0.1, 0.0]},
    ]  # fmt: skip
    lines = zoo.markdown(table).splitlines()
    assert lines[2] == "| mha | 1,234 | 2 | 16 | 2 | 0.500 ± 0.100 | 0.250 ± 0.000 | n/a | n/a |"


# About a minute on 2 shared CPU cores: a sweep compiles the train step and the report four
# evaluation programs (one per length).
@pytest.mark.slow
def test_the_tiny_sweep_runs_and_reports(tmp_path):
    plan = sweep.load_sweep(f"{REPO / 'experiments' / 'attention_zoo.py'}:tiny", [])
    plan = dataclasses.replace(
        plan, trials=[t for t in plan.trials if t.overrides["model.mixer"] == "mha"]
    )
    sweep.run_sweep(plan, tmp_path)
    out = zoo.report(tmp_path)
    (entry,) = out["table"]
    assert (entry["mixer"], entry["seeds"], entry["lengths"]) == ("mha", 2, [16, 32, 64, 128])
    assert all(0 <= m <= 1 for m in entry["mean"])
    assert json.loads((tmp_path / "zoo.json").read_text()) == out["table"]
    assert (tmp_path / "extrapolation_mha.png").stat().st_size > 0
    assert "acc at 8T" in (tmp_path / "zoo.md").read_text()
