"""A staging buffer another process on the same machine can map: the one device-specific piece
of the IPC copy service (CUDA assumptions of the IPC path live here and nowhere else).

- CPU (the CPU twin): a file in /dev/shm, created owner-only (0600) with O_EXCL and mapped
  with `torch.UntypedStorage.from_file(..., shared=True)`; its handle is the file's path and
  size. The owner unlinks it on `close`, on a failed creation, and at interpreter exit.
- CUDA: a tensor from the caching allocator, shared with `torch.multiprocessing.reductions
  .reduce_tensor` (a cudaIpcMemHandle of its allocation); the receiver rebuilds it with
  `rebuild_cuda_tensor` on its own device index (CUDA_VISIBLE_DEVICES may number the one
  physical device differently in each process). It is allocated in a classic segment even
  where the allocator is set to expandable segments (`classic_segments`): an expandable
  segment is CUDA virtual memory, which exports no cudaIpcMemHandle.

Handles travel as JSON (plain fields, bytes as hex) — never pickled: a receiver calls a fixed
rebuild function with decoded values, so nothing it receives can name code to run. A receiver
opens each handle once and caches the mapping (`HandleCache`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import uuid
import weakref

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_NAME = re.compile(r"^mcore-rl-staging-[0-9a-f]{32}-r\d+$")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# torch reads its allocator settings from the first of these that is set (PYTORCH_ALLOC_CONF is
# the newer name)
_ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_EXPANDABLE = "expandable_segments"


def allocator_conf(env=None) -> str:
    """The allocator settings the process runs with ("" when none are set)."""
    env = os.environ if env is None else env
    return next((env[var] for var in _ALLOC_CONF_VARS if env.get(var)), "")


def _fields(conf: str) -> list[str]:
    return [f.strip() for f in conf.split(",") if f.strip()]


def with_flag(conf: str, key: str, enabled: bool) -> str:
    """`conf` with `key` set to `enabled`, every other field as it was: torch resets every
    option a settings string it is handed leaves out (max_split_size_mb, the garbage
    collection threshold, ...), so a bare "expandable_segments:False" would drop them."""
    want = f"{key}:{enabled}"
    fields = _fields(conf)
    for i, field in enumerate(fields):
        if field.partition(":")[0].strip() == key:
            fields[i] = want
            return ",".join(fields)
    return ",".join(fields + [want])


def expandable_segments_on(env=None) -> bool:
    """Whether the process's allocator settings turn expandable segments on."""
    return any(name.strip() == _EXPANDABLE and value.strip().lower() in ("true", "1")
               for name, _, value in (f.partition(":") for f in _fields(allocator_conf(env))))


@contextlib.contextmanager
def classic_segments(env=None, set_allocator_settings=None):
    """Allocations inside the block come from classic segments: with expandable segments on,
    they are turned off for the block (torch's runtime allocator setting, the process's other
    options kept), then the process's settings are put back whole."""
    if not expandable_segments_on(env):
        yield
        return
    conf = allocator_conf(env)
    apply = set_allocator_settings or torch.cuda.memory._set_allocator_settings
    apply(with_flag(conf, _EXPANDABLE, False))
    try:
        yield
    finally:
        apply(conf)


class SharedStaging:
    """One rank's shared staging buffer of `nbytes` bytes (uint8) on `device`."""

    def __init__(self, nbytes: int, device: str | torch.device, owner_rank: int):
        self.device = torch.device(device)
        self.nbytes = nbytes
        self.path: str | None = None
        self._handle: bytes | None = None
        if self.device.type == "cpu":
            self.tensor = self._create_file(nbytes, owner_rank)
        elif self.device.type == "cuda":  # pragma: no cover - GPU only
            with classic_segments():
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            raise ValueError(f"shared staging on {self.device}: expected cpu or cuda")

    def _create_file(self, nbytes: int, owner_rank: int) -> torch.Tensor:
        path = os.path.join(_shm_dir(), f"mcore-rl-staging-{uuid.uuid4().hex}-r{owner_rank}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.path = path
        self._finalizer = weakref.finalize(self, _unlink, path)  # also runs at exit
        try:
            os.ftruncate(fd, max(nbytes, 1))
            os.close(fd)
            storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(nbytes, 1))
            return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
        except BaseException:
            self.close()
            raise

    def handle(self) -> bytes:
        """What a receiver needs to map this buffer, as JSON bytes — computed once, so every
        sync hands out the same bytes and receivers keep their mapping (`HandleCache`)."""
        if self._handle is None:
            if self.device.type == "cpu":
                self._handle = json.dumps({"kind": "shm", "path": self.path,
                                           "nbytes": self.nbytes}).encode()
            else:  # pragma: no cover - GPU only
                self._handle = _cuda_handle(self.tensor)
        return self._handle

    def unlink(self) -> None:
        """Remove the shared-memory file's name (every receiver has mapped it): the mappings
        keep the bytes, and the kernel frees them with the last one, however processes end."""
        if self.path is not None:
            self._finalizer()  # unlinks once

    def close(self) -> None:
        self.tensor = None
        self.unlink()


def open_handle(raw: bytes, device: str | torch.device) -> torch.Tensor:
    """Map a peer's staging buffer (uint8, `nbytes` long) from its handle, on `device` (this
    rank's own device: on CUDA its local index, whatever the peer's numbering)."""
    info = json.loads(raw.decode())
    if info.get("kind") == "shm":
        return _open_shm(info["path"], int(info["nbytes"]))
    if info.get("kind") == "cuda":  # pragma: no cover - GPU only
        return _open_cuda(info, torch.device(device))
    raise ValueError(f"staging handle of unknown kind {info.get('kind')!r}")


def _open_shm(path: str, nbytes: int) -> torch.Tensor:
    """Refuse anything but a regular file we created: the name pattern, in the shm directory,
    not a symlink, owned by this user."""
    if os.path.dirname(path) != _shm_dir() or not _NAME.match(os.path.basename(path)):
        raise ValueError(f"staging handle {path!r} is not an mcore-rl staging file")
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() \
            or info.st_size < max(nbytes, 1):
        raise ValueError(f"staging file {path} is not a regular file of this user holding "
                         f"{nbytes} bytes")
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]


def _cuda_handle(tensor: torch.Tensor) -> bytes:  # pragma: no cover - GPU only

    _rebuild, args = reduce_tensor(tensor)
    (_cls, size, stride, offset, _storage_cls, _dtype, device, handle, storage_bytes,
     storage_offset, _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return json.dumps({
        "kind": "cuda", "size": list(size), "stride": list(stride), "offset": offset,
        "device": device, "handle": handle.hex(), "storage_bytes": storage_bytes,
        "storage_offset": storage_offset, "ref_handle": ref_handle.hex(),
        "ref_offset": ref_offset,
        "event_handle": None if event_handle is None else event_handle.hex(),
        "event_sync": bool(event_sync)}).encode()


def _open_cuda(info: dict, device: torch.device) -> torch.Tensor:  # pragma: no cover - GPU

    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(info["size"]), tuple(info["stride"]), int(info["offset"]),
        torch.storage.TypedStorage, torch.uint8, index, bytes.fromhex(info["handle"]),
        int(info["storage_bytes"]), int(info["storage_offset"]), False,
        bytes.fromhex(info["ref_handle"]), int(info["ref_offset"]),
        None if info["event_handle"] is None else bytes.fromhex(info["event_handle"]),
        bool(info["event_sync"]))


def settle(device: torch.device) -> None:
    """Make this process's copies on `device` visible to (or finished before) the peer's
    next step: the gloo signal that follows must not overtake queued CUDA work."""
    if device.type == "cuda":  # pragma: no cover - GPU only
        torch.cuda.current_stream(device).synchronize()


class HandleCache:
    """A receiver's mapped peer buffers: each handle is opened once and kept until the peer
    hands out a new one (a bigger buffer) or the cache is cleared."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._by_peer: dict[int, tuple[bytes, torch.Tensor]] = {}

    def get(self, peer: int, raw: bytes) -> torch.Tensor:
        cached = self._by_peer.get(peer)
        if cached is None or cached[0] != raw:
            self._by_peer[peer] = (raw, open_handle(raw, self.device))
        return self._by_peer[peer][1]

    def clear(self) -> None:
        self._by_peer.clear()


__all__ = ["HandleCache", "SharedStaging", "open_handle", "settle"]
