"""The parts of Qwen3-Next that need no hybrid stack, each against transformers' own module
on random weights: its gated attention (``q_proj`` producing each head's query and output
gate, a sigmoid gate on every output element, QK-norm with zero-centred RMSNorm weights
stored as ``w`` and applied as ``1 + w``, RoPE on the first quarter of each head) is
attnlab's ``gated`` mixer with ``kind="elementwise"``, ``qk_norm`` and ``rotary_dim``.
Skipped without transformers and torch (the ``hf`` extra)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_mixer_recurrent import mixer_module, plain_call, rel

from attnlab import ModelConfig


def _qwen3_next_attention(hf_kwargs):
    pytest.importorskip("transformers", reason="transformers (and torch) hold the reference")
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    hf = transformers.Qwen3NextConfig(**hf_kwargs)
    hf._attn_implementation = "eager"
    layer = m.Qwen3NextAttention(hf, layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return layer.double().eval(), m.Qwen3NextRotaryEmbedding(hf), torch


def test_gated_attention_equals_qwen3_next_attention():
    """``Qwen3NextAttention`` (GQA 4:2, head 16, partial rotary 0.25) and the ``gated``
    mixer on its weights: equal outputs at every position of a causal pass, to 1e-5
    relative (float64 reference, float32 ours)."""
    D, N, K, H, T = 32, 4, 2, 16, 7
    layer, rope, torch = _qwen3_next_attention(
        dict(
            hidden_size=D, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
            partial_rotary_factor=0.25, rms_norm_eps=1e-6, num_hidden_layers=1,
            layer_types=["full_attention"], rope_theta=10000.0,
        )
    )  # fmt: skip
    cfg = ModelConfig(
        d_model=D, n_heads=N, n_kv_heads=K, head_dim=H, n_layers=1, max_len=16,
        position="rope", rotary_dim=H // 4, rope_theta=10000.0, norm="rmsnorm",
        norm_eps=1e-6, qk_norm=True, mixer="gated", mixer_settings={"kind": "elementwise"},
    )  # fmt: skip
    module = mixer_module(cfg)
    w = {n: np.asarray(p.detach().numpy(), np.float32) for n, p in layer.named_parameters()}
    put = lambda name, value: setattr(module, name, nnx.Param(jnp.asarray(value)))
    q_and_gate = w["q_proj.weight"].reshape(N, 2, H, D)  # each head: its query rows, its gate rows
    put("q_DNH", q_and_gate[:, 0].transpose(2, 0, 1))
    put("gate_DNH", q_and_gate[:, 1].transpose(2, 0, 1))
    put("k_DKH", w["k_proj.weight"].reshape(K, H, D).transpose(2, 0, 1))
    put("v_DKH", w["v_proj.weight"].reshape(K, H, D).transpose(2, 0, 1))
    put("o_NHD", w["o_proj.weight"].T.reshape(N, H, D))
    module.q_norm.scale_D = nnx.Param(jnp.asarray(1 + w["q_norm.weight"]))  # zero-centred
    module.k_norm.scale_D = nnx.Param(jnp.asarray(1 + w["k_norm.weight"]))

    x = np.random.default_rng(1).normal(size=(1, T, D))
    with torch.no_grad():
        xt = torch.tensor(x)
        cos, sin = rope(xt, torch.arange(T)[None])
        mask = torch.full((T, T), -torch.inf, dtype=torch.float64).triu(1)[None, None]
        want, _ = layer(xt, position_embeddings=(cos, sin), attention_mask=mask)
    graphdef, params = nnx.split(module)
    run = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x, plain_call(1, T)))
    got = run(params, jnp.asarray(x, jnp.float32))[0]
    assert rel(np.asarray(got), want.numpy()) <= 1e-5


def test_moe_with_gated_shared_expert_equals_qwen3_next_sparse_moe_block():
    """``Qwen3NextSparseMoeBlock`` (4 experts, top 2 renormalised, one shared SwiGLU expert of
    its own width 40 scaled by ``sigmoid(shared_expert_gate(x))``) and the ``moe`` FFN with
    ``d_shared=40, shared_gate=True`` on its weights: equal outputs, 1e-5 relative."""
    pytest.importorskip("transformers", reason="transformers (and torch) hold the reference")
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    from attnlab.contracts.ffn import get_ffn

    D, E, F, Fs = 32, 4, 24, 40
    hf = transformers.Qwen3NextConfig(
        hidden_size=D, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F,
        shared_expert_intermediate_size=Fs, norm_topk_prob=True, num_hidden_layers=1,
        layer_types=["full_attention"],
    )  # fmt: skip
    block = m.Qwen3NextSparseMoeBlock(hf)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    block = block.double().eval()
    w = {n: np.asarray(p.detach().numpy(), np.float32) for n, p in block.named_parameters()}
    cfg = ModelConfig(
        d_model=D, n_heads=4, n_layers=1, ffn="swiglu", ffn_variant="moe",
        ffn_settings=dict(n_experts=E, top_k=2, d_expert=F, renormalize=True, n_shared=1,
                          d_shared=Fs, shared_gate=True),
    )  # fmt: skip
    module = get_ffn("moe")(cfg, cfg.ffn_settings, rngs=nnx.Rngs(0))
    put = lambda name, value: setattr(module, name, nnx.Param(jnp.asarray(value)))
    put("router_DE", w["gate.weight"].T)
    put("w_gate_EDF", w["experts.gate_up_proj"][:, :F].transpose(0, 2, 1))
    put("w_in_EDF", w["experts.gate_up_proj"][:, F:].transpose(0, 2, 1))
    put("w_out_EFD", w["experts.down_proj"].transpose(0, 2, 1))
    put("shared_gate_DF", w["shared_expert.gate_proj.weight"].T)
    put("shared_in_DF", w["shared_expert.up_proj.weight"].T)
    put("shared_out_FD", w["shared_expert.down_proj.weight"].T)
    put("shared_expert_gate_D", w["shared_expert_gate.weight"][0])

    x = np.random.default_rng(3).normal(size=(2, 5, D))
    with torch.no_grad():
        want = block(torch.tensor(x)).numpy()
    graphdef, params = nnx.split(module)
    got, _ = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))(params, jnp.asarray(x))
    assert rel(np.asarray(got), want) <= 1e-5
    # Without the gate the shared expert's output would differ: the gate is applied.
    module.shared_expert_gate_D = None
    ungated, _ = module(jnp.asarray(x, jnp.float32))
    assert rel(np.asarray(ungated), want) > 1e-2


def test_shared_expert_width_and_gate_need_a_shared_expert():
    from attnlab.errors import ConfigError

    for extra in ({"d_shared": 8}, {"shared_gate": True}):
        with pytest.raises(ConfigError, match="ffn_settings.n_shared=0"):
            ModelConfig(ffn_variant="moe", ffn_settings={"n_experts": 4, **extra})
