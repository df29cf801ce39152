"""``python -m shoal.deploy.remote SHOAL-ARGS...``: how a launcher that holds a pipe to
the remote side (ssh) runs a shoal process there.

It reads one JSON line from stdin, ``{"env": {...}}`` (the cluster's secret among it:
never on a command line, where other users of the host could read it), then runs
``python -m shoal SHOAL-ARGS...`` with that environment, its output going where this
process's goes. TLS files sent inline (``SHOAL_TLS_*_PEM``) are written to a private
directory (mode 700, files 600), named to the child by their ``SHOAL_TLS_*`` paths,
and removed when the child ends. When stdin ends (the launcher closed it, or the ssh
connection broke) or a SIGTERM, SIGINT or SIGHUP arrives, the child gets a SIGTERM (it
closes as for a Ctrl-C: a worker tells the scheduler) and a SIGKILL if it is still
there :data:`KILL_AFTER` seconds later. Exits with the child's exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

#: seconds between the SIGTERM to the child and the SIGKILL
KILL_AFTER = 15.0


def _read_env(stream: Any) -> dict[str, str]:
    line = stream.readline()
    if not line:
        raise SystemExit("shoal.deploy.remote: stdin ended before the settings line")
    try:
        message = json.loads(line)
        env = message["env"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"shoal.deploy.remote: a bad settings line ({type(exc).__name__})") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SystemExit("shoal.deploy.remote: the settings line's env must map names to strings")
    return env


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m shoal.deploy.remote SHOAL-ARGS...", file=sys.stderr)
        return 2
    stdin = os.fdopen(0, "r", encoding="utf-8", errors="replace", closefd=False)
    env = {**os.environ, **_read_env(stdin)}
    tls_dir = _write_tls_files(env)
    try:
        return _run(argv, env, stdin)
    finally:
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)


def _write_tls_files(env: dict[str, str]) -> str | None:
    """Write the TLS files sent inline to a new private directory and point ``env``'s
    ``SHOAL_TLS_*`` paths at them; returns the directory (None: none was sent)."""
    from ..comm.security import INLINE_TLS

    sent = {var: env.pop(inline) for var, inline in INLINE_TLS.items() if inline in env}
    if not sent:
        return None
    directory = tempfile.mkdtemp(prefix="shoal-tls-")  # mode 700
    for var, text in sent.items():
        path = os.path.join(directory, var.lower() + ".pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        env[var] = path
    return directory


def _run(argv: list[str], env: dict[str, str], stdin: Any) -> int:
    child = subprocess.Popen([sys.executable, "-m", "shoal", *argv], env=env, stdin=subprocess.DEVNULL)
    stopping = threading.Event()

    def stop() -> None:
        if stopping.is_set():
            return
        stopping.set()
        if child.poll() is None:
            child.terminate()

            def kill() -> None:
                if child.poll() is None:
                    child.kill()

            timer = threading.Timer(KILL_AFTER, kill)
            timer.daemon = True
            timer.start()

    def watch_stdin() -> None:
        while stdin.readline():  # nothing more is expected: anything else is ignored
            pass
        stop()

    threading.Thread(target=watch_stdin, name="shoal-remote-stdin", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop())
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # (a signal's handler ran)
            continue
    sys.stdout.flush()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
