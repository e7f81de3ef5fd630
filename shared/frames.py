"""The frames that tokenyard's processes exchange over ZeroMQ: one tagged msgspec union.

Every frame is an ``array_like`` struct, so on the wire it is a msgpack array whose first
element is the tag. A step's frames are O(batch): prompts travel once, in ``Submit`` and
in the prefill chunks of ``StepPlan``; a decode slice carries no token at all.
"""

from __future__ import annotations

import enum

import msgspec


class _Frame(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True, tag_field="frame"):
    """Base of every top-level frame; the tag is the class name."""


class _Part(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Base of the structs nested inside frames."""


class FinishReason(enum.StrEnum):
    """Why a request ended; its value is the ``finish_reason`` of the OpenAI API."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away
    ERROR = "error"  # the engine failed the request


class Process(enum.StrEnum):
    """The processes that send the scheduler a heartbeat."""

    WORKER = "worker"
    DETOKENIZER = "detokenizer"


class ProcessState(enum.StrEnum):
    """A process's state in its heartbeat."""

    LOADING = "loading"
    WARMING = "warming"  # loaded, running its warm-up
    READY = "ready"
    FAILED = "failed"  # up, but it cannot serve (e.g. a tensor-parallel rank died); ``detail`` says why


class EngineState(enum.StrEnum):
    """An engine replica's state, as its scheduler reports it (and as the api sums its replicas)."""

    LOADING = "loading"  # a process is not ready yet
    READY = "ready"
    FAILED = "failed"  # a process reported a failure
    UNHEALTHY = "unhealthy"  # the worker has not answered a step for --stall-timeout-s
    UNAVAILABLE = "unavailable"  # the api's own word for a replica whose scheduler went silent


class ErrorType(enum.StrEnum):
    """The error ``type`` of the OpenAI API for a request the engine refused or failed."""

    INVALID_REQUEST = "invalid_request_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"


class GrammarKind(enum.StrEnum):
    """What a structured output's ``Grammar.text`` is, as xgrammar reads it."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema (JSON text): the output is one JSON value it allows
    REGEX = "regex"
    EBNF = "ebnf"  # xgrammar's EBNF (GBNF), rule ``root`` first
    STRUCTURAL_TAG = "structural_tag"  # an xgrammar structural tag (JSON text): tool calls in the model's format


class Grammar(_Part):
    """What a structured output must follow; the api checked that it parses, the worker compiles it."""

    kind: GrammarKind
    text: str
    strict: bool = False  # json_schema: objects take no properties beyond those they name (OpenAI's strict)


class SamplingParams(_Part):
    """How a request's next token is drawn (vLLM semantics for the penalties).

    Order: ``logit_bias`` is added, then the penalties applied (repetition over prompt and
    output tokens, frequency and presence over output tokens); ``logprobs`` are read off that
    processed distribution, before temperature and the top-k / top-p / min-p filters.
    """

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's and the k most likely tokens' log-probabilities
    grammar: Grammar | None = None  # structured outputs: the output follows this grammar
    grammar_after: list[int] = []  # ... from after these tokens (the end of a reasoning block; empty: from its start)

    @property
    def penalised(self) -> bool:
        """Whether sampling needs the request's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def follows_outputs(self) -> bool:
        """Whether the worker must know which prefilled tokens are earlier outputs (a preempted request is
        recomputed from its prompt and outputs): the penalties count them, and a grammar resumes after them."""
        return self.penalised or self.grammar is not None


class Submit(_Frame):
    rid: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    arrival_time: float = 0.0
    reply_to: str = ""  # inbox address of the api replica that owns the reply ("": the configured api)
    trace: str = ""  # W3C traceparent of the api's span of this request when it is traced (untraced: one byte, once per request)
    anchors: list[int] = []  # prompt positions that end a rendered chat message (ascending): hybrid models checkpoint their GDN state there


class Abort(_Frame):
    rid: str
    reason: str = "client disconnected"


class StreamOpen(_Part):
    """A request's opening: what the process that makes its text needs before its first token (who builds
    it, who sends it where, and the end rule over its fields: ``shared/stream_contract.py``)."""

    rid: str
    prompt_tokens: int
    max_tokens: int
    stop_token_ids: list[int] = []  # empty with ignore_eos
    min_tokens: int = 0
    stop: list[str] = []
    skip_special_tokens: bool = True
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    reply_to: str = ""


class Slice(_Part):
    """One request's share of a step: ``num_tokens`` positions starting at ``start``.

    A prefill chunk carries its ``token_ids``; a decode slice carries none and the worker
    feeds back the token it sampled last for this request. A decode slice of ``num_tokens > 1`` is a
    speculative verify: the worker proposes up to ``num_tokens - 1`` tokens after the fed-back one, checks them in
    the same forward, and its ``StepResult`` holds one ``Sampled`` per token kept (the accepted proposals
    and the target's own next token), in order. For a hybrid (GDN) model every slice
    names the request's state ``slot``, held from admission to finish or preemption; a slice at
    ``start == 0`` starts from a zero state. Models without GDN layers leave it at -1 (not sent).
    A traced request's prefill chunks carry the parent of the worker's span of their forward pass in ``trace``.
    """

    rid: str
    start: int
    num_tokens: int
    token_ids: list[int] = []
    new_blocks: list[int] = []  # appended to the request's block table before the step
    sample: bool = True
    sampling: SamplingParams | None = None  # sent with the request's first slice only
    # With ``sampling``, for penalised requests only: the prompt's length (later positions are outputs being
    # recomputed after a preemption; 0: all are prompt) and the tokens before ``start`` (a prefix-cache hit).
    prompt_len: int = 0
    prefix_ids: list[int] = []
    slot: int = -1  # GDN state slot, on every slice of a hybrid model's request
    opened: StreamOpen | None = None  # on the first slice of the first admission: the worker forwards it to the text maker
    stop_token_ids: list[int] = []  # with ``sampling``: the tokens that end the request within a run of decode steps (none with ignore_eos)
    trace: str = ""  # a traced request's prefill chunk: the W3C traceparent of the scheduler's span of it (untraced: not sent when last)
    # Hybrid models' prefix cache: the first slice after a hit copies GDN checkpoint ``restore`` into ``slot``; a prefill
    # chunk copies its state at each (position, checkpoint) of ``checkpoints`` (positions in (start, start + num_tokens]).
    restore: int = -1
    checkpoints: list[tuple[int, int]] = []
    draft_blocks: list[int] = []  # --speculative-method draft: appended to the request's draft model block table before the step


class StepPlan(_Frame):
    """One step, or with ``decode_steps > 1`` (plans of decodes alone) a run of steps: the worker runs the plan
    that many times, each step feeding back its samples (a slice computes positions ``start``, ``start + 1``, ...;
    its ``new_blocks`` cover them all), sends each step's tokens to the text maker as it goes, and answers with one
    ``StepResult`` holding every token in order. A request that samples one of its stop tokens leaves the run and
    is skipped by later plans until released (the scheduler runs several steps only where that token ends it).
    """

    step: int
    slices: list[Slice]
    decode_steps: int = 1


class CompileGrammar(_Frame):
    """A queued request's grammar, for the worker to compile off the step's path; it answers ``GrammarCompiled``,
    and the scheduler admits the request only then."""

    rid: str
    grammar: Grammar


class GrammarCompiled(_Frame):
    rid: str
    error: str = ""  # non-empty: the grammar did not compile, and the request fails with it


class Release(_Frame):
    """Worker-side state of these requests (last token, block table, rng) may be dropped."""

    rids: list[str]


class TokenLogprobs(_Part):
    """A sampled token's log-probability and the most likely tokens' (ids and log-probabilities, best first)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Sampled(_Part):
    rid: str
    token_id: int
    logprobs: TokenLogprobs | None = None  # only when the request asked for logprobs


class StepResult(_Frame):
    step: int
    sampled: list[Sampled]
    forward_s: float = 0.0
    error: str = ""  # non-empty: the step failed and none of its slices produced a token
    proposed: dict[str, int] = {}  # each speculative slice's proposed tokens (0: none, it ran as a plain decode)
    no_guess: list[str] = []  # requests sampled here whose proposer has no guess for their next tokens (prompt lookup found no n-gram)


class TokenDelta(_Part):
    rid: str
    token_ids: list[int] = []
    finish: FinishReason | None = None  # from the scheduler, without tokens: the request was aborted or failed
    logprobs: list[TokenLogprobs] = []  # one per token id, when the request asked for logprobs


class TokenBatch(_Frame):
    """To the process that makes the text (the api, or the detokenizer with ``--detokenize-in detokenizer``):
    from the worker after each step, the requests it opened and the tokens it sampled; from the scheduler,
    the requests it ended from outside (aborted or failed; the api knows those itself)."""

    opened: list[StreamOpen] = []
    deltas: list[TokenDelta] = []


class TokenText(_Part):
    """A token as the logprobs of the OpenAI API show it: its text, its exact bytes and its log-probability."""

    token: str
    raw: bytes
    logprob: float


class TextLogprobs(_Part):
    """An output token's logprobs with the token texts resolved: the chosen token, then the most likely ones."""

    chosen: TokenText
    top: list[TokenText] = []


class TextDelta(_Part):
    rid: str
    text: str = ""
    completion_tokens: int = 0  # tokens of output so far, counted up to a matched stop string
    finish: FinishReason | None = None  # on the request's last delta
    prompt_tokens: int = 0
    cached_tokens: int = 0
    matched: str = ""  # the stop string that finished the request, if one did
    logprobs: list[TextLogprobs] = []  # one per output token in this delta, when the request asked for logprobs


class TextBatch(_Frame):
    deltas: list[TextDelta]


class Finish(_Frame):
    """The text maker matched a stop string: the scheduler must finish the request."""

    rid: str
    reason: FinishReason = FinishReason.STOP
    matched: str = ""


class Error(_Frame):
    """A request (``rid``) or, with ``rid == ""``, every in-flight request failed."""

    rid: str
    status: int
    message: str
    type: ErrorType = ErrorType.SERVER


class MemorySplit(_Part):
    """How a worker's memory is split between its KV cache and its expert cache, with what a new split must hold
    to: a KV cache of whole blocks, and an expert cache of at least one layer's top-k slots (none: no expert cache)."""

    kv_blocks: int = 0  # the scheduler's blocks
    kv_block_bytes: int = 0  # one block of every layer
    expert_cache_bytes: int = 0  # the budget asked for (0: no expert cache, every expert resident)
    expert_slots: int = 0
    expert_slot_bytes: int = 0
    expert_top_k: int = 0
    experts: int = 0  # every MoE layer's experts: the most slots a bank holds
    applying: bool = False  # a resize is under way

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes


class ResizeMemory(_Frame):
    """api → scheduler → worker: a new split of the worker's memory (-1 keeps a size). The scheduler preempts every
    running request (recomputed later), releases them on the worker and waits for its ``MemoryResized``."""

    id: str
    kv_cache_bytes: int = -1
    expert_cache_bytes: int = -1
    reply_to: str = ""  # the api replica's inbox that waits for the answer


class MemoryResized(_Frame):
    """worker → scheduler → api: the split once applied, or why not (``status`` as the api answers it)."""

    id: str
    split: MemorySplit | None = None
    status: int = 200
    error: str = ""


class Heartbeat(_Frame):
    """Liveness and load progress of one process, sent to its downstream neighbour."""

    process: Process
    pid: int
    state: ProcessState
    detail: str = ""
    progress: float = 0.0
    kv_blocks: int = 0  # the worker's KV cache blocks (it may size them from device memory); 0: not said
    draft_kv_blocks: int = 0  # the worker's draft model's KV blocks (speculative method draft); 0: none, or not said
    memory: MemorySplit | None = None  # once loaded


class EngineStatus(_Frame):
    """The scheduler's periodic summary for the api: readiness and load.

    ``boot`` identifies the scheduler's incarnation: when it changes, requests the api still
    waits on were lost with the previous one. ``engine`` echoes the name the receiving api
    replica gave this engine in its ``ApiAnnounce`` ("" before it has announced itself).
    """

    state: EngineState
    boot: str = ""
    detail: str = ""
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    engine: str = ""
    memory: MemorySplit | None = None  # the worker's, once heard


class ApiAnnounce(_Frame):
    """An api replica tells a scheduler where it receives and what it calls that engine.

    Sent every heartbeat: the scheduler sends its ``EngineStatus`` to every api replica heard
    from recently, so several api replicas can share one engine.
    """

    replica: str
    address: str
    engine: str


Frame = (
    Submit
    | Abort
    | StepPlan
    | CompileGrammar
    | GrammarCompiled
    | Release
    | StepResult
    | TokenBatch
    | TextBatch
    | Finish
    | Error
    | Heartbeat
    | EngineStatus
    | ApiAnnounce
    | ResizeMemory
    | MemoryResized
)
