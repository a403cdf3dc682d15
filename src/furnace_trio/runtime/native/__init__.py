"""The native CPU kernels (``cpu_kernels.c``, with ``cpu_kquants.c`` and ``cpu_repack.c``):
built on first use, loaded through ctypes; a machine without a C compiler gets torch kernels
instead.

- :mod:`.config`: how the library is built (compiler, flags, cache directory), passed in.
- :mod:`.library`: compiling, caching and loading the shared library (:func:`load`).
- :mod:`.cache`: each cached library sealed by its build and checked before loading.
- :mod:`.kernels`: :class:`Kernels`, the typed ctypes entry points.
- :mod:`.formats`: the enums and layouts Python and the C code share.

Callers import this package (``from furnace_trio.runtime import native``) and use the names
below.
"""

from furnace_trio.runtime.native.config import DEFAULT_NATIVE_CONFIG, NativeConfig
from furnace_trio.runtime.native.formats import (
    KV_F16,
    KV_F32,
    KV_I8,
    LINEAR_CONCAT,
    LINEAR_Q4,
    LINEAR_Q4_0,
    LINEAR_Q4_K,
    LINEAR_Q5_0,
    LINEAR_Q5_K,
    LINEAR_Q6_K,
    LINEAR_Q8,
    LINEAR_W8,
    DecodeDims,
    KVScales,
    kv_kind,
    quantize_kv_rows,
    supports_kv,
)
from furnace_trio.runtime.native.kernels import Kernels
from furnace_trio.runtime.native.library import cache_dir, load

__all__ = [
    "DEFAULT_NATIVE_CONFIG",
    "KV_F16",
    "KV_F32",
    "KV_I8",
    "LINEAR_CONCAT",
    "LINEAR_Q4",
    "LINEAR_Q4_0",
    "LINEAR_Q4_K",
    "LINEAR_Q5_0",
    "LINEAR_Q5_K",
    "LINEAR_Q6_K",
    "LINEAR_Q8",
    "LINEAR_W8",
    "DecodeDims",
    "KVScales",
    "Kernels",
    "NativeConfig",
    "cache_dir",
    "kv_kind",
    "load",
    "quantize_kv_rows",
    "supports_kv",
]
