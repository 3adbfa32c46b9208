"""Loss by length (``attnlab.evaluation.length``): equal to a direct computation in both modes,
``--rope-scaling`` equal to the same scaling in the config, and limits refused in one line."""

import pathlib

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model
from attnlab.errors import ConfigError
from attnlab.evaluation import length


def _tiny(position="rope", max_len=32):
    cfg = ModelConfig(
        arch="decoder", vocab_size=17, d_model=16, n_layers=1, n_heads=2, max_len=max_len,
        position=position, norm="rmsnorm",
    )  # fmt: skip
    return cfg, nnx.state(build_model(cfg, seed=0))


def _scorable(cfg, state, limit=None, train_len=16):
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 300)
    return length.Scorable("tiny", cfg, state, ids, limit, "the test's limit", train_len)


def _direct(cfg, state, ids, L, mode, tokens, stride=None):
    """Full forward per window, mean cross-entropy of the scored tokens."""
    model = nnx.merge(length.merged(cfg, state)[0], state)
    starts, first = length.windows(ids, L, mode, tokens, stride)
    total, count = 0.0, 0
    for s in starts:
        seq = np.asarray(ids[s : s + L + 1])[None].astype(np.int32)
        logits = model(seq[:, :-1]).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:])
        total += float(ce[0, first:].sum())
        count += L - first
    return total / count, count


@pytest.mark.parametrize("mode", ["chunks", "sliding"])
def test_loss_by_length_equals_a_direct_computation(mode):
    cfg, state = _tiny()
    s = _scorable(cfg, state)
    out = length.evaluate_lengths(s, [8, 16], modes=(mode,), tokens=32, chunk=8, rows=3)
    for row in out["results"]:
        want, count = _direct(cfg, state, s.ids, row["length"], mode, 32)
        assert row["tokens"] == count
        np.testing.assert_allclose(row["loss"], want, rtol=2e-5)
    assert [r["mode"] for r in out["results"]] == [mode] * 2


def test_sliding_scores_the_last_stride_tokens_of_each_window():
    starts, first = length.windows(np.arange(100), 16, "sliding", 32, stride=4)
    assert first == 12 and list(starts[:3]) == [0, 4, 8] and len(starts) == 8
    starts, first = length.windows(np.arange(100), 16, "chunks", 32)
    assert first == 0 and list(starts) == [0, 16]


def test_lengths_past_the_trained_ones_extend_the_positions():
    cfg, state = _tiny("alibi", max_len=8)  # nothing of ALiBi depends on max_len
    out = length.evaluate_lengths(_scorable(cfg, state), [8, 32], tokens=32, chunk=16)
    assert np.isfinite([r["loss"] for r in out["results"]]).all()


def test_rope_scaling_equals_the_same_scaling_in_the_config():
    cfg, state = _tiny()
    scaled = length.Scorable(
        "tiny", length._with_scaling(cfg, "yarn:4", 16), state, None, None, "", 16
    )
    assert scaled.cfg.rope_scaling.kind == "yarn" and scaled.cfg.rope_scaling.factor == 4.0
    same = cfg.replace(rope_scaling={"kind": "yarn", "factor": 4.0, "original_max_len": 16})
    ids = np.random.default_rng(1).integers(0, 17, 100)
    a = length.evaluate_lengths(
        length.Scorable("a", scaled.cfg, state, ids, None, "", 16), [32], tokens=32, chunk=8
    )
    b = length.evaluate_lengths(
        length.Scorable("b", same, state, ids, None, "", 16), [32], tokens=32, chunk=8
    )
    plain = length.evaluate_lengths(
        length.Scorable("c", cfg, state, ids, None, "", 16), [32], tokens=32, chunk=8
    )
    assert a["results"][0]["loss"] == pytest.approx(b["results"][0]["loss"], rel=1e-6)
    assert a["results"][0]["loss"] != plain["results"][0]["loss"]  # the scaling is applied


def test_rope_scaling_is_refused_for_other_positions_and_bad_specs():
    cfg, _ = _tiny("alibi")
    with pytest.raises(ConfigError, match="not rope"):
        length.parse_rope_scaling("yarn:4", cfg, 16)
    cfg, _ = _tiny()
    for bad in ("yarn", "longrope:4", "linear:-1"):
        with pytest.raises(ConfigError, match="KIND:FACTOR"):
            length.parse_rope_scaling(bad, cfg, 16)


def test_a_length_past_the_limit_is_one_line_before_any_compute(monkeypatch):
    cfg, state = _tiny("learned")
    scorable = _scorable(cfg, state, limit=32)
    scorable.limit_reason = "the learned position table of model.max_len=32 rows"
    monkeypatch.setattr(length, "score_length", lambda *a, **k: pytest.fail("computed"))
    with pytest.raises(ConfigError) as e:
        length.evaluate_lengths(scorable, [16, 64])
    message = str(e.value)
    assert "\n" not in message and "64" in message and "max_len=32" in message


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory):
    """A 2-step run of experiments/length_positions.py:tiny with a learned table of 64 rows."""
    from attnlab import experiment, runs

    root = pathlib.Path(__file__).resolve().parents[1]
    workdir = tmp_path_factory.mktemp("learned") / "run"
    spec = f"{root / 'experiments' / 'length_positions.py'}:tiny"
    cfg = experiment.load_config(spec, ["--config.model.position=learned"])
    runs.train(cfg, workdir, progress=False)
    return workdir


def test_the_cli_refuses_a_length_past_a_learned_table(learned_run, capsys):
    from attnlab import cli

    code = cli.main(["eval", "--workdir", str(learned_run), "--lengths", "16,128"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1
    assert "--lengths 128" in err and "max_len=64" in err


def test_the_cli_writes_json_and_a_plot(tiny_lm_run, tmp_path, capsys):
    import json

    from attnlab import cli

    code = cli.main(
        ["eval", "--workdir", str(tiny_lm_run), "--lengths", "8,32", "--tokens", "64",
         "--context-mode", "both", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code in (0, None)
    out = json.loads((tmp_path / "length_eval.json").read_text())
    rows = next(iter(out.values()))["results"]
    assert {(r["length"], r["mode"]) for r in rows} == {
        (8, "chunks"),
        (32, "chunks"),
        (8, "sliding"),
        (32, "sliding"),
    }
    assert (tmp_path / "length_eval_chunks.png").is_file()
    assert jax.numpy.isfinite(jax.numpy.asarray([r["loss"] for r in rows])).all()


def test_given_text_replaces_the_validation_split(tiny_lm_run):
    run = length.from_workdir(tiny_lm_run)
    text = run.decode(run.ids[:200])
    again = length.from_workdir(tiny_lm_run, text=text)
    np.testing.assert_array_equal(again.ids, run.ids[:200])


def test_seeds_average_into_a_mean_with_its_t_interval_in_the_table_and_plot(tmp_path):
    def result(losses):
        rows = [{"mode": "chunks", "length": n, "loss": v, "tokens": 64}
                for n, v in zip((16, 32), losses, strict=True)]  # fmt: skip
        return {"name": "run", "train_len": 16, "results": rows}

    seeds = [result([2.0, 2.5]), result([2.2, 2.9]), result([2.1, 2.6])]
    mean = length.mean_over_seeds(seeds)
    at_32 = np.array([2.5, 2.9, 2.6])
    # Student's t at 97.5% with 2 degrees of freedom is 4.303.
    half = 4.303 * at_32.std(ddof=1) / np.sqrt(3)
    row = mean["results"][1]
    np.testing.assert_allclose([row["loss"], row["loss_interval"]], [at_32.mean(), half])
    np.testing.assert_allclose(row["perplexity"], np.exp(at_32.mean()))
    assert row["loss_per_seed"] == [2.5, 2.9, 2.6] and mean["seeds"] == 3
    assert (
        f"| run | 2.100 ± {4.303 * 0.1 / np.sqrt(3):.3f} | {at_32.mean():.3f} ± {half:.3f} |"
        in (length.markdown_table({"run": mean}, ("chunks",)))
    )
    assert length.plot_lengths({"run": mean}, "chunks", tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(ValueError, match="different lengths"):
        length.mean_over_seeds(
            [seeds[0], result([1.0, 1.0]) | {"results": seeds[0]["results"][::-1]}]
        )
