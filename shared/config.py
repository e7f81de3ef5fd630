"""Typed configuration: one frozen dataclass defines every setting of the stack, once.

Each process builds the same ``StackConfig`` from its command line (``from_argv``); the
flags, their defaults and help text are generated from the dataclass fields, so a
setting exists in exactly one place. Derived values (addresses, ports, KV block count)
are properties.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Any

from shared.model_info import KV_CACHE_DTYPES

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "SmolLM2-135M-Instruct")


API_KEY_ENV = "TOKENYARD_API_KEY"

# Settings whose values the worker resolves (services/worker: linear.py, device.py); defined here, once.
WEIGHT_QUANTS = ("auto", "none", "fp16", "int8", "int4", "int4-a8")
DEVICES = ("auto", "cpu", "cuda")


def _opt(default: Any, help: str, *, choices: tuple[str, ...] = (), minimum: float | None = None, **flags: bool) -> Any:
    """A setting; ``choices`` or ``minimum`` bound its values (a flag outside them is refused before anything
    starts), ``repeatable`` lets its flag be given several times (joined with commas), ``secret`` keeps it off child argv."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum, **flags})


@dataclass(frozen=True)
class StackConfig:
    model: str = _opt(DEFAULT_MODEL_DIR, "model directory in the Hugging Face layout")
    served_model_name: str = _opt("", "model id shown by /v1/models (default: the directory name)")
    host: str = _opt("127.0.0.1", "address the api listens on")
    port: int = _opt(8000, "api port (HTTP, metrics and instrumentation)", minimum=1)
    scheduler_metrics_port: int = _opt(0, "scheduler /metrics port (0: port + 1)", minimum=0)
    worker_metrics_port: int = _opt(0, "worker /metrics port (0: port + 2)", minimum=0)
    detokenizer_metrics_port: int = _opt(0, "detokenizer /metrics port (0: port + 3)", minimum=0)
    metrics_host: str = _opt("127.0.0.1", "address the non-api metrics servers listen on")
    run_dir: str = _opt("", "directory of the stack's ipc sockets (default: a per-port temp dir)")
    api_addr: str = _opt("", "ZMQ address the api receives on (default: ipc in run_dir)")
    scheduler_addr: str = _opt("", "ZMQ address the scheduler receives on")
    worker_addr: str = _opt("", "ZMQ address the worker receives on")
    detokenizer_addr: str = _opt("", "ZMQ address the detokenizer receives on")
    api_replica: str = _opt("api-0", "identity of this api replica (names its inbox; replies are addressed to the inbox)")
    engines: str = _opt("", "engine replicas the api routes to, as name=scheduler_addr,... (default: one, engine-0 at --scheduler-addr)")
    router_policy: str = _opt("load", "how the api picks an engine replica: load, prefix or round_robin", choices=("load", "prefix", "round_robin"))
    replicas: int = _opt(1, "engine replicas the launcher starts, each its own scheduler, worker and detokenizer", minimum=1)
    engine_name: str = _opt("", "this engine replica's name, a `replica` label on its processes' metrics (the launcher sets engine-<i>)")
    kv_cache_tokens: int = _opt(16384, "KV cache size in tokens (ignored if kv_cache_bytes is set)", minimum=1)
    kv_cache_bytes: int = _opt(0, "KV cache size in bytes (0: use kv_cache_tokens)", minimum=0)
    block_size: int = _opt(8, "tokens per KV block (the prefix cache's granularity: 8 rather than 16 halves what a hit recomputes)", minimum=1)
    max_num_seqs: int = _opt(64, "most requests in one step", minimum=1)
    max_num_batched_tokens: int = _opt(512, "token budget of one step (prefill chunk size)", minimum=1)
    mixed_step_target_ms: float = _opt(
        250.0,
        "target time of a step that carries decodes: its prefill chunk is cut to what the worker's measured time per token "
        "fits, so a new long prompt does not hold the running streams' next token for a whole chunk (0: only "
        "max_num_batched_tokens limits it)",
        minimum=0,
    )
    decode_plan_ms: float = _opt(
        20.0,
        "while nothing waits or prefills, a plan of decodes alone runs as many decode steps as fit this time by the worker's "
        "measured step time (at most 16), streaming each step's tokens, with one result for the scheduler: fewer wake-ups per "
        "token where steps are short (a CPU at few streams), a new request held back by up to about twice this (0: one step per plan)",
        minimum=0,
    )
    stream_interval: int = _opt(
        1,
        "steps whose sampled tokens the worker gathers into one frame for the detokenizer (and so one chunk for the "
        "client): fewer wake-ups of the detokenizer, api and client per token where a step is short (few streams on a "
        "CPU), a burstier stream; a token waits at most this many steps less one, a request's first and stop tokens none",
        minimum=1,
    )
    detokenize_in: str = _opt(
        "api",
        "which process turns tokens into text: the api (the worker sends each request's tokens to the api that owns it; "
        "one process less woken per token, as vLLM's frontend does) or the detokenizer (a process of its own, SGLang's "
        "layout: that work stays off the api's event loop, for many streams on a GPU). Every process of a stack must "
        "be started with the same value",
        choices=("api", "detokenizer"),
    )
    max_waiting: int = _opt(1024, "most requests waiting for admission before 429", minimum=0)
    enable_prefix_cache: bool = _opt(True, "reuse the KV of full blocks shared with earlier prompts")
    pipeline_depth: int = _opt(2, "step plans in flight at once (1: strictly alternate plan and result)", minimum=1)
    max_model_len: int = _opt(0, "context limit (0: the model's max_position_embeddings)", minimum=0)
    tool_call_parser: str = _opt(
        "",
        "tool-call format: hermes, qwen3_coder, llama3_json or none (default: chosen by the model)",
        choices=("", "hermes", "qwen3_coder", "llama3_json", "none"),
    )
    reasoning_parser: str = _opt("", "reasoning format: think or none (default: chosen by the model)", choices=("", "think", "none"))
    dtype: str = _opt(
        "auto",
        "weight and activation dtype: auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    weight_quant: str = _opt(
        "auto",
        "weight storage of the dense projections and lm_head: auto (on an x86 CPU with a float32 model: int4 where the checkpoint "
        "round-trips through q4_1 blocks exactly, as one converted from a q4_1 GGUF, else fp16; elsewhere none), "
        "none (the dtype's own), fp16 (fbgemm fp16 packs, fp32 arithmetic), int4 (q4_1 blocks, lm_head q8_0 blocks, in panels of 8 "
        "channels; activations int16 per block of 32 features), int4-a8 (int4, but the projections' steps of > 4 rows round "
        "activations to int8, llama.cpp's q4_1 x q8 arithmetic: opt-in, ~1.8x int4's many-row GEMM speed, logit error ~7e-2) or int8 (per-channel weights; on the CPU activations int8 per block of 32 features: opt-in, +1.7 % perplexity)",
        choices=WEIGHT_QUANTS,
    )
    weight_prefetch: str = _opt(
        "auto",
        "how a CPU worker's int4 products prefetch the weights they stream each step: keep (into every cache level, so that "
        "a last-level cache that holds them serves them from step to step), stream (non-temporal: read from memory past the "
        "caches, leaving those to the step's other data) or auto (keep where the quantized weights take at most half of the "
        "L3 cache, else stream)",
        choices=("auto", "keep", "stream"),
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache storage: auto (float16 for a float32 model on the CPU, else the model's dtype), model, float16 or int8 "
        "(a float32 model on the CPU: llama.cpp's q8_0 per head vector, 0.53x fp16's bytes; opt-in: logit error ~1e-2)",
        choices=KV_CACHE_DTYPES,
    )
    device: str = _opt("auto", "worker device: auto (CUDA when available), cpu or cuda", choices=DEVICES)
    cuda_graph_max_batch: int = _opt(32, "largest decode batch replayed from a CUDA graph (buckets 1, 2, 4, 8, 16, 24, ...; 0: always eager)", minimum=0)
    gpu_memory_utilization: float = _opt(
        0.9,
        "fraction of the GPU the worker may use; the KV cache gets what the weights leave (0: size it by kv_cache_tokens/bytes)",
        minimum=0,
    )
    num_threads: int = _opt(0, "torch threads of the worker (0: all cores)", minimum=0)
    worker_core: str = _opt(
        "auto",
        "CPU placement where the worker computes on the CPU: auto (its main thread keeps the first allowed CPU to itself once warm, "
        "and every other thread of the stack runs on the rest; one worker per host only), a CPU number instead of the first, or off",
    )
    tensor_parallel_size: int = _opt(1, "worker ranks each step is split across (torch.distributed: gloo on CPU, NCCL on GPU)", minimum=1)
    tensor_parallel_rank: int = _opt(0, "this worker process's rank; rank 0 talks to the scheduler (the launcher starts the others)", minimum=0)
    tensor_parallel_addr: str = _opt("", "rendezvous of the worker ranks, a torch.distributed init method (default: tcp://127.0.0.1:<port + 90>)")
    heartbeat_s: float = _opt(0.5, "interval of heartbeats and engine status frames", minimum=0.01)
    engine_timeout_s: float = _opt(3.0, "a process silent this long is taken for dead (its requests fail)", minimum=0.01)
    stall_timeout_s: float = _opt(60.0, "a step unanswered this long marks the worker stalled (unhealthy)", minimum=0.01)
    max_body_bytes: int = _opt(8 * 1024 * 1024, "largest accepted HTTP request body", minimum=1)
    max_in_flight: int = _opt(0, "most engine requests the api holds (running or waiting) before answering 429 (0: max_num_seqs + max_waiting)", minimum=0)
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, how long running requests may take to finish before they are aborted", minimum=0)
    api_key: str = _opt(
        "", f"API key required on generation and admin routes; repeat the flag or separate keys with commas (also ${API_KEY_ENV})", repeatable=True, secret=True
    )
    auth_health_metrics: bool = _opt(False, "require the API key on /health and /metrics too (open by default, for probes and Prometheus)")
    curve_key_file: str = _opt(
        "", "ZMQ CURVE certificate with its secret key (zmq.auth format), shared by the stack's processes; required to bind ZMQ outside loopback or ipc"
    )
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error", "critical"))
    log_format: str = _opt("auto", "log as json, console, or auto (console on a terminal, JSON lines otherwise)", choices=("auto", "json", "console"))

    # Derived values. -----------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

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
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys: the flag's and the environment's (none: the api is open)."""
        joined = f"{self.api_key},{os.environ.get(API_KEY_ENV, '')}"
        return tuple(dict.fromkeys(key.strip() for key in joined.split(",") if key.strip()))

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.max_num_seqs + self.max_waiting

    @property
    def engine_addresses(self) -> dict[str, str]:
        """Engine replica name -> scheduler address, in the order given."""
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
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            parse = _bounded(_parse_bool if kind is bool else kind, f.metadata["choices"], f.metadata["minimum"])
            help = f.metadata["help"]
            if "default" not in help and f.default not in ("", ()):  # an empty default says nothing; some texts say their own
                help = f"{help} (default: {f.default})"
            help = help.replace("%", "%%")  # argparse formats help with %
            if f.metadata.get("repeatable"):
                parser.add_argument(_flag(f.name), dest=f.name, type=parse, action="append", help=help)
            else:
                parser.add_argument(_flag(f.name), dest=f.name, type=parse, default=f.default, help=help)

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
