"""Building ``cpu_kernels.c`` into a shared library, caching it, and loading it once.

The C source is compiled once per machine with the configured C compiler (default ``cc``)
for the CPU it runs on (``-march=native``: AVX-512, AVX2 or plain C) and cached in the
directory of its :class:`~furnace_trio.runtime.native.config.NativeConfig` (default
``~/.cache/furnace-trio``), keyed by the source, the compiler and the CPU. Building takes
about a second; a machine without a compiler gets :func:`load` returning ``None`` and the
callers fall back to torch kernels.

Each built file is sealed and checked before it is loaded (:mod:`.cache`): a truncated or
corrupt one is logged, removed and rebuilt instead of crashing ``dlopen``.

The library is loaded after torch, so ``libgomp.so.1`` resolves to the OpenMP runtime
torch already loaded.

What is loaded is the process's, not a caller's (:class:`LoadedLibraries`): a shared
library is a process resource, so one :class:`Kernels` per built file serves every runner
of the process. The CPU's identity and each compiler's version, parts of the build key, are
facts of the machine, asked once per process too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from furnace_trio.runtime.native.cache import (
    BUILD_TIMEOUT_S,
    MAGIC,
    TEMPORARY_SUFFIX,
    cache_problem,
    remove_stale_temporaries,
    seal,
)
from furnace_trio.runtime.native.config import DEFAULT_NATIVE_CONFIG, NativeConfig
from furnace_trio.runtime.native.kernels import Kernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent.parent / "cpu_kernels.c"
# What SOURCE includes (part of the build key).
INCLUDES = tuple(Path(__file__).parent.parent / name for name in ("cpu_kquants.c", "cpu_repack.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


class LoadedLibraries:
    """The built libraries a process has loaded, or failed to build, by file.

    One per process (:data:`LOADED`), on purpose: ``dlopen`` maps a file once per process
    (a second ``ctypes.CDLL`` of the same path gets the same handle) and ctypes never
    unloads it, so the process holds one library per built file whoever asked first. A
    cache per owner would give no isolation, only repeat the seal check (a digest of the
    whole file) for that same handle, and rerun a compiler that already failed. The lock
    makes concurrent first loads build once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[Path, Kernels | None] = {}

    def get(self, target: Path, compiler: str, flags: tuple[str, ...]) -> Kernels | None:
        """The kernels of the built file ``target``, building it with ``compiler`` and
        ``flags`` when it is missing or fails its seal; ``None`` (remembered) when that
        fails."""
        with self._lock:
            if target in self._by_path:
                return self._by_path[target]
            kernels = _build_and_load(compiler, flags, target)
            self._by_path[target] = kernels
            return kernels


#: This process's loaded libraries.
LOADED = LoadedLibraries()


def cache_dir(config: NativeConfig = DEFAULT_NATIVE_CONFIG) -> Path:
    return config.directory


@functools.cache
def _cpuinfo() -> str | None:
    """``/proc/cpuinfo``'s text, read once per process; ``None`` where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


@functools.cache
def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    text = _cpuinfo()
    if text is None:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def tuning_flags_for(cpuinfo: str) -> tuple[str, ...]:
    """Switches beyond ``-march=native`` for the CPU ``cpuinfo`` (``/proc/cpuinfo``'s text)
    describes, on AMD's AVX-512 (measured per CPU in docs/benchmarks.md):

    - four rows a K-quant register block (``KQ_ROWS``, six by default on AVX-512). Zen 4
      runs 512-bit instructions through 256-bit units; there four rows measured 1.07x to
      1.14x faster for Q4_K at 16 rows and Q6_K the same, where Intel's AVX-512 cores
      measured six faster;
    - from Zen 5 on (family 26), whose units are 512 bits wide, those four rows against the
      whole panel at once (``KQ_VECS=4``, a half by default): Q4_K 1.25x to 1.46x and Q6_K
      1.06x to 1.09x faster at 16 rows there.
    """
    lines = cpuinfo.splitlines()

    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(name)), "")

    if "AuthenticAMD" not in field("vendor_id") or "avx512f" not in field("flags").split():
        return ()
    family = field("cpu family")
    if family.isdigit() and int(family) >= 26:
        return ("-DKQ_ROWS=4", "-DKQ_VECS=4")
    return ("-DKQ_ROWS=4",)


def tuning_flags() -> tuple[str, ...]:
    """:func:`tuning_flags_for` this machine."""
    return tuning_flags_for(_cpuinfo() or "")


def _compiler(config: NativeConfig) -> str | None:
    return shutil.which(config.compiler)


@functools.cache
def _compiler_version(compiler: str) -> str:
    """``cc --version`` (part of the build key), asked once per process and compiler."""
    try:
        return subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{target.name}.", suffix=TEMPORARY_SUFFIX, dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        seal(Path(tmp))
        os.replace(tmp, target)  # atomic: a concurrent builder never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(
    config: NativeConfig = DEFAULT_NATIVE_CONFIG, *, extra_flags: tuple[str, ...] = ()
) -> Kernels | None:
    """The kernels, building them if needed; ``None`` where they cannot be built here.

    :func:`tuning_flags`, ``config.flags`` and then ``extra_flags`` go after :data:`FLAGS`
    (a later ``-D`` wins): tests build the AVX2
    and plain-C variants on an AVX-512 machine with ``-mno-avx512f -mno-avxvnni`` and
    ``-march=x86-64`` (tests/runtime/native_builds.py), and a server configured with
    ``FURNACE_NATIVE_FLAGS="-mno-avx512f -mno-avxvnni"`` runs the AVX2 build (what a CPU
    without AVX-512 or AVX-VNNI runs, for comparisons on this one).
    """
    extra_flags = (*config.flags, *extra_flags)
    compiler = _compiler(config)
    if compiler is None:
        logger.warning("native kernels: no C compiler (set CC); using torch kernels")
        return None
    source = b"".join(path.read_bytes() for path in (SOURCE, *INCLUDES))
    flags = (*FLAGS, *tuning_flags(), *extra_flags)
    parts = [compiler, _compiler_version(compiler), " ".join(flags), _cpu_identity()]
    key = hashlib.blake2b(
        b"\0".join([source, MAGIC, *(p.encode() for p in parts)]), digest_size=12
    ).hexdigest()
    target = cache_dir(config) / f"cpu_kernels-{key}.so"
    return LOADED.get(target, compiler, flags)


def _build_and_load(compiler: str, flags: tuple[str, ...], target: Path) -> Kernels | None:
    """Load ``target``, built first where it is missing or fails its seal; ``None`` (and a
    warning) where building or loading fails."""
    try:
        if target.parent.is_dir():
            remove_stale_temporaries(target.parent)
        problem = cache_problem(target) if target.exists() else None
        if problem is not None:
            logger.warning("native kernels: %s is %s; rebuilding it", target, problem)
            target.unlink(missing_ok=True)
        if not target.exists():
            logger.info("native kernels: building %s", target)
            _build(compiler, flags, target)
        problem = cache_problem(target)
        if problem is not None:  # changed under us since the build: do not load it
            raise OSError(f"{target} is {problem}")
        return Kernels(ctypes.CDLL(str(target)), target)
    except subprocess.CalledProcessError as exc:
        logger.warning("native kernels: build failed, using torch kernels:\n%s", exc.stderr)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native kernels unavailable (%s); using torch kernels", exc)
    return None
