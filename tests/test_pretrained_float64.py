"""Every family in float64 against transformers in float64, and float32 as close to that as
transformers' own float32.

The checkpoints are the tiny random ones the family tests write (their fixtures imported
here, not rebuilt). The oracle is the family's transformers code run in float64 with eager
attention and eager experts; where that code casts to float32 inside (RMSNorm statistics,
RoPE tables, softmax ``dtype=torch.float32``, routers), ``Float64Everywhere`` turns each such
cast into float64, so the oracle computes the same formulas with nothing rounded to float32.

- attnlab in float64 (``load_pretrained(dtype="float64")`` under JAX's 64-bit mode, scoped
  to the test with ``jax.enable_x64``) equals the oracle to 1e-8 relative: only the order of
  summation differs.
- attnlab's float32 logits are no further from the oracle than transformers' own float32
  ones: the ratio of their root-mean-square errors is at most 1.5.

The same holds for the gpt2 and llama fixtures of ``../shared/fixtures/hf``. Inputs are
eight unpadded rows of 32 tokens: padding is the family tests' subject, rounding this file's.
``-s`` prints each family's figures.
"""

import jax
import numpy as np
import pytest
from hf_reference import torch, transformers
from test_pretrained_catalogue import NAMES as CATALOGUE  # noqa: E402
from test_pretrained_catalogue import checkpoints as catalogue_checkpoints  # noqa: E402, F401
from test_pretrained_hf import SPECS as HF_SPECS  # noqa: E402
from test_pretrained_hf import checkpoints as hf_checkpoints  # noqa: E402, F401
from test_pretrained_hybrid import checkpoints as hybrid_checkpoints  # noqa: E402, F401
from test_pretrained_moe import SPECS as MOE_SPECS  # noqa: E402
from test_pretrained_moe import checkpoints as moe_checkpoints  # noqa: E402, F401
from test_pretrained_open import NAMES as OPEN  # noqa: E402
from test_pretrained_open import checkpoints as open_checkpoints  # noqa: E402, F401
from test_pretrained_qwen3_next import checkpoint as qwen3_next_checkpoint  # noqa: E402, F401
from test_pretrained_ssm import checkpoint as mamba2_checkpoint  # noqa: E402, F401
from tiers import cases  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from attnlab.errors import ConfigError  # noqa: E402
from attnlab.kv_cache import init_cache  # noqa: E402
from attnlab.pretrained import load_pretrained  # noqa: E402

F64_TOL = 1e-8
RATIO = 1.5
FLOOR = 1e-7  # float32's own resolution: relative errors under it are not compared
V = 96

# case -> (fixture, name in that fixture's module or None for a one-checkpoint fixture)
CASES = {
    **{n: ("catalogue_checkpoints", n) for n in CATALOGUE},
    **{n: ("open_checkpoints", n) for n in OPEN},
    **{n: ("moe_checkpoints", n) for n in MOE_SPECS},
    **{n: ("hf_checkpoints", n) for n in HF_SPECS},
    "bamba": ("hybrid_checkpoints", "regular"),
    "nemotron_h": ("hybrid_checkpoints", "nemotron_h"),
    "falcon_h1": ("hybrid_checkpoints", "falcon_h1"),
    "mamba2": ("mamba2_checkpoint", None),
    "qwen3_next": ("qwen3_next_checkpoint", None),
}
# One dense, one with experts, one hybrid of attention and Mamba-2 (each 3-7 s on 2 cores;
# the whole set 8 min, Granite 4 and Qwen3-Next the slowest at 30-36 s).
FAST = ("olmo2", "gpt_oss", "falcon_h1")
SLOW = "one more family's checkpoint built, run by transformers twice and compiled twice"


class Float64Everywhere(TorchFunctionMode):
    """Every float32 that torch is asked for (``.float()``, ``.to(torch.float32)``,
    ``softmax(dtype=torch.float32)``, ``arange(dtype=torch.float)``, a new tensor of the
    default dtype) made float64."""

    def __enter__(self):
        self.default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self.default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].double()
        wide = lambda a: torch.float64 if a is torch.float32 else a  # noqa: E731
        return func(*map(wide, args), **{k: wide(v) for k, v in kwargs.items()})


def checkpoint(request, case):
    fixture, name = CASES[case]
    got = request.getfixturevalue(fixture)
    model, *_, folder = got(name) if name is not None else got
    return model, folder


def oracle(model):
    """``model``'s weights in its transformers class, built and run in float64 throughout."""
    with Float64Everywhere():
        kwargs = dict(attn_implementation="eager", dtype=torch.float64)
        try:
            exact = type(model)._from_config(model.config, experts_implementation="eager", **kwargs)
        except (TypeError, ValueError):
            exact = type(model)._from_config(model.config, **kwargs)
        exact.load_state_dict(model.state_dict())
    return exact.eval()


def inputs(case):
    """Eight unpadded rows of 32 ids; target ids for an encoder-decoder."""
    rng = np.random.default_rng(5)
    ids = rng.integers(3, V, (8, 32)).astype(np.int32)
    if case not in HF_SPECS or "decoder_start_token_id" not in HF_SPECS[case][2]:
        return ids, None
    tgt = rng.integers(3, V, (8, 10)).astype(np.int32)
    tgt[:, 0] = HF_SPECS[case][2]["decoder_start_token_id"]
    return ids, tgt


def hf_logits(model, ids, tgt, *, x64=False):
    t = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.long)  # noqa: E731
    kwargs = {} if tgt is None else {"decoder_input_ids": t(tgt)}
    with torch.no_grad():
        if x64:
            with Float64Everywhere():
                return oracle(model)(t(ids), **kwargs).logits.numpy()
        return model(t(ids), **kwargs).logits.numpy()


def attnlab_logits(folder, ids, tgt, dtype):
    kwargs = {} if tgt is None else {"decoder_input_ids": tgt}
    handle = load_pretrained(folder, dtype=dtype)
    return np.asarray(handle.logits(ids, **kwargs))


def largest(x, ref):
    """The largest error relative to the largest logit."""
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max())


def rms(x, ref):
    """The root-mean-square error relative to the logits' own: a float32 forward's rounding
    over every logit. Steadier than the largest error (which moved by up to 2x between
    input draws with the same model), though one sensitive token can still weigh: on
    Qwen3.5-MoE's checkpoint the ratio is 0.9-1.5 over draws of 4 x 32 tokens, 0.9-1.4 of
    8 x 32."""
    return float(np.sqrt(np.mean((np.asarray(x, np.float64) - ref) ** 2) / np.mean(ref**2)))


def check(model, folder, ids, tgt, label):
    """attnlab in float64 equals the oracle; its float32 is as close to it as transformers'."""
    exact = hf_logits(model, ids, tgt, x64=True)
    theirs = rms(hf_logits(model, ids, tgt), exact)
    ours = rms(attnlab_logits(folder, ids, tgt, "float32"), exact)
    with jax.enable_x64(True):
        ours64 = attnlab_logits(folder, ids, tgt, "float64")
    f64 = largest(ours64, exact)
    ratio = max(ours, FLOOR) / max(theirs, FLOOR)
    print(
        f"\n{label}: float64 {f64:.1e}; float32 rms {ours:.2e}, theirs {theirs:.2e}, {ratio:.2f}x"
    )
    assert ours64.dtype == np.float64
    assert f64 <= F64_TOL, f64
    assert ratio <= RATIO, (ours, theirs)


@pytest.mark.parametrize("case", cases(list(CASES), slow={c: SLOW for c in CASES if c not in FAST}))
def test_float64_equals_transformers_and_float32_is_as_close_as_theirs(request, case):
    model, folder = checkpoint(request, case)
    check(model, folder, *inputs(case), case)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_shared_fixtures_in_float64_and_float32(shared_dir, name):
    folder = shared_dir / "fixtures" / "hf" / name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids = np.load(folder / "reference.npz")["input_ids"]
    check(model, folder, ids, None, name)


def test_float64_decodes_through_a_float64_cache(request):
    """Falcon-H1 (attention and Mamba-2 states) decodes in float64: every cache entry is
    float64 and the greedy tokens are the float64 forward's argmax."""
    _, folder = checkpoint(request, "falcon_h1")
    ids = np.random.default_rng(1).integers(3, V, (1, 6)).astype(np.int32)
    with jax.enable_x64(True):
        handle = load_pretrained(folder, dtype="float64")
        cache = init_cache(handle.config, 1, 16)
        assert {str(x.dtype) for x in jax.tree.leaves(cache.layers)} == {"float64"}
        new = np.asarray(handle.generate(ids, 6).tokens)
        logits = np.asarray(handle.logits(np.concatenate([ids, new[:, :-1]], 1)))
    assert logits.dtype == np.float64
    np.testing.assert_array_equal(logits[0, ids.shape[1] - 1 :].argmax(-1), new[0])


def test_float64_without_64_bit_mode_says_how_to_turn_it_on(request):
    _, folder = checkpoint(request, "olmo2")
    with jax.enable_x64(False), pytest.raises(ConfigError, match="JAX_ENABLE_X64=1"):
        load_pretrained(folder, dtype="float64")
