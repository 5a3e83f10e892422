"""A model's identity for chunk keys: its weights' bytes and the settings that change its KV.

Why: a chunk key names the tokens, the namespace and the layout (shapes, dtype). Two checkpoints
with the same shapes at the same path (a fine-tune copied over its base, a re-quantized model)
must not share chunks: the KV of one is wrong for the other. The connectors' default namespaces
(``vllm:<model>``, ``vllm-tier:<model>``, :func:`kvstore.connectors.hf.namespace_for_model`) end
with ``#id=<model_identity(...)>``; an explicit namespace still wins.

What is hashed (:func:`weights_fingerprint`):

- every weight file of the checkpoint, whole: ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
  ``*.gguf`` (a directory's top level, or the one file a GGUF model names). Headers and sizes
  are not enough: a fine-tune changes only tensor values. blake2b in 1 MiB blocks, one thread
  per file (shards in parallel): measured 0.26-0.36 s for the 98 MB SmolLM2 GGUF on the 2-core
  CI machine under load (~0.3 GB/s per core; ~1 GB/s on an idle server core), so a 16 GB
  checkpoint in 4 shards costs ~15 s at its first start, nothing after;
- the JSON files that shape the model or its weights: ``config.json``, ``*.index.json``, the
  quantization configs (tokenizer files do not change the KV of a given token sequence).

Not read: what a training run leaves beside the weights (``optimizer.pt``, ``rng_state*.pth``,
...: never loaded, often larger than the model), and a Hugging Face cache file, whose snapshot
entry links to ``blobs/<sha256>`` (or git sha1): that name already is its content hash.

A file's digest is cached in ``$XDG_CACHE_HOME/kvstore/weights.json`` (default ``~/.cache``)
under its path, size, inode, mtime and ctime: a restart hashes nothing again, and any rewrite,
copy or rename over the file changes its ctime (which no tool can set back), so a stale digest
is never reused. A cache that cannot be written only costs the hash at the next start.

A model that is not a local path is looked up in the Hugging Face cache (where vLLM and
transformers download to); if absent, its identity is its name and revision only, and a
warning says to pin a revision or set the namespace explicitly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.connectors")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json", "hf_quant_config.json")
BLOCK = 1 << 20
CACHE_ENTRIES = 4096  # file digests remembered; the oldest are dropped first
_DIGESTS: dict[str, str] = {}  # this process's: a scheduler and a worker side hash once even if the cache is unwritable


def cache_path() -> Path:
    """Where file digests are cached (``$XDG_CACHE_HOME/kvstore/weights.json``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore" / "weights.json"


def file_digest(path: Path) -> str:
    """blake2b of the whole file (hex); reads it in 1 MiB blocks."""
    digest = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


# Files a training run leaves beside the weights: never loaded by an engine, often larger than the model.
TRAINING_FILES = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "training_args.bin", "rng_state")
_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _content_name(path: Path) -> str | None:
    """A Hugging Face cache file's content hash, free: its snapshot entry links to ``blobs/<sha256 or git sha1>``."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and _BLOB_NAME.fullmatch(target.name):
        return target.name
    return None


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_dev}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _checkpoint_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = [
        path
        for path in root.iterdir()
        if path.is_file()
        and (path.name.endswith(WEIGHT_SUFFIXES) or path.name in CONFIG_FILES or path.name.endswith(".index.json"))
        and not path.name.startswith(TRAINING_FILES)
    ]
    return sorted(files)


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """A digest of the checkpoint at ``path`` (a directory or a single file), cached per file.

    Contract: changes whenever any weight or config byte changes (see the module docstring for
    what is hashed); stays the same for an untouched checkpoint, without re-reading it.
    Raises ``FileNotFoundError`` if ``path`` does not exist.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {root}")
    store = cache_path()
    try:
        cached: dict[str, str] = json.loads(store.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):  # not ours, or damaged: start over
        cached = {}
    checkpoint = _checkpoint_files(root)
    named = {file: name for file in checkpoint if (name := _content_name(file)) is not None}
    files = {file: _stat_key(file) for file in checkpoint if file not in named}
    cached.update({key: _DIGESTS[key] for key in files.values() if key in _DIGESTS and key not in cached})
    new = [file for file, key in files.items() if key not in cached]
    digests = {key: cached[key] for key in files.values() if key in cached}
    if new:  # shards hashed in parallel: hashlib releases the GIL on large blocks
        with ThreadPoolExecutor(max_workers=min(len(new), os.cpu_count() or 1)) as pool:
            for file, digest in zip(new, pool.map(file_digest, new), strict=True):
                digests[files[file]] = digest
                if _stat_key(file) == files[file]:  # not rewritten while it was read: worth remembering
                    cached[files[file]] = _DIGESTS[files[file]] = digest
        _write_cache(store, cached)
    _DIGESTS.update({key: cached[key] for key in files.values() if key in cached})
    total = hashlib.blake2b(digest_size=20)
    for file in checkpoint:
        total.update(f"{file.name}={named[file] if file in named else digests[files[file]]}\n".encode())
    return total.hexdigest()


def _write_cache(store: Path, cached: dict[str, str]) -> None:
    entries = dict(list(cached.items())[-CACHE_ENTRIES:])
    try:
        store.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=store.parent, prefix=".weights-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(temp, store)  # atomic: a concurrent reader sees the old or the new file
    except OSError as exc:
        log.info("kvstore: cannot cache weight digests in %s (%r): the next start hashes them again", store, exc)


def _local_checkpoint(model: str, revision: str | None) -> Path | None:
    """``model`` as a local path, or its snapshot in the Hugging Face cache; None if neither."""
    if os.path.exists(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not installed, not a repo id, not downloaded
        return None


def model_identity(model: str, settings: Mapping[str, Any] | None = None, revision: str | None = None) -> str:
    """24 hex digits naming the weights of ``model`` (a path or hub id) and ``settings``.

    ``settings``: what else changes the KV for the same tokens (dtype, quantization, rope
    scaling, KV cache dtype, config overrides); JSON-serialisable values (others by ``str``).
    Equal inputs give equal identities in every process; any weight byte changes it.
    """
    checkpoint = _local_checkpoint(model, revision)
    if checkpoint is not None:
        weights = weights_fingerprint(checkpoint)
    else:
        log.warning(
            "kvstore: the weights of %r are not on this machine: the namespace names the model and revision "
            "only; pin a revision, or set the namespace explicitly when weights change under one name",
            model,
        )
        weights = f"name={model}"
    text = json.dumps({"weights": weights, "revision": revision, **(settings or {})}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def default_namespace(
    prefix: str, model: str, settings: Mapping[str, Any] | None = None, revision: str | None = None
) -> str:
    """``<prefix>:<model>#id=<model_identity>``: the connectors' namespace unless one is given."""
    return f"{prefix}:{model}#id={model_identity(model, settings, revision)}"


def require_one_namespace(own: tuple[str, str], others: Mapping[str, str]) -> None:
    """Raise :class:`~kvstore.errors.ConfigError` unless every process of an engine keys chunks alike.

    ``own`` is (who, identity) of the process checking, e.g. ``("worker rank 1", ...)``; ``others``
    maps each other process (``"the scheduler"``) to the identity it computed: a namespace, with
    whatever else keys depend on (the vLLM connector adds its layout). Processes that disagree
    would lose every chunk silently (one files it where the other never looks), so the engine
    must not go on: the error names both identities and the way out.
    """
    who, identity = own
    differ = {name: theirs for name, theirs in others.items() if theirs != identity}
    if differ:
        listed = "; ".join(f"{name}: {theirs!r}" for name, theirs in sorted(differ.items()))
        raise ConfigError(
            f"kvstore: the processes of this engine key chunks differently ({who}: {identity!r}; {listed}), so "
            "chunks saved by one would never be found by the other. A setting the default namespace hashes "
            "differs between them; set kvstore_namespace explicitly (one per model and weights) and please "
            "report this with your model's config.json and vLLM version"
        )
