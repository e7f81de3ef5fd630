"""Tensor parallelism of the worker: R ranks over torch.distributed (gloo on CPU, NCCL on GPU).

Each rank holds 1/R of every layer: whole attention heads of q/k/v and the KV cache, and 1/R of
the MLP's (and every expert's) intermediate columns of gate/up; o_proj and down are split along
their input, so each rank's output is a partial sum that one ``all_reduce`` completes, the
residual counted once (by rank 0). Embedding, norms, router and lm_head are replicated.

Rank 0, the leader, is the worker the scheduler talks to: it broadcasts every ``StepPlan`` and
``Release`` to the followers as the frame's msgpack bytes (never pickle), samples, and
broadcasts the sampled tokens so every rank feeds the same token to the next decode.

A rank that dies is noticed at once, not at the collective's timeout: each follower holds a TCP
connection to the leader (``RankLiveness``) on which nothing is sent after a handshake, so the
connection turning readable means the peer's process ended.
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from shared.codec import decode, encode
from shared.frames import Frame

SUPPORTED_FAMILIES = ("llama", "qwen3", "qwen3_moe")
_COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def _broadcast_bytes(data: bytes, leader: bool, device: torch.device) -> bytes:
    """The leader's ``data`` on every rank (followers pass b""), as a size then uint8 tensor: never pickle."""
    size = torch.tensor([len(data) if leader else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if leader:  # no .item() here: on a GPU it would wait for the device on every step
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), 0)
        return data
    if not size.item():
        return b""
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, 0)
    return buffer.cpu().numpy().tobytes()


_HELLO = struct.Struct("!ii")  # rank, pid: the one message each side sends on a liveness connection


class RankLiveness:
    """One TCP connection between the leader and each follower, used only to notice a peer's end.

    After the handshake (each side sends its rank and pid) nothing more is sent, so a connection
    that turns readable is one whose peer closed it (its process ended, however it died) or that
    failed (TCP keepalive gives up on a vanished host within seconds). A rank that hangs alive is
    not caught here: the scheduler's stall timeout catches that.
    """

    KEEPALIVE = (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3))

    def __init__(self, peers: dict[int, tuple[socket.socket, int, str]]) -> None:
        self.peers = peers  # rank -> (connection, pid, address)
        self._watching = False
        self._thread: threading.Thread | None = None

    @classmethod
    def leader(cls, host: str, size: int, share: Callable[[bytes], bytes], timeout_s: float) -> RankLiveness:
        """Listens on ``host`` (the rendezvous host, which the followers reach), tells them where, and
        accepts one connection per follower; a connection that does not say hello properly is dropped."""
        listener = socket.create_server((host, 0))
        share(f"{host}:{listener.getsockname()[1]}".encode())
        peers: dict[int, tuple[socket.socket, int, str]] = {}
        deadline = time.monotonic() + timeout_s
        with listener:
            while len(peers) < size - 1:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, address = listener.accept()
                except TimeoutError:
                    raise RuntimeError(f"tensor parallel: only ranks {sorted(peers)} connected their liveness socket within {timeout_s:g}s") from None
                try:
                    conn.settimeout(min(5.0, max(0.01, deadline - time.monotonic())))  # a follower says hello at once
                    rank, pid = _HELLO.unpack(_receive_exactly(conn, _HELLO.size))
                    if not 0 < rank < size or rank in peers:
                        raise ValueError(f"unexpected rank {rank}")
                    conn.sendall(_HELLO.pack(0, os.getpid()))
                except (OSError, ValueError, struct.error):
                    conn.close()
                    continue
                peers[rank] = (_watched(conn), pid, f"{address[0]}:{address[1]}")
        return cls(peers)

    @classmethod
    def follower(cls, rank: int, share: Callable[[bytes], bytes], timeout_s: float) -> RankLiveness:
        host, _, port = share(b"").decode().rpartition(":")
        conn = socket.create_connection((host, int(port)), timeout=timeout_s)
        conn.sendall(_HELLO.pack(rank, os.getpid()))
        _, pid = _HELLO.unpack(_receive_exactly(conn, _HELLO.size))
        return cls({0: (_watched(conn), pid, f"{host}:{port}")})

    def dead_peer(self, timeout_s: float = 0.0) -> str | None:
        """Why a peer is gone, if one is (waiting up to ``timeout_s`` for one to go); None while all live."""
        by_fd = {conn.fileno(): rank for rank, (conn, _, _) in self.peers.items()}
        readable, _, _ = select.select(list(by_fd), [], [], timeout_s)
        for fd in readable:
            rank = by_fd[fd]
            conn, pid, address = self.peers[rank]
            try:
                data = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                why = "it closed its connection (the process ended)" if not data else "it broke the liveness protocol"
            except BlockingIOError:
                continue
            except OSError as exc:
                why = f"its connection failed ({exc.strerror or exc})"
            return f"tensor-parallel rank {rank} (pid {pid} at {address}) is gone: {why}"
        return None

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Calls ``on_lost(why)`` once, from a thread, when a peer is gone (until ``stop``)."""
        self._watching = True

        def run() -> None:
            while self._watching:
                why = self.dead_peer(0.25)
                if why is not None and self._watching:
                    on_lost(why)
                    return

        self._thread = threading.Thread(target=run, name="rank-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Peers leaving from now on are expected (a clean shutdown)."""
        self._watching = False
        if self._thread is not None:
            self._thread.join()

    def close(self, wait_s: float = 0.0) -> None:
        """Closes the connections, after waiting up to ``wait_s`` for the peers to close theirs first
        (the leader waits, so a follower never mistakes a clean stop for the leader's death)."""
        self.stop()
        deadline = time.monotonic() + wait_s
        for conn, _, _ in self.peers.values():
            select.select([conn], [], [], max(0.0, deadline - time.monotonic()))
            conn.close()

    def describe(self) -> list[dict]:
        return [{"rank": rank, "pid": pid, "address": address} for rank, (_, pid, address) in sorted(self.peers.items())]


def _receive_exactly(conn: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = conn.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return data


def _watched(conn: socket.socket) -> socket.socket:
    """Blocking, with TCP keepalive (a peer host that vanishes without closing is noticed in ~5s)."""
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in RankLiveness.KEEPALIVE:
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return conn


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    device: torch.device  # where collectives run: cpu for gloo, the rank's GPU for NCCL
    liveness: RankLiveness | None = None  # the leader's connections to the followers, or a follower's to the leader

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    # Leader -> followers. ----------------------------------------------------------------

    def send_frame(self, frame: Frame | None) -> None:
        """Leader: the next frame every follower runs (None: stop)."""
        _broadcast_bytes(b"" if frame is None else encode(frame), True, self.device)

    def receive_frame(self) -> Frame | None:
        """Follower: the frame the leader sent next (None: stop)."""
        data = _broadcast_bytes(b"", False, self.device)
        return decode(data) if data else None

    def share_tokens(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """The leader's sampled tokens, on every rank (followers pass None)."""
        buffer = tokens.to(self.device, torch.int64) if self.leader else torch.empty(count, dtype=torch.int64, device=self.device)
        dist.broadcast(buffer, 0)
        return buffer.cpu()


def init_group(rank: int, size: int, init_method: str, timeout_s: float = 600.0) -> TensorParallelGroup:
    """Joins the ranks' process group (blocks until all ``size`` ranks have joined) and connects the
    ranks' liveness sockets (the leader listens on the rendezvous host)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def share(data: bytes) -> bytes:
        return _broadcast_bytes(data, rank == 0, device)

    if rank == 0:
        liveness = RankLiveness.leader(rendezvous_host(init_method), size, share, timeout_s)
    else:
        liveness = RankLiveness.follower(rank, share, timeout_s)
    return TensorParallelGroup(rank, size, device, liveness)


def rendezvous_host(init_method: str) -> str:
    """The leader's host as the followers reach it: that of a tcp:// init method, else MASTER_ADDR."""
    url = urlparse(init_method)
    return (url.hostname if url.scheme == "tcp" else None) or os.environ.get("MASTER_ADDR", "127.0.0.1")


# Sharding. ---------------------------------------------------------------------------------


def shard_config(config: dict, size: int) -> dict:
    """config.json as one rank sees its shard: 1/size of the heads and intermediate columns."""
    family = config.get("model_type", "llama")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"--tensor-parallel-size {size}: model_type {family!r} is not supported with tensor parallelism (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": config["intermediate_size"]}
    if family == "qwen3_moe":
        sizes["moe_intermediate_size"] = config["moe_intermediate_size"]
    uneven = [f"{name}={value}" for name, value in sizes.items() if value % size]
    if uneven:
        raise ValueError(f"--tensor-parallel-size {size} must divide {', '.join(uneven)}")
    return {
        **config,
        **{name: value // size for name, value in sizes.items()},
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,  # not hidden / the rank's heads
    }


def shard_weights(weights: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's tensors (owned copies): column-parallel ones split by output rows, row-parallel
    ones by input columns, o_proj's bias kept by rank 0 only (it is added once); the rest as is."""
    shard: dict[str, torch.Tensor] = {}
    for name in list(weights):
        tensor = weights.pop(name)
        if name.endswith(_COLUMN_PARALLEL):
            tensor = tensor.chunk(size, 0)[rank]
        elif name.endswith(_ROW_PARALLEL):
            tensor = tensor.chunk(size, 1)[rank]
        elif name.endswith("o_proj.bias"):
            tensor = tensor if rank == 0 else torch.zeros_like(tensor)
        elif name.endswith("experts.gate_up_proj"):  # fused [E, 2I, H]: gate rows, then up rows
            gate, up = tensor.chunk(2, 1)
            tensor = torch.cat([gate.chunk(size, 1)[rank], up.chunk(size, 1)[rank]], 1)
        elif name.endswith("experts.down_proj"):  # fused [E, H, I]
            tensor = tensor.chunk(size, 2)[rank]
        shard[name] = tensor.clone(memory_format=torch.contiguous_format)
    return shard


class _ReducedBlock:
    """A row-parallel block ``residual + f(x)``: rank 0 adds the residual, the other ranks zero,
    and the partial sums are all_reduced, so every rank holds the full result."""

    def __init__(self, block, group: TensorParallelGroup) -> None:
        self.block, self.group = block, group

    def tensors(self) -> list[torch.Tensor]:
        return self.block.tensors()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, *rest) -> torch.Tensor:
        out = self.block(x, residual if self.group.leader or residual is None else torch.zeros_like(residual), *rest)
        return self.group.all_reduce(out)


def parallelize(model, group: TensorParallelGroup) -> None:
    """Wraps each layer's attention and MLP of a model built from a shard in their all_reduce."""
    model.layers = [layer._replace(attn=_ReducedBlock(layer.attn, group), mlp=_ReducedBlock(layer.mlp, group)) for layer in model.layers]
