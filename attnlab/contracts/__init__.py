"""The extension points: what a variant implements, and the registry a config names it from.

``mixer`` (``ModelConfig.mixer``: a sequence-mixing module, the built-ins in
``attnlab.nn.mixers``), ``ffn`` (``ModelConfig.ffn_variant``: a feed-forward module),
``score_function`` (``ModelConfig.attention_fn``: the scores of softmax attention),
``optimizer`` (``optim.name`` and ``optim.schedule``); ``registry`` is the registry of
modules the first two share. Nothing here imports a model: the config validates against
these, and ``attnlab.nn`` builds from them.
"""
