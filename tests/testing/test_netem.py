"""The emulated cluster link: rate parsing, rate-limited gloo all-reduce in namespaces
(2 ranks on a veth pair, 4 through a bridge), and removal of everything it creates."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from distllm.testing.netem import (
    IFNAME,
    SUBNET,
    EmulatedNetwork,
    _EnterNetns,
    _list_netns,
    cleanup_stale,
    measure_allreduce,
    parse_rate,
)

NBYTES = 8 << 20  # 8 MiB of float32


def _need_root() -> None:
    """Network namespaces need root: elsewhere the emulated link is legitimately absent (CI
    runs as root, so these tests run there)."""
    if os.geteuid() != 0:
        pytest.skip("not root, so no network namespaces: UNTESTED here are the rate-limited "
                    "link (its bandwidth, gloo binding to it) and the removal of its "
                    "namespaces on exit, exceptions and signals; run as root to test them")


def _open(nranks: int, rate: str | None) -> EmulatedNetwork:
    _need_root()
    net = EmulatedNetwork(nranks=nranks, rate=rate).__enter__()
    assert net.available, f"running as root, yet the emulated network failed: {net.reason}"
    assert net.env == {"GLOO_SOCKET_IFNAME": IFNAME} and net.setup is not None
    return net


def test_parse_rate():
    assert parse_rate("2gbit") == 2 * 10**9
    assert parse_rate("10gbit") == 10**10
    assert parse_rate("500mbit") == 5 * 10**8
    assert parse_rate("1gbps") == 8 * 10**9  # tc's convention: bps is bytes per second
    assert parse_rate(" 2.5GBit ") == 2_500_000_000
    assert parse_rate("64kbit") == 64_000
    assert parse_rate(10**9) == 10**9
    for bad in ["", "fast", "2 gigabit", "-1gbit", "1e9", "0gbit", "gbit", None, True]:
        with pytest.raises(ValueError, match=r"--net .*e\.g\. '2gbit'"):
            parse_rate(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nranks"):
        EmulatedNetwork(nranks=0)
    with pytest.raises(ValueError, match="delay_ms"):
        EmulatedNetwork(nranks=2, delay_ms=-1.0)
    with pytest.raises(ValueError, match="--net"):
        EmulatedNetwork(nranks=2, rate="2gbitz")
    with pytest.raises(ValueError, match=r"EmulatedNetwork\(nranks=\.\.\.\)"):
        _EnterNetns(("a", "b"))(0, 4)
    net = EmulatedNetwork(nranks=2)  # not entered: nothing created, nothing usable
    assert not net.available and net.setup is None and net.env == {} and net.reason


def _tbf_rates(net: EmulatedNetwork) -> list[int]:
    """The rate (bits/s) of every tbf qdisc in the network's namespaces, as tc reads it
    back: the shaping as configured, whatever the load does to a timing."""
    rates = []
    for ns in net.namespaces:
        shown = subprocess.run(["tc", "-n", ns, "qdisc", "show"], capture_output=True,
                               text=True, check=True).stdout
        rates += [parse_rate(r) for r in re.findall(r"qdisc tbf .*? rate (\S+)", shown.lower())]
    return rates


# The time of an all-reduce over the link: no faster than the rate allows (the shaping
# works), and not slower than a tenth of it. The ranks' copies and TCP run on the CPU, so
# a loaded machine slows them (4 ranks through the bridge read 0.26 of the rate beside CI's
# other test processes); the configured rate itself is read back from tc (_tbf_rates).
SLOWEST = 0.1


def test_two_ranks_rate_limited_and_removed():
    """8 MiB all-reduce over a 1 Gbit/s veth pair: gloo binds to the namespace interface and
    the time is bandwidth-bound (each rank sends ~8 MiB): no faster than the rate allows (an
    unlimited veth or loopback moves it several times faster on an idle machine). Loopback
    is run too, for the sum; its time is not compared (on a loaded machine, CI's second
    torch version building beside the tests, it took 68 ms against the link's 75)."""
    rate = 10**9
    lo = measure_allreduce(None, 2, NBYTES, reps=3)
    net = _open(2, "1gbit")
    names = list(net.namespaces)
    try:
        assert len(names) == 2 and all(n in _list_netns() for n in names)
        assert _tbf_rates(net) == [rate, rate]  # each rank's egress
        link = measure_allreduce(net, 2, NBYTES, reps=3)
    finally:
        net.__exit__(None, None, None)
    assert not any(n in _list_netns() for n in names), "namespaces left behind"
    assert not net.available and net.setup is None and net.env == {}
    assert link["correct"] and lo["correct"], "the all-reduce summed wrong over the link"
    assert link["local_addrs"] == [[f"{SUBNET}.1"], [f"{SUBNET}.2"]], link  # gloo bound to it
    ideal_ms = NBYTES * 8 / rate * 1e3  # ring all-reduce of 2 ranks: N bytes out per rank
    ratio = ideal_ms / link["median_ms"]  # achieved fraction of the link rate
    assert SLOWEST <= ratio <= 1.2, f"{link['median_ms']:.1f} ms vs ideal {ideal_ms:.1f} ms"


def test_one_rank():
    net = _open(1, "1gbit")
    try:
        one = measure_allreduce(net, 1, 1 << 16, reps=1)
    finally:
        net.__exit__(None, None, None)
    assert one["correct"], "a 1-rank all-reduce over the lone veth is wrong"
    assert not net.namespaces, f"left behind: {net.namespaces}"


def test_four_ranks_through_a_bridge():
    net = _open(4, "2gbit")
    names = list(net.namespaces)
    try:
        assert len(names) == 5, names  # four ranks and the bridge's
        assert _tbf_rates(net) == [2 * 10**9] * 8  # each rank's egress, each switch port
        link = measure_allreduce(net, 4, NBYTES, reps=2)
    finally:
        net.__exit__(None, None, None)
    assert not any(n in _list_netns() for n in names), "namespaces left behind"
    assert link["correct"], "the 4-rank all-reduce through the bridge summed wrong"
    assert link["local_addrs"] == [[f"{SUBNET}.{r + 1}"] for r in range(4)], link
    ideal_ms = 2 * 3 / 4 * NBYTES * 8 / 2e9 * 1e3  # ring: 2 (n-1)/n N bytes out per rank
    assert SLOWEST <= ideal_ms / link["median_ms"] <= 1.2, (link["median_ms"], ideal_ms)


def test_removed_after_exception_and_stale_cleanup():
    _need_root()
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedNetwork(nranks=3, rate="1gbit") as net:
            assert net.available, net.reason
            names = list(net.namespaces)
            pid = os.fork()
            if pid == 0:  # a forked child's exit must not remove the parent's network
                net.close()
                os._exit(0)
            os.waitpid(pid, 0)
            assert all(n in _list_netns() for n in names), "a forked child removed them"
            raise RuntimeError("boom")
    assert names and not any(n in _list_netns() for n in names)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"dlnet-{dead.pid}-abc123-0", f"dlnet-{os.getpid()}-abc123-br"
    for n in (stale, live):
        subprocess.run(["ip", "netns", "add", n], check=True)
    try:
        removed = cleanup_stale()
        assert stale in removed and stale not in _list_netns()
        assert live in _list_netns(), "a namespace of a live process was removed"
    finally:
        for n in (stale, live):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


# the child handles SIGINT as an interactive Python does, even when the test run itself
# was started in the background (a background job inherits SIGINT ignored)
_CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from distllm.testing.netem import EmulatedNetwork
with EmulatedNetwork(nranks=2, rate="1gbit") as net:
    assert net.available, net.reason
    print(" ".join(net.namespaces), flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_removed_when_the_process_is_signalled(sig):
    _need_root()
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        names = p.stdout.readline().split()
        assert len(names) == 2 and all(n in _list_netns() for n in names)
        p.send_signal(sig)
        p.wait(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.1)
    assert not any(n in _list_netns() for n in names), f"left behind after {sig.name}"


def _kernel_has_netem() -> bool:
    """Whether this kernel attaches a netem qdisc, probed on the loopback of a scratch
    namespace (independently of EmulatedNetwork; named so that cleanup_stale would find it)."""
    name = f"dlnet-{os.getpid()}-{secrets.token_hex(3)}-0"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        probe = subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem",
                                "delay", "1ms"], capture_output=True)
        return probe.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_delay_is_added_by_netem_under_the_tbf():
    _need_root()
    if not _kernel_has_netem():
        pytest.skip("this kernel has no sch_netem: UNTESTED here is the delayed link (netem "
                    "under the tbf); the fallback without netem is tested below")
    with EmulatedNetwork(nranks=2, rate="1gbit", delay_ms=1.0) as net:
        assert net.available, f"the kernel has netem, yet the network failed: {net.reason}"
        out = subprocess.run(["tc", "-n", net.namespaces[0], "qdisc", "show", "dev", IFNAME],
                             capture_output=True, text=True, check=True).stdout
        assert "netem" in out and "delay 1ms" in out and "tbf" in out, out
    assert not [n for n in _list_netns() if n.startswith(net.tag)], "left behind"


def test_delay_without_netem_makes_the_network_unavailable(monkeypatch):
    """A kernel without sch_netem (emulated: tc refuses the netem qdisc) makes the whole
    network unavailable with that reason, and nothing is left behind."""
    from distllm.testing import netem

    _need_root()
    real_tc = netem._tc

    def tc_without_netem(ns, *args):
        if "netem" in args:
            raise OSError(f"`tc -n {ns} ... netem` failed: Error: Specified qdisc kind is unknown.")
        real_tc(ns, *args)

    monkeypatch.setattr(netem, "_tc", tc_without_netem)
    with EmulatedNetwork(nranks=2, rate="1gbit", delay_ms=1.0) as net:
        assert not net.available, "a delay was asked for and netem is missing, yet available"
        assert "sch_netem" in net.reason and "delay_ms" in net.reason, net.reason
        assert not net.namespaces and net.setup is None and net.env == {}
    assert not [n for n in _list_netns() if n.startswith(net.tag)], "left behind"


def test_network_labels_loopback_and_fallback(monkeypatch):
    from distllm.testing import netem

    with netem.open_network(None) as lk:
        assert (lk.label, lk.reason, lk.setup, lk.env) == ("loopback", "", None, None)
    monkeypatch.setattr(netem, "_unavailable_reason", lambda nranks, delay_ms: "no namespaces")
    with netem.open_network("2gbit") as lk:
        assert lk.label == "loopback" and lk.setup is None and lk.env is None
        assert lk.reason == "2gbit unavailable: no namespaces"


def test_a_signal_during_close_leaves_the_rest_for_the_exit_handler(monkeypatch):
    # a second SIGTERM (SystemExit) while close() deletes the namespaces: those not deleted
    # yet stay recorded, so the exit handler's close deletes them (they were forgotten)
    from distllm.testing import netem

    net = netem.EmulatedNetwork(nranks=2)
    net.namespaces = ["a", "b", "c"]
    deleted, calls = [], {"n": 0}

    def ip(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise SystemExit(143)
        deleted.append(args[-1])

    monkeypatch.setattr(netem, "_ip", ip)
    with pytest.raises(SystemExit):
        net.close()
    assert deleted == ["c"] and net.namespaces == ["a", "b"]
    net.close()  # what the exit handler runs
    assert deleted == ["c", "b", "a"] and net.namespaces == []


@pytest.mark.parametrize("nranks", [2, 3])
def test_the_delay_is_added_once_per_message(monkeypatch, nranks):
    """A message leaves its sender's dl0 and, with more than 2 ranks, enters the bridge port
    towards its receiver: both are rate-limited, only the sender's egress delays (the delay
    was added at both, twice delay_ms per message over a bridge). The commands are recorded,
    not run."""
    from distllm.testing import netem

    tcs = []
    monkeypatch.setattr(netem, "_ip", lambda *a, ns=None, check=True: None)
    monkeypatch.setattr(netem, "_tc", lambda ns, *a: tcs.append((ns.rsplit("-", 1)[-1], a)))
    monkeypatch.setattr(netem.subprocess, "run", lambda *a, **k: None)
    net = EmulatedNetwork(nranks=nranks, rate="1gbit", delay_ms=5.0)
    monkeypatch.setattr(net, "_add_ns", lambda name: None)
    net._build()
    where = lambda kind: sorted((ns, a[a.index("dev") + 1]) for ns, a in tcs if kind in a)  # noqa: E731
    ranks = [(str(r), IFNAME) for r in range(nranks)]
    ports = [("br", f"p{r}") for r in range(nranks)] if nranks > 2 else []
    assert where("netem") == ranks
    assert where("tbf") == sorted(ranks + ports)
