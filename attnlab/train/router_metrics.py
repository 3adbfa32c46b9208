"""Router statistics of a mixture-of-experts model, accumulated in the train state.

Per step, from the model's ``aux`` (``attnlab.contracts.ffn``): the load-balancing and z-losses
(means over the MoE layers), the assignments each expert received (summed over the layers)
and the dropped assignments (0: dispatch is dropless). The train state's ``acc`` sums them
between log lines; ``router_record`` turns the sums into the log line's values.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

KEYS = ("moe_load_balance", "moe_z_loss", "moe_tokens_per_expert", "moe_dropped")


def zeros_router(mcfg) -> dict:
    """The empty router sums of ``mcfg``'s model ({} without experts)."""
    n = getattr(getattr(mcfg, "ffn_settings", None), "n_experts", None)
    if n is None:
        return {}
    # Separate arrays: the train state's buffers are donated, each must be its own.
    return {
        "moe_load_balance": jnp.zeros((), jnp.float32),
        "moe_z_loss": jnp.zeros((), jnp.float32),
        "moe_tokens_per_expert": jnp.zeros((n,), jnp.float32),
        "moe_dropped": jnp.zeros((), jnp.float32),
    }


def router_sums(aux) -> dict:
    """One step's router statistics from ``ModelOutput.aux`` ({} when None)."""
    if aux is None or "tokens_per_expert" not in aux:
        return {}
    return {
        "moe_load_balance": jnp.mean(aux["load_balance"]),
        "moe_z_loss": jnp.mean(aux["z_loss"]),
        "moe_tokens_per_expert": jnp.sum(aux["tokens_per_expert"], axis=0).astype(jnp.float32),
        "moe_dropped": jnp.sum(aux["dropped"]).astype(jnp.float32),
    }


def router_record(acc) -> dict:
    """Log-line values from a host copy of the accumulators: the mean losses per step, each
    expert's share of the assignments and the dropped assignments."""
    if "moe_tokens_per_expert" not in acc:
        return {}
    steps = max(int(acc["steps"]), 1)
    counts = np.asarray(acc["moe_tokens_per_expert"], np.float64)
    share = counts / max(counts.sum(), 1.0)
    return {
        "moe_load_balance": float(acc["moe_load_balance"]) / steps,
        "moe_z_loss": float(acc["moe_z_loss"]) / steps,
        "moe_tokens_per_expert": [round(float(x), 5) for x in share],
        "moe_max_expert_share": float(share.max()),
        "moe_dropped": int(acc["moe_dropped"]),
    }
