"""The builds of the native kernels every kernel test runs on: this CPU's, and the narrower
builds a CPU without AVX-512 VNNI, without AVX-512 (with the 256-bit AVX-VNNI of Intel's
client cores and AMD's Zen 5, and without it, as on AMD's Zen 3) or without AVX2 gets, as
far as this machine can execute them."""

from __future__ import annotations

from pathlib import Path

from furnace_trio.runtime import native


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


BUILDS: dict[str, tuple[str, ...]] = {
    "native": (),
    "no-vnni": ("-mno-avx512vnni",),
    "no-avx512": ("-mno-avx512f", "-mno-avxvnni"),
    "plain-c": ("-march=x86-64",),
}
if {"avx512f", "avx_vnni"} <= _cpu_flags():
    # without AVX-512 but with AVX-VNNI (elsewhere that is the native build, or no build)
    BUILDS["avx-vnni"] = ("-mno-avx512f",)

# The vector widths each build may have (a narrower CPU's native build is narrower too).
WIDTHS = {
    "native": (1, 8, 16),
    "no-vnni": (1, 8, 16),
    "no-avx512": (1, 8),
    "plain-c": (1,),
    "avx-vnni": (8,),
}


def load_build(name: str) -> native.Kernels:
    """The kernels of build ``name``, checked to be built with the width it should have."""
    kernels = native.load(extra_flags=BUILDS[name])
    assert kernels is not None, "the native kernels must build on the test machine (a C compiler)"
    assert kernels.vector_width in WIDTHS[name]
    return kernels
