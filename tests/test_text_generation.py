"""Text in, text out: a tiny random GPT-2 written by transformers with a small trained BPE."""

import pathlib

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers (and torch) are needed to write the reference model"
)
torch = pytest.importorskip("torch", reason="transformers needs torch to build the model")

from attnlab.cli import main  # noqa: E402
from attnlab.data.bpe import HFTokenizer, train_bpe  # noqa: E402
from attnlab.pretrained import load_pretrained  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog.\nthe dog sleeps; the fox runs.\n" * 40


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2_text")
    tok = train_bpe(TEXT, 300)
    tok.save(folder / "tokenizer.json")
    cfg = transformers.GPT2Config(
        vocab_size=tok.vocab_size,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=tok.vocab_size - 1,
        eos_token_id=tok.vocab_size - 1,
        pad_token_id=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return pathlib.Path(folder), model


def reference(folder, model, prompt, n):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return tok.decode(out[0, ids.shape[1] :])


def test_generate_text_equals_transformers_generate_and_decode(gpt2_folder):
    folder, model = gpt2_folder
    handle = load_pretrained(folder)
    for prompt in ("the quick brown", "a fox"):
        text = handle.generate_text(prompt, max_new_tokens=12)
        assert text == reference(folder, model, prompt, 12)
    both = handle.generate_text(["the quick brown", "a fox"], max_new_tokens=12)
    assert both == [reference(folder, model, p, 12) for p in ("the quick brown", "a fox")]
    tok = HFTokenizer.from_file(folder / "tokenizer.json")
    result = handle.generate(np.asarray([tok.encode("a fox")]), 12)  # the same ids
    assert tok.decode(result.tokens[0, : result.lengths[0]]) == both[1]


def test_sample_cli_prints_the_continuation(gpt2_folder, capsys):
    folder, model = gpt2_folder
    args = ["sample", "--pretrained", str(folder), "--prompt", "the dog", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == "the dog" + reference(folder, model, "the dog", 6) + "\n"
