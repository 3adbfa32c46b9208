"""File checksums for the integrity records of checkpoints and prepared corpora.

``CHECKSUMS`` maps a name, as a record stores it, to a function of a file opened for binary
reading that returns its hex digest; ``file_checksum(path, name)`` opens and reads the file in
blocks (the memory used does not grow with the file). CRC-32 is what attnlab writes: it finds
every burst of up to 32 flipped bits, misses random damage with odds of 2**-32, and was the
fastest of the three on checkpoint and corpus files (``benchmarks/checkpoint_checksums.py``);
SHA-256 verifies corpora written before CRC-32 was recorded.
"""

from __future__ import annotations

import hashlib
import pathlib
import zlib
from collections.abc import Callable
from typing import BinaryIO

BLOCK = 1 << 22  # bytes read at a time


def _crc32(file: BinaryIO) -> str:
    value = 0
    while block := file.read(BLOCK):
        value = zlib.crc32(block, value)
    return f"{value:08x}"


def _hashlib(name: str) -> Callable[[BinaryIO], str]:
    return lambda file: hashlib.file_digest(file, name).hexdigest()


CHECKSUMS: dict[str, Callable[[BinaryIO], str]] = {
    "crc32": _crc32,
    "sha256": _hashlib("sha256"),
    "blake2b": _hashlib("blake2b"),
}


def file_checksum(path: str | pathlib.Path, name: str = "crc32") -> str:
    """The hex digest of the file at ``path`` by the checksum ``name`` (a key of ``CHECKSUMS``)."""
    with open(path, "rb") as file:
        return CHECKSUMS[name](file)
