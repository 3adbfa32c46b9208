"""The built-in mixers, one file each: ``mha`` (``Attention``: MHA/GQA/MQA, which the
attention variants subclass), ``sinks``, ``gated``, ``differential``, ``mla``, ``gated_deltanet``,
``mamba2``, ``base_conv``, and the block-sparse ``moba`` and ``nsa``. Each is written with the
mixer contract of ``attnlab.contracts.mixer``, whose registry imports them on first use."""
