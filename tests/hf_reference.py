"""Tiny random checkpoints that transformers writes, for the tests that load them (nothing is
downloaded): transformers and torch (importing this module skips the importing test module
without them, the ``hf`` extra), a model built from a config (``DECODER``'s fields, changed per
family) with its weights moved off their init (``tiny_model``), each saved once per test
module (``built_once``), and what to compare with: transformers' logits (``hf_logits``) and
greedy generation (``generate_greedy``)."""

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers (and torch) are needed to write reference checkpoints"
)
torch = pytest.importorskip("torch", reason="transformers needs torch to build the models")

V = 96  # the tiny checkpoints' vocabulary
# A tiny decoder's config.json fields (2 layers, GQA 4:2); each family's tests change some.
DECODER = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.125,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def hf(x):
    """Token ids (or a mask) as the torch tensor transformers takes."""
    return torch.as_tensor(np.asarray(x), dtype=torch.long)


def hf_logits(model, ids, mask):
    """transformers' logits of ``model`` on ``ids`` with the attention ``mask`` (numpy)."""
    with torch.no_grad():
        return model(hf(ids), attention_mask=hf(mask)).logits.numpy()


def tiny_model(model_cls: str, config, seed: int, *perturbs, **from_config):
    """``transformers.<model_cls>`` built from ``config`` in float32 with torch seeded
    ``seed``, then changed by each ``(function, seed)`` of ``perturbs``
    (``function(model, torch.Generator().manual_seed(seed))``); in eval mode, with no eos id
    in its generation config (``generate`` makes every token asked for). ``from_config``:
    ``_from_config``'s options (``attn_implementation="eager"``)."""
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)._from_config(
        config, dtype=torch.float32, **from_config
    )
    for perturb, perturb_seed in perturbs:
        perturb(model, torch.Generator().manual_seed(perturb_seed))
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def built_once(tmp_path_factory, build, save_options=lambda name: {}):
    """``get(name) -> (model, folder)``: ``build(name)``'s model saved with
    ``save_pretrained(folder, **save_options(name))`` into a folder of its own, built on the
    first call for each name (a module-scoped fixture returns it)."""
    built = {}

    def get(name):
        if name not in built:
            model = build(name)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder, **save_options(name))
            built[name] = model, folder
        return built[name]

    return get


def generate_greedy(model, prompt_BT, n: int):
    """transformers' greedy ``generate`` of ``n`` tokens after ``prompt_BT`` (a torch tensor),
    without its cache, returning the sequences and each step's logits."""
    with torch.no_grad():
        return model.generate(
            prompt_BT,
            attention_mask=torch.ones_like(prompt_BT),
            do_sample=False,
            num_beams=1,
            max_new_tokens=n,
            use_cache=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
