"""``run_harness`` reports each metric's standard error as the harness computes it (closed
form for a mean: the sample standard deviation over sqrt(n)), and the harness says nothing
about git when the working directory is not a repository.

The model is a bigram table in NumPy behind the real ``Backend`` adapter, so the test
exercises the harness wrapper without compiling a model."""

import json
import subprocess

import numpy as np
import pytest

pytest.importorskip("lm_eval")

V = 256
N_QUESTIONS = 24


def _bigram_backend():
    from attnlab.evaluation.backends import Backend

    logits_VV = np.random.default_rng(0).normal(0.0, 2.0, (V, V))
    logp_VV = logits_VV - np.log(np.exp(logits_VV).sum(-1, keepdims=True))

    class Bigram(Backend):
        def log_probs(self, tokens_BT):
            return logp_VV[np.asarray(tokens_BT)].astype(np.float32)

    return Bigram(
        name="bigram", model=None, graphdef=None, state=None, max_len=64,
        encode=lambda s: list(s.encode()), decode=lambda ids: bytes(ids).decode(errors="replace"),
        prefix_id=10, eos_id=None,
    )  # fmt: skip


def _task(folder):
    rng = np.random.default_rng(1)
    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
    rows = [
        {"q": f"q{i}:", "choices": [" " + w for w in rng.choice(words, 3, replace=False)],
         "answer": int(rng.integers(3))}
        for i in range(N_QUESTIONS)
    ]  # fmt: skip
    folder.mkdir()
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "mc.yaml").write_text(
        "task: bigram_mc\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n"
        f"  data_files:\n    test: {folder}/mc.jsonl\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    return folder


@pytest.mark.slow(reason="imports the harness and runs a task through it")
def test_harness_results_carry_the_standard_error_and_no_git_message(tmp_path, monkeypatch, capfd):
    import lm_eval.tasks
    from lm_eval.api.metrics import mean_stderr

    from attnlab.evaluation.harness import run_harness

    class LocalTasks(lm_eval.tasks.TaskManager):  # skips indexing the harness's own tasks
        def __init__(self, include_path=None):
            super().__init__(include_path=include_path, include_defaults=False)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    outside = tmp_path / "not_a_repo"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    git = subprocess.run(["git", "rev-parse"], cwd=outside, capture_output=True, check=False)
    if git.returncode == 0:
        pytest.skip("the temporary folder sits inside a git repository")
    monkeypatch.chdir(outside)
    out = run_harness(_bigram_backend(), "bigram_mc", include_path=_task(tmp_path / "t"),
                      log_samples=True)  # fmt: skip
    captured = capfd.readouterr()
    assert "fatal" not in captured.err and "not a git repository" not in captured.err

    results = out["results"]["bigram_mc"]
    acc = np.array([s["acc"] for s in out["samples"]["bigram_mc"]], np.float64)
    assert len(acc) == N_QUESTIONS and 0 < acc.mean() < 1
    assert results["acc,none"] == pytest.approx(acc.mean())
    stderr = results["acc_stderr,none"]
    assert isinstance(stderr, float)
    assert stderr == pytest.approx(acc.std(ddof=1) / np.sqrt(N_QUESTIONS), rel=1e-12)
    assert stderr == pytest.approx(mean_stderr(list(acc)), rel=1e-12)
