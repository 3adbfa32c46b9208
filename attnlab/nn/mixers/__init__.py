"""The built-in attention variants beyond ``mha`` (``attnlab.nn.attention``), each in its own
file, written with the variant contract of ``attnlab.mixers``; ``attnlab.mixers`` imports
them on first use."""
