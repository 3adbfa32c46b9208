"""The viz helpers the notebooks use: masks, position tables, head scores, run samples."""

import json

import numpy as np
import pytest

from attnlab import ops, viz


def _image(ax):
    return np.asarray(ax.get_images()[0].get_array())


def test_plot_mask_draws_the_mask_it_is_given():
    mask = ops.causal(5)  # [1, 1, 5, 5]
    fig = viz.plot_mask(mask, title="causal", key_labels="abcde", query_labels="abcde")
    (ax,) = fig.axes
    np.testing.assert_array_equal(_image(ax), np.tril(np.ones((5, 5))))
    assert ax.get_title() == "causal"
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcde")


def test_plot_mask_needs_one_row_and_head():
    with pytest.raises(ValueError, match=r"mask\[0, 0\]"):
        viz.plot_mask(np.ones((2, 1, 3, 3), bool))
    with pytest.raises(ValueError, match="key labels"):
        viz.plot_mask(np.ones((3, 4), bool), key_labels="ab")


def test_plot_masks_one_panel_per_entry():
    masks = {
        "causal": ops.causal(6),
        "window": ops.sliding_window(6, window=2),
        "cross": ops.cross(np.ones((1, 4), bool), np.ones((1, 6), bool)),
    }
    fig = viz.plot_masks(masks, ncols=2)
    drawn = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in drawn] == list(masks)
    np.testing.assert_array_equal(_image(drawn[1]), np.asarray(masks["window"][0, 0], float))
    assert _image(drawn[2]).shape == (4, 6)
    assert len(fig.axes) == 4 and not fig.axes[3].axison  # the unused panel is blank
    with pytest.raises(ValueError, match="at least one"):
        viz.plot_masks({})


def test_plot_position_table_is_symmetric_in_colour():
    table = np.asarray(ops.sinusoidal(16, 8))
    fig = viz.plot_position_table(table, title="sin")
    image = fig.axes[0].get_images()[0]
    np.testing.assert_allclose(_image(fig.axes[0]), table)
    lo, hi = image.get_clim()
    assert lo == pytest.approx(-hi) and hi == pytest.approx(np.abs(table).max())


def test_previous_token_scores_finds_the_planted_head():
    T, N = 7, 3
    uniform_NTS = np.tril(np.ones((T, T)))
    uniform_NTS = np.broadcast_to(uniform_NTS / uniform_NTS.sum(-1, keepdims=True), (N, T, T))
    weights = np.array(uniform_NTS)
    weights[1] = np.eye(T, k=-1)
    weights[1, 0, 0] = 1.0
    scores = viz.previous_token_scores(weights)
    assert scores.shape == (N,)
    assert scores[1] == pytest.approx(1.0)
    expected_uniform = np.mean([1.0 / (i + 1) for i in range(1, T)])
    assert scores[0] == pytest.approx(expected_uniform)
    assert int(np.argmax(scores)) == 1
    # Leading axes (layers) are kept; offset=0 reads the main diagonal.
    stacked = viz.previous_token_scores(np.stack([weights, weights]))
    assert stacked.shape == (2, N)
    assert viz.previous_token_scores(weights, offset=0)[1] == pytest.approx(1.0 / T)


def test_previous_token_scores_rejects_short_inputs():
    with pytest.raises(ValueError, match="T=1"):
        viz.previous_token_scores(np.ones((2, 1, 1)))
    with pytest.raises(ValueError):
        viz.previous_token_scores(np.ones(4))


def test_plot_head_scores_annotates_every_cell():
    scores = np.arange(6, dtype=np.float32).reshape(2, 3) / 5
    fig = viz.plot_head_scores(scores, title="prev")
    ax = fig.axes[0]
    assert len(ax.texts) == 6
    assert ax.texts[5].get_text() == "1.00"
    assert viz.plot_head_scores(scores[0]).axes[0].get_images()[0].get_array().shape == (1, 3)


def test_read_samples(tmp_path):
    assert viz.read_samples(tmp_path) == []
    records = [{"step": 3, "text": "def f"}, {"step": 6, "text": "def g"}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert viz.read_samples(tmp_path) == records
    with pytest.raises(FileNotFoundError, match="work directory"):
        viz.read_samples(tmp_path / "missing")
