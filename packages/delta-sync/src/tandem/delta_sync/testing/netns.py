"""Network namespaces joined by veth pairs with token-bucket rate limits (`ip`, `tc tbf`).

A test/benchmark helper: needs root (CAP_NET_ADMIN) and iproute2. Every namespace and
link it makes carries a per-instance prefix, and `close` deletes them all (deleting a
namespace deletes its ends of the veth pairs), so a failed test leaves nothing behind.
No namespace is given a route to the host's network: traffic stays between the
namespaces made here.

Every namespace uses Reno congestion control, whatever the host's default. The round trips
are added above TCP (by `proxy.Proxy`), so TCP itself sees links of well under a
millisecond. A loss-based algorithm reacts to what the emulation does make real, the
bottleneck's queue and its drops, and Cubic behaves like Reno at these round trips. A
model-based one (BBR, the default on some hosts) sizes its window from a round trip the
emulation hides. Sixteen BBR transfers sharing a 40 Mbit/s uplink overran its queue:
thousands of retransmitted segments and several timeouts per step, and equal shards
finished anywhere from 2 s to 8.5 s. With Reno there were no timeouts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid

from tandem.delta_sync.errors import DeltaSyncError

_TIMEOUT = 10.0  # seconds for any one `ip`, `tc` or `sysctl` command
CC = "reno"  # in every namespace: built into every kernel and allowed in any namespace


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root to emulate a WAN"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("sysctl", "procps")):
        if shutil.which(tool) is None:
            return f"`{tool}` ({package}) is not installed"
    return None


def sh(*args: str) -> str:
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise DeltaSyncError(f"`{' '.join(args)}` did not finish in {_TIMEOUT:g} s") from None
    if res.returncode != 0:
        raise DeltaSyncError(f"`{' '.join(args)}` failed: {res.stderr.strip()}")
    return res.stdout


class Namespaces:
    """Namespaces and links made for one emulation; `close` removes them."""

    def __init__(self) -> None:
        why = unavailable()
        if why is not None:
            raise DeltaSyncError(why)
        self.tag = f"tds{uuid.uuid4().hex[:6]}"
        self.names: list[str] = []
        self._links = 0

    def add(self, role: str) -> str:
        name = f"{self.tag}-{role}"
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", name, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={CC}")
        return name

    def link(
        self, a: str, a_addr: str, b: str, b_addr: str, rate_ab: float | None, rate_ba: float | None
    ) -> tuple[str, str]:
        """A veth pair a <-> b with /30 addresses; rates in bit/s per direction (None: no
        limit), as a `tbf` qdisc on the sending end."""
        self._links += 1
        dev_a, dev_b = f"{self.tag}{self._links}a", f"{self.tag}{self._links}b"
        sh(
            "ip",
            "link",
            "add",
            dev_a,
            "netns",
            a,
            "type",
            "veth",
            "peer",
            "name",
            dev_b,
            "netns",
            b,
        )
        for ns, dev, addr, rate in ((a, dev_a, a_addr, rate_ab), (b, dev_b, b_addr, rate_ba)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            if rate is not None:
                self.limit(ns, dev, rate)
        return dev_a, dev_b

    @staticmethod
    def limit(ns: str, dev: str, rate: float) -> None:
        # burst: ~4 ms of the rate, at least 64 KiB (a GSO segment must fit in the bucket)
        burst = max(64 << 10, int(rate / 8 * 0.004))
        sh(
            "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "100ms",
        )  # fmt: skip

    def route(self, ns: str, via: str, forward: bool = False) -> None:
        sh("ip", "-n", ns, "route", "add", "default", "via", via)
        if forward:
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")

    def fail_fast(self, ns: str) -> None:
        """Routes over a link whose other end is down are not used: a connection over a cut
        link fails at once (as a router's 'unreachable' makes it) instead of timing out."""
        for conf in ("all", "default"):
            key = f"net.ipv4.conf.{conf}.ignore_routes_with_linkdown=1"
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", key)

    def route_to(self, ns: str, subnet: str, via: str) -> None:
        sh("ip", "-n", ns, "route", "add", subnet, "via", via)

    def set_link(self, ns: str, dev: str, up: bool) -> None:
        sh("ip", "-n", ns, "link", "set", dev, "up" if up else "down")

    def close(self) -> None:
        """Stop whatever still runs in these namespaces, then delete them (and their links)."""
        for name in reversed(self.names):
            try:
                pids = sh("ip", "netns", "pids", name).split()
            except DeltaSyncError:
                pids = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(DeltaSyncError):
                sh("ip", "netns", "del", name)
        self.names.clear()
