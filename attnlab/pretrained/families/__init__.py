"""The built-in Hugging Face families, one file each (``attnlab.pretrained.family``).

Importing this package registers them, in ``BUILTINS`` order: the order export tries them
in. A family that is a special case of another (Qwen3 of Llama with QK-norm, Mistral of Llama
with a window in every layer) comes after it, so a model both describe is written as the
plainer one.
"""

import importlib

BUILTINS = (
    "llama",
    "olmo2",
    "phi3",
    "gemma",
    "mixtral",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "mamba2",
    "bamba",
    "falcon_h1",
    "nemotron_h",
    "gpt2",
    "bert",
    "bart",
    "t5",
    "smollm3",
    "olmo3",
    "apertus",
    "glm4_moe",
    "lfm2",
    "mamba",
    "jamba",
    "granitemoehybrid",
    "qwen3_5",
    "minimax",
    "deepseek_v32",
    "kimi_linear",
)

for _name in BUILTINS:
    importlib.import_module(f"{__name__}.{_name}")
