"""An emulated cluster link for multi-rank benchmarks, calibration and tests on one machine.

Over loopback, communication between ranks costs CPU time and is never bandwidth-bound, so
overlapping it with computation gains nothing. :class:`EmulatedNetwork` gives each rank
its own Linux network namespace, joined by a veth pair (two ranks) or through a bridge
living in a namespace of its own (more ranks), with every rank's link rate-limited by a
``tc`` token-bucket filter (optionally delayed by ``netem``)::

    with EmulatedNetwork(nranks=2, rate="2gbit") as net:
        if not net.available:
            print("loopback:", net.reason)
        results = run_distributed(fn, 2, setup=net.setup, env=net.env)

``net.setup(rank, world)`` moves the calling rank process into its namespace (before
``torch.distributed`` starts, so that gloo's sockets live there); ``net.env`` names the
interface gloo must bind to. Addresses are in 10.213.0.0/24 and exist only inside the
namespaces this object created; everything is removed on exit, on exceptions, on SIGTERM
and at interpreter exit. Needs Linux, root and iproute2; elsewhere ``available`` is False,
``reason`` says why, ``setup`` is None and ``env`` is empty (the caller runs on loopback).

:func:`open_network` wraps that for a run: a :class:`Network` with the label its rows
carry (the rate, or ``loopback`` with the reason of the fallback). :func:`measure_allreduce`
checks a link: the sum of an all-reduce, its time and the interface gloo bound to.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["EmulatedNetwork", "Network", "open_network", "measure_allreduce", "parse_rate",
           "cleanup_stale", "IFNAME", "PREFIX"]

PREFIX = "dlnet"  # namespace names: dlnet-<pid>-<random>-<rank> and dlnet-<pid>-<random>-br
IFNAME = "dl0"  # the rank's interface, same name in every namespace
SUBNET = "10.213.0"  # /24, private to the namespaces of one run
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000

_UNITS = {  # as in tc(8): "bit" is bits per second, "bps" is BYTES per second
    "": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")
_STALE_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(?:\d+|br)$")


def parse_rate(rate: str | int | float) -> int:
    """``"2gbit"``, ``"500mbit"``, ``"1gbps"`` (= 8 Gbit/s, tc's bytes unit) -> bits/s."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        m = _RATE_RE.match(str(rate).lower()) if isinstance(rate, str) else None
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(
                f"--net {rate!r}: not a link rate; give a number with a tc unit, e.g. "
                "'2gbit', '10gbit', '500mbit' (bits/s) or '1gbps' (bytes/s, = 8gbit)"
            )
        bits = float(m.group(1)) * _UNITS[m.group(2)]
    if not bits >= 1000:
        raise ValueError(f"--net {rate!r}: the rate must be at least 1kbit, e.g. '2gbit'")
    return int(bits)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed: {p.stderr.strip() or p.returncode}")
    return p


def _tc(ns: str, *args: str) -> None:
    cmd = ["tc", "-n", ns, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed: {p.stderr.strip() or p.returncode}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def cleanup_stale() -> list[str]:
    """Remove namespaces left by runs of this module whose process is gone; return them.

    Only names of the form ``dlnet-<pid>-<hex>-<rank|br>`` with a dead ``pid`` are touched.
    """
    removed = []
    for name in _list_netns():
        m = _STALE_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


def _unavailable_reason(nranks: int, delay_ms: float | None) -> str:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, or omit --net)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if nranks > 254:
        return f"nranks={nranks}: at most 254 ranks fit the emulated /24 subnet"
    return ""


@dataclass(frozen=True)
class _EnterNetns:
    """Picklable ``setup(rank, world)``: move the calling process into its rank's namespace.

    Only the calling thread changes namespace; threads (and sockets) it creates afterwards
    live there, which is why this must run before ``torch.distributed`` starts.
    """

    names: tuple[str, ...]

    def __call__(self, rank: int, world: int) -> None:
        if world != len(self.names):
            raise ValueError(
                f"the emulated network has {len(self.names)} ranks but the run has {world}: "
                "create EmulatedNetwork(nranks=...) with the run's world size"
            )
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(os.path.join(NETNS_DIR, self.names[rank]), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {self.names[rank]}: {os.strerror(err)}")
        finally:
            os.close(fd)


class EmulatedNetwork:
    """Rate-limited links between ``nranks`` rank processes, for the life of a ``with``.

    Args:
        nranks: number of ranks (>= 1); 2 get a veth pair, more a bridge (1: a lone veth).
        rate: link rate per direction, e.g. ``"2gbit"`` (see :func:`parse_rate`);
            None leaves the links unshaped.
        delay_ms: one-way delay added with ``netem`` on each rank's egress (None: none).
    """

    def __init__(self, nranks: int = 2, rate: str | int | None = "2gbit",
                 delay_ms: float | None = None) -> None:
        if nranks < 1:
            raise ValueError(f"nranks={nranks}: the emulated network needs at least 1 rank")
        if delay_ms is not None and not delay_ms >= 0:
            raise ValueError(f"delay_ms={delay_ms}: give a delay >= 0 in ms, or None")
        self.nranks = nranks
        self.rate_bits = None if rate is None else parse_rate(rate)
        self.delay_ms = delay_ms
        self.available = False
        self.reason = "not started (use EmulatedNetwork as a context manager)"
        self.setup: Callable[[int, int], None] | None = None
        self.env: dict[str, str] = {}
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.namespaces: list[str] = []  # every namespace created, in creation order
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a forked child must not tear the network down
        self._old_sigterm = None
        self._our_sigterm = None

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        reason = _unavailable_reason(self.nranks, self.delay_ms)
        if reason:
            self.reason = reason
            return self
        atexit.register(self.close)
        self._install_sigterm()
        try:
            cleanup_stale()
            self._build()
        except OSError as e:
            self.close()
            self.reason = f"could not build the emulated network: {e}"
            return self
        except BaseException:
            self.close()
            raise
        rank_ns = tuple(f"{self.tag}-{r}" for r in range(self.nranks))
        self.available, self.reason = True, ""
        self.setup = _EnterNetns(rank_ns)
        self.env = {"GLOO_SOCKET_IFNAME": IFNAME}
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace (and with them the links) this object created."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            # each name forgotten only once deleted: a signal that ends this loop leaves
            # the rest recorded for the exit handler's close
            while self.namespaces:
                _ip("netns", "del", self.namespaces[-1], check=False)
                self.namespaces.pop()
            self.available, self.setup, self.env = False, None, {}
            if self.reason == "":
                self.reason = "closed"
        atexit.unregister(self.close)
        self._restore_sigterm()

    def _install_sigterm(self) -> None:
        """Turn SIGTERM into SystemExit while open, so that ``with`` cleans up."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program handles SIGTERM itself; atexit still covers a clean exit

        def _on_term(signum, frame):  # noqa: ARG001
            raise SystemExit(128 + signum)

        self._old_sigterm = signal.signal(signal.SIGTERM, _on_term)
        self._our_sigterm = _on_term

    def _restore_sigterm(self) -> None:
        if self._our_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is self._our_sigterm:  # not replaced since
            signal.signal(signal.SIGTERM, self._old_sigterm)
        self._old_sigterm = self._our_sigterm = None

    # ---- building --------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        self.namespaces.append(name)  # first: a signal during the add still has it deleted
        _ip("netns", "add", name)
        _ip("link", "set", "lo", "up", ns=name)

    def _build(self) -> None:
        ranks = [f"{self.tag}-{r}" for r in range(self.nranks)]
        for ns in ranks:
            self._add_ns(ns)
        if self.nranks == 2:
            _ip("link", "add", IFNAME, "type", "veth", "peer", "name", IFNAME, "netns",
                ranks[1], ns=ranks[0])
        elif self.nranks > 2:
            br = f"{self.tag}-br"
            self._add_ns(br)
            _ip("link", "add", "br0", "type", "bridge", ns=br)
            for r, ns in enumerate(ranks):
                _ip("link", "add", IFNAME, "type", "veth", "peer", "name", f"p{r}", "netns",
                    br, ns=ns)
                _ip("link", "set", f"p{r}", "master", "br0", "up", ns=br)
                # the switch port towards rank r: its ingress, at the link rate (the delay
                # is the sender's egress alone: a message crosses one egress and one port)
                self._shape(br, f"p{r}", delay=False)
            _ip("link", "set", "br0", "up", ns=br)
        elif self.nranks == 1:  # a veth with its peer beside it: the interface gloo expects
            _ip("link", "add", IFNAME, "type", "veth", "peer", "name", "dl0p", ns=ranks[0])
            _ip("link", "set", "dl0p", "up", ns=ranks[0])
        for r, ns in enumerate(ranks):
            # IPv4 only on the link, so that gloo cannot pick an IPv6 link-local address
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                            f"net.ipv6.conf.{IFNAME}.disable_ipv6=1"], capture_output=True)
            _ip("addr", "add", f"{SUBNET}.{r + 1}/24", "dev", IFNAME, ns=ns)
            _ip("link", "set", IFNAME, "up", ns=ns)
            self._shape(ns, IFNAME)  # the rank's egress

    def _shape(self, ns: str, dev: str, delay: bool = True) -> None:
        """tbf at the link rate (burst: 1 ms of traffic, at least two 64 KiB GSO packets),
        then netem for the delay, if asked (and ``delay``)."""
        parent = ["root"]
        if self.rate_bits is not None:
            burst = max(2 * 65536, self.rate_bits // 8 // 1000)
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                "rate", f"{self.rate_bits}bit", "burst", str(burst), "latency", "20ms")
            parent = ["parent", "1:1"]
        if self.delay_ms and delay:
            try:
                _tc(ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem",
                    "delay", f"{self.delay_ms}ms", "limit", "100000")
            except OSError as e:
                raise OSError(f"{e} (the kernel lacks sch_netem? drop delay_ms)") from None

    def __repr__(self) -> str:
        rate = "unshaped" if self.rate_bits is None else f"{self.rate_bits / 1e9:g} Gbit/s"
        state = "available" if self.available else f"unavailable: {self.reason}"
        return f"EmulatedNetwork(nranks={self.nranks}, {rate}, {state})"


# ---- where a run's ranks talk, and a check of the link ---------------------------------------
@dataclass
class Network:
    """Where a run's ranks talk: ``label`` for its rows ("2gbit", or "loopback"), ``reason``
    why an asked-for emulated link fell back to loopback ("" otherwise), and the
    ``setup``/``env`` to pass to ``run_distributed``."""

    label: str
    reason: str
    setup: Callable[[int, int], None] | None
    env: dict[str, str] | None


@contextlib.contextmanager
def open_network(rate: str | None, nranks: int = 2) -> Iterator[Network]:
    """An emulated link of ``rate`` for ``nranks`` ranks (``None``: loopback), as a
    :class:`Network`; where the emulated network cannot be made it is loopback with the
    reason."""
    if not rate:
        yield Network("loopback", "", None, None)
        return
    with EmulatedNetwork(nranks, rate) as net:
        if net.available:
            yield Network(str(rate), "", net.setup, net.env)
        else:
            yield Network("loopback", f"{rate} unavailable: {net.reason}", None, None)


def _allreduce_rank(nbytes: int, reps: int) -> dict:
    """One all-reduce of ``nbytes`` of float32 checked for its sum (and warming the link
    up), then ``reps`` timed ones; the interface gloo's TCP connections use (from this
    namespace's /proc/net/tcp)."""
    import torch
    import torch.distributed as dist

    from distllm.comm.collectives import all_reduce
    from distllm.diagnostics.timing import time_collective

    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((nbytes // 4,), float(rank + 1))
    all_reduce(x)  # the one timed below
    correct = bool((x == world * (world + 1) / 2).all())
    times_ms = time_collective("all_reduce", nbytes // 4, reps=reps, warmup=0)
    addrs = _tcp_local_addrs()
    # no rank ends (closing its connections) before every rank has read its own: a loaded
    # machine's slower rank had found its side already closing, no longer ESTABLISHED
    dist.barrier()
    return {"times_ms": times_ms, "local_addrs": addrs, "correct": correct}


def _tcp_local_addrs() -> list[str]:
    """Local IPv4 addresses of established TCP connections in the caller's namespace."""
    addrs = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, _, state = line.split()[1:4]
            if state == "01":  # ESTABLISHED
                ip_hex = local.split(":")[0]
                addrs.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return sorted(addrs)


def measure_allreduce(net: EmulatedNetwork | None, nranks: int = 2, nbytes: int = 8 << 20,
                      reps: int = 5) -> dict:
    """Median all-reduce time (each repetition the slowest rank's) and algorithm bandwidth
    (``nbytes`` / time) over ``net`` (None or unavailable: loopback)."""
    import statistics

    from distllm.testing.distributed import run_distributed

    use = net is not None and net.available
    res = run_distributed(_allreduce_rank, nranks, nbytes, reps, timeout=120,
                          setup=net.setup if use else None, env=net.env if use else None)
    med_ms = statistics.median(res[0]["times_ms"])
    return {"median_ms": med_ms, "algbw_gbit": nbytes * 8 / (med_ms * 1e-3) / 1e9,
            "local_addrs": [r["local_addrs"] for r in res],
            "correct": all(r["correct"] for r in res)}
