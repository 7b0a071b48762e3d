"""Discovery by DNS: the A and AAAA records of a headless Service, looked up on an interval."""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from prefix_gateway.backends.membership import Membership, ServiceSpec, address_url
from prefix_gateway.config import ConfigError

log = logging.getLogger("prefix_gateway.backends.discovery")


def build_resolver(nameserver: str) -> dns.asyncresolver.Resolver:
    """The system's resolver (with its search domains), or one DNS server given as HOST:PORT."""
    if not nameserver:
        return dns.asyncresolver.Resolver()
    host, port = nameserver, "53"
    if nameserver.startswith("["):
        host, _, port = nameserver[1:].partition("]")
        port = port.lstrip(":") or "53"
    elif nameserver.count(":") == 1:
        host, port = nameserver.split(":")
    if not port.isdigit():
        raise ConfigError(f"dns_nameserver {nameserver!r} is not HOST[:PORT]")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(host, int(port))]
    return resolver


class DnsSource:
    """A headless Service's A/AAAA records, looked up on an interval."""

    def __init__(
        self,
        target: ServiceSpec,
        membership: Membership,
        resolver: dns.asyncresolver.Resolver,
        interval: float,
    ) -> None:
        self.target = target
        self.membership = membership
        self._resolver = resolver
        self._interval = interval

    async def sync(self) -> None:
        addresses: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(
                    self.target.host, rdtype, search=True, lifetime=self._interval
                )
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            addresses.update(str(record.address) for record in answer)
        self.membership.update(address_url(address, self.target.port) for address in addresses)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.sync()
            except dns.exception.DNSException as exc:
                log.warning("cannot resolve %s: %s", self.target.host, exc)

    async def close(self) -> None:
        await self.membership.close()
