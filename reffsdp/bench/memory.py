"""Peak and kept memory per rank: the CUDA allocator, or a process-wide heap counter on CPU.

[Note: counting CPU heap bytes]
A profiler sees only the allocations of the threads it is active on, and a CPU tensor is
often freed on another thread (a gloo worker finishing an asynchronous collective drops the
last reference), so its curve drifts and its peak is wrong. Instead every rank process is
started with a tiny allocator shim in ``LD_PRELOAD``: ``malloc``, ``calloc``, ``realloc``,
``posix_memalign``, ``aligned_alloc``, ``memalign`` and ``free`` forward to glibc and keep
an atomic count of live bytes (``malloc_usable_size`` of each block) and its high-water
mark. CPU tensors come from ``posix_memalign``, so every one is seen, whichever thread
frees it. The shim is compiled at first use from the C source below with the system C
compiler (``$CC`` or ``cc``) into a cache directory; without a compiler, CPU memory is
reported as not measured.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

HEAP_COUNTER_SOURCE = r"""
/* Process-wide count of live heap bytes, for LD_PRELOAD. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <string.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static long long current_bytes;
static long long peak_bytes;

static void added(void *p) {
    if (!p) return;
    long long now = __atomic_add_fetch(&current_bytes, (long long)malloc_usable_size(p),
                                       __ATOMIC_RELAXED);
    long long peak = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&peak_bytes, &peak, now, 1,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void removed(void *p) {
    if (p) __atomic_sub_fetch(&current_bytes, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

void *malloc(size_t n) { void *p = __libc_malloc(n); added(p); return p; }
void *calloc(size_t k, size_t n) { void *p = __libc_calloc(k, n); added(p); return p; }
void free(void *p) { removed(p); __libc_free(p); }
void *realloc(void *old, size_t n) {
    size_t old_size = old ? malloc_usable_size(old) : 0;
    void *p = __libc_realloc(old, n);
    if (p || n == 0) {
        __atomic_sub_fetch(&current_bytes, (long long)old_size, __ATOMIC_RELAXED);
        added(p);
    }
    return p;
}
void *memalign(size_t align, size_t n) { void *p = __libc_memalign(align, n); added(p); return p; }
void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
int posix_memalign(void **out, size_t align, size_t n) {
    void *p = __libc_memalign(align, n);
    if (!p) return ENOMEM;
    added(p);
    *out = p;
    return 0;
}

long long heap_counter_current(void) { return __atomic_load_n(&current_bytes, __ATOMIC_RELAXED); }
long long heap_counter_peak(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }
void heap_counter_reset_peak(void) {
    __atomic_store_n(&peak_bytes, __atomic_load_n(&current_bytes, __ATOMIC_RELAXED),
                     __ATOMIC_RELAXED);
}
"""


def cache_dir() -> Path:
    """Where the compiled shim lives: ``$REFFSDP_BENCH_CACHE`` or ``~/.cache/reffsdp``."""
    env = os.environ.get("REFFSDP_BENCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reffsdp"


def build_heap_counter() -> tuple[Path | None, str]:
    """Compile the shim once (cached by source hash); ``(path, "")`` or ``(None, why)``."""
    digest = hashlib.sha256(HEAP_COUNTER_SOURCE.encode()).hexdigest()[:12]
    target = cache_dir() / f"heap_counter_{digest}.so"
    if target.exists():
        return target, ""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, (
            "no C compiler found (set CC or install cc) to build the heap counter; "
            "CPU memory is not measured"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "heap_counter.c"
        source.write_text(HEAP_COUNTER_SOURCE)
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            return None, (
                f"{compiler} failed to build the heap counter ({result.stderr.strip()[:300]}); "
                "CPU memory is not measured"
            )
        os.replace(built, target)  # atomic: concurrent builders never see half a file
    return target, ""


class HeapCounter:
    """The shim loaded in this process through ``LD_PRELOAD`` (see the module note)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._current = lib.heap_counter_current
        self._peak = lib.heap_counter_peak
        self._current.restype = self._peak.restype = ctypes.c_longlong
        self._reset = lib.heap_counter_reset_peak

    @classmethod
    def load(cls) -> HeapCounter | None:
        """The counter, if this process was started with it preloaded."""
        path = next(
            (p for p in os.environ.get("LD_PRELOAD", "").split() if "heap_counter" in p), None
        )
        if path is None:
            return None
        return cls(ctypes.CDLL(path))

    def current(self) -> int:
        return self._current()

    def peak(self) -> int:
        return self._peak()

    def reset_peak(self) -> None:
        self._reset()


@dataclass
class MemoryProbe:
    """Reads one rank's live and peak bytes on ``device``; ``available`` says if it can."""

    device: torch.device
    heap: HeapCounter | None

    @property
    def available(self) -> bool:
        return self.device.type == "cuda" or self.heap is not None

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.heap.current() if self.heap is not None else 0

    def start_step(self) -> int:
        """Reset the peak to now; return the bytes live now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.heap is not None:
            self.heap.reset_peak()
        return self.current()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.heap.peak() if self.heap is not None else 0

    def reserved_peak(self) -> int | None:
        """CUDA only: the caching allocator's reserved high-water mark."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        return None
