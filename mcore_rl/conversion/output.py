"""All-or-nothing output directories: a conversion writes into a hidden temp dir beside the
target and renames it into place only when complete, so a failure or Ctrl-C leaves nothing at
the destination (and, with --force, the old output untouched until the new one is ready)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from mcore_rl.conversion.errors import ConversionError

PARTIAL_MARK = ".partial-"


def check_paths(src: Path, dst: Path, *, force: bool) -> None:
    """Refuse a missing source, source == destination, a destination that contains the source
    (--force would delete it), an existing destination without --force, and a destination
    below a file."""
    if not src.exists():
        raise ConversionError(f"source {src} does not exist")
    s, d = src.resolve(), dst.resolve()
    if s == d:
        raise ConversionError(f"source and destination are the same path ({s})")
    if d in s.parents:
        raise ConversionError(f"destination {d} contains the source {s}")
    if dst.exists() or dst.is_symlink():
        if not force:
            raise ConversionError(f"destination {dst} already exists (pass --force to "
                                  "replace it)")
    for parent in d.parents:   # missing parents are created (mkdir -p); files are in the way
        if parent.exists():
            if not parent.is_dir():
                raise ConversionError(f"destination's parent {parent} is not a directory")
            break


def temp_dir_for(dst: Path) -> Path:
    """A fresh name beside `dst` (same file system, so the final rename is atomic)."""
    d = dst.resolve()
    return d.parent / f".{d.name}{PARTIAL_MARK}{uuid.uuid4().hex[:8]}"


def commit(tmp: Path, dst: Path, *, force: bool) -> None:
    """Move the finished `tmp` to `dst`, replacing an existing `dst` only with `force`."""
    dst = dst.resolve()
    fsync_tree(tmp)
    old = None
    if dst.exists() or dst.is_symlink():
        if not force:
            raise ConversionError(f"destination {dst} appeared while converting; not replaced")
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        remove(old)
    fsync_dir(dst.parent)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def fsync_tree(root: Path) -> None:
    """Flush every file and every directory under `root` (already-synced ones are cheap), so
    a rename that follows publishes data that is on disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
