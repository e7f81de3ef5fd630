"""Typed configuration: frozen dataclasses define every setting of the stack, once, in groups.

Each group (model, api, transport, scheduler, worker, processes, logging) defines its settings;
``StackConfig`` inherits every group, so each process builds the same ``StackConfig`` from its
command line (``from_argv``) and reads any setting flat (``config.heartbeat_s``). The flags, their
defaults and help text are generated from the fields, and choices come from ``shared/choices.py``,
the names the services' registries are keyed by. Derived values (addresses, ports) are properties.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Any

from shared.choices import (
    DEVICES,
    DTYPE_NAMES,
    EXPERT_CACHE_CPU_EXPERTS,
    EXPERT_CACHE_FILLS,
    EXPERT_CACHE_POLICIES,
    EXPERT_CACHE_PREFETCH,
    LOG_FORMATS,
    LOG_LEVELS,
    REASONING_PARSER_NAMES,
    ROUTER_POLICY_NAMES,
    TOOL_PARSER_NAMES,
    WEIGHT_QUANTS,
)
from shared.model_info import KV_CACHE_DTYPES

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "SmolLM2-135M-Instruct")


API_KEY_ENV = "TOKENYARD_API_KEY"


def _opt(default: Any, help: str, *, choices: tuple[str, ...] = (), minimum: float | None = None, **flags: bool) -> Any:
    """A setting; ``choices`` or ``minimum`` bound its values (a flag outside them is refused before anything
    starts), ``repeatable`` lets its flag be given several times (joined with commas), ``secret`` keeps it off child argv."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum, **flags})


# The groups: each defines its settings once, and StackConfig inherits them all, so a setting reads
# the same from any group (``config.heartbeat_s``). A group's docstring names it (before the colon) in
# --help and in docs/configuration.md; the longer story of a setting is told there, not in its help.


@dataclass(frozen=True)
class ModelConfig:
    """Model: the checkpoint served, its name and its context limit."""

    model: str = _opt(DEFAULT_MODEL_DIR, "model directory in the Hugging Face layout")
    served_model_name: str = _opt("", "model id shown by /v1/models (default: the directory name)")
    max_model_len: int = _opt(0, "context limit (0: the model's max_position_embeddings)", minimum=0)

    @property
    def model_id(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


@dataclass(frozen=True)
class ApiConfig:
    """HTTP api: the api's listener, routing among engine replicas, output parsing, limits and keys."""

    host: str = _opt("127.0.0.1", "address the api listens on")
    port: int = _opt(8000, "api port (HTTP, metrics and instrumentation)", minimum=1)
    api_replica: str = _opt("api-0", "identity of this api replica (names its inbox)")
    engines: str = _opt("", "engine replicas the api routes to: name=scheduler_addr,... (default: engine-0 at --scheduler-addr)")
    engines_from_dns: str = _opt("", "engine replicas from DNS instead: host:port of a headless Service, one address per scheduler")
    engines_dns_interval_s: float = _opt(5.0, "how often the api resolves --engines-from-dns again", minimum=0.1)
    router_policy: str = _opt("load", "how the api picks an engine replica", choices=ROUTER_POLICY_NAMES)
    tool_call_parser: str = _opt("", "tool-call format (default: chosen by the model)", choices=("", *TOOL_PARSER_NAMES, "none"))
    reasoning_parser: str = _opt("", "reasoning format (default: chosen by the model)", choices=("", *REASONING_PARSER_NAMES, "none"))
    max_body_bytes: int = _opt(8 * 1024 * 1024, "largest accepted HTTP request body", minimum=1)
    max_in_flight: int = _opt(0, "most engine requests the api holds before answering 429 (0: max_num_seqs + max_waiting)", minimum=0)
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, how long running requests may take to finish before they are aborted", minimum=0)
    api_key: str = _opt("", f"API key of generation and admin routes; repeatable, comma-separated (also ${API_KEY_ENV})", repeatable=True, secret=True)
    auth_health_metrics: bool = _opt(False, "require the API key on /health and /metrics too")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys: the flag's and the environment's (none: the api is open)."""
        joined = f"{self.api_key},{os.environ.get(API_KEY_ENV, '')}"
        return tuple(dict.fromkeys(key.strip() for key in joined.split(",") if key.strip()))


@dataclass(frozen=True)
class TransportConfig:
    """ZMQ transport: the processes' addresses, their CURVE key, heartbeats and timeouts."""

    run_dir: str = _opt("", "directory of the stack's ipc sockets (default: a per-port temp dir)")
    api_addr: str = _opt("", "ZMQ address the api receives on (default: ipc in run_dir)")
    scheduler_addr: str = _opt("", "ZMQ address the scheduler receives on")
    worker_addr: str = _opt("", "ZMQ address the worker receives on")
    detokenizer_addr: str = _opt("", "ZMQ address the detokenizer receives on")
    curve_key_file: str = _opt("", "ZMQ CURVE secret key file of the stack (needed to bind ZMQ outside loopback or ipc)")
    heartbeat_s: float = _opt(0.5, "interval of heartbeats and engine status frames", minimum=0.01)
    engine_timeout_s: float = _opt(3.0, "a process silent this long is taken for dead (its requests fail)", minimum=0.01)
    stall_timeout_s: float = _opt(60.0, "a step unanswered this long marks the worker stalled (unhealthy)", minimum=0.01)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler: KV cache size and blocks, batching, step timing, admission, the prefix cache and speculative decoding."""

    kv_cache_tokens: int = _opt(16384, "KV cache size in tokens (ignored if kv_cache_bytes is set)", minimum=1)
    kv_cache_bytes: int = _opt(0, "KV cache size in bytes (0: use kv_cache_tokens)", minimum=0)
    block_size: int = _opt(8, "tokens per KV block, the prefix cache's granularity", minimum=1)
    max_num_seqs: int = _opt(64, "most requests in one step", minimum=1)
    max_num_batched_tokens: int = _opt(512, "token budget of one step (prefill chunk size)", minimum=1)
    mixed_step_target_ms: float = _opt(250.0, "target time of a step that carries decodes (0: only max_num_batched_tokens bounds it)", minimum=0)
    decode_plan_ms: float = _opt(20.0, "time a plan of decodes alone may fill with decode steps (0: one step per plan)", minimum=0)
    max_waiting: int = _opt(1024, "most requests waiting for admission before 429", minimum=0)
    enable_prefix_cache: bool = _opt(True, "reuse the KV of full blocks shared with earlier prompts")
    gdn_checkpoint_slots: int = _opt(64, "GDN state checkpoints a hybrid model's prefix cache keeps (0: no prefix cache for hybrid models)", minimum=0)
    gdn_checkpoint_bytes: int = _opt(0, "GDN state checkpoints' size in bytes (0: use gdn_checkpoint_slots)", minimum=0)
    gdn_checkpoint_interval: int = _opt(512, "tokens between GDN state checkpoints of a prefill, rounded up to whole blocks", minimum=1)
    pipeline_depth: int = _opt(2, "step plans in flight at once (1: strictly alternate plan and result)", minimum=1)
    speculative_method: str = _opt("", "proposer of the tokens a decode step verifies (default: none, no speculation)", choices=("", "ngram", "draft", "mtp"))
    draft_model: str = _opt("", "small model of the same tokenizer that speculative_method draft proposes with")
    num_speculative_tokens: int = _opt(3, "most proposed tokens one decode step verifies", minimum=1)
    ngram_min: int = _opt(2, "shortest n-gram of a request's last tokens that ngram looks up in its earlier tokens", minimum=1)
    ngram_max: int = _opt(4, "longest such n-gram (the longest that matches proposes)", minimum=1)
    speculative_max_batch: int = _opt(4, "requests may speculate only while at most this many run", minimum=1)


@dataclass(frozen=True)
class WorkerConfig:
    """Worker: device, dtypes and weight storage, the expert cache, threads and placement, tensor parallelism, streaming."""

    dtype: str = _opt("auto", "weight and activation dtype (auto: bfloat16 on CUDA, float32 on the CPU)", choices=("auto", *DTYPE_NAMES))
    weight_quant: str = _opt("auto", "weight storage of the dense projections and lm_head (auto: by device and checkpoint)", choices=WEIGHT_QUANTS)
    weight_prefetch: str = _opt(
        "auto", "whether a CPU worker's int4 products keep the weights in the caches or stream them", choices=("auto", "keep", "stream")
    )
    kv_cache_dtype: str = _opt("auto", "KV cache storage (auto: float16 for a float32 model on the CPU, else the model's dtype)", choices=KV_CACHE_DTYPES)
    device: str = _opt("auto", "worker device (auto: CUDA when available)", choices=DEVICES)
    cuda_graph_max_batch: int = _opt(32, "largest decode batch replayed from a CUDA graph (0: always eager)", minimum=0)
    gpu_memory_utilization: float = _opt(0.9, "fraction of the GPU the worker may use (0: size the KV cache by kv_cache_tokens/bytes)", minimum=0)
    num_threads: int = _opt(0, "torch threads of the worker (0: all cores)", minimum=0)
    worker_core: str = _opt("auto", "CPU the worker's main thread keeps to itself: auto (the first allowed), a CPU number, or off")
    tensor_parallel_size: int = _opt(1, "worker ranks each step is split across", minimum=1)
    tensor_parallel_rank: int = _opt(0, "this worker process's rank (rank 0 talks to the scheduler)", minimum=0)
    tensor_parallel_addr: str = _opt("", "rendezvous of the worker ranks (default: tcp://127.0.0.1:<port + 90>)")
    stream_interval: int = _opt(1, "steps whose tokens the worker sends as one chunk", minimum=1)
    expert_cache_bytes: str = _opt("0", "MoE experts held in RAM (a GPU's memory on one): bytes or a percentage such as 25% (0: all resident)")
    expert_cache_dir: str = _opt("", "directory of the expert cache's spill file (default: ~/.cache/tokenyard/experts)")
    expert_cache_policy: str = _opt("lfu", "which expert the expert cache evicts: lfu (scan resistant, the default) or lru", choices=EXPERT_CACHE_POLICIES)
    expert_cache_fill: str = _opt(
        "auto", "how steps read experts: on-demand misses, whole layers streamed, or auto (by measured rates)", choices=EXPERT_CACHE_FILLS
    )
    expert_cache_prefetch: str = _opt(
        "on", "one-token steps read the experts the next MoE layer is predicted to route to while this layer runs", choices=EXPERT_CACHE_PREFETCH
    )
    expert_cache_cpu_experts: str = _opt(
        "auto", "GPU worker: run a missed expert few tokens use on the CPU, not copy it (auto: by measured rates)", choices=EXPERT_CACHE_CPU_EXPERTS
    )


@dataclass(frozen=True)
class ProcessConfig:
    """Processes: engine replicas, which process makes the text, and the metrics servers."""

    replicas: int = _opt(1, "engine replicas the launcher starts, each its own scheduler, worker and detokenizer", minimum=1)
    engine_name: str = _opt("", "this engine replica's name, the `replica` label of its metrics (the launcher sets engine-<i>)")
    detokenize_in: str = _opt("api", "which process turns tokens into text (the same on every process)", choices=("api", "detokenizer"))
    metrics_host: str = _opt("127.0.0.1", "address the non-api metrics servers listen on")
    scheduler_metrics_port: int = _opt(0, "scheduler /metrics port (0: port + 1)", minimum=0)
    worker_metrics_port: int = _opt(0, "worker /metrics port (0: port + 2)", minimum=0)
    detokenizer_metrics_port: int = _opt(0, "detokenizer /metrics port (0: port + 3)", minimum=0)


@dataclass(frozen=True)
class LoggingConfig:
    """Logging: every process's log, and where the api, scheduler and worker send request traces."""

    log_level: str = _opt("info", "log level", choices=LOG_LEVELS)
    log_format: str = _opt("auto", "log format (auto: console on a terminal, JSON lines otherwise)", choices=LOG_FORMATS)
    otlp_traces_endpoint: str = _opt("", "OpenTelemetry collector of request traces: http(s)://host:4318 or grpc://host:4317 (default: none)")


# A dataclass takes its bases' fields from the last base to the first: these are GROUPS reversed.
@dataclass(frozen=True)
class StackConfig(LoggingConfig, ProcessConfig, WorkerConfig, SchedulerConfig, TransportConfig, ApiConfig, ModelConfig):
    """Every setting of the stack: the groups' fields, and the values derived from several groups."""

    # Derived values. -----------------------------------------------------------------

    @property
    def metric_labels(self) -> dict[str, str]:
        """Labels on every metric sample this process exports."""
        return {"model_name": self.model_id, **({"replica": self.engine_name} if self.engine_name else {})}

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join(tempfile.gettempdir(), f"tokenyard-{self.port}")

    def _ipc(self, explicit: str, name: str) -> str:
        return explicit or f"ipc://{os.path.join(self.resolved_run_dir, name)}.sock"

    @property
    def api_address(self) -> str:
        return self._ipc(self.api_addr, f"api-{self.api_replica}")

    @property
    def scheduler_address(self) -> str:
        return self._ipc(self.scheduler_addr, "scheduler")

    @property
    def worker_address(self) -> str:
        return self._ipc(self.worker_addr, "worker")

    @property
    def detokenizer_address(self) -> str:
        return self._ipc(self.detokenizer_addr, "detokenizer")

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.max_num_seqs + self.max_waiting

    @property
    def engine_addresses(self) -> dict[str, str]:
        """Engine replica name -> scheduler address, in the order given (none yet with --engines-from-dns)."""
        if self.engines_from_dns:
            if self.engines:
                raise ValueError("--engines and --engines-from-dns exclude each other: give one")
            return {}
        if not self.engines:
            return {"engine-0": self.scheduler_address}
        engines: dict[str, str] = {}
        for item in self.engines.split(","):
            name, sep, address = item.strip().partition("=")
            if not sep or not name or not address:
                raise ValueError(f"--engines: expected name=scheduler_addr, got {item.strip()!r}")
            if name in engines:
                raise ValueError(f"--engines: replica name {name!r} is given twice")
            engines[name] = address
        return engines

    @property
    def engines_dns_target(self) -> tuple[str, int]:
        """(host, port) of --engines-from-dns."""
        host, sep, port = self.engines_from_dns.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--engines-from-dns: expected host:port, got {self.engines_from_dns!r}")
        return host.strip("[]"), int(port)

    @property
    def tensor_parallel_init(self) -> str:
        return self.tensor_parallel_addr or f"tcp://127.0.0.1:{self.port + 90}"

    def metrics_port(self, process: str) -> int:
        explicit = {
            "api": self.port,
            "scheduler": self.scheduler_metrics_port,
            "worker": self.worker_metrics_port,
            "detokenizer": self.detokenizer_metrics_port,
        }[process]
        offset = {"api": 0, "scheduler": 1, "worker": 2, "detokenizer": 3}[process]
        return explicit or self.port + offset

    # Command line. -------------------------------------------------------------------

    def to_argv(self) -> list[str]:
        """Flags that rebuild this config in a child process (only non-default values; secrets travel in the environment)."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default and not f.metadata.get("secret"):
                argv += [_flag(f.name), str(value).lower() if isinstance(value, bool) else str(value)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, under a heading per group (``--help`` lists them so)."""
        hints = typing.get_type_hints(cls)
        for title, fields in setting_groups(cls):
            section = parser.add_argument_group(title)
            for f in fields:
                kind = hints[f.name]
                choices, minimum = f.metadata["choices"], f.metadata["minimum"]
                parse = _bounded(_parse_bool if kind is bool else kind, choices, minimum)
                help = f.metadata["help"]
                if "default" not in help and f.default not in ("", ()):  # an empty default says nothing; some texts say their own
                    help = f"{help} (default: {f.default})"
                help = help.replace("%", "%%")  # argparse formats help with %
                metavar = "{" + ",".join(c for c in choices if c) + "}" if choices else None
                if f.metadata.get("repeatable"):
                    section.add_argument(_flag(f.name), dest=f.name, type=parse, action="append", metavar=metavar, help=help)
                else:
                    section.add_argument(_flag(f.name), dest=f.name, type=parse, default=f.default, metavar=metavar, help=help)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackConfig:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            if f.metadata.get("repeatable"):
                values[f.name] = ",".join(values[f.name] or []) or f.default
        return cls(**values)

    @classmethod
    def from_argv(cls, argv: list[str] | None = None, description: str = "") -> StackConfig:
        parser = argparse.ArgumentParser(description=description)
        cls.add_arguments(parser)
        return cls.from_args(parser.parse_args(argv))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GROUPS: tuple[type, ...] = StackConfig.__bases__[::-1]
"""The groups of settings, in the order of --help and docs/configuration.md."""


UNGROUPED = "Other settings"


def group_title(group: type) -> str:
    """The group's heading: its docstring up to the colon."""
    return (group.__doc__ or "").partition(":")[0]


def setting_groups(config: type = StackConfig) -> list[tuple[str, list[dataclasses.Field]]]:
    """(heading, fields) per group, in GROUPS' order; fields ``config`` defines outside the groups come
    last, under ``UNGROUPED``, so that none is left without its flag."""
    out = [(group_title(group), list(dataclasses.fields(group))) for group in GROUPS]
    grouped = {f.name for _, fields in out for f in fields}
    ungrouped = [f for f in dataclasses.fields(config) if f.name not in grouped]
    return out + ([(UNGROUPED, ungrouped)] if ungrouped else [])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bounded(parse: Any, choices: tuple[str, ...], minimum: float | None) -> Any:
    """``parse``, refusing a value outside ``choices`` or below ``minimum`` (argparse names the flag)."""
    if not choices and minimum is None:
        return parse

    def parse_bounded(text: str) -> Any:
        value = parse(text)
        if choices and value not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(repr(c) for c in choices)}, got {text!r}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {text!r}")
        return value

    parse_bounded.__name__ = parse.__name__  # argparse's "invalid <type> value" message names it
    return parse_bounded


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")
