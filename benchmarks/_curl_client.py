"""curl as a benchmark client: the leanest one at hand, C, one process per stream.

On a 2-core machine the client shares the cores with the server's model threads, so its
own CPU per streamed chunk is counted in what a benchmark calls the server's cost (the
raw Python client of ``_raw_client.py`` spends 30 to 80 us per token, and costs the server
about 1.5 times that). curl reads and discards each chunk in a few microseconds of C.

Each stream is one ``curl`` process whose transfers (``--next``) reuse one keep-alive
connection; each response body goes to a file in ``/dev/shm`` (read afterwards for its
usage chunk, outside the timing). The time of a stream is the sum of curl's own
``time_total`` of its transfers, which leaves out the process's start; the time of a round
is the longest stream's. There is no per-token timing (no ITL).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence

from _raw_client import stream_request


def _usage_tokens(path: str) -> int:
    with open(path, "rb") as f:
        body = f.read()
    at = body.rindex(b"data: {")
    return int(json.loads(body[at + 6 : body.index(b"\n\n", at)])["usage"]["completion_tokens"])


def curl_requests(
    port: int, model: str, prompts: Sequence[str], streams: int, requests: int, max_tokens: int
) -> tuple[int, float, float, float]:
    """``streams`` concurrent curl processes of ``requests`` streaming chat completions
    each: (completion tokens, seconds, ITL p50 (NaN: not measured), curl's CPU seconds)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        procs = []
        for w in range(streams):
            cmd = ["curl", "-sS", "--no-buffer"]
            for r in range(w * requests, (w + 1) * requests):
                if r > w * requests:
                    cmd.append("--next")
                body = json.dumps(stream_request(model, prompts[r % len(prompts)], max_tokens))
                cmd += ["-H", "Content-Type: application/json", "--data-binary", body]
                cmd += ["-o", f"{tmp}/{r}", "-w", "%{http_code} %{time_total}\\n", url]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        stream_seconds: list[float] = []
        cpu = 0.0
        for proc in procs:
            assert proc.stdout is not None
            lines = proc.stdout.read().split()
            proc.stdout.close()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu += usage.ru_utime + usage.ru_stime
            codes, times = lines[0::2], lines[1::2]
            if proc.returncode != 0 or len(codes) != requests or set(codes) != {"200"}:
                raise RuntimeError(f"curl: exit {proc.returncode}, statuses {codes}")
            stream_seconds.append(sum(float(t) for t in times))
        tokens = sum(_usage_tokens(f"{tmp}/{r}") for r in range(streams * requests))
    return tokens, max(stream_seconds), float("nan"), cpu
