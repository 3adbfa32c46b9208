"""``attnlab eval --pretrained HF_DIR --lengths ...``: loss by length of a Hugging Face folder.

A tiny random Llama (RoPE, ``max_position_embeddings`` 32) with a small byte-level BPE is
written by transformers; the command scores a ``--text`` file (or, without one, the end of
the embedded corpus) through the folder's tokenizer. Each length's loss, in both context
modes, equals transformers' in float64 over the same windows (its own tokenizer wrapper, the
weights read back from the folder). attnlab runs in float32: each log-probability is rounded
to about 6e-8 relative and the few hundred of a chunk are summed pairwise (log2(256) x 6e-8
is about 5e-7), so ``RTOL`` = 1e-5 leaves a twentyfold margin over that bound; measured: at
most 1.2e-7 (1.1e-6 nats on a loss of 9.4). ``--rope-scaling linear:4`` equals transformers
with the same scaling in its config and moves the loss at 4x the original context by 4%
(> 100 x RTOL) from the unscaled model's; ``--tasks`` scores the folder at that length.
Missing inputs are one line each.
"""

import json

import numpy as np
import pytest

from attnlab.cli import main

RTOL = 1e-5  # float32 attnlab against float64 transformers (the module docstring)
ORIGINAL = 32  # the model's max_position_embeddings
THETA = 100.0  # a small RoPE base: every pair of dims turns within the context
TOKENS = 256  # scored per length
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
    "matches and pack my box with five dozen liquor jugs"
)


def _one_line_error(capsys, code, *words):
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err


def test_missing_inputs_are_one_line(tmp_path, capsys):
    missing = tmp_path / "no_model"
    code = main(["eval", "--pretrained", str(missing), "--lengths", "8,16"])
    _one_line_error(capsys, code, str(missing), "config.json")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    code = main(["eval", "--pretrained", str(tmp_path / "model"), "--lengths", "8,16"])
    _one_line_error(capsys, code, "tokenizer.json")
    args = ["eval", "--pretrained", str(tmp_path / "model"), "--lengths", "8"]
    code = main([*args, "--text", str(tmp_path / "none.txt")])
    _one_line_error(capsys, code, "--text", "none.txt", "no such file")
    code = main([*args, "--text", str(tmp_path / "none.txt"), "--tasks", "passkey"])
    _one_line_error(capsys, code, "--text", "--tasks")
    code = main([*args, "--step", "3"])
    _one_line_error(capsys, code, "--step")
    code = main(["eval", "--pretrained", str(tmp_path / "model")])
    _one_line_error(capsys, code, "--lengths")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``(folder, text file)``: a random Llama saved by transformers with a BPE trained on
    words drawn by a seeded generator, and more words to score."""
    from hf_reference import torch, transformers

    from attnlab.data.bpe import train_bpe

    rng = np.random.default_rng(0)
    drawn = rng.choice(WORDS.split(), 8000)
    text = "".join(w + ("\n" if rng.random() < 0.1 else " ") for w in drawn)
    folder = tmp_path_factory.mktemp("llama")
    tok = train_bpe(text[:20_000], 320)
    tok.save(folder / "tokenizer.json")
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        tie_word_embeddings=False, initializer_range=0.5,  # sharp enough for positions to show
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms off their init, so a dropped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    held_out = folder.parent / "held_out.txt"
    held_out.write_text(text[20_000:], encoding="utf-8")
    return folder, held_out


def _transformers_losses(folder, text_file, lengths, mode, rope=None):
    """Mean next-token NLL per length by transformers in float64: windows of L + 1 ids every
    L tokens (``chunks``, all scored) or every L/4 (``sliding``, the last L/4 scored),
    ``TOKENS`` scored tokens per length."""
    from hf_reference import torch, transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids = tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    params = {"rope_type": "default", "rope_theta": THETA} if rope is None else rope
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float64, rope_parameters=params, attn_implementation="eager"
    ).eval()
    out = {}
    for L in lengths:
        stride = L if mode == "chunks" else L // 4
        starts = range(0, TOKENS // stride * stride, stride)
        assert starts[-1] + L + 1 <= len(ids)  # the text holds every window
        window = torch.tensor([ids[s : s + L + 1] for s in starts])
        with torch.no_grad():
            logp = torch.log_softmax(model(window[:, :-1]).logits, -1)
        nll = -logp.gather(-1, window[:, 1:, None])[..., 0]
        out[L] = nll[:, L - stride :].mean().item()
    return out


def _attnlab_losses(folder, text_file, out, *flags):
    args = ["eval", "--pretrained", str(folder), "--text", str(text_file)]
    assert main([*args, "--tokens", str(TOKENS), "--out", str(out), *flags]) == 0
    (result,) = json.loads((out / "length_eval.json").read_text()).values()
    rows = result["results"]
    assert all(r["tokens"] == TOKENS for r in rows)
    return result, {(r["mode"], r["length"]): r["loss"] for r in rows}


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.slow(reason="writes a tiny Llama with transformers, compiles four window shapes")
def test_loss_by_length_equals_transformers_in_float64(llama, tmp_path):
    folder, text = llama
    flags = ["--lengths", f"8,{ORIGINAL}", "--context-mode", "both"]
    result, got = _attnlab_losses(folder, text, tmp_path, *flags)
    assert result["train_len"] == ORIGINAL and result["limit"] == ORIGINAL
    assert (tmp_path / "length_eval_chunks.png").is_file()
    assert (tmp_path / "length_eval_sliding.png").is_file()
    errors = {}
    for mode in ("chunks", "sliding"):
        want = _transformers_losses(folder, text, [8, ORIGINAL], mode)
        for L, loss in want.items():
            errors[mode, L] = _rel(got[mode, L], loss)
    assert max(errors.values()) < RTOL, errors


@pytest.mark.slow(reason="writes a tiny Llama with transformers, compiles two window shapes")
def test_rope_scaling_equals_transformers_and_moves_the_loss_past_the_context(
    llama, tmp_path, capsys
):
    folder, text = llama
    long = 4 * ORIGINAL
    flags = ["--lengths", f"{ORIGINAL},{long}", "--rope-scaling", "linear:4"]
    result, got = _attnlab_losses(folder, text, tmp_path, *flags)
    assert result["rope_scaling"]["kind"] == "linear" and result["limit"] == long
    scaled = {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}
    want = _transformers_losses(folder, text, [ORIGINAL, long], "chunks", rope=scaled)
    plain = _transformers_losses(folder, text, [long], "chunks")
    errors = {L: _rel(got["chunks", L], want[L]) for L in want}
    moved = _rel(got["chunks", long], plain[long])
    assert max(errors.values()) < RTOL, errors
    assert moved > 100 * RTOL, moved  # the scaling is applied past the original context
    capsys.readouterr()
    args = ["eval", "--pretrained", str(folder), "--text", str(text), "--lengths", str(long)]
    code = main(args)
    _one_line_error(capsys, code, f"--lengths {long}", f"max_position_embeddings={ORIGINAL}")


@pytest.mark.slow(reason="writes a tiny Llama with transformers, compiles greedy decoding")
def test_tasks_score_a_pretrained_folder_at_a_scaled_length(llama, tmp_path):
    folder, _ = llama
    long = 4 * ORIGINAL
    args = ["eval", "--pretrained", str(folder), "--lengths", f"{long}", "--tasks", "passkey"]
    args += ["--rope-scaling", "linear:4", "--examples", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    (result,) = json.loads((tmp_path / "tasks.json").read_text()).values()
    assert 0.0 <= result["accuracy"]["passkey"][str(long)] <= 1.0  # the task fits the length
    assert (tmp_path / "tasks.png").is_file()


@pytest.mark.slow(reason="writes a tiny Llama with transformers, reads the embedded corpus")
def test_without_text_the_end_of_the_embedded_corpus_is_scored(llama, tmp_path):
    import inspect

    from attnlab.data.corpus import stdlib_corpus
    from attnlab.evaluation import length

    folder, _ = llama
    chars = inspect.signature(length.from_pretrained).parameters["max_chars"].default
    tail = tmp_path / "tail.txt"
    tail.write_text(stdlib_corpus(None)[-chars:], encoding="utf-8")
    args = ["eval", "--pretrained", str(folder), "--lengths", f"{ORIGINAL}"]
    assert main([*args, "--tokens", str(TOKENS), "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "length_eval.json").read_text()).values()
    (row,) = result["results"]
    want = _transformers_losses(folder, tail, [ORIGINAL], "chunks")[ORIGINAL]
    assert row["tokens"] == TOKENS and _rel(row["loss"], want) < RTOL, (row["loss"], want)
