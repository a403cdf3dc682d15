"""Schemathesis against ``/openapi.json`` on a real loopback socket (scripted engine).

The suite runs a small budget; ``nox -s fuzz`` runs this module as a script with a larger
one (``python -m tests.test_fuzz --max-examples 200 --max-time 240``). Both check: no 5xx,
every response (status, content type, body) conforms to the document, schema-invalid
requests are rejected, and afterwards the server is healthy and serves a normal request.

``positive_data_acceptance`` is left out: some valid-by-schema bodies are rightly refused
(a token id outside the vocabulary, a ``tool_choice`` naming no tool, ``max_tokens`` beyond
the context): rules a schema cannot state.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import httpx
import trio

from .http_server import MODEL_NAME, serve_scripted

logger = logging.getLogger(__name__)

EXCLUDED_CHECKS = "positive_data_acceptance"


def schemathesis_command(
    url: str, *, max_examples: int, max_time: int, seed: int, phases: str
) -> list[str]:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:  # a test dependency: missing means a broken install, not a skip
        raise FileNotFoundError("schemathesis' `st` is not installed (pip install -e '.[test]')")
    return [
        st,
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        EXCLUDED_CHECKS,
        "--max-examples",
        str(max_examples),
        "--max-time",
        str(max_time),
        "--seed",
        str(seed),
        "--phases",
        phases,
        "--workers",
        "1",
        "--request-timeout",
        "20",
        "--no-color",
        "--warnings",
        "off",
    ]


async def fuzz(
    *,
    max_examples: int,
    max_time: int,
    seed: int,
    phases: str = "examples,coverage,fuzzing,stateful",
) -> tuple[int, str]:
    """Serve the scripted app, run schemathesis against it, check the server afterwards.

    Returns schemathesis' exit status and output; raises if the server is not healthy after.
    """
    async with serve_scripted() as served:
        command = schemathesis_command(
            served.url, max_examples=max_examples, max_time=max_time, seed=seed, phases=phases
        )
        with trio.fail_after(max_time + 120):
            result = await trio.run_process(command, capture_stdout=True, stderr=-2, check=False)
        output = result.stdout.decode(errors="replace")
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            health = await http.get("/health")
            assert health.status_code == 200, health.text
            ok = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert ok.status_code == 200, ok.text
        await served.wait_idle(sessions_may_hold=True)  # a case may open a session
    return result.returncode, output


async def test_schemathesis_small_budget() -> None:
    code, output = await fuzz(max_examples=3, max_time=20, seed=1, phases="coverage,fuzzing")
    assert code == 0, output[-6000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-examples", type=int, default=200)
    parser.add_argument("--max-time", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    code, output = trio.run(
        lambda: fuzz(max_examples=args.max_examples, max_time=args.max_time, seed=args.seed)
    )
    sys.stdout.write(output)
    sys.stdout.write(f"\nschemathesis exit status {code}; the server was healthy afterwards\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
