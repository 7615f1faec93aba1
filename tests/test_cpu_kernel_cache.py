"""The C kernels' cache (kernels/cpu_cache.py, kernels/cpu_build.py): issue 35 item 7 and issue 36 item 4.

A library another user could have planted is never loaded (its constructor never runs), a cached library that
lacks a symbol falls back instead of crashing, a warm cache needs no compiler, $CC with arguments is run as given
and a failed build logs one line. The other user is uid 65534 (nobody): a child process dropped to it before it
acts. The planted library's constructor writes a marker file, so "refused" means the marker never appears.
cpu_ops (the quickest build) stands for the three kernels, which share cpu_build.build.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from pdserve.engine import envs
from pdserve.kernels import cpu_attention, cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None or shutil.which("gcc") is None,
                                reason="the cpu ops kernels are not built here, or no gcc")
NOBODY = 65534
OPS_SYMBOLS = ("pd_rotary", "pd_rms_norm", "pd_silu_and_mul", "pd_write_kv")
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("PD_PLANTED_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) fclose(f);
}
int pd_rotary(void) { return 0; }
int pd_rms_norm(void) { return 0; }
int pd_silu_and_mul(void) { return 0; }
int pd_write_kv(void) { return 0; }
"""
PARTIAL_C = "int pd_silu_and_mul(void) { return 0; }\n"     # one of the four symbols cpu_ops binds


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """cpu_ops built once with CC="<wrapper> -DPD_VIA_WRAPPER" (the wrapper logs its arguments, then runs gcc):
    its cache file's name and bytes, the wrapper's log, and the planted and partial libraries' bytes."""
    d = tmp_path_factory.mktemp("kernel-cache")
    wrapper, log = d / "cc-wrapper", d / "cc.log"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec gcc "$@"\n')
    wrapper.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs, "PDSERVE_CACHE_DIR", d / "cache")
        mp.setenv("CC", f"{wrapper} -DPD_VIA_WRAPPER")
        cpu_ops.load.cache_clear()
        assert cpu_ops.load() is not None
        cpu_ops.load.cache_clear()
    [path] = (d / "cache" / "kernels").glob("cpu_ops-*.so")
    libs = {}
    for which, source in (("planted", PLANTED_C), ("partial", PARTIAL_C)):
        (d / f"{which}.c").write_text(source)
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(d / f"{which}.so"), str(d / f"{which}.c")], check=True)
        libs[which] = (d / f"{which}.so").read_bytes()
    return {"name": path.name, "data": path.read_bytes(), "log": log, **libs}


def _put(folder: Path, name: str, data: bytes) -> None:
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / name).write_bytes(data)
    (folder / name).chmod(0o700)


def as_nobody(script: str) -> None:
    subprocess.run(["sh", "-c", f"umask 022; {script}"], user=NOBODY, group=NOBODY, extra_groups=[], check=True)


def test_cc_with_arguments_is_run_as_given(built):
    """CC="<wrapper> -DPD_VIA_WRAPPER" is a command and its arguments, as CC="ccache gcc" is (split like make's
    shell splits it); it was looked up as one program, not found, and silently replaced by cc."""
    assert built["log"].exists() and "-DPD_VIA_WRAPPER" in built["log"].read_text()


@pytest.mark.parametrize("cc", [None, "/nonexistent/cc"])
def test_a_warm_cache_loads_without_a_compiler(built, fresh_ops_load, monkeypatch, cc):
    """An image whose kernels were built in a stage with gcc runs them in a stage without one: the cache is
    looked up before a compiler is needed, and its key does not ask one for its version."""
    _put(fresh_ops_load / "kernels", built["name"], built["data"])
    monkeypatch.setenv("PATH", str(fresh_ops_load / "empty"))        # no cc, no gcc
    monkeypatch.delenv("CC", raising=False) if cc is None else monkeypatch.setenv("CC", cc)
    lib = cpu_ops.load()
    assert lib is not None and all(hasattr(lib, s) for s in OPS_SYMBOLS)


def test_a_cached_library_missing_a_symbol_falls_back_then_is_rebuilt(built, fresh_ops_load, monkeypatch, caplog):
    """Only the one symbol was checked, so a cached library without pd_rotary crashed start-up with
    AttributeError in _bind. Now: no compiler, the torch path and one line saying why; a compiler, rebuilt."""
    _put(fresh_ops_load / "kernels", built["name"], built["partial"])
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_ops.load() is None
    assert "lacks pd_rotary, pd_rms_norm, pd_write_kv" in caplog.text and "use torch" in caplog.text
    cpu_ops.load.cache_clear()
    monkeypatch.setenv("CC", "gcc")
    lib = cpu_ops.load()
    assert lib is not None and all(hasattr(lib, s) for s in OPS_SYMBOLS)
    assert (fresh_ops_load / "kernels" / built["name"]).read_bytes() != built["partial"]


def test_a_failed_build_logs_one_line_naming_the_fallback(fresh_load, monkeypatch, caplog):
    """A compiler that fails printed a warning per build tried and the compiler's stderr, lines and all."""
    cc = fresh_load / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'In file included from x.c:1:' >&2\necho 'x.c:3:1: error: nope' >&2\n"
                  "echo '1 error generated.' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level(logging.INFO, logger="pdserve.kernels"):
        assert cpu_attention.load() is None
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("pdserve.kernels")
             and r.levelno >= logging.INFO]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "error: nope" in lines[0] and "plain-torch backend" in lines[0]


def _world_writable_kernels(root: Path, planted: Path, name: str) -> None:
    root.mkdir(mode=0o755)
    (root / "kernels").mkdir()
    (root / "kernels").chmod(0o1777)
    as_nobody(f"cp {planted} {root}/kernels/{name}")


def _world_writable_root(root: Path, planted: Path, name: str) -> None:
    root.mkdir()
    root.chmod(0o777)
    as_nobody(f"mkdir {root}/kernels && cp {planted} {root}/kernels/{name}")


def _root_of_another_user(root: Path, planted: Path, name: str) -> None:
    as_nobody(f"mkdir {root} {root}/kernels && cp {planted} {root}/kernels/{name}")


def _kernels_of_another_user(root: Path, planted: Path, name: str) -> None:
    root.mkdir(mode=0o755)
    (root / "kernels").mkdir(mode=0o755)
    os.chown(root / "kernels", NOBODY, NOBODY)
    as_nobody(f"cp {planted} {root}/kernels/{name}")


def _writable_file(root: Path, planted: Path, name: str) -> None:
    root.mkdir(mode=0o755)
    (root / "kernels").mkdir(mode=0o755)
    (root / "kernels" / name).write_bytes(b"")
    (root / "kernels" / name).chmod(0o666)
    as_nobody(f"cat {planted} > {root}/kernels/{name}")


def _symlinked_file(root: Path, planted: Path, name: str) -> None:
    root.mkdir(mode=0o700)
    (root / "kernels").mkdir(mode=0o700)
    as_nobody(f"cp {planted} {root.parent}/evil.so")
    (root / "kernels" / name).symlink_to(root.parent / "evil.so")


def _symlinked_kernels(root: Path, planted: Path, name: str) -> None:
    as_nobody(f"mkdir {root.parent}/evil && cp {planted} {root.parent}/evil/{name}")
    root.mkdir(mode=0o700)
    (root / "kernels").symlink_to(root.parent / "evil")


@pytest.fixture
def shared_tmp():
    """A folder like /tmp (1777), outside pytest's root-only tmp_path, so nobody can reach it."""
    path = Path(tempfile.mkdtemp(prefix="pdserve-kernel-cache-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def _plant(shared_tmp: Path, built: dict, plant, monkeypatch) -> Path:
    """The attack set up by ``plant`` as the cache root ``shared_tmp/cache``: -> the constructor's marker."""
    root, marker = shared_tmp / "cache", shared_tmp / "constructor-ran"
    (shared_tmp / "planted.so").write_bytes(built["planted"])
    (shared_tmp / "planted.so").chmod(0o644)
    plant(root, shared_tmp / "planted.so", built["name"])
    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", root)
    monkeypatch.setenv("PD_PLANTED_MARKER", str(marker))
    cpu_ops.load.cache_clear()
    return marker


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (nobody) needs root")


@needs_root
@pytest.mark.parametrize("plant, why", [
    (_world_writable_kernels, "kernels is writable by its group and others (mode 1777"),
    (_world_writable_root, "cache is writable by its group and others (mode 0777"),
    (_root_of_another_user, "cache belongs to uid 65534"),
    (_kernels_of_another_user, "kernels belongs to uid 65534"),
    (_writable_file, "is writable by its group and others (mode 0666"),
    (_symlinked_file, ".so is a symlink (refused)"),
    (_symlinked_kernels, "kernels is a symlink (refused)"),
])
def test_a_library_another_user_could_plant_is_never_loaded(built, shared_tmp, monkeypatch, caplog, plant, why):
    """As uid nobody, a cpu_ops-<hash>.so planted in a cache folder it can write ran its constructor as root
    (issue 35): any file of the right name was loaded. No compiler here (CC names none), so the refused cache
    leaves the torch path -- and one line that says why."""
    marker = _plant(shared_tmp, built, plant, monkeypatch)
    lib = _load_with_cc(monkeypatch, "/nonexistent/cc")
    assert not marker.exists() and lib is None
    assert sum(why in r.getMessage() for r in caplog.records) == 1, caplog.text


@needs_root
def test_a_refused_cache_is_not_written_and_the_kernels_are_built_privately(built, shared_tmp, monkeypatch, caplog):
    """With a compiler, a cache that fails its checks costs a build in a private temporary folder, not the
    kernels: nothing is read from it (the planted constructor does not run) and nothing is written to it."""
    marker = _plant(shared_tmp, built, _world_writable_kernels, monkeypatch)
    lib = _load_with_cc(monkeypatch, "gcc")
    assert not marker.exists()
    assert lib is not None and all(hasattr(lib, s) for s in OPS_SYMBOLS)
    assert os.listdir(shared_tmp / "cache" / "kernels") == [built["name"]]           # the planted file alone
    assert "built in a private temporary folder" in caplog.text


def _load_with_cc(monkeypatch, cc: str):
    """cpu_ops.load() with ``CC`` set to ``cc`` (forgotten again after)."""
    monkeypatch.setenv("CC", cc)
    try:
        return cpu_ops.load()
    finally:
        cpu_ops.load.cache_clear()
