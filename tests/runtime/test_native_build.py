"""Building the native kernels: the per-machine cache, the flags and cache directory of a
:class:`NativeConfig`, a missing compiler and a source that does not compile (both leave
the server on torch kernels), truncated libraries and killed builds' temporaries."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from furnace_trio.runtime import native
from furnace_trio.runtime.native import cache as library_cache
from furnace_trio.runtime.native import library
from furnace_trio.runtime.native.config import NativeConfig
from furnace_trio.runtime.quant import (
    quantize_weight,
)


def test_build_is_cached_per_machine() -> None:
    kernels = native.load()
    assert kernels is not None
    assert kernels.vector_width in (1, 8, 16)
    assert kernels.path.is_file()
    assert kernels.path.parent == native.cache_dir()
    assert native.load() is kernels  # built and loaded once per process
    assert native.load(extra_flags=("-march=x86-64",)) is not kernels


def test_tuning_flags_per_cpu() -> None:
    """Four-row K-quant register blocks on AMD's AVX-512 only, against the whole panel from
    Zen 5 (family 26) on."""
    amd = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
    assert library.tuning_flags_for(amd) == ("-DKQ_ROWS=4",)  # Zen 4
    zen5 = amd.replace(": 25", ": 26")
    assert library.tuning_flags_for(zen5) == ("-DKQ_ROWS=4", "-DKQ_VECS=4")
    assert library.tuning_flags_for(zen5.replace(" avx512f", "")) == ()
    assert library.tuning_flags_for(amd.replace("cpu family\t: 25\n", "")) == ("-DKQ_ROWS=4",)
    assert library.tuning_flags_for(amd.replace(" avx512f", "")) == ()  # Zen 3: AVX2
    assert library.tuning_flags_for(amd.replace("AuthenticAMD", "GenuineIntel")) == ()
    assert library.tuning_flags_for("") == ()
    assert library.tuning_flags() == library.tuning_flags_for(Path("/proc/cpuinfo").read_text())


def test_tuning_flags_reach_the_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build passes the CPU's tuning switches, before the config's own flags."""
    seen: list[tuple[str, ...]] = []
    build = library._build

    def spy(compiler: str, flags: tuple[str, ...], target: Path) -> None:
        seen.append(flags)
        build(compiler, flags, target)

    monkeypatch.setattr(library, "tuning_flags", lambda: ("-DKQ_ROWS=3",))
    monkeypatch.setattr(library, "_build", spy)
    kernels = native.load(NativeConfig(cache_dir=tmp_path, flags=("-DKQ_VECS=4",)))
    assert kernels is not None
    (flags,) = seen
    assert flags.index("-DKQ_ROWS=3") < flags.index("-DKQ_VECS=4")


def test_flags_from_the_config() -> None:
    """The config's flags pick the build (here the plain-C one)."""
    kernels = native.load(NativeConfig(flags=("-march=x86-64",)))
    assert kernels is not None
    assert kernels.vector_width == 1
    assert native.load(extra_flags=("-march=x86-64",)) is kernels  # same flags, same build
    assert native.load() is not kernels


def test_fresh_build_in_an_empty_cache(tmp_path: Path) -> None:
    """What a new machine does on first start: compile, cache, load, compute."""
    kernels = native.load(NativeConfig(cache_dir=tmp_path))
    assert kernels is not None
    assert kernels.path.parent == tmp_path and kernels.path.is_file()
    q, scale = quantize_weight(torch.randn(70, 48))
    x = torch.randn(3, 48)
    out = torch.empty(3, 70)
    kernels.w8_linear(x, kernels.pack_w8(q), scale, None, out)
    want = (x.double() @ (q.double() * scale.double()[:, None]).T).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_missing_compiler_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="furnace_trio.runtime.native.library"):
        assert native.load(NativeConfig(compiler="/nonexistent/cc")) is None
    assert "no C compiler" in caplog.text


def test_build_failure_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(library, "SOURCE", bad)
    with caplog.at_level(logging.WARNING, logger="furnace_trio.runtime.native.library"):
        assert native.load(NativeConfig(cache_dir=tmp_path / "cache")) is None
    assert "build failed" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library is kept


_LOAD_IN_A_NEW_PROCESS = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from furnace_trio.runtime import native
kernels = native.load(native.NativeConfig(cache_dir=Path(sys.argv[1])))
print(kernels.path if kernels is not None else "none")
"""


def _load_in_a_new_process(cache: Path) -> subprocess.CompletedProcess[str]:
    """A fresh process, as a server start is (this one has the library loaded already)."""
    src = str(Path(native.__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": src}
    return subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    """A truncated ``.so`` in the cache killed every start with SIGBUS in ``dlopen``; it
    is found before loading, logged and rebuilt."""
    first = _load_in_a_new_process(tmp_path)
    assert first.returncode == 0, first.stderr
    library = Path(first.stdout.strip())
    assert library.parent == tmp_path and library_cache.cache_problem(library) is None
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 2])
    assert library_cache.cache_problem(library) is not None
    second = _load_in_a_new_process(tmp_path)
    assert second.returncode == 0, (second.returncode, second.stderr)
    assert second.stdout.strip() == str(library)
    assert "rebuilding it" in second.stderr and "truncated" in second.stderr
    assert library_cache.cache_problem(library) is None
    # A flipped byte of a full-length file is caught by the digest.
    data = bytearray(library.read_bytes())
    data[len(data) // 3] ^= 0xFF
    library.write_bytes(bytes(data))
    assert library_cache.cache_problem(library) == "corrupt (its digest does not match)"


def test_temporaries_of_killed_builds_are_removed(tmp_path: Path) -> None:
    stale = [tmp_path / "tmpab12cd.so", tmp_path / "cpu_kernels-x.so.k3j2.so.tmp"]
    fresh = tmp_path / "tmpnew.so"  # a build in progress in another process
    for path in [*stale, fresh]:
        path.write_bytes(b"\x7fELF partial")
    old = time.time() - library_cache.STALE_TEMPORARY_S - 60
    for path in stale:
        os.utime(path, (old, old))
    loaded = _load_in_a_new_process(tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert not any(path.exists() for path in stale)
    assert fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [fresh.name, Path(loaded.stdout.strip()).name]
    )
