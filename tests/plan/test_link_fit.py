"""The alpha-beta fit of measured all-reduce times (``distllm plan --calibrate``): bandwidth
from the largest messages, latency from the small ones, never faster than the largest
message measured nor than the link's line rate; and the packaged CPU profile's links, which
are that fit of the points it stores."""

from __future__ import annotations

import re

import pytest

from distllm.plan import load_profile
from distllm.plan.calibrate import AR_SIZES, FIT, fit_alpha_beta

N = 4
K, C = 2 * (N - 1), 2 * (N - 1) / N  # ring steps, bytes factor of a ring all-reduce


def _ring(alpha: float, beta: float, s: float) -> float:
    return K * alpha + C * s * beta


def _stored_points(text: str) -> dict[int, float]:
    return {int(k) << 10: float(v) * 1e-3 for k, v in re.findall(r"(\d+) KiB: ([\d.]+) ms", text)}


def test_noisy_small_messages_do_not_make_the_link_faster():
    """A 125 MB/s link with 1 ms per step, its small messages measured 40% off either way:
    the relative-error fit weighed each as much as the largest and came out faster than the
    wire; this one keeps the bandwidth of the large messages."""
    alpha, rate = 1e-3, 125e6
    times = {s: _ring(alpha, 1 / rate, s) for s in AR_SIZES}
    for s, f in zip(AR_SIZES[:3], (0.6, 1.4, 0.7), strict=True):
        times[s] *= f
    a, b = fit_alpha_beta(times, N)
    big = max(AR_SIZES)
    assert _ring(a, b, big) >= times[big] * (1 - 1e-12)
    assert 1 / b <= rate * 1.01, 1 / b


def test_never_faster_than_the_line_rate():
    """Measured points that a ring at 150 MB/s would give: with the link's rate known, the
    fit stays at it (and still predicts the largest message no faster than measured)."""
    times = {s: _ring(1e-3, 1 / 150e6, s) for s in AR_SIZES}
    assert 1 / fit_alpha_beta(times, N)[1] == pytest.approx(150e6, rel=1e-9)
    a, b = fit_alpha_beta(times, N, line_rate=125e6)
    assert 1 / b == pytest.approx(125e6, rel=1e-12)
    assert _ring(a, b, max(AR_SIZES)) >= times[max(AR_SIZES)]


def test_measure_link_caps_the_fit_at_the_emulated_rate(monkeypatch):
    """``--net 1gbit``: 125 MB/s at most, whatever the points say."""
    import contextlib

    from distllm.plan import calibrate as cal

    times = {s: _ring(1e-3, 1 / 200e6, s) for s in AR_SIZES}
    per_rank = [{s: (times[s], 1e-4 + s * 1e-10) for s in AR_SIZES}] * N

    class Net(contextlib.nullcontext):
        available, reason, setup, env = True, "", None, None

        def __init__(self, **kw):
            super().__init__(self)

    monkeypatch.setattr("distllm.testing.run_distributed", lambda *a, **k: per_rank)
    monkeypatch.setattr("distllm.testing.netem.EmulatedNetwork", Net)
    link, _ = cal.measure_link("1gbit", nranks=N)
    assert link.bandwidth == pytest.approx(125e6, rel=1e-12)
    assert f"{FIT}, at most the 1gbit line rate" in link.source
    loop, _ = cal.measure_link(None, nranks=N)
    assert loop.bandwidth == pytest.approx(200e6, rel=1e-9)


@pytest.mark.parametrize("name", ["intra", "inter"])
def test_the_packaged_cpu_links_are_the_fit_of_their_stored_points(name):
    """The packaged profile stores its measured points in each link's ``source``: its
    figures are this fit of them (the relative-error fit put the emulated 1 Gbit/s link at
    150.8 MB/s, above its 125 MB/s)."""
    link = load_profile("cpu").links[name]
    wall_text, cpu_text = link.source.split("CPU seconds per rank")
    wall, cpu = _stored_points(wall_text), _stored_points(cpu_text)
    assert sorted(wall) == sorted(cpu) == list(AR_SIZES)
    rate = 125e6 if name == "inter" else None
    a, b = fit_alpha_beta(wall, N, rate)
    assert (link.latency, link.bandwidth) == pytest.approx((a, 1 / b), rel=1e-12)
    assert (link.cpu_latency, link.cpu_per_byte) == pytest.approx(fit_alpha_beta(cpu, N),
                                                                  rel=1e-12)
    big = max(wall)
    assert _ring(link.latency, 1 / link.bandwidth, big) >= wall[big] * (1 - 1e-12)
    if rate:
        assert link.bandwidth <= rate
    assert FIT in link.source
