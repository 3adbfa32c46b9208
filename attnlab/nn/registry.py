"""``MODEL_CLASSES``: each architecture's name (``ModelConfig.arch``) -> its NNX class.

The table sits below the models it names, so that what reads a model's shapes
(``attnlab.nn.parametrization``) need not import ``attnlab.nn.models``, which builds models
with its multipliers. ``attnlab.nn.models`` fills it where it defines the classes, and
every import of ``attnlab.nn`` runs that first.
"""

from __future__ import annotations

MODEL_CLASSES: dict[str, type] = {}
