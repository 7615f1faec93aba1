"""Building pdserve's C kernels (``cpu_attention.c``, ``cpu_ops.c``, ``cpu_linear.c``) with the machine's compiler,
cached.

    lib, isa, reasons = load_best(SOURCE, "pd_symbol", ISAS, None, "label")  # the best build that runs
    path = build(SOURCE, "pd_symbol", isa_flags)   # compiled once per source + headers + flags + compiler
    reason = unsupported(cpu_flags(), CPU_FLAGS)   # None where this machine can build and run them

Called by the ``load`` of ``cpu_attention``, ``cpu_ops`` and ``cpu_linear`` (through ``load_best``). A library
is built at ``PDSERVE_CACHE_DIR/kernels/<stem>-<hash>.so`` with
``cc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp`` (plus the caller's ISA flags): written to a temporary
name, checked to load, made readable by all (a cache shared by users) and renamed, so processes building at once
never see a half-written file and a compiler that wrote nothing poisons no cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine import envs

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


def load_best(source: Path, symbol: str, isas: dict[str, tuple], isa: str | None, label: str,
              extra_flags: Sequence[str] = ()) -> tuple[ctypes.CDLL | None, str | None, list[str]]:
    """The first of ``isas`` (``isa`` alone, or ``isa_order``'s) this machine builds and loads, with
    ``extra_flags``: -> (library, its name, the reasons the ones before it failed); (None, None, reasons) where
    none did. A build that fails before another is tried is logged (``label`` names the kernel)."""
    flags, reasons = cpu_flags(), []
    names = [isa] if isa else isa_order(isas)
    for name in names:
        reason = unsupported(flags, isas[name][1])
        if reason is None:
            try:
                return ctypes.CDLL(str(build(source, symbol, list(isas[name][0]) + list(extra_flags)))), name, reasons
            except (OSError, subprocess.SubprocessError) as e:
                stderr = getattr(e, "stderr", None)
                reason = f"build failed: {e}" + (f": {stderr.decode(errors='replace')[-500:]}" if stderr else "")
        reasons.append(f"{name}: {reason}")
        if name != names[-1]:
            log.warning("%s: the %s build is unavailable (%s); trying the next one", label, name, reason)
    return None, None, reasons


def unsupported(flags: set[str] | None, needs: tuple[str, ...]) -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"machine is {platform.machine()}, not x86_64"
    if flags is None:
        return "/proc/cpuinfo has no flags line"
    missing = [f for f in needs if f not in flags]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    if compiler() is None:
        return "no C compiler (cc, gcc or $CC)"
    return None


def compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)


def build(source: Path, symbol: str, isa_flags: Sequence[str] = ()) -> Path:
    """The library's path, compiled if no loadable one (exporting ``symbol``) is cached for this source (with
    the headers beside it), flags and compiler."""
    cc, cflags = compiler(), CFLAGS + list(isa_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout.split(b"\n")[0]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))      # cpu_vec.h
    tag = hashlib.sha256(source.read_bytes() + headers + " ".join(cflags).encode() + b"\0" + cc.encode() + version)
    out_dir = envs.PDSERVE_CACHE_DIR / "kernels"
    target = out_dir / f"{source.stem}-{tag.hexdigest()[:16]}.so"
    if target.exists() and loadable(target, symbol):
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *cflags, "-o", tmp, str(source)], check=True, capture_output=True, timeout=120)
        if not loadable(Path(tmp), symbol):
            raise OSError(f"{cc} wrote no loadable library with {symbol}")
        os.chmod(tmp, 0o755)                  # mkstemp made it 0600: other users of a shared cache read it too
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s (%s): %s", source.name, " ".join(isa_flags) or "avx2", target)
    return target


def loadable(path: Path, symbol: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(str(path)), symbol)
    except OSError:
        return False
