"""The api process: builds the aiohttp application and runs it; SIGTERM drains it (see services.api.admission)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from importlib import metadata

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.api.admin_routes import routes as admin_routes
from services.api.admission import Admission
from services.api.anthropic_routes import routes as anthropic_routes
from services.api.auth import auth_middleware
from services.api.chat import ChatFormat
from services.api.engine_client import Engine, EngineClient
from services.api.errors import ApiError
from services.api.metrics import HTTP_REQUESTS
from services.api.openai_routes import routes as openai_routes
from services.api.openapi import openapi_document
from services.api.responses_routes import routes as responses_routes
from services.api.router import make_policy
from services.api.state import API_STATE, ApiState
from services.api.templating import PromptBuilder
from services.api.tokenize_routes import routes as tokenize_routes
from services.api.tracing import ApiTracing
from shared.config import StackConfig
from shared.cpu_placement import keep_off_worker_core
from shared.metrics import PROCESS_UP, exposition
from shared.model_info import gdn_checkpoints, load_model_info
from shared.tracing import tracer_for

log = structlog.get_logger()


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as an error in the route's protocol shape; every answer is counted by route and status."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    anthropic = request.path.startswith("/v1/messages")
    try:
        response = await handler(request)
    except ApiError as exc:
        response = exc.response(anthropic)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[API_STATE].config.max_body_bytes
        response = ApiError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large").response(anthropic)
    except web.HTTPException as exc:  # a 405 keeps its Allow header
        response = ApiError(exc.status, exc.reason or "error", headers={k: v for k, v in exc.headers.items() if k == "Allow"}).response(anthropic)
    except (asyncio.CancelledError, ConnectionResetError):
        HTTP_REQUESTS.labels(route, "499").inc()  # the client went away
        raise
    except Exception:
        log.exception("unhandled_error", path=request.path)
        response = ApiError(500, "internal server error").response(anthropic)
    HTTP_REQUESTS.labels(route, str(response.status)).inc()
    return response


async def health(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    if state.admission.draining:
        return web.json_response({"status": "draining", "detail": "shutting down: finishing running requests, admitting none"}, status=503)
    engine_state, detail = state.engine.describe_state()
    status = 200 if state.engine.ready else 503
    return web.json_response({"status": "ok" if status == 200 else engine_state, "detail": detail}, status=status)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _VERSION})


def _package_version() -> str:
    try:
        return metadata.version("tokenyard")
    except metadata.PackageNotFoundError:
        return "0+unknown"


_VERSION = _package_version()


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app, _VERSION))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=exposition(request.app[API_STATE].config.metric_labels), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def instrumentation(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    engine = state.engine
    return web.json_response(
        {
            "process": "api",
            "pid": os.getpid(),
            "model": state.model.path,
            "model_id": state.model_id,
            "model_revision": state.model.revision(),
            "family": state.model.family,
            "max_model_len": state.max_model_len,
            "eos_token_ids": state.eos_token_ids,
            "chat_template": state.prompts.has_chat_template,
            "tool_call_parser": state.chat_format.tool_parser,
            "reasoning_tags": state.chat_format.reasoning_tags,
            "native_tools": state.chat_format.native_tools,
            "listen": f"http://{state.config.host}:{state.config.port}",
            "replica": state.config.api_replica,
            "max_body_bytes": state.config.max_body_bytes,
            "in_flight": len(engine.streams),
            "admission": {"in_flight": state.admission.in_flight, "limit": state.admission.limit, "draining": state.admission.draining},
            "api_keys": len(state.config.api_keys),
            "engine": {
                "state": engine.describe_state()[0],
                "detail": engine.describe_state()[1],
                "running": engine.status.running,
                "waiting": engine.status.waiting,
            },
            "replicas": engine.describe_replicas(),
            "router_policy": state.config.router_policy,
            "detokenize_in": state.config.detokenize_in,
            "addresses": engine.addresses(),
        }
    )


def create_app(config: StackConfig, engine_factory: Callable[[StackConfig], Engine] = EngineClient) -> web.Application:
    """The api; tests pass an ``engine_factory`` that builds a scripted engine instead of the ZeroMQ client."""
    open_paths = frozenset({"/openapi.json"} | (set() if config.auth_health_metrics else {"/health", "/metrics"}))
    middlewares = [error_middleware, auth_middleware(config.api_keys, open_paths)]  # auth inside: its 401 gets the protocol's shape
    tracer = tracer_for(config.otlp_traces_endpoint, "tokenyard-api")
    tracing = ApiTracing(tracer, config.model_id) if tracer is not None else None
    if tracing is not None:  # outermost: its span sees the answer's final status
        middlewares.insert(0, tracing.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    model = load_model_info(config.model)

    async def on_startup(app: web.Application) -> None:
        # A hybrid model's prefix cache checkpoints its GDN state where the rendered chat messages end: the api finds them.
        prompts = PromptBuilder(config.model, anchors=config.enable_prefix_cache and gdn_checkpoints(model, config) > 0)
        # tool_call_parser / reasoning_parser: "" chooses by chat template and model family (see services.api.chat).
        chat_format = ChatFormat.for_model(model.family, prompts.chat_template, config.tool_call_parser, config.reasoning_parser)
        engine = engine_factory(config)
        engine.start()
        app[API_STATE] = ApiState(
            config=config,
            model=model,
            prompts=prompts,
            engine=engine,
            chat_format=chat_format,
            admission=Admission(config.in_flight_limit),
            tracing=tracing,
        )
        PROCESS_UP.labels("api").set(1)

    async def on_cleanup(app: web.Application) -> None:
        state = app[API_STATE]
        await state.engine.close()
        state.prompts.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/instrumentation", instrumentation)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_routes(openai_routes)
    app.router.add_routes(responses_routes)
    app.router.add_routes(anthropic_routes)
    app.router.add_routes(tokenize_routes)
    app.router.add_routes(admin_routes)
    return app


async def serve(config: StackConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains: admission closes (503), running requests get ``drain_timeout_s``
    to finish, the rest are interrupted with an error, and the process exits normally."""
    app = create_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("api_listening", listen=f"http://{config.host}:{config.port}")
    try:
        await stop.wait()
        await app[API_STATE].admission.drain(config.drain_timeout_s)
    finally:
        await runner.cleanup()
    log.info("api_stopped")


def main(argv: list[str] | None = None) -> None:
    from shared.logging import setup_logging

    config = StackConfig.from_argv(argv, "tokenyard api")
    try:  # a bad routing setting stops the api here, with the flag named, not at its first request
        make_policy(config.router_policy, config.block_size)
        _ = config.engine_addresses
        if config.engines_from_dns:
            _ = config.engines_dns_target
    except ValueError as exc:
        raise SystemExit(f"tokenyard api: {exc}") from None
    setup_logging("api", config.log_level, config.log_format)
    if (cpus := keep_off_worker_core(config)) is not None:
        log.info("cpu_placement", cpus=sorted(cpus))
    log.info("api_starting", listen=f"http://{config.host}:{config.port}", model=config.model, api_keys=len(config.api_keys))
    asyncio.run(serve(config))
