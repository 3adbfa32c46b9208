"""The passkey experiment's tools on its tiny variant: warm start and accuracy against distance."""

import json
import pathlib

import jax
import numpy as np

from attnlab import experiment, runs

PATH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "long_context_passkey.py"


def test_tiny_run_warm_starts_and_scores_by_distance(tmp_path, capsys):
    exp = experiment.import_experiment(PATH)
    cfg = experiment.load_config(f"{PATH}:tiny")
    runs.train(cfg, tmp_path / "short", progress=False)

    assert exp.warm_start(tmp_path / "short", tmp_path / "long", variant="tiny") == 2
    source = runs.load_run(tmp_path / "short").params
    long = runs.load_run(tmp_path / "long")
    params, step = long.params, long.step
    assert step == 0
    for a, b in zip(jax.tree.leaves(source), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)

    capsys.readouterr()
    exp.main(["--workdir", str(tmp_path / "short"), "--rows", "10", "--buckets", "4"])
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 2 and result["seq_len"] == 64
    buckets = result["buckets"]
    assert len(buckets) == 4 and sum(b["rows"] for b in buckets) == 10
    assert buckets[0]["lo"] == 5 and buckets[-1]["hi"] == 64 - 4 - 2  # every drawn distance
    assert all(b["lo"] == a["hi"] + 1 for a, b in zip(buckets, buckets[1:], strict=False))
    assert sum(k["rows"] for k in result["keys"].values()) == 10
    for b in [result, *buckets]:
        assert b["exact_match"] is None or 0.0 <= b["exact_match"] <= b["token_accuracy"] <= 1.0
    png = tmp_path / "short" / "passkey_accuracy_64.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
