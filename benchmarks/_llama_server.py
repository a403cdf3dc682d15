"""llama.cpp's own server (``llama-server``) for side-by-side benchmarks: found, or built.

The llama.cpp sources come from PyPI: the source distribution of ``llama-cpp-python``
vendors a whole llama.cpp tree (``vendor/llama.cpp``), server included, and PyPI is
reachable where GitHub may not be. Only the ``llama-server`` target is built (CPU backend),
into ``build/llama.cpp-<version>/`` of this repository (ignored by git); a second call
finds it there. On 2 cores the build takes about 17 minutes.

The instruction sets are this CPU's (``/proc/cpuinfo``), named one by one rather than with
``-march=native``, so that AMX can be left out: on an AMX host (cpu-b in docs/history.md)
ggml's AMX matmul crashes llama-server in its warm-up with an illegal instruction, while
AMX itself works there (a small tile program that asks Linux for the tile state first
runs), so the crash is ggml's; its cause is not known. Neither furnace-trio's kernels nor
this build use AMX; ``LLAMA_AMX=1`` builds llama.cpp with it.

Order: an explicit path, ``$LLAMA_SERVER``, ``llama-server`` on ``PATH``, a finished build,
a new build. ``isa="avx2"`` builds without AVX-512 and AVX-VNNI, into ``build-avx2``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # the release whose vendored llama.cpp was measured


def llama_cpp_source(version: str = LLAMA_CPP_PYTHON) -> Path:
    """The vendored llama.cpp tree of ``llama-cpp-python==version``, downloaded once."""
    base = ROOT / "build" / f"llama.cpp-{version}"
    tree = base / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    base.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*pip, "--dest", str(base), f"llama-cpp-python=={version}"], check=True)
    (archive,) = base.glob(f"llama_cpp_python-{version}.tar.gz")
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(base, filter="data")
        else:
            tar.extractall(base)  # PyPI's own archive of a pinned release
    return tree


# /proc/cpuinfo flag -> ggml's CMake option for it.
X86_FEATURES = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
AMX_FEATURES = {
    "amx_tile": "GGML_AMX_TILE",
    "amx_int8": "GGML_AMX_INT8",
    "amx_bf16": "GGML_AMX_BF16",
}


# Left out for ``isa="avx2"``: what an AVX2-only CPU (AMD Zen 3: no AVX-512) does not have.
AVX2_LACKS = {"avx_vnni", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"}


def ggml_cpu_flags(isa: str = "native") -> list[str]:
    """ggml's instruction-set options for this CPU (x86), or for ``isa="avx2"`` this CPU's
    without AVX-512 and AVX-VNNI; ``-march=native`` where there are no x86 flags."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = set(next(line.split(":", 1)[1].split() for line in f if line.startswith("flags")))
    except (OSError, StopIteration):
        return ["-DGGML_NATIVE=ON"]
    if isa == "avx2":
        cpu -= AVX2_LACKS
    features = dict(X86_FEATURES, **(AMX_FEATURES if os.environ.get("LLAMA_AMX") == "1" else {}))
    return ["-DGGML_NATIVE=OFF"] + [
        f"-D{option}={'ON' if flag in cpu else 'OFF'}" for flag, option in features.items()
    ]


def build_llama_server(isa: str = "native", version: str = LLAMA_CPP_PYTHON) -> Path:
    tree = llama_cpp_source(version)
    build = tree / ("build" if isa == "native" else f"build-{isa}")
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    print(f"building llama-server ({isa}) from llama-cpp-python=={version}'s sources")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *ggml_cpu_flags(isa)]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    return binary


def build_llama_tool(target: str, isa: str = "native", version: str = LLAMA_CPP_PYTHON) -> Path:
    """Another of llama.cpp's programs (``llama-quantize``, ``llama-perplexity``) from the
    same sources and build directory as :func:`build_llama_server`'s."""
    tree = llama_cpp_source(version)
    build = tree / ("build" if isa == "native" else f"build-{isa}")
    binary = build / "bin" / target
    if binary.is_file():
        return binary
    build_llama_server(isa, version)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(build), "--target", target, "-j", jobs], check=True)
    return binary


def find_llama_server(explicit: str | None = None, isa: str = "native") -> Path:
    """The ``llama-server`` binary to run (see the module's docstring for the order). For
    ``isa="avx2"`` only an explicit path or this module's own build."""
    found = [explicit]
    if isa == "native":
        found += [os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")]
    for candidate in found:
        if candidate:
            path = Path(candidate)
            if not path.is_file():
                raise FileNotFoundError(f"no llama-server at {path}")
            return path
    return build_llama_server(isa)


def llama_server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), "unknown version")
