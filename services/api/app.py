"""The api process: builds the aiohttp application and runs it."""

from __future__ import annotations

import asyncio
import os
import time

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.api.engine_client import EngineClient
from services.api.errors import ApiError
from services.api.metrics import HTTP_REQUESTS
from services.api.openai_routes import routes as openai_routes
from services.api.state import ApiState
from services.api.templating import PromptBuilder
from shared.config import StackConfig
from shared.metrics import PROCESS_UP
from shared.model_info import load_model_info

log = structlog.get_logger()


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-shaped error; every answer is counted by route and status."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        response = await handler(request)
    except ApiError as exc:
        response = exc.response()
    except web.HTTPRequestEntityTooLarge as exc:
        response = ApiError(413, f"the request body is larger than the limit of {exc.max_size} bytes", code="request_too_large").response()
    except web.HTTPException as exc:
        response = ApiError(exc.status, exc.reason or "error").response()
    except (asyncio.CancelledError, ConnectionResetError):
        HTTP_REQUESTS.labels(route, "499").inc()  # the client went away
        raise
    except Exception:
        log.exception("unhandled_error", path=request.path)
        response = ApiError(500, "internal server error").response()
    HTTP_REQUESTS.labels(route, str(response.status)).inc()
    return response


async def health(request: web.Request) -> web.Response:
    state: ApiState = request.app["state"]
    engine_state, detail = state.engine.describe_state()
    status = 200 if state.engine.ready else 503
    return web.json_response({"status": "ok" if status == 200 else engine_state, "detail": detail}, status=status)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def instrumentation(request: web.Request) -> web.Response:
    state: ApiState = request.app["state"]
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
            "listen": f"http://{state.config.host}:{state.config.port}",
            "replica": state.config.api_replica,
            "max_body_bytes": state.config.max_body_bytes,
            "in_flight": len(engine.streams),
            "engine": {
                "state": engine.describe_state()[0],
                "detail": engine.describe_state()[1],
                "running": engine.status.running,
                "waiting": engine.status.waiting,
            },
            "addresses": {"inbox": engine.inbox.address, "scheduler": engine.to_scheduler.address},
        }
    )


def create_app(config: StackConfig) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_body_bytes)
    model = load_model_info(config.model)

    async def on_startup(app: web.Application) -> None:
        engine = EngineClient(config)
        engine.start()
        app["state"] = ApiState(config=config, model=model, prompts=PromptBuilder(config.model), engine=engine)
        PROCESS_UP.labels("api").set(1)

    async def on_cleanup(app: web.Application) -> None:
        state: ApiState = app["state"]
        await state.engine.close()
        state.prompts.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/instrumentation", instrumentation)
    app.router.add_routes(openai_routes)
    return app


def main(argv: list[str] | None = None) -> None:
    from shared.logging import setup_logging

    config = StackConfig.from_argv(argv, "tokenyard api")
    setup_logging("api", config.log_level, config.log_format)
    started = time.perf_counter()
    app = create_app(config)
    log.info("api_starting", listen=f"http://{config.host}:{config.port}", model=config.model, setup_s=round(time.perf_counter() - started, 2))
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True, print=None, access_log=None, handle_signals=True)
