"""What a process does with its memory: large frees go back to the OS at once, an unloaded version's heap is
trimmed, and what a process holds once it is up is left out of the garbage collector's full passes.
"""
from __future__ import annotations

import ctypes
import functools
import gc

# glibc's malloc raises its mmap threshold after each large free (up to 32 MiB), so after one huge image its
# later large buffers come from the heap and stay with the process when freed (measured: 118 MB idle, 295 MB
# after a few 40-megapixel images). A fixed threshold keeps large buffers mmapped: freed, they go back at once.
# Not glibc's own 128 KiB: every buffer above the threshold is a fresh mapping whose pages fault in on first
# touch, and an ordinary image's buffers (224x224 RGB: 150 KB decoded, 600 KB as float32) paid that on every
# request: ViT-S/16 served one client 12.3 ms over the raw session at 128 KiB, 7.8-8.5 ms at 4 MiB
# (docs/tail-latency.md).
_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION_BYTES = 4 * 2**20


def return_large_frees_to_the_os() -> bool:
    """Fix glibc's mmap threshold (no-op elsewhere); True when it was set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))
    except (OSError, AttributeError):  # not glibc
        return False


def give_freed_memory_back() -> bool:
    """Return the heap's free pages to the OS (glibc's malloc_trim; no-op elsewhere): after a model version is
    unloaded its freed weights sit in the heap's arenas, and a process that loads and unloads versions all day
    would hold its peak forever. True when it was done."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None and hasattr(libc, "malloc_trim") else False


@functools.cache
def _libc():
    """glibc, loaded once (each CDLL is a new handle); None elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def freeze_startup_objects() -> None:
    """Leave what a process holds once it is up out of every later garbage collection (`gc.freeze`).

    A worker starts with about 75,000 objects the collector tracks (FastAPI's routes, pydantic's validators,
    numpy, ONNX Runtime's bindings, the model's metadata), and each full collection walked them all again while
    every request in the process waited: 40 ms here, the worst of a worker's tail at 32 clients. Frozen, they
    are still freed by reference counting; only a cycle among them waits for `collect_cycles`. Collected first,
    so that startup's own garbage is not kept for good."""
    gc.collect()
    gc.freeze()


def collect_cycles() -> None:
    """A full collection that reaches the frozen objects too (an unloaded model's last references may sit in
    cycles among them), then what survives frozen again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
