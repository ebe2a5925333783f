"""Which model a KV block belongs to: model identity and key namespaces.

Two models whose KV caches have the same shape (a Qwen2 and a Llama of equal
dimensions, or one model and its fine-tune) produce blocks of the same size
and layout that hold different numbers.  A block is only reusable by the
model that computed it, so every path that stores KV (the serving engine, the
vLLM connector, the LMCache and SGLang backends, and :func:`beluga.kv.block_keys`)
keys its blocks under a :class:`KVNamespace`: a digest of the
:class:`ModelIdentity` (the weights), the block layout, and whatever else the
path needs kept apart.  Nothing else decides whether two engines share blocks.

A :class:`ModelIdentity` comes from one of, best first:

``ModelIdentity.explicit(name, revision)``
    the user says which model this is; it overrides any fingerprint.  Engines
    that pass the same name and revision share blocks, whatever their weights:
    keep the revision in step with the weights.
a Hugging Face snapshot (:meth:`ModelIdentity.of_files`)
    a model in the Hugging Face cache (a repo id, or a path inside
    ``models--ORG--NAME/snapshots/COMMIT``) is named by its repo and commit
    hash: exact, and free to compute.
files on disk (:meth:`ModelIdentity.of_files`)
    any other directory (or single weights file) is fingerprinted: the bytes
    of ``config.json``, every weights file's name and size, the whole header
    of each safetensors file (every tensor's name, dtype, shape and offsets),
    and a deterministic sample of each tensor's bytes (:data:`FILE_WINDOWS`
    windows of :data:`WINDOW_BYTES` bytes; for other formats, windows spread
    over the file).  A few thousand small reads, whatever the model's size.
tensors in memory (:meth:`ModelIdentity.of_module`)
    a loaded torch module is fingerprinted the same way: its config (less
    bookkeeping keys), every parameter's and buffer's name, dtype and shape,
    and :data:`TENSOR_SAMPLES` elements of each, spread over the tensor.

What a fingerprint catches: another architecture, other dimensions or
dtypes, another config (RoPE scaling, for instance), another checkpoint of the
same architecture (other seeds, a full fine-tune, merged LoRA adapters: all of
them change nearly every element, so every sampled window).  What it does
not: a change confined to a few weights that no window happens to cover (a
surgical edit of a handful of values, a fine-tune of one small tensor lucky
enough to miss all its windows), or a change outside what is read (code that
transforms the weights after loading, for :meth:`of_files`).  For those, give
an explicit revision.  In the other direction a fingerprint errs safely:
two copies of one model that fingerprint differently (another transformers
version adding config keys, say) only miss each other's blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from beluga.errors import KVLayoutError
from beluga.kv.store import MAX_KEY_BYTES

#: bump when what goes into a namespace changes, so old blocks are never read as new ones
NAMESPACE_VERSION = 1
DIGEST_BYTES = 16
TENSOR_SAMPLES = 256  # elements sampled per tensor in memory
FILE_WINDOWS = 8  # windows sampled per tensor of a safetensors file
WINDOW_BYTES = 32
WHOLE_FILE_WINDOWS = 256  # windows sampled per weights file of another format
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
CONFIG_FILES = ("config.json", "params.json")
# config keys that do not change what the model computes
_CONFIG_BOOKKEEPING = frozenset(
    {"transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict"}
)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ModelIdentity:
    """Which model (weights) a KV block was computed by.

    ``fingerprint`` decides: two identities are equal, and their engines share
    blocks, exactly when their fingerprints are.  ``name`` is for messages
    (a repo id, a directory name).  Build one with :meth:`explicit`,
    :meth:`of_files`, :meth:`of_module` or :func:`resolve_model`.
    """

    fingerprint: str
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.fingerprint:
            raise ValueError("a model identity needs a non-empty fingerprint")

    def __str__(self) -> str:
        return f"{self.name or 'model'} [{self.fingerprint}]"

    @classmethod
    def explicit(cls, name: str, revision: str) -> ModelIdentity:
        """The model the user names: ``name`` at ``revision`` (both count, nothing is read)."""
        if not name or not revision:
            raise ValueError(
                "an explicit model identity needs a name and a revision, "
                f"not {name!r} and {revision!r}"
            )
        return cls(f"revision:{name}@{revision}", name)

    @classmethod
    def of_files(
        cls, model: str, revision: str | None = None, *, cache_dir: str | None = None
    ) -> ModelIdentity:
        """The identity of a model on disk: a directory, a weights file, or a cached repo id.

        A path inside a Hugging Face snapshot, or a repo id found in the
        Hugging Face cache (``cache_dir``, else ``$HF_HUB_CACHE``, else
        ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) at ``revision``
        (a branch, tag or commit), is named by its commit; any other path is
        fingerprinted (see the module docstring).  ``revision`` None means
        "not known": the repo's only cached snapshot, refused when there are
        several.  Raises ``LookupError`` when ``model`` is neither, and
        ``ValueError`` for a directory without weights.
        """
        if os.path.exists(model):
            path = os.path.abspath(model)
            snapshot = _snapshot_of(path)
            if snapshot is not None:
                repo, commit = snapshot
                return cls(f"hf:{repo}@{commit}", repo)
            return cls(f"files:{_files_digest(path)}", os.path.basename(path.rstrip(os.sep)))
        commit = _cached_commit(model, revision, cache_dir)
        if commit is None:
            at = "" if revision is None else f" at revision {revision!r}"
            raise LookupError(
                f"{model!r} is not a local path, and no snapshot of it{at} is in the "
                f"Hugging Face cache {_hub_cache(cache_dir)}"
            )
        return cls(f"hf:{model}@{commit}", model)

    @classmethod
    def of_module(cls, module: Any, *, name: str | None = None) -> ModelIdentity:
        """The identity of a loaded torch module (its config, tensors and samples of them)."""
        digest = hashlib.sha256()
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            digest.update(_canonical_config(config.to_dict()))
        tensors = [*module.named_parameters(), *module.named_buffers()]
        if not tensors:
            raise ValueError(f"{type(module).__name__} has no parameters or buffers to fingerprint")
        for tensor_name, tensor in sorted(tensors, key=lambda item: item[0]):
            digest.update(f"{tensor_name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
            digest.update(_tensor_sample(tensor, tensor_name))
        if name is None:
            name = getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or ""
            name = name or type(module).__name__
        return cls(f"tensors:{digest.hexdigest()[:32]}", name)


@dataclass(frozen=True)
class KVNamespace:
    """The key space of one model's blocks on one path: model, block layout and scope.

    ``layout`` is everything that fixes a block's bytes besides the weights
    (a :attr:`beluga.transfer.BlockFormat.fingerprint`, or a framework's
    description of its pages); ``scope`` is anything else that must keep
    blocks apart (the path that writes them, a rank, a hash algorithm, a
    user's namespace).  :meth:`key` puts the namespace's digest in front of a
    path's own key, so two namespaces never share a key.
    """

    model: ModelIdentity
    layout: str
    scope: tuple[str, ...] = ()
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.layout:
            raise ValueError("a KV namespace needs the block layout it holds")
        parts = [NAMESPACE_VERSION, self.model.fingerprint, self.layout, list(self.scope)]
        raw = json.dumps(parts, separators=(",", ":")).encode()
        object.__setattr__(self, "digest", hashlib.sha256(raw).digest()[:DIGEST_BYTES])

    def key(self, raw: bytes | str) -> bytes:
        """A store key for ``raw`` in this namespace (``raw`` hashed when it would not fit)."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if len(data) > MAX_KEY_BYTES - DIGEST_BYTES:
            data = hashlib.sha256(data).digest()
        return self.digest + data


def resolve_model(
    model: str | None,
    *,
    revision: str | None = None,
    explicit_revision: str | None = None,
    path: str | None = None,
    cache_dir: str | None = None,
    setting: str,
) -> ModelIdentity:
    """The identity of the model a framework serves, refused with ``setting`` when unknown.

    ``explicit_revision`` (the user's override) wins; then the files at
    ``path`` (default: ``model`` itself, a path or a cached repo id) at the
    framework's ``revision``.  ``setting`` tells the user how to set the
    override in this framework, e.g. ``"kv_connector_extra_config 'model_revision'"``.
    Raises :class:`~beluga.errors.KVLayoutError` when nothing identifies the weights.
    """
    name = display_name(model or path or "")
    if explicit_revision:
        if not name:
            raise KVLayoutError(f"a model revision ({setting}) needs the model's name as well")
        return ModelIdentity.explicit(name, str(explicit_revision))
    where = path or model
    if not where:
        raise KVLayoutError(
            f"Beluga keys KV blocks by model and was not told which model this is: set {setting} "
            "to the model's revision (engines sharing blocks must use the same value)"
        )
    try:
        return ModelIdentity.of_files(where, revision, cache_dir=cache_dir)
    except (LookupError, ValueError, OSError) as e:
        raise KVLayoutError(
            f"cannot identify the weights of model {where!r} ({e}); Beluga keys KV blocks by "
            f"model so that different weights never share them: set {setting} to the model's "
            "revision (engines sharing blocks must use the same value, and change it with "
            "the weights)"
        ) from None


def display_name(model: str) -> str:
    """A short name for a model string: a cached repo id, a path's last part, or as given."""
    if not model:
        return ""
    if os.path.exists(model):
        path = os.path.abspath(model)
        snapshot = _snapshot_of(path)
        return snapshot[0] if snapshot else os.path.basename(path.rstrip(os.sep))
    return model


# -- Hugging Face cache ------------------------------------------------------


def _hub_cache(cache_dir: str | None) -> str:
    if cache_dir:
        return cache_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    return os.path.join(home, "hub")


def _snapshot_of(path: str) -> tuple[str, str] | None:
    """(repo id, commit) when ``path`` lies in a Hugging Face cache snapshot."""
    parts = path.split(os.sep)
    for i in range(len(parts) - 2):
        repo, snapshots, commit = parts[i : i + 3]
        if repo.startswith("models--") and snapshots == "snapshots" and _COMMIT.fullmatch(commit):
            return repo.removeprefix("models--").replace("--", "/"), commit
    return None


def _cached_commit(repo: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The commit of ``repo`` at ``revision`` (None: its only snapshot) in the HF cache."""
    folder = os.path.join(_hub_cache(cache_dir), "models--" + repo.replace("/", "--"))
    if revision is None:
        try:
            snapshots = [
                c for c in os.listdir(os.path.join(folder, "snapshots")) if _COMMIT.fullmatch(c)
            ]
        except OSError:
            return None
        if len(snapshots) > 1:
            raise LookupError(
                f"{len(snapshots)} snapshots of {repo!r} are in the Hugging Face cache "
                f"{_hub_cache(cache_dir)}, and which one is served is not known"
            )
        return snapshots[0] if snapshots else None
    commit = revision if _COMMIT.fullmatch(revision) else None
    if commit is None:
        try:
            with open(os.path.join(folder, "refs", revision)) as f:
                commit = f.read().strip()
        except OSError:
            return None
    return commit if os.path.isdir(os.path.join(folder, "snapshots", commit)) else None


# -- fingerprints ------------------------------------------------------------


def _spread(count: int, span: int, salt: str) -> Iterator[int]:
    """``count`` deterministic positions in ``range(span)``, one per equal slice, jittered.

    One per slice covers the whole range; the jitter (splitmix64 of the salt
    and the index) keeps the samples off any period the data may have, such
    as a matrix's columns.
    """
    seed = int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little")
    for i in range(count):
        start, end = span * i // count, span * (i + 1) // count
        z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        yield start + (z ^ (z >> 31)) % max(1, end - start)


def _canonical_config(config: dict[str, Any]) -> bytes:
    kept = {
        k: v for k, v in config.items() if not k.startswith("_") and k not in _CONFIG_BOOKKEEPING
    }
    return json.dumps(kept, sort_keys=True, default=str, separators=(",", ":")).encode()


def _tensor_sample(tensor: Any, salt: str) -> bytes:
    """The bytes of :data:`TENSOR_SAMPLES` elements spread over a tensor (all, if fewer)."""
    import torch

    values = tensor.detach()
    if values.device.type == "meta":
        raise ValueError(f"tensor {salt} is on the meta device: load the weights first")
    n = values.numel()
    if n <= TENSOR_SAMPLES:
        flat = values.reshape(-1)
    else:
        index = torch.tensor(list(_spread(TENSOR_SAMPLES, n, salt)), device=values.device)
        flat = (
            values[torch.unravel_index(index, values.shape)] if values.ndim > 1 else values[index]
        )
    flat = flat.contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _files_digest(path: str) -> str:
    """A fingerprint of the config and weights files at ``path`` (a directory or one file)."""
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        weights = [n for n in names if n.endswith(WEIGHT_SUFFIXES)]
        configs = [n for n in names if n in CONFIG_FILES]
        root = path
    else:
        root, single = os.path.split(path)
        weights, configs = [single], []
    if not weights:
        raise ValueError(f"no weights files ({', '.join(WEIGHT_SUFFIXES)}) in {path}")
    digest = hashlib.sha256()
    for name in configs:
        with open(os.path.join(root, name), "rb") as f:
            digest.update(f"{name}\n".encode() + f.read())
    for name in weights:
        digest.update(_file_fingerprint(os.path.join(root, name), name))
    return digest.hexdigest()[:32]


def _file_fingerprint(path: str, name: str) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f"{name}|{size}\n".encode()
        if name.endswith(".safetensors"):
            return head + b"".join(_safetensors_samples(f.fileno(), size, name))
        windows = _spread(WHOLE_FILE_WINDOWS, max(1, size - WINDOW_BYTES), name)
        return head + b"".join(os.pread(f.fileno(), WINDOW_BYTES, at) for at in windows)


def _safetensors_samples(fd: int, size: int, name: str) -> Iterable[bytes]:
    """The header of a safetensors file, then :data:`FILE_WINDOWS` windows of each tensor."""
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if header_len > size - 8:
        raise ValueError(f"{name} is not a safetensors file (its header is cut short)")
    header = os.pread(fd, header_len, 8)
    yield header
    data = 8 + header_len
    tensors = json.loads(header)
    for tensor_name in sorted(tensors):
        if tensor_name == "__metadata__":
            continue
        begin, end = tensors[tensor_name]["data_offsets"]
        span = max(0, end - begin - WINDOW_BYTES)
        for at in _spread(FILE_WINDOWS, span + 1, f"{name}/{tensor_name}"):
            yield os.pread(fd, min(WINDOW_BYTES, end - begin), data + begin + at)
