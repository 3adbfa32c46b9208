"""Loading the Hugging Face fixtures of ../shared/fixtures/hf and reproducing their outputs.

Each fixture folder holds a tiny random checkpoint and ``reference.npz`` computed with
transformers (see its README). Forward passes must match to 1e-4 at every position, padded
query positions included; greedy decoding through the KV cache must reproduce the
reference ids exactly and its per-step logits to 1e-4.
"""

import functools
import importlib.util
import json
import shutil
import struct

import jax
import jax.numpy as jnp
import matplotlib
import ml_dtypes
import numpy as np
import pytest
from compile_count import compiles
from flax import nnx
from safetensors.numpy import load_file, save_file
from tiers import cases

import attnlab
from attnlab import init_cache
from attnlab.pretrained import (
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
    load_pretrained,
)
from attnlab.viz import plot_attention

matplotlib.use("Agg")

TOL = 1e-4
SLOW = "another family's reference decoding: one compile each"
HAS_DECODE = importlib.util.find_spec("attnlab.decode") is not None


def fixture(shared_dir, name):
    return shared_dir / "fixtures" / "hf" / name


def reference(shared_dir, name):
    return dict(np.load(fixture(shared_dir, name) / "reference.npz"))


def max_diff(a, b):
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@functools.partial(jax.jit, static_argnums=0)
def _cached_step(graphdef, state, tokens_BT, cache):
    model = nnx.merge(graphdef, state)
    if model.cfg.arch == "decoder":
        out = model(tokens_BT, cache=cache)
    else:
        out = model.decode(tokens_BT, cache=cache)
    return out.logits[:, -1], out.cache


@functools.partial(jax.jit, static_argnums=0)
def _cross_cache(graphdef, state, src_BS, cache):
    model = nnx.merge(graphdef, state)
    return model.init_cross_cache(cache, model.encode(src_BS))


def cached_greedy(handle, prompt_BT, n):
    """Greedy decoding through the model's KV cache, one token per step.

    Returns the ``n`` generated ids ``[B, n]`` and the logits that chose them ``[B, n, V]``.
    Decoder-only models continue ``prompt_BT``; encoder-decoder models read it as the
    source and start from the checkpoint's decoder start id. Independent of attnlab.decode.
    """
    cfg = handle.config
    graphdef, state = nnx.split(handle.model)
    prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
    B, T = prompt_BT.shape
    if cfg.arch == "decoder":
        first, cache = prompt_BT, init_cache(cfg, B, T + n)
    else:
        first = jnp.full((B, 1), handle.decoder_start_id, jnp.int32)
        # The start id and the n generated ids: n + 1 tokens (the last one's logits unused).
        cache = _cross_cache(graphdef, state, prompt_BT, init_cache(cfg, B, n + 1))
    logits_BV, cache = _cached_step(graphdef, state, first, cache)
    ids, steps = [], []
    for _ in range(n):
        steps.append(np.asarray(logits_BV))
        next_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        ids.append(np.asarray(next_B))
        logits_BV, cache = _cached_step(graphdef, state, next_B[:, None], cache)
    return np.stack(ids, 1), np.stack(steps, 1)


# Forward passes --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoder_logits_match_reference(shared_dir, name):
    ref = reference(shared_dir, name)
    handle = load_pretrained(fixture(shared_dir, name))
    assert handle.config.arch == "decoder"
    logits = np.asarray(handle.logits(ref["input_ids"], ref["attention_mask"]))
    assert logits.shape == ref["logits"].shape
    real = ref["attention_mask"].astype(bool)
    assert max_diff(logits[real], ref["logits"][real]) <= TOL
    assert max_diff(logits, ref["logits"]) <= TOL  # padded queries attend the real keys
    # Without a mask the real tokens are unchanged (right padding), the padded ones are not.
    unmasked = np.asarray(handle.logits(ref["input_ids"]))
    assert max_diff(unmasked[real], ref["logits"][real]) <= TOL
    assert max_diff(unmasked, ref["logits"]) > 1e-2


def test_bert_hidden_states_and_mlm_logits_match_reference(shared_dir):
    ref = reference(shared_dir, "bert")
    handle = load_pretrained(fixture(shared_dir, "bert"))
    args = (ref["input_ids"], ref["attention_mask"], ref["token_type_ids"])
    assert max_diff(handle.hidden_states(*args), ref["last_hidden_state"]) <= TOL
    assert max_diff(handle.mlm_logits(*args), ref["mlm_logits"]) <= TOL
    assert max_diff(handle.logits(*args[:2], token_type_ids=args[2]), ref["mlm_logits"]) <= TOL
    # Token types matter: dropping them moves the outputs far beyond the tolerance.
    assert max_diff(handle.mlm_logits(*args[:2]), ref["mlm_logits"]) > 1e-2


def test_marian_logits_match_reference(shared_dir):
    ref = reference(shared_dir, "marian")
    handle = load_pretrained(fixture(shared_dir, "marian"))
    logits = handle.logits(
        ref["input_ids"], ref["attention_mask"], decoder_input_ids=ref["decoder_input_ids"]
    )
    assert max_diff(logits, ref["logits"]) <= TOL
    assert handle.decoder_start_id == 1 and handle.pad_id == 1 and handle.eos_id == 0


# Greedy generation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", cases(["gpt2", "llama", "marian"], slow=dict(llama=SLOW, marian=SLOW))
)
def test_cached_greedy_matches_reference(shared_dir, name):
    ref = reference(shared_dir, name)
    handle = load_pretrained(fixture(shared_dir, name))
    seq2seq = handle.config.arch == "encoder_decoder"
    for k in (0, 1):
        prompt = ref[f"source_{k}" if seq2seq else f"prompt_{k}"]
        expected = (
            ref[f"greedy_{k}"][:, 1:] if seq2seq else ref[f"greedy_{k}"][:, prompt.shape[1] :]
        )
        ids, step_logits = cached_greedy(handle, prompt, expected.shape[1])
        np.testing.assert_array_equal(ids, expected)
        assert max_diff(step_logits, ref[f"greedy_logits_{k}"]) <= TOL


@pytest.mark.skipif(not HAS_DECODE, reason="attnlab/decode.py is not in this tree yet")
@pytest.mark.slow(reason="generate() on pretrained models; the cached greedy test covers the path")
@pytest.mark.parametrize("name", ["gpt2", "llama", "marian"])
def test_generate_matches_reference(shared_dir, name):
    ref = reference(shared_dir, name)
    handle = load_pretrained(fixture(shared_dir, name))
    seq2seq = handle.config.arch == "encoder_decoder"
    for k in (0, 1):
        prompt = ref[f"source_{k}" if seq2seq else f"prompt_{k}"]
        greedy = ref[f"greedy_{k}"]
        expected = greedy[:, 1:] if seq2seq else greedy[:, prompt.shape[1] :]
        result = handle.generate(prompt, expected.shape[1], eos_id=None, return_logits=True)
        np.testing.assert_array_equal(np.asarray(result.tokens), expected)
        assert max_diff(result.logits, ref[f"greedy_logits_{k}"]) <= TOL
        # Stopping at the config's eos changes nothing: no special id is ever generated.
        result = handle.generate(prompt, expected.shape[1])
        np.testing.assert_array_equal(np.asarray(result.tokens), expected)


@pytest.mark.skipif(not HAS_DECODE, reason="attnlab/decode.py is not in this tree yet")
@pytest.mark.slow(reason="compiles generation for ragged batches of two pretrained models")
@pytest.mark.parametrize("name", ["llama", "marian"])
def test_generate_a_right_padded_batch(shared_dir, name):
    """Both prompts in one batch, the shorter right-padded: each row decodes as alone."""
    ref = reference(shared_dir, name)
    handle = load_pretrained(fixture(shared_dir, name))
    seq2seq = handle.config.arch == "encoder_decoder"
    rows = [ref[f"source_{k}" if seq2seq else f"prompt_{k}"][0] for k in (0, 1)]
    width = max(len(r) for r in rows)
    ids = np.full((2, width), handle.pad_id, np.int32)
    mask = np.zeros((2, width), np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    result = handle.generate(ids, 16, attention_mask=mask, eos_id=None)
    for b, r in enumerate(rows):
        greedy = ref[f"greedy_{b}"][0]
        np.testing.assert_array_equal(result.tokens[b], greedy[1:] if seq2seq else greedy[len(r) :])
    if not seq2seq:
        with pytest.raises(ValueError, match="right-padded"):
            handle.generate(ids, 2, attention_mask=mask[:, ::-1])


@pytest.mark.skipif(not HAS_DECODE, reason="attnlab/decode is not in this tree yet")
def test_the_handle_splits_its_model_once(shared_dir, monkeypatch):
    """Repeated logits/generate calls neither re-split the model nor compile again."""
    handle = load_pretrained(fixture(shared_dir, "llama"))
    ids = reference(shared_dir, "llama")["prompt_0"]
    first = handle.logits(ids)
    handle.generate(ids, 4, eos_id=None)
    handle.generate(ids, 4, eos_id=None, temperature=0.8, top_k=5)
    splits = []
    real_split = nnx.split
    monkeypatch.setattr(nnx, "split", lambda *a, **k: splits.append(1) or real_split(*a, **k))
    with compiles() as count:
        for _ in range(2):
            np.testing.assert_array_equal(np.asarray(handle.logits(ids)), np.asarray(first))
            out = attnlab.generate(handle, ids, 4, eos_id=None)
            handle.generate(ids, 4, eos_id=None, temperature=0.5, top_p=0.9, seed=1)
    assert splits == [] and count() == 0
    np.testing.assert_array_equal(out.tokens, handle.generate(ids, 4, eos_id=None).tokens)


# Attention weights and plotting -----------------------------------------------------------


@pytest.mark.slow(reason="a pretrained model's attention weights for every layer, then plots")
def test_attention_weights_and_plot(shared_dir):
    ref = reference(shared_dir, "llama")
    handle = load_pretrained(fixture(shared_dir, "llama"))
    ids, mask = ref["input_ids"], ref["attention_mask"]
    w = np.asarray(handle.attention(ids, layer=1, attention_mask=mask))
    B, T = ids.shape
    assert w.shape == (B, handle.config.n_heads, T, T)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(w, 1) == 0.0)  # causal
    assert np.all(w[1][:, :, ~mask[1].astype(bool)] == 0.0)  # padded keys get no weight
    with pytest.raises(ValueError, match="layer=2"):
        handle.attention(ids, layer=2)

    fig = plot_attention(w[0], tokens=list(ids[0]), title="llama layer 1")
    assert len([ax for ax in fig.axes if ax.get_images()]) == handle.config.n_heads
    fig.savefig(_buffer(), format="png")
    fig = plot_attention(w[0, 2])  # a single [T, S] map
    assert len([ax for ax in fig.axes if ax.get_images()]) == 1


def test_seq2seq_attention_selects_stack_and_kind(shared_dir):
    ref = reference(shared_dir, "marian")
    handle = load_pretrained(fixture(shared_dir, "marian"))
    args = dict(attention_mask=ref["attention_mask"], decoder_input_ids=ref["decoder_input_ids"])
    S, T = ref["input_ids"].shape[1], ref["decoder_input_ids"].shape[1]
    enc = handle.attention(ref["input_ids"], layer=0, stack="encoder", **args)
    cross = handle.attention(ref["input_ids"], layer=1, kind="cross", **args)
    assert enc.shape == (2, 4, S, S) and cross.shape == (2, 4, T, S)
    assert np.all(np.asarray(cross)[1][..., 11:] == 0.0)  # padded source positions


def _buffer():
    import io

    return io.BytesIO()


# Input validation ---------------------------------------------------------------------------


def test_token_ids_are_checked_before_the_model(shared_dir):
    gpt2 = load_pretrained(fixture(shared_dir, "gpt2"))
    V = gpt2.config.vocab_size
    with pytest.raises(ValueError, match=f"vocab_size={V}"):
        gpt2.logits(np.array([[3, V]]))
    with pytest.raises(ValueError, match="vocab_size"):
        gpt2.logits(np.array([[-1, 4]]))
    with pytest.raises(ValueError, match="max_len=64"):
        gpt2.logits(np.full((1, 65), 3))
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        gpt2.logits(np.array([3, 4]))
    with pytest.raises(ValueError, match="attention_mask"):
        gpt2.logits(np.array([[3, 4]]), np.array([[1, 1, 0]]))
    with pytest.raises(TypeError):
        gpt2.mlm_logits(np.array([[3, 4]]))
    bert = load_pretrained(fixture(shared_dir, "bert"))
    with pytest.raises(ValueError, match="type_vocab_size=2"):
        bert.mlm_logits(np.array([[3, 4]]), token_type_ids=np.array([[0, 2]]))
    marian = load_pretrained(fixture(shared_dir, "marian"))
    with pytest.raises(ValueError, match="decoder_input_ids"):
        marian.logits(np.array([[3, 4]]), decoder_input_ids=np.array([[1, 104]]))


# Configs: count_params and kv_cache_bytes accept Hugging Face config.json -------------------

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
}


def test_qwen3_4b_params_and_cache_from_its_config():
    cfg = attnlab.pretrained.model_config_from_hf(QWEN3_4B)
    assert attnlab.count_params(cfg) == 4_022_468_096
    assert attnlab.kv_cache_bytes(cfg, 1, 4096, "bfloat16") == 576 * 2**20 == 603_979_776
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.qk_norm, cfg.rope_theta) == (128, 8, True, 1e6)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "marian"])
def test_count_params_of_a_checkpoint_folder(shared_dir, name):
    folder = fixture(shared_dir, name)
    stored = sum(v.size for v in load_file(folder / "model.safetensors").values())
    from_folder = attnlab.pretrained.model_config_from_hf(folder)
    assert attnlab.count_params(from_folder) == stored
    from_file = attnlab.pretrained.model_config_from_hf(str(folder / "config.json"))
    assert from_file == from_folder


# Errors --------------------------------------------------------------------------------------


def copy_fixture(shared_dir, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(fixture(shared_dir, name), folder)
    for f in folder.iterdir():
        f.chmod(0o644)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_unsupported_model_type(shared_dir, tmp_path):
    folder = copy_fixture(shared_dir, "gpt2", tmp_path)
    edit_config(folder, model_type="gptj")
    with pytest.raises(UnsupportedCheckpointError, match="model_type='gptj'") as info:
        load_pretrained(folder)
    assert isinstance(info.value, ValueError)


def test_unsupported_config_value_is_named(shared_dir, tmp_path):
    folder = copy_fixture(shared_dir, "llama", tmp_path)
    # Dynamic NTK scaling changes the frequencies with the length: attnlab does not read it.
    edit_config(folder, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_parameters.rope_type='dynamic'"):
        load_pretrained(folder)


def test_missing_tensor(shared_dir, tmp_path):
    folder = copy_fixture(shared_dir, "gpt2", tmp_path)
    edit_tensors(folder, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(MissingTensorError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias") as info:
        load_pretrained(folder)
    assert isinstance(info.value, KeyError)


def test_config_asking_for_absent_biases_is_a_missing_tensor(shared_dir, tmp_path):
    folder = copy_fixture(shared_dir, "llama", tmp_path)
    edit_config(folder, attention_bias=True)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_pretrained(folder)


def test_unexpected_tensor(shared_dir, tmp_path):
    folder = copy_fixture(shared_dir, "bert", tmp_path)
    edit_tensors(folder, lambda t: t.update({"bert.encoder.layer.0.extra": np.zeros(3, "f4")}))
    with pytest.raises(UnexpectedTensorError, match=r"bert\.encoder\.layer\.0\.extra") as info:
        load_pretrained(folder)
    assert isinstance(info.value, KeyError)


def test_tensor_shape_disagreeing_with_config(shared_dir, tmp_path):
    folder = copy_fixture(shared_dir, "llama", tmp_path)
    edit_config(folder, num_key_value_heads=4)
    with pytest.raises(TensorShapeError, match=r"k_proj\.weight.*\(32, 64\).*\(64, 64\)") as info:
        load_pretrained(folder)
    assert isinstance(info.value, ValueError)
    assert "n_kv_heads=4" in str(info.value)

    folder = copy_fixture(shared_dir, "marian", tmp_path / "m")
    edit_tensors(folder, lambda t: t.update(final_logits_bias=t["final_logits_bias"][:, :-1]))
    with pytest.raises(TensorShapeError, match=r"final_logits_bias.*\(1, 103\).*\(1, 104\)"):
        load_pretrained(folder)


def test_missing_folder_and_files(shared_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_pretrained(tmp_path / "nowhere")
    folder = copy_fixture(shared_dir, "gpt2", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(folder)


def test_base_model_checkpoint_without_the_head_prefix(shared_dir, tmp_path):
    """A GPT2Model checkpoint (no ``transformer.`` prefix, tied head) loads the same."""
    folder = copy_fixture(shared_dir, "gpt2", tmp_path)
    edit_tensors(
        folder, lambda t: t.update({k.removeprefix("transformer."): t.pop(k) for k in list(t)})
    )
    ref = reference(shared_dir, "gpt2")
    logits = load_pretrained(folder).logits(ref["input_ids"], ref["attention_mask"])
    assert max_diff(logits, ref["logits"]) <= TOL


def write_bfloat16_safetensors(path, tensors):
    """A safetensors file of BF16 tensors, written byte by byte (no torch needed)."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in tensors.items():
        data = np.ascontiguousarray(value.astype(ml_dtypes.bfloat16)).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_bfloat16_checkpoint(shared_dir, tmp_path):
    """bfloat16 tensors (which NumPy lacks) are decoded; outputs move by bf16 rounding only."""
    folder = copy_fixture(shared_dir, "llama", tmp_path)
    path = folder / "model.safetensors"
    write_bfloat16_safetensors(path, load_file(path))
    ref = reference(shared_dir, "llama")
    handle = load_pretrained(folder)
    assert handle.config.param_dtype == "float32"
    assert 1e-4 < max_diff(handle.logits(ref["input_ids"][:1]), ref["logits"][:1]) < 0.5
