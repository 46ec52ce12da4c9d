"""Reading a checkpoint written elsewhere as data only.

torch.distributed.checkpoint keeps its index, `.metadata`, as a pickle and loads it with plain
`pickle`: a crafted one runs any code. `SafeReader` reads it with `MetadataUnpickler`, which
builds only DCP's metadata classes and the torch sizes, dtypes and layouts they hold, and
refuses any other global before a single object is built. `metadata_problem` then checks the
index is one Piper writes: every entry tensor storage (a bytes entry would be `torch.load`ed
with weights_only=False, which runs code) and every storage file a plain name in the folder.
`keys_problem` checks each key a rank asks for has the shape and dtype of its tensor.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(Exception):
    """A checkpoint file that is not the data Piper writes (the message says why)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` building only _ALLOWED classes and torch dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"{METADATA} names {module}.{name}, not a checkpoint class")


def read_metadata(path: str | Path) -> Metadata:
    """The `.metadata` of the checkpoint folder `path`, built by MetadataUnpickler; raises
    UnsafeCheckpoint when it names anything else or is no DCP Metadata."""
    data = (Path(path) / METADATA).read_bytes()
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # a truncated or garbled pickle: any unpickling error
        raise UnsafeCheckpoint(f"{METADATA} is unreadable ({type(exc).__name__})") from None
    if type(metadata) is not Metadata:
        raise UnsafeCheckpoint(f"{METADATA} holds a {type(metadata).__name__}, not Metadata")
    return metadata


def metadata_problem(path: str | Path) -> str | None:
    """Why the checkpoint at `path` is not data Piper reads (None: it is): the folder holds a
    symbolic link, or its `.metadata` names anything but checkpoint classes, declares a key
    as bytes, or points at a file outside the folder or one with transforms."""
    linked = sorted(p.name for p in Path(path).iterdir() if p.is_symlink())
    if linked:
        return f"{linked[0]} is a symbolic link, not a file of the checkpoint"
    try:
        metadata = read_metadata(path)
    except UnsafeCheckpoint as exc:
        return str(exc)
    except OSError as exc:
        return f"{METADATA} unreadable ({exc.strerror})"
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            return f"{METADATA} declares {key} as bytes, not tensor storage"
        if not isinstance(entry, TensorStorageMetadata):
            return f"{METADATA} declares {key} as {type(entry).__name__}"
    folder = Path(path)
    for info in (metadata.storage_data or {}).values():
        if not isinstance(info, _StorageInfo) or info.transform_descriptors:
            return f"{METADATA} holds a storage entry Piper does not write"
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            return f"{METADATA} points at {name!r}, not a file of the checkpoint"
    return None


def keys_problem(metadata: Metadata, want: dict) -> str | None:
    """Why the checkpoint cannot fill `want` (key -> tensor or DTensor): a key missing, not
    tensor storage, or of another shape or dtype (None: it can)."""
    saved = metadata.state_dict_metadata
    for key in sorted(want):
        entry, tensor = saved.get(key), want[key]
        if entry is None:
            return f"it has no {key}"
        if not isinstance(entry, TensorStorageMetadata):
            return f"{key} is not tensor storage"
        if tuple(entry.size) != tuple(tensor.shape):
            return f"{key} has shape {list(entry.size)}, this run's is {list(tensor.shape)}"
        if entry.properties.dtype != tensor.dtype:
            return f"{key} is {entry.properties.dtype}, this run's is {tensor.dtype}"
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by MetadataUnpickler (read_metadata)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpoint("per-rank metadata files are not read")
        metadata = read_metadata(self.path)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
