"""The server as a user runs it: a process of its own, on a port it picks, with its logs.

For what only the whole process shows (the log lines hypercorn and the app write together)
and for the browser tests (selenium drives the page from a thread of its own, so the
server is better out of the test's process). The command's ``--bind 127.0.0.1:0`` lets
the kernel pick the port; the URL is read from the server's own "Running on" line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import furnace_trio

#: The repository root (hypercorn.toml) and the source tree (the package is not installed).
ROOT = Path(__file__).resolve().parents[1]
SRC = Path(furnace_trio.__file__).resolve().parents[1]
RUNNING_ON = re.compile(r"Running on (http://127\.0\.0\.1:\d+)")
#: The serve module with hypercorn.toml, as docs/ and README tell users to run it.
SERVE = ("-m", "furnace_trio.server.serve", "-c", str(ROOT / "hypercorn.toml"))
#: hypercorn's own command line with hypercorn.toml.
HYPERCORN = ("-m", "hypercorn", "-c", str(ROOT / "hypercorn.toml"), "furnace_trio.app:app")


@dataclass(slots=True)
class ServedProcess:
    url: str
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def logs(self) -> str:
        return self.stderr.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> None:
        """Bounded polling of the log for ``text`` (a request's line is written once its
        response has ended, which the client may see first)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.logs():
            assert time.monotonic() < deadline, f"{text!r} not logged in {timeout_s} s"
            time.sleep(0.05)


@contextmanager
def serve_process(
    command: Sequence[str],
    logs: Path,
    env: Mapping[str, str] | None = None,
    *,
    start_timeout_s: float = 300.0,
) -> Iterator[ServedProcess]:
    """Run ``python <command> --bind 127.0.0.1:0`` with ``env`` added to the environment;
    yield once it says where it runs. On the way out: SIGTERM (a drain), then SIGKILL if
    it has not exited 30 s later. The output goes to files under ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)
    stdout, stderr = logs / "stdout.txt", logs / "stderr.txt"
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
        "FURNACE_KV_CACHE_MB": "128",
        **(env or {}),
    }
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, *command, "--bind", "127.0.0.1:0"],
            stdout=out,
            stderr=err,
            env=environ,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + start_timeout_s
        while (match := RUNNING_ON.search(stderr.read_text(errors="replace"))) is None:
            if process.poll() is not None:
                raise AssertionError(
                    f"the server exited with {process.returncode}:\n{_tail(stderr)}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not start:\n{_tail(stderr)}")
            time.sleep(0.2)
        yield ServedProcess(match.group(1), process, stdout, stderr)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:]
