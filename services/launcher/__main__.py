"""The local launcher: prepares the default model, starts the four processes, waits until ready.

With ``--replicas N`` it starts N engine replicas (each a scheduler, worker and detokenizer
with its own sockets under ``run_dir/engine-<i>`` and its own metrics ports, replica i's at
``port + 1 + 3i`` onwards) and one api routing among them.

Every process is a child of this one (and dies with it); the launcher stays in the
foreground, prints the URL once ``/health`` answers 200, and on Ctrl-C or SIGTERM stops
every process it started: the api first, which drains (its running requests finish, or are
aborted after ``--drain-timeout-s``) while the engine still serves them, then the engine. A child that dies is restarted (the others fail its in-flight
requests and wait for it); one that keeps dying stops the stack with a non-zero exit.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from shared.config import API_KEY_ENV, DEFAULT_MODEL_DIR, StackConfig
from shared.model_info import is_gguf, load_model_info
from shared.transport import InsecureBindError, check_binds

PROCESSES = ("scheduler", "worker", "detokenizer", "api")
ENGINE_PROCESSES = PROCESSES[:3]
STOP_GRACE_S = 10.0
GROUP_EXIT_GRACE_S = 5.0  # a dead rank's peers exit by themselves within ~1s; then they are killed
READY_TIMEOUT_S = 600.0
MAX_RESTARTS = 5  # within RESTART_WINDOW_S, before the launcher gives up
RESTART_WINDOW_S = 60.0


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher dies without cleaning up (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def replica_config(config: StackConfig, index: int) -> StackConfig:
    """The configuration of engine replica ``index``'s processes: own sockets and metrics ports, the one api."""
    if config.scheduler_addr or config.worker_addr or config.detokenizer_addr:
        raise SystemExit("--replicas > 1 places each replica's sockets under run_dir: leave --scheduler-addr, --worker-addr and --detokenizer-addr unset")
    if config.tensor_parallel_addr:
        raise SystemExit("--replicas > 1 gives each replica's worker ranks their own rendezvous: leave --tensor-parallel-addr unset")
    return dataclasses.replace(
        config,
        run_dir=os.path.join(config.resolved_run_dir, f"engine-{index}"),
        engine_name=f"engine-{index}",
        tensor_parallel_addr=f"tcp://127.0.0.1:{config.port + 90 + index}",
        api_addr=config.api_address,
        scheduler_metrics_port=config.metrics_port("scheduler") + 3 * index,
        worker_metrics_port=config.metrics_port("worker") + 3 * index,
        detokenizer_metrics_port=config.metrics_port("detokenizer") + 3 * index,
    )


def check_tensor_parallel(config: StackConfig) -> None:
    """Refuses at once a model the worker ranks could not split (instead of failing ranks restarting)."""
    if config.tensor_parallel_size < 1:
        raise SystemExit(f"--tensor-parallel-size must be at least 1, got {config.tensor_parallel_size}")
    if config.tensor_parallel_size == 1:
        return
    if is_gguf(config.model):
        raise SystemExit("tokenyard: a GGUF model is served unsharded: leave --tensor-parallel-size at 1")
    from services.worker.tensor_parallel import shard_config

    with open(os.path.join(config.model, "config.json")) as f:
        model_config = json.load(f)
    try:
        shard_config(model_config, config.tensor_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"tokenyard: {exc}") from None


def check_speculative(config: StackConfig) -> None:
    """Refuses at once speculative decoding where the engine cannot verify (instead of a scheduler failing to start)."""
    if not config.speculative_method:
        return
    if config.tensor_parallel_size > 1:
        raise SystemExit("tokenyard: speculative decoding does not run with tensor parallelism: leave --tensor-parallel-size at 1")
    if config.speculative_method == "draft":
        if not config.draft_model:
            raise SystemExit("tokenyard: --speculative-method draft needs --draft-model, the directory of a small model with the model's tokenizer")
        try:
            draft = load_model_info(config.draft_model)
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"tokenyard: --draft-model {config.draft_model} is not a model ({exc})") from None
        vocab = load_model_info(config.model).vocab_size
        if draft.vocab_size != vocab:
            raise SystemExit(
                f"tokenyard: --draft-model has a vocabulary of {draft.vocab_size} tokens but the model {vocab}: a draft must share the model's tokenizer"
            )
    if config.speculative_method == "mtp":
        from services.worker.speculative.mtp import MTP_FAMILIES

        family = load_model_info(config.model).family
        if family not in MTP_FAMILIES:
            raise SystemExit(f"tokenyard: --speculative-method mtp runs the MTP layer of {', '.join(MTP_FAMILIES)} checkpoints; a {family} model has none")


def check_expert_cache(config: StackConfig) -> None:
    """Refuses at once an expert cache the worker would refuse for its size's spelling, the model's family or tensor parallelism."""
    if config.expert_cache_bytes.strip() in ("0", "0%"):
        return
    from services.worker.expert_cache import FAMILIES, cache_bytes

    try:
        cache_bytes(config.expert_cache_bytes, 1)
    except ValueError as exc:
        raise SystemExit(f"tokenyard: {exc}") from None
    family = load_model_info(config.model).family
    if family not in FAMILIES:
        raise SystemExit(f"tokenyard: --expert-cache-bytes serves {' and '.join(FAMILIES)} models, not {family}")
    if config.tensor_parallel_size > 1:
        raise SystemExit("tokenyard: --expert-cache-bytes does not run with tensor parallelism: leave --tensor-parallel-size at 1")


def _engine_argvs(config: StackConfig, suffix: str) -> dict[str, list[str]]:
    """An engine replica's processes: scheduler, detokenizer (unless the api detokenizes), and the worker's ranks
    (rank 0 named ``worker``)."""
    processes = [p for p in ENGINE_PROCESSES if p != "detokenizer" or config.detokenize_in == "detokenizer"]  # else the api detokenizes
    argvs = {f"{process}{suffix}": [sys.executable, "-m", f"services.{process}", *config.to_argv()] for process in processes}
    for rank in range(1, config.tensor_parallel_size):
        rank_config = dataclasses.replace(config, tensor_parallel_rank=rank)
        argvs[f"worker-rank{rank}{suffix}"] = [sys.executable, "-m", "services.worker", *rank_config.to_argv()]
    return argvs


def child_argvs(config: StackConfig) -> dict[str, list[str]]:
    """Each child's name and the argv that starts it (one api; one set of engine processes per replica)."""
    if config.replicas < 1:
        raise SystemExit(f"--replicas must be at least 1, got {config.replicas}")
    check_tensor_parallel(config)
    check_speculative(config)
    check_expert_cache(config)
    if config.replicas == 1:
        return {**_engine_argvs(config, ""), "api": [sys.executable, "-m", "services.api", *config.to_argv()]}
    argvs: dict[str, list[str]] = {}
    engines = []
    for index in range(config.replicas):
        engine = replica_config(config, index)
        engines.append(f"engine-{index}={engine.scheduler_address}")
        argvs.update(_engine_argvs(engine, f"@engine-{index}"))
    api = dataclasses.replace(config, engines=",".join(engines))
    argvs["api"] = [sys.executable, "-m", "services.api", *api.to_argv()]
    return argvs


def listen_ports(argvs: dict[str, list[str]]) -> list[tuple[str, str, int]]:
    """(what, host, port) of every TCP port the children will listen on: the api's, and each process's metrics."""
    ports = []
    for name, argv in argvs.items():
        process, _, replica = name.partition("@")
        if process not in PROCESSES:  # a worker's other ranks serve no metrics
            continue
        config = StackConfig.from_argv(argv[3:])
        what = "api" if process == "api" else f"{process}{'@' + replica if replica else ''} metrics"
        ports.append((what, config.host if process == "api" else config.metrics_host, config.metrics_port(process)))
    return sorted(ports, key=lambda item: item[0] != "api")  # the api's first: the one a user chose


def ports_in_use(ports: list[tuple[str, str, int]]) -> list[str]:
    """The ports another program already listens on, as "host:port (what)"."""
    taken = []
    for what, host, port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: a closing socket does not count
            try:
                probe.bind((host, port))
            except OSError:
                taken.append(f"{host}:{port} ({what})")
    return taken


def restart_group(name: str) -> str:
    """Children that restart together: a worker's ranks share one process group, so one dying restarts all."""
    process, _, replica = name.partition("@")
    return f"worker@{replica}" if process.startswith("worker") else name


class Launcher:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.argvs = child_argvs(config)
        self.children: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def start(self) -> None:
        for name in self.argvs:
            self._spawn(name)

    def _spawn(self, name: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, API_KEY_ENV: ",".join(self.config.api_keys)}  # keys stay out of argv (readable by every user in ps)
        self.children[name] = subprocess.Popen(self.argvs[name], cwd=root, env=env, preexec_fn=_die_with_parent)

    def wait_ready(self) -> bool:
        url = f"http://{self.config.host}:{self.config.port}/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping:
            # Health first: once the api has answered 200 the stack is up, and a child that dies from
            # then on (even before this loop looks again) is supervise()'s to restart, not a failed start.
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self._dead_child():
                return False
            time.sleep(0.25)
        return False

    def _dead_child(self) -> str | None:
        for name, child in self.children.items():
            if child.poll() is not None:
                return f"{name} (pid {child.pid}) exited with code {child.returncode}"
        return None

    def supervise(self) -> int:
        """Restarts any child that dies; gives up (non-zero exit) if one keeps dying."""
        restarts: list[float] = []
        while not self.stopping:
            for name, child in self.children.items():
                if child.poll() is None:
                    continue
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(restarts) > MAX_RESTARTS:
                    print(
                        f"tokenyard: {name} exited with code {child.returncode}; {MAX_RESTARTS} restarts in {RESTART_WINDOW_S:g}s, giving up",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                print(f"tokenyard: {name} (pid {child.pid}) exited with code {child.returncode}; restarting it", file=sys.stderr, flush=True)
                group = [other for other in self.children if restart_group(other) == restart_group(name)]
                self._reap([other for other in group if other != name], GROUP_EXIT_GRACE_S)
                for other in group:
                    self._spawn(other)
                break  # self.children changed
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """The api first (it drains while the engine still serves its running requests), then the engine processes."""
        self._stop([self.children[name] for name in ("api",) if name in self.children], self.config.drain_timeout_s + STOP_GRACE_S)
        self._stop([child for name, child in self.children.items() if name != "api"], STOP_GRACE_S)

    def _reap(self, names: list[str], grace_s: float) -> None:
        """The rest of a dead child's group: worker ranks notice a dead peer and exit by themselves
        (rank 0 after telling the scheduler why), so they get ``grace_s`` before they are killed."""
        deadline = time.monotonic() + grace_s
        for name in names:
            child = self.children[name]
            if child.poll() is None:  # it may have gone already, before this loop's poll saw the first death
                try:
                    child.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                    continue
            print(f"tokenyard: {name} (pid {child.pid}) exited by itself with code {child.returncode}", file=sys.stderr, flush=True)

    @staticmethod
    def _stop(children: list[subprocess.Popen], grace_s: float) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def main(argv: list[str] | None = None) -> int:
    config = StackConfig.from_argv(argv, "tokenyard: start the whole stack locally")
    if os.path.abspath(config.model) == os.path.abspath(DEFAULT_MODEL_DIR):
        from services.launcher.prepare_model import prepare_default_model

        prepare_default_model(config.model)
    try:  # a model directory that is not one fails every process with a traceback each: say it once, start nothing
        load_model_info(config.model)
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, KeyError):
            reason = f"its config.json has no {exc}"
        elif isinstance(exc, json.JSONDecodeError):
            reason = f"its config.json is not valid JSON ({exc})"
        else:
            reason = str(exc)
        print(f"tokenyard: cannot serve --model {config.model}: {reason}", file=sys.stderr, flush=True)
        return 2
    if not config.run_dir:  # a fresh socket directory per stack: two stacks never collide
        config = StackConfig(**{**config.as_dict(), "run_dir": tempfile.mkdtemp(prefix="tokenyard-")})
    try:  # the children would refuse too, one by one, and be restarted in vain
        check_binds([config.api_address, config.scheduler_address, config.worker_address, config.detokenizer_address], config.curve_key_file)
    except InsecureBindError as exc:
        print(f"tokenyard: {exc}", file=sys.stderr, flush=True)
        return 2
    launcher = Launcher(config)
    taken = ports_in_use(listen_ports(launcher.argvs))
    if taken:  # the children would die one by one, and the api's health check would find the other server's
        print(f"tokenyard: already in use: {', '.join(taken)} (another stack? choose another --port)", file=sys.stderr, flush=True)
        return 2

    def request_stop(*_: object) -> None:
        launcher.stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    launcher.start()
    print(f"tokenyard: starting {', '.join(launcher.argvs)} for {config.model_id} ...", file=sys.stderr, flush=True)
    code = 0
    if launcher.wait_ready():
        print(f"tokenyard is ready: http://{config.host}:{config.port}/v1 (model {config.model_id!r})", flush=True)
        code = launcher.supervise()
    elif not launcher.stopping:
        print(f"tokenyard: the stack did not become ready ({launcher._dead_child() or 'timed out'})", file=sys.stderr, flush=True)
        code = 1
    launcher.stop()
    print("tokenyard: stopped", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
