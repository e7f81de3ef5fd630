"""Engine replicas found in DNS: each address of a headless Service is one engine replica's scheduler.

``--engines-from-dns HOST:PORT`` names the Service (Kubernetes gives a StatefulSet's headless Service
one A record per pod); the api resolves it every ``--engines-dns-interval-s`` and adds the schedulers
that appear and retires those that went. A replica is named by its pod (the first label of its
address's reverse record, ``<pod>.<service>.<namespace>...``), or by its address where there is none.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import structlog

log = structlog.get_logger()

Resolve = Callable[[str, int], list[str]]
"""(host, port) -> the IP addresses the host resolves to; raises OSError when it does not."""
NameOf = Callable[[str], str]
"""An IP address -> the replica name it goes by."""


def resolve_addresses(host: str, port: int) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


def pod_name(ip: str) -> str:
    try:
        return socket.gethostbyaddr(ip)[0].split(".")[0]
    except OSError:
        return ip


class DnsEngines:
    """The scheduler addresses a headless Service resolves to, each under a name that stays while its address does."""

    def __init__(self, host: str, port: int, resolve: Resolve = resolve_addresses, name_of: NameOf = pod_name) -> None:
        self.host, self.port = host, port
        self.resolve, self.name_of = resolve, name_of
        self._names: dict[str, str] = {}  # address -> its name, fixed at first sight

    def lookup(self) -> dict[str, str] | None:
        """Replica name -> scheduler address of every engine the Service resolves to now; None when it does not
        resolve (DNS down, or no pod published yet): then the api keeps the replicas it knows, whose silence it notices."""
        try:
            ips = self.resolve(self.host, self.port)
        except OSError as exc:
            log.warning("engines_dns_failed", host=self.host, error=str(exc))
            return None
        addresses = {f"tcp://[{ip}]:{self.port}" if ":" in ip else f"tcp://{ip}:{self.port}": ip for ip in ips}
        self._names = {address: self._names.get(address) or self.name_of(ip) for address, ip in addresses.items()}
        return {name: address for address, name in self._names.items()}
