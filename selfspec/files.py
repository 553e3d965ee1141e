"""The one way selfspec writes files: to a temporary name beside the destination, then renamed over it, so a reader
sees the old file or the new one and an interruption leaves nothing half-written. Outputs are ordinary files
(0644) and directories (0755), not the private modes `tempfile` creates. And where selfspec keeps what it caches.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def cache_root() -> Path:
    """Where selfspec keeps converted models and machine profiles ($SELFSPEC_CACHE, else ~/.cache/selfspec)."""
    return Path(os.environ.get("SELFSPEC_CACHE", "~/.cache/selfspec")).expanduser()


@functools.lru_cache(maxsize=1)
def cpu_signature() -> str:
    """A short hash of the CPU model and its instruction sets, for cache keys: compiled code, measured cost curves and
    kernel splits belong to one kind of CPU (a home directory shared between machines must not mix them)."""
    text = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            lines = [line for line in handle.read().splitlines() if line.startswith(("model name", "flags"))]
        text = "\n".join(sorted(set(lines)))
    return hashlib.sha1((text or platform.processor() or platform.machine()).encode()).hexdigest()[:10]


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(temp_path) to fill a temporary file beside `path`, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temp))
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda temp: temp.write_text(text, encoding="utf-8"))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path` to fill; on success it replaces `path` (an existing directory is
    swapped out, then removed), on failure it is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield temp
        temp.chmod(0o755)
        for item in temp.rglob("*"):
            item.chmod(0o755 if item.is_dir() else 0o644)
        if path.exists():
            backup = path.with_name(f".{path.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            path.rename(backup)
            temp.rename(path)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            temp.rename(path)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
