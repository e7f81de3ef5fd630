"""Container health check: asks the tokenyard process running in this container for its /health.

One image serves every process, so the check reads the process's own command line
(``python -m services.<name> --flags...``) and parses it with the same ``StackConfig`` the
process used, to learn which process this is and where its /health listens. Exits 0 on
HTTP 200, 1 otherwise (loading, failed, or not answering).

    python deploy/healthcheck.py            # find the process among /proc/*
    python deploy/healthcheck.py --pid 42   # check this one
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

from shared.config import StackConfig

PROCESSES = ("api", "scheduler", "worker", "detokenizer", "launcher")
MODULES = tuple(f"services.{name}" for name in PROCESSES)
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def service_argv(pid: int) -> list[str] | None:
    """The argv of a tokenyard process (``... -m services.<name> ...``), or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [arg.decode() for arg in f.read().split(b"\0") if arg]
    except OSError:
        return None
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] in MODULES:
            return argv[i + 1 :]
    return None


def find_service() -> list[str]:
    for entry in sorted(os.listdir("/proc"), key=lambda name: (len(name), name)):
        if entry.isdigit() and int(entry) != os.getpid():
            argv = service_argv(int(entry))
            if argv is not None:
                return argv
    raise SystemExit("healthcheck: no `python -m services.<name>` process found")


def health_url(argv: list[str]) -> str:
    """``argv`` is ``["services.<name>", *flags]``."""
    name = argv[0].removeprefix("services.")
    config = StackConfig.from_argv(argv[1:])
    if name in ("api", "launcher"):  # the launcher's /health is the api's
        host, port = config.host, config.port
    else:
        host, port = config.metrics_host, config.metrics_port(name)
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"http://{host}:{port}/health"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, help="the tokenyard process to check (default: the one found in /proc)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for /health")
    args = parser.parse_args()
    argv = find_service() if args.pid is None else service_argv(args.pid)
    if argv is None:
        raise SystemExit(f"healthcheck: pid {args.pid} is not a tokenyard process")
    url = health_url(argv)
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            print(f"{url}: {response.status} {response.read().decode(errors='replace')}")
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: {exc.code} {exc.read().decode(errors='replace')}")
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
