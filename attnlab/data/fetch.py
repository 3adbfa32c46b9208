"""Data the user does not have yet: downloaded once into a cache directory, checksum verified.

The cache is ``$ATTNLAB_CACHE`` when set, else the platform's user cache directory
(``~/.cache/attnlab`` on Linux). ``fetch("shakespeare")`` (or any URL with its SHA-256)
downloads through a temporary file that is renamed into place only once its SHA-256 matches,
so a failed or corrupted download leaves nothing behind: no network, a refused or missing
URL, a full disk are a ``FetchError`` naming the URL and what to do. A data path written
``cache:NAME`` names a known dataset's file in the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from attnlab.errors import DataError, DataFileError, FetchError, one_line

CACHE_ENV = "ATTNLAB_CACHE"
CACHE_PREFIX = "cache:"


@dataclasses.dataclass(frozen=True)
class Dataset:
    url: str
    sha256: str
    filename: str
    about: str


DATASETS = {
    "shakespeare": Dataset(
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        filename="tinyshakespeare.txt",
        about="tiny Shakespeare (1,115,394 bytes) from karpathy/char-rnn, public domain text",
    ),
}


class ChecksumError(DataError):
    """A download whose SHA-256 is not the expected one (nothing was kept)."""


def cache_dir() -> pathlib.Path:
    """Where fetched files live: ``$ATTNLAB_CACHE`` or the user cache directory."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("attnlab"))


def cached_path(name: str) -> pathlib.Path:
    """The cache location of the known dataset ``name`` (it may not exist yet)."""
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
    return cache_dir() / DATASETS[name].filename


def resolve(path: str) -> str:
    """``cache:NAME`` -> the cached file, with the command that fetches it when it is absent."""
    if not path.startswith(CACHE_PREFIX):
        return path
    name = path[len(CACHE_PREFIX) :]
    found = cached_path(name)
    if not found.is_file():
        raise DataFileError(
            f"data.path={path!r}: {found} is absent; run `attnlab data fetch {name}` "
            f"(or set {CACHE_ENV} to a directory holding {DATASETS[name].filename})"
        )
    return str(found)


def sha256_of(path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fetch(source: str, *, sha256: str | None = None, filename: str | None = None, progress=True):
    """Downloads a known dataset name or a URL (with ``sha256``) into the cache; its path.

    A file already in the cache with the right checksum is not downloaded again.
    """
    if source in DATASETS:
        known = DATASETS[source]
        url, sha256, filename = known.url, sha256 or known.sha256, filename or known.filename
    elif "://" in source:
        url = source
        if not sha256:
            raise DataError(f"{source}: pass the file's SHA-256 (--sha256) to fetch a URL")
        filename = filename or pathlib.PurePosixPath(urllib.parse.urlparse(url).path).name
    else:
        raise DataError(
            f"unknown dataset {source!r}; known: {', '.join(sorted(DATASETS))}, or a URL with "
            "--sha256"
        )
    target = cache_dir() / filename
    if target.is_file() and sha256_of(target) == sha256:
        return target
    try:
        return _download(url, sha256, target, progress)
    except urllib.error.HTTPError as e:
        raise FetchError(f"{url}: the server answered {e.code} {e.reason}; check the URL") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        why = getattr(e, "reason", None) or e
        if isinstance(why, FileNotFoundError):
            raise FetchError(f"cannot download {url}: no such file; check the URL") from None
        raise FetchError(
            f"cannot download {url} ({one_line(why) or type(why).__name__}): this machine seems "
            f"offline; fetch on a machine with network access and copy {filename} into "
            f"{target.parent} (or set {CACHE_ENV}); nothing was kept"
        ) from None
    except OSError as e:
        raise FetchError(
            f"cannot write {target} ({e.strerror or one_line(e)}); free some space or set "
            f"{CACHE_ENV} to a writable directory; nothing was kept"
        ) from None


def _download(url, sha256, target, progress) -> pathlib.Path:
    """Writes ``url`` to ``target`` through a temporary file; the cache directory is made
    only once the server answered, so an offline attempt leaves nothing."""
    from tqdm.auto import tqdm

    with urllib.request.urlopen(url, timeout=60) as response:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            digest = hashlib.sha256()
            total = int(response.headers.get("Content-Length") or 0) or None
            with (
                os.fdopen(fd, "wb") as out,
                tqdm(total=total, unit="B", unit_scale=True, disable=not progress) as bar,
            ):
                while block := response.read(1 << 20):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
            if digest.hexdigest() != sha256:
                raise ChecksumError(
                    f"{url}: SHA-256 {digest.hexdigest()} is not the expected {sha256}; "
                    "nothing was kept"
                )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
