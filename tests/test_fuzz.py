"""Fuzzing the `attnlab` command: drawn config overrides, data files and sampling arguments,
valid and invalid. Each invocation either succeeds with finite results or fails with one line
that names a field or flag; never a traceback, a hang or a NaN reported as success."""

import json
import math
import pathlib
import re
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from run_checks import TINY, call_cli

BASE = ["--config.train.steps=2", "--config.eval.batches=0", "--config.eval.sample_tokens=0"]
BASE += ["--config.model.d_model=16", "--config.model.d_ff=32"]
NAMES = re.compile(r"(--[a-z][\w-]*|\b[a-z_]+\.[a-z_0-9]+\b|config\.json|data\.path)")

OVERRIDES = {
    "optim.learning_rate": ["0.01", "-1.0", "nan", "1e30"],
    "optim.b2": ["0.95", "1.5", "-0.1"],
    "optim.eps": ["1e-8", "0.0", "inf"],
    "optim.clip_norm": ["0.0", "-2.0"],
    "train.steps": ["3", "0"],
    "train.batch_size": ["2", "0"],
    "train.on_nonfinite": ["skip", "maybe"],
    "data.seq_len": ["8", "0", "64"],
    "data.val_fraction": ["0.2", "0.0", "1.5"],
    "model.vocab_size": ["256", "4"],
    "model.n_heads": ["2", "3", "0"],
    "eval.sample_temperature": ["0.5", "-1.0"],
}
TEXT = "def add(a, b):\n    return a + b\n\n" * 40
DATA = st.sampled_from(["", TEXT, TEXT[:30], "caf\xe9", None])
FUZZ = settings(
    max_examples=12,
    deadline=120_000,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# The fast tier draws the first few examples of each property, the slow tier all of them.
FEW = settings(FUZZ, max_examples=3)
ALL = pytest.mark.slow(reason="every drawn example is a CLI run that compiles its own shapes")


def assert_one_named_error(err, command):
    lines = [line for line in err.splitlines() if not line.startswith("attnlab: warning")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"attnlab {command}: error: "), lines[0]
    assert NAMES.search(lines[0].split("error: ", 1)[1]), lines[0]


TRAIN_DRAWS = given(
    overrides=st.dictionaries(st.sampled_from(sorted(OVERRIDES)), st.just(None), max_size=3).map(
        lambda keys: sorted(keys)
    ),
    choice=st.data(),
    text=DATA,
)


def train_runs_or_fails_with_one_named_error(capsys, overrides, choice, text):
    argv = [
        f"--config.{k}={choice.draw(st.sampled_from(OVERRIDES[k]), label=k)}" for k in overrides
    ]
    with tempfile.TemporaryDirectory() as tmp:
        if text is not None:
            path = pathlib.Path(tmp) / "data.txt"
            path.write_bytes(text.encode("latin-1" if "\xe9" in text else "utf-8"))
            argv.append(f"--config.data.path={path}")
        workdir = pathlib.Path(tmp) / "run"
        rc, out, err = call_cli(
            capsys, ["train", "--no-progress", "--config", TINY, "--workdir", str(workdir)]
            + BASE + argv,
        )  # fmt: skip
        if rc == 0:
            record = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
            assert math.isfinite(record["train_loss"]), out
        else:
            assert rc in (1, 2), (rc, err)
            assert_one_named_error(err, "train")
            if rc == 2:  # refused before starting: nothing written
                assert not workdir.exists(), list(workdir.iterdir())


test_train_runs_or_fails_with_one_named_error = FEW(
    TRAIN_DRAWS(train_runs_or_fails_with_one_named_error)
)
test_train_runs_or_fails_with_one_named_error_all = ALL(
    FUZZ(TRAIN_DRAWS(train_runs_or_fails_with_one_named_error))
)

SAMPLE_DRAWS = given(
    prompt=st.sampled_from([None, "def ", "", "\u2603", "x" * 40]),
    max_new_tokens=st.sampled_from(["0", "3", "200", "-1"]),
    temperature=st.sampled_from(["0", "0.7", "-1", "nan", "inf"]),
    top_k=st.sampled_from(["0", "5", "-2"]),
    top_p=st.sampled_from(["1.0", "0.5", "0", "2"]),
    on_overflow=st.sampled_from(["stop", "raise", "wrap"]),
)


def sample_runs_or_fails_with_one_named_error(
    tiny_lm_run, capsys, prompt, max_new_tokens, temperature, top_k, top_p, on_overflow
):
    argv = ["sample", "--workdir", str(tiny_lm_run), "--max-new-tokens", max_new_tokens]
    argv += ["--temperature", temperature, "--top-k", top_k, "--top-p", top_p]
    argv += ["--on-overflow", on_overflow] + (["--prompt", prompt] if prompt is not None else [])
    rc, out, err = call_cli(capsys, argv)
    if rc == 0:
        assert out.startswith(prompt or "def "), out
    else:
        assert rc == 2, (rc, err)
        assert_one_named_error(err, "sample") if on_overflow != "wrap" else None
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


test_sample_runs_or_fails_with_one_named_error = settings(FEW, max_examples=6)(
    SAMPLE_DRAWS(sample_runs_or_fails_with_one_named_error)
)
test_sample_runs_or_fails_with_one_named_error_all = ALL(
    settings(FUZZ, max_examples=25)(SAMPLE_DRAWS(sample_runs_or_fails_with_one_named_error))
)


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
