"""``attnlab eval --harness``: the EleutherAI harness scores a run on local YAML tasks over JSON
Lines files the test writes; its log-likelihoods equal a direct float64 computation from the
run's logits, its greedy generations equal ``attnlab.generate`` row by row."""

import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")

QUESTIONS = [
    ("def f(x):\n    return", [" x", " None", " self"], 0),
    ("import os\nimport", [" sys", " re"], 1),
    ("class A:\n    def __init__(self", ["):", ", x):"], 0),
]
TEXTS = ["for i in range(10):\n    print(i)\n", "x = 1\n" * 12]  # the second spans windows
PROMPTS = ["def main(", "return self.", "if __name__ =="]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def _tasks(tmp_path):
    rows = {
        "mc": [{"q": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
        "roll": [{"text": t} for t in TEXTS],
        "gen": [{"prompt": p} for p in PROMPTS],
    }
    for name, records in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = "dataset_path: json\ntest_split: test\n"
    (tmp_path / "mc.yaml").write_text(
        f"task: attnlab_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path}/mc.jsonl\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (tmp_path / "roll.yaml").write_text(
        f"task: attnlab_roll\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path}/roll.jsonl\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    (tmp_path / "gen.yaml").write_text(
        f"task: attnlab_gen\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path}/gen.jsonl\noutput_type: generate_until\ndoc_to_text: '{{{{prompt}}}}'\n"
        "doc_to_target: ''\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return tmp_path


def _direct_logp(model, ids):
    """float64 log-probabilities [T, V] of the next token after each of ``ids``."""
    logits = np.asarray(model(np.asarray(ids, np.int32)[None]).logits[0], np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _loglikelihood(model, context, continuation):
    ids = list(context) + list(continuation)
    logp = _direct_logp(model, ids[:-1])
    n = len(continuation)
    return sum(logp[len(ids) - 1 - n + i, continuation[i]] for i in range(n))


@pytest.mark.slow(reason="trains a tiny run, imports the harness and compiles its programs")
def test_harness_loglikelihoods_equal_a_direct_computation(tiny_lm_run, tmp_path):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from attnlab import load_run
    from attnlab.decode import generate
    from attnlab.evaluation.backends import from_run
    from attnlab.evaluation.harness import run_harness

    run = load_run(tiny_lm_run)
    enc = run.task.encode
    out = run_harness(
        from_run(tiny_lm_run),
        "attnlab_mc,attnlab_roll,attnlab_gen",
        include_path=_tasks(tmp_path),
        batch_size=2,
        log_samples=True,
    )
    for sample in out["samples"]["attnlab_mc"]:
        doc = sample["doc"]
        direct = [_loglikelihood(run.model, enc(doc["q"]), enc(c)) for c in doc["choices"]]
        got = [r[0][0] for r in sample["resps"]]
        np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-4)
        assert sample["acc"] == float(np.argmax(direct) == doc["answer"])
    for sample in out["samples"]["attnlab_roll"]:
        tokens = [int(i) for i in enc(sample["doc"]["text"])]
        windows = get_rolling_token_windows(tokens, int(enc("\n")[0]), run.model.cfg.max_len, 1)
        direct = sum(_loglikelihood(run.model, *make_disjoint_window(w)) for w in windows)
        np.testing.assert_allclose(sample["resps"][0][0], direct, rtol=1e-5, atol=1e-4)
    for sample in out["samples"]["attnlab_gen"]:
        ids = enc(sample["doc"]["prompt"])
        alone = generate(run.model, ids[None], 6, eos_id=None)
        text = run.task.decode(alone.tokens[0, : alone.lengths[0]]).split("\n")[0]
        assert sample["resps"][0][0] == text


@pytest.mark.slow(reason="trains a tiny run, imports the harness and compiles its programs")
def test_eval_harness_command_prints_the_results(tiny_lm_run, tmp_path, capsys):
    from attnlab.cli import main

    args = ["eval", "--harness", "attnlab_mc", "--workdir", str(tiny_lm_run)]
    assert main([*args, "--include-path", str(_tasks(tmp_path))]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert 0.0 <= results["attnlab_mc"]["acc,none"] <= 1.0
    assert isinstance(results["attnlab_mc"]["acc_stderr,none"], float)  # not "N/A"


def test_eval_harness_flags_are_checked(tmp_path, capsys):
    from attnlab.cli import main

    assert main(["eval", "--harness", "x"]) == 2
    assert "--workdir RUN or --pretrained DIR" in capsys.readouterr().err
    assert main(["eval", "--pretrained", str(tmp_path)]) == 2
    assert "--pretrained is scored by --harness" in capsys.readouterr().err
    assert main(["eval"]) == 2
    assert "needs --workdir DIR" in capsys.readouterr().err


@pytest.mark.slow(reason="writes a tiny GPT-2 with transformers and runs the harness on it")
def test_a_pretrained_folder_scores_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from attnlab.data.bpe import train_bpe
    from attnlab.evaluation.backends import from_pretrained
    from attnlab.evaluation.harness import run_harness

    text = "the quick brown fox jumps over the lazy dog.\nthe dog sleeps; the fox runs.\n" * 40
    folder = tmp_path / "gpt2"
    folder.mkdir()
    tok = train_bpe(text, 300)
    tok.save(folder / "tokenizer.json")
    end = tok.vocab_size - 1
    cfg = transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=end, eos_token_id=end, pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    questions = [("the quick brown", [" fox", " dog"], 0), ("the dog", [" sleeps", " runs."], 0)]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "mc.jsonl").write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in questions)
    )
    (tmp_path / "t" / "mc.yaml").write_text(
        "task: gpt2_mc\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path}/t/mc.jsonl\noutput_type: multiple_choice\ndoc_to_text: '{{{{q}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    out = run_harness(
        from_pretrained(folder), "gpt2_mc", include_path=tmp_path / "t", log_samples=True
    )
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for sample in out["samples"]["gpt2_mc"]:
        q = sample["doc"]["q"]
        for choice, resp in zip(sample["doc"]["choices"], sample["resps"], strict=True):
            context = hf_tok(q)["input_ids"]
            cont = hf_tok(q + choice)["input_ids"][len(context) :]
            ids = torch.tensor([context + cont])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), -1).numpy()
            n = len(cont)
            direct = sum(logp[len(context) - 1 + i, cont[i]] for i in range(n))
            np.testing.assert_allclose(resp[0][0], direct, rtol=1e-4, atol=1e-4)
