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
from attnlab.contracts.mixer import MixerSettings, register_mixer
from attnlab.nn.mixers.mha import Attention

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
    assert sizes["mha"] == {"d_model": 64, "d_ff": 256, "params": 102_976, "ratio": 1.0}
    wide = sizes["wide_gate"]
    assert wide["d_model"] < 64 and wide["d_model"] % 8 == 0
    assert abs(wide["ratio"] - 1) < 0.1


def test_the_recurrent_rows_and_hybrids_are_matched_within_one_ffn_column():
    model = zoo.get_config("zoology").model
    sizes = zoo.matched_sizes(model, zoo.SWEEPS["zoology"].rows)
    target = sizes["mha"]["params"]
    for name, size in sizes.items():
        # one hidden unit of the FFN holds 2 * d_model + 1 parameters per layer (gelu)
        layers = zoo.zoo_rows()[name].get("n_layers", 2)
        assert abs(size["params"] - target) <= layers * (2 * size["d_model"] + 1), name
    assert sizes["hybrid_3to1"]["d_model"] < 64 == sizes["hybrid_1to1"]["d_model"]


def test_the_sweep_covers_every_row_and_the_table_reads():
    plan = sweep.load_sweep(f"{REPO / 'experiments' / 'attention_zoo.py'}:tiny", [])
    names = [zoo.row_of(t.cfg.model.to_dict()) for t in plan.trials]
    assert set(names) == set(zoo.zoo_rows()) == set(zoo.builtin_mixers()) | set(zoo.HYBRIDS)
    assert {"gated_deltanet", "mamba2", "hybrid_3to1", "hybrid_1to1"} <= set(names)
    assert len(plan.trials) == len(set(names)) * 2  # one training set, two seeds
    assert all(t.cfg.data.kind == "mqar" for t in plan.trials)
    hybrid = next(t.cfg.model for t in plan.trials if zoo.row_of(t.cfg.model.to_dict()) ==
                  "hybrid_3to1")  # fmt: skip
    assert hybrid.n_layers == 4 and list(hybrid.block_pattern.block)[-1] == "mha"
    zoology = sweep.load_sweep(f"{REPO / 'experiments' / 'attention_zoo.py'}:zoology", [])
    assert {(t.cfg.data.seq_len, t.cfg.data.max_len) for t in zoology.trials} == {(64, 16)}
    assert zoo.eval_pairs(4, 16) == [4, 8, 16] and zoo.eval_pairs(3, 6) == [3, 4, 6]
    table = [
        {"variant": "mha", "params": 1234, "trained_pairs": [2, 4], "pairs": 2, "seq_len": 16,
         "seeds": 2, "lengths": [16, 32], "mean": [0.5, 0.25], "std": [0.1, 0.0]},
    ]  # fmt: skip
    lines = zoo.markdown(table).splitlines()
    assert (
        lines[2] == "| mha | 1,234 | 2-4 | 2 | 16 | 2 | 0.500 ± 0.100 | 0.250 ± 0.000 | n/a | n/a |"
    )
    assert zoo.recall_by_pairs(table).axes[0].get_xlabel() == "key-value pairs"


# About a minute and a half on 2 shared CPU cores: a sweep compiles the train step of each
# row and the report four evaluation programs (one per length) of each.
@pytest.mark.slow(reason="trains mha (2 seeds) and the 3:1 hybrid, then scores them at 4 lengths")
def test_the_tiny_sweep_runs_and_reports(tmp_path):
    plan = sweep.load_sweep(f"{REPO / 'experiments' / 'attention_zoo.py'}:tiny", [])
    keep = {("mha", 0), ("mha", 1), ("hybrid_3to1", 0)}
    plan = dataclasses.replace(plan, trials=[
        t for t in plan.trials if (zoo.row_of(t.cfg.model.to_dict()), t.cfg.train.seed) in keep
    ])  # fmt: skip
    sweep.run_sweep(plan, tmp_path)
    out = zoo.report(tmp_path)
    mha, hybrid = sorted(out["table"], key=lambda e: e["variant"] != "mha")
    assert (mha["variant"], mha["seeds"], mha["lengths"]) == ("mha", 2, [16, 32, 64, 128])
    assert (hybrid["variant"], hybrid["seeds"], hybrid["pairs"]) == ("hybrid_3to1", 1, 2)
    assert hybrid["lengths"] == [16, 32, 64, 128] and hybrid["std"] == [0.0] * 4
    assert all(0 <= m <= 1 for e in (mha, hybrid) for m in e["mean"])
    assert json.loads((tmp_path / "zoo.json").read_text()) == out["table"]
    for png in ("extrapolation_mha", "extrapolation_hybrid_3to1", "recall_by_pairs"):
        assert (tmp_path / f"{png}.png").stat().st_size > 0
    assert "acc at 8T" in (tmp_path / "zoo.md").read_text()
