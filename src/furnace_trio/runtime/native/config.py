"""How the native CPU kernels are built: a value passed in, never read from the environment.

The server reads ``FURNACE_NATIVE_FLAGS``, ``FURNACE_CACHE_DIR`` and ``CC`` once, in
:mod:`furnace_trio.server.config`, and hands this record down through
:class:`~furnace_trio.runtime.runner.RunnerConfig`; tests and benchmarks build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class NativeConfig:
    """The compiler, its extra flags and the cache of built libraries.

    ``flags`` go after the default ones (``-O3 -march=native ...``): ``("-mno-avx512f",)``
    builds the AVX2 kernels on an AVX-512 CPU. Each set of flags is a separate cached build.
    ``cache_dir`` ``None`` is ``~/.cache/furnace-trio``.
    """

    flags: tuple[str, ...] = ()
    cache_dir: Path | None = None
    compiler: str = "cc"

    @property
    def directory(self) -> Path:
        """Where built libraries are kept."""
        if self.cache_dir is not None:
            return self.cache_dir
        return Path.home() / ".cache" / "furnace-trio"


#: The defaults: ``cc``, no extra flags, ``~/.cache/furnace-trio``.
DEFAULT_NATIVE_CONFIG = NativeConfig()
