"""The front's polling policy, on synthetic times: when it polls, for how long, and how the adaptive
window follows the traffic."""

import pytest

from gepool.scheduler import polling
from gepool.scheduler.polling import PollPolicy

US = 1e-6
SHORT = polling.SHORT_BATCH_S


def answered_then_arrived(p: PollPolicy, at: float, gap: float) -> None:
    p.answered(at, 1, 50 * US, True)
    p.arrived(at + gap)


def test_a_lone_short_batch_is_polled_for_until_its_expected_end():
    p = PollPolicy(cpus=2)
    p.dispatched(10.0, 1, 40 * US)
    assert p.until(10.0, True) == (pytest.approx(10.0 + 40 * US + polling.COMPLETION_SLACK_S), False)
    assert p.until(10.0, False) == (0.0, False), "batching traffic: no polling"
    p.answered(10.0001, 1, 40 * US, True)
    assert p.completion_due == 0.0


@pytest.mark.parametrize("requests, cost", [(2, 40 * US), (1, SHORT * 2), (1, None)])
def test_batches_that_are_shared_long_or_unmeasured_are_slept_through(requests, cost):
    p = PollPolicy(cpus=2)
    p.dispatched(10.0, requests, cost)
    until, _ = p.until(10.0, True)
    assert until <= 10.0


def test_the_window_grows_to_catch_a_gap_like_the_last_and_never_past_its_limit():
    p = PollPolicy(cpus=2)
    p.answered(1.0, 1, 50 * US, True)
    assert p.until(1.0, True) == (0.0, False), "no window before any gap was seen"
    p.arrived(1.0 + 80 * US)
    assert p.window_s == pytest.approx(80 * US * polling.GROW + polling.WINDOW_PAD_S)
    p.answered(2.0, 1, 50 * US, True)
    until, window = p.until(2.0, True)
    assert window and until == pytest.approx(2.0 + p.window_s)
    answered_then_arrived(p, 3.0, polling.WINDOW_LIMIT_S * 0.99)
    assert p.window_s == polling.WINDOW_LIMIT_S
    answered_then_arrived(p, 4.0, polling.WINDOW_LIMIT_S * 5)
    assert p.window_s == polling.WINDOW_LIMIT_S, "a gap past the limit changes nothing"


def test_empty_windows_halve_it_to_nothing_and_a_missed_window_is_not_polled_again():
    p = PollPolicy(cpus=2)
    answered_then_arrived(p, 1.0, 150 * US)
    sizes = []
    t = 2.0
    while p.window_s:
        p.answered(t, 1, 50 * US, True)
        assert p.until(t, True)[1]
        p.missed()
        assert p.until(t, True) == (0.0, False)
        sizes.append(p.window_s)
        t += 1
    assert all(b == a / 2 for a, b in zip(sizes, sizes[1:]) if b)
    assert len(sizes) <= 6 and p.misses == len(sizes) == p.polls


def test_a_batch_of_several_or_a_long_one_opens_no_window():
    p = PollPolicy(cpus=2)
    answered_then_arrived(p, 1.0, 100 * US)
    p.answered(2.0, 3, 50 * US, True)
    assert p.until(2.0, True) == (0.0, False)
    p.answered(3.0, 1, SHORT * 3, True)
    assert p.until(3.0, True) == (0.0, False)


def test_fixed_and_off():
    fixed = PollPolicy(500)
    assert fixed.until(1.0, True) == (pytest.approx(1.0 + 500 * US), False)
    assert fixed.until(1.0, False) == (0.0, False)
    assert fixed.summary()["mode"] == "fixed"
    off = PollPolicy(-1)
    off.dispatched(1.0, 1, 10 * US)
    answered_then_arrived(off, 1.0, 50 * US)
    off.answered(2.0, 1, 10 * US, True)
    assert off.until(2.0, True) == (0.0, False) and off.summary()["mode"] == "off"


def test_adaptive_polling_is_off_on_one_cpu_and_an_explicit_window_is_kept():
    assert not PollPolicy(0, cpus=1).enabled
    assert PollPolicy(0, cpus=2).enabled
    assert PollPolicy(300, cpus=1).until(1.0, True) == (pytest.approx(1.0 + 300 * US), False)


def test_a_window_resumed_after_another_event_is_counted_once():
    p = PollPolicy(cpus=2)
    answered_then_arrived(p, 1.0, 100 * US)
    p.answered(2.0, 1, 50 * US, True)
    assert p.until(2.0, True)[1] and p.until(2.0 + 10 * US, True)[1]  # interrupted, then resumed
    assert p.polls == 1


def test_nothing_is_polled_for_while_another_worker_computes():
    p = PollPolicy(cpus=2)
    p.dispatched(1.0, 1, 40 * US)
    assert p.until(1.0, True, busy_workers=1)[0] > 1.0, "the short batch's own worker is busy: poll"
    assert p.until(1.0, True, busy_workers=2) == (0.0, False), "another model computes: sleep"
    answered_then_arrived(p, 2.0, 100 * US)
    p.answered(3.0, 1, 40 * US, True)
    assert p.until(3.0, True, busy_workers=1) == (0.0, False)
    assert p.until(3.0, True, busy_workers=0)[1]
