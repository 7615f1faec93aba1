"""Building pdserve's C kernels (``cpu_attention.c``, ``cpu_ops.c``, ``cpu_linear.c``) with the machine's compiler,
cached.

    lib, isa, reasons = load_best(SOURCE, SYMBOLS, ISAS, None, "label")   # the best build that runs, or reasons
    lib = build(SOURCE, SYMBOLS, isa_flags)   # the cached library, else compiled; loaded, every symbol checked
    reason = unsupported(cpu_flags(), CPU_FLAGS)   # None where this machine runs them

Called by the ``load`` of ``cpu_attention``, ``cpu_ops`` and ``cpu_linear`` (through ``load_best``), each with
every symbol it binds. A library is cached as ``PDSERVE_CACHE_DIR/kernels/<stem>-<key>.so`` (``cpu_cache.py``:
private to the user, checked before it is loaded); the key covers the source, the headers beside it and the
flags (``-O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp`` plus the ISA build's and the caller's), not the
compiler, so the cache is looked up first and a warm cache needs no compiler (an image built with gcc in one
stage runs its kernels in a stage without one; after changing compilers, remove the cache to rebuild). The
compiler is ``$CC`` split like a shell word list (``CC="ccache gcc"``), else ``cc`` or ``gcc``; it writes into a
private temporary folder, and the library is copied into the cache under a temporary name, loaded, checked and
renamed, so processes building at once never see a half-written file and a compiler that wrote nothing poisons
no cache. Where no build loads, the caller logs one line (the reasons, each on one line) and its fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine import envs
from pdserve.kernels import cpu_cache

log = logging.getLogger(__name__)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC"]
CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_flags() -> set[str] | None:
    try:
        return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return None


def cpu_vendor() -> str | None:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or None."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("vendor_id")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return None


def isa_order(isas: dict[str, tuple]) -> list[str]:
    """The builds of ``isas`` (name -> (cc flags, CPU flags needed), best first, ending in "avx2") to try on this
    machine: those its CPU has, from ``PDSERVE_CPU_ISA`` down ("avx2": the AVX2 builds only, on any CPU; the
    builds give the same bits, so this is for mixed fleets and tests)."""
    flags, names = cpu_flags(), list(isas)
    names = names[names.index(envs.PDSERVE_CPU_ISA):] if envs.PDSERVE_CPU_ISA in names else names
    return [name for name in names if name == "avx2" or (flags and set(isas[name][1]) <= flags)]


def load_best(source: Path, symbols: Sequence[str], isas: dict[str, tuple], isa: str | None, label: str,
              extra_flags: Sequence[str] = ()) -> tuple[ctypes.CDLL | None, str | None, list[str]]:
    """The first of ``isas`` (``isa`` alone, or ``isa_order``'s) this machine loads with all of ``symbols``, with
    ``extra_flags``: -> (library, its name, why the ones before it failed); (None, None, why) where none did, for
    the caller's one log line. Where a later build stands in for a failed one, one warning says so (``label``
    names the kernel)."""
    flags, failed = cpu_flags(), {}
    for name in [isa] if isa else isa_order(isas):
        why = unsupported(flags, isas[name][1])
        if why is None:
            try:
                lib = build(source, symbols, list(isas[name][0]) + list(extra_flags))
            except (OSError, subprocess.SubprocessError) as e:
                why = _one_line(e)
            else:
                if failed:
                    log.warning("%s: the %s build is unavailable (%s); using the %s build", label,
                                ", ".join(failed), "; ".join(_grouped(failed)), name)
                return lib, name, _grouped(failed)
        failed[name] = why
    return None, None, _grouped(failed)


def _grouped(failed: dict[str, str]) -> list[str]:
    """{build: reason} -> ["avx512vl, avx2: reason", ...]: a reason the builds share said once."""
    names: dict[str, list[str]] = {}
    for name, why in failed.items():
        names.setdefault(why, []).append(name)
    return [f"{', '.join(n)}: {why}" for why, n in names.items()]


def _one_line(e: BaseException) -> str:
    """A build's failure on one line: the compiler's first error line (its whole stderr goes to the debug log)."""
    stderr = getattr(e, "stderr", None)
    if not stderr:
        return str(e)
    text = stderr.decode(errors="replace")
    log.debug("compiler stderr: %s", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
    return f"build failed (exit {getattr(e, 'returncode', '?')}): {first[:300]}"


def unsupported(flags: set[str] | None, needs: tuple[str, ...]) -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"machine is {platform.machine()}, not x86_64"
    if flags is None:
        return "/proc/cpuinfo has no flags line"
    missing = [f for f in needs if f not in flags]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    return None


def compiler() -> list[str] | None:
    """The compiler's command: ``$CC`` split into words (``ccache gcc``, ``gcc -O2``) where set, else ``cc`` or
    ``gcc``; None where its program is not found (a ``$CC`` that is not found is not replaced by ``cc``)."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            words = shlex.split(cc)
        except ValueError:
            return None
        return words if words and shutil.which(words[0]) else None
    return next(([c] for c in ("cc", "gcc") if shutil.which(c)), None)


def cache_name(source: Path, cflags: Sequence[str]) -> str:
    """``<stem>-<key>.so``: the key hashes the source, the headers beside it (cpu_vec.h) and the flags."""
    headers = b"".join(h.name.encode() + b"\0" + h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    tag = hashlib.sha256(b"pdserve-c-kernel-2\0" + source.read_bytes() + b"\0" + headers + b"\0"
                         + "\0".join(cflags).encode())
    return f"{source.stem}-{tag.hexdigest()[:16]}.so"


def build(source: Path, symbols: Sequence[str], isa_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """The library of ``source`` built with ``isa_flags``, with all of ``symbols``: the cached one where the cache
    is trusted and holds it, else compiled (into the cache, or a private folder where the cache is not trusted)
    and loaded; OSError or SubprocessError (why, on one line) where neither gives one."""
    cflags = CFLAGS + list(isa_flags)
    name = cache_name(source, cflags)
    dir_fd, stale = cpu_cache.open_cache(), None
    try:
        if dir_fd is not None:
            lib, stale = cpu_cache.lookup(dir_fd, name, symbols)      # stale: why a cached one is not used
            if lib is not None:
                return lib
        cc = compiler()
        if cc is None:
            raise OSError((f"the cached {stale}, and " if stale else "") + _no_compiler())
        lib = _install(dir_fd, name, _compile(cc, source, cflags), symbols)
        where = envs.PDSERVE_CACHE_DIR / "kernels" / name if dir_fd is not None else "a private temporary folder"
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    log.info("built %s (%s) in %s%s", source.name, " ".join(isa_flags) or "avx2", where,
             f", replacing the cached {stale}" if stale else "")
    return lib


def _no_compiler() -> str:
    cc = os.environ.get("CC", "").strip()
    return "no C compiler to build it (" + (f"$CC={cc!r} not found" if cc else "no cc or gcc on PATH; set $CC") + ")"


def _install(dir_fd: int | None, name: str, data: bytes, symbols: Sequence[str]) -> ctypes.CDLL:
    if dir_fd is not None:
        return cpu_cache.install(dir_fd, name, data, symbols)
    fd, path = cpu_cache.private_dir()
    try:
        return cpu_cache.install(fd, name, data, symbols)
    finally:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def _compile(cc: list[str], source: Path, cflags: Sequence[str]) -> bytes:
    """The library ``cc`` builds from ``source`` with ``cflags``, in a private temporary folder."""
    with tempfile.TemporaryDirectory(prefix="pdserve-cc-") as tmp:
        out = Path(tmp) / f"{source.stem}.so"
        subprocess.run([*cc, *cflags, "-o", str(out), str(source)], check=True, capture_output=True, timeout=120)
        try:
            fd = os.open(out, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise OSError(f"{' '.join(cc)} exited 0 but wrote no library") from None
        with os.fdopen(fd, "rb") as f:
            return f.read()
