"""--engines-from-dns: the api finds its engine replicas in a headless Service's addresses, and follows them."""

from __future__ import annotations

import asyncio

import pytest

from services.api.engine_client import EngineClient
from services.api.engine_discovery import DnsEngines
from services.api.errors import ApiError
from shared.config import StackConfig
from shared.frames import EngineStatus, Submit, TextDelta


class FakeDns:
    """A Service's A records and their reverse names, changed by the test; None: the lookup fails."""

    def __init__(self) -> None:
        self.records: dict[str, str] | None = {}  # ip -> pod name
        self.asked: list[tuple[str, int]] = []

    def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.records is None:
            raise OSError(-2, "Name or service not known")
        return sorted(self.records)

    def name_of(self, ip: str) -> str:
        return self.records[ip]


async def _collect(client: EngineClient, submit: Submit) -> list[TextDelta]:
    return [d async for d in client.generate(submit)]


def test_the_target_is_host_and_port_and_excludes_a_static_list() -> None:
    assert StackConfig(engines_from_dns="tokenyard-engine.default.svc:5551").engines_dns_target == ("tokenyard-engine.default.svc", 5551)
    assert StackConfig(engines_from_dns="tokenyard-engine:5551").engine_addresses == {}
    with pytest.raises(ValueError, match="--engines-from-dns: expected host:port"):
        _ = StackConfig(engines_from_dns="tokenyard-engine").engines_dns_target
    with pytest.raises(ValueError, match="exclude each other"):
        _ = StackConfig(engines_from_dns="e:1", engines="e0=tcp://a:1").engine_addresses


def test_lookup_names_each_address_by_its_pod_and_keeps_the_name_while_the_address_stays() -> None:
    dns = FakeDns()
    engines = DnsEngines("tokenyard-engine", 5551, dns.resolve, dns.name_of)
    dns.records = {"10.0.0.7": "tokenyard-engine-0", "fd00::8": "tokenyard-engine-1"}
    assert engines.lookup() == {"tokenyard-engine-0": "tcp://10.0.0.7:5551", "tokenyard-engine-1": "tcp://[fd00::8]:5551"}
    dns.records = {"10.0.0.7": "renamed", "10.0.0.9": "tokenyard-engine-1"}  # a reverse record that changes does not rename
    assert engines.lookup() == {"tokenyard-engine-0": "tcp://10.0.0.7:5551", "tokenyard-engine-1": "tcp://10.0.0.9:5551"}
    dns.records = None
    assert engines.lookup() is None  # DNS down: the caller keeps what it knows
    assert dns.asked == [("tokenyard-engine", 5551)] * 3


def test_the_api_adds_replicas_that_appear_and_retires_gone_ones_once_their_requests_end(tmp_path) -> None:
    async def scenario() -> None:
        dns = FakeDns()
        config = StackConfig(run_dir=str(tmp_path), engines_from_dns="tokenyard-engine:5551", heartbeat_s=0.02, engines_dns_interval_s=0.1)
        client = EngineClient(config)
        client.discovery = DnsEngines(*config.engines_dns_target, dns.resolve, dns.name_of)
        try:
            assert client.describe_state() == ("loading", "no engine replica at tokenyard-engine:5551 yet")
            client._on_status(EngineStatus(state="ready", boot="b1"))  # engine "": no replica is known by that
            with pytest.raises(ApiError, match="not ready"):
                await anext(client.generate(Submit(rid="r0", prompt_ids=[1], max_tokens=1)))

            dns.records = {"127.0.0.1": "engine-0", "127.0.0.2": "engine-1"}
            client.start()
            await asyncio.sleep(0.05)
            assert {r.name: r.address for r in client.replicas.values()} == {"engine-0": "tcp://127.0.0.1:5551", "engine-1": "tcp://127.0.0.2:5551"}
            for name in ("engine-0", "engine-1"):
                client._on_status(EngineStatus(state="ready", boot="b1", engine=name))
            assert client.ready

            task = asyncio.create_task(_collect(client, Submit(rid="r1", prompt_ids=[1], max_tokens=1)))
            await asyncio.sleep(0.01)
            owner = client.owner["r1"].name
            other = "engine-1" if owner == "engine-0" else "engine-0"
            dns.records = {ip: name for ip, name in dns.records.items() if name == other}
            await asyncio.sleep(0.15)
            leaving = client.replicas[owner]  # gone from DNS: out of rotation, kept while its request runs
            assert leaving.retiring and not leaving.ready and client.owner["r1"] is leaving
            for rid in ("r2", "r3"):
                new = asyncio.create_task(_collect(client, Submit(rid=rid, prompt_ids=[1], max_tokens=1)))
                await asyncio.sleep(0.01)
                assert client.owner[rid].name == other
                client.streams[rid].put_nowait(TextDelta(rid=rid, finish="stop"))
                await new
            client.streams["r1"].put_nowait(TextDelta(rid="r1", text="done", finish="stop"))
            assert [d.text for d in await task] == ["done"]
            await asyncio.sleep(0.05)
            assert list(client.replicas) == [other]  # its last request ended: it goes

            dns.records = None  # DNS fails: the replicas stay
            await asyncio.sleep(0.15)
            assert list(client.replicas) == [other]
            dns.records = {"127.0.0.3": other}  # its pod was replaced: a new address under the same name
            await asyncio.sleep(0.15)
            assert client.replicas[other].address == "tcp://127.0.0.3:5551" and not client.ready  # until it reports ready
        finally:
            await client.close()

    asyncio.run(scenario())
