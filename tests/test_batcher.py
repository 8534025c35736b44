"""The dynamic batcher's rules, driven by a fake clock: no sleeps."""

import pytest

from gepool.scheduler import batcher
from gepool.scheduler.batcher import DynamicBatcher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, us: int) -> None:
        self.now += us / 1e6


def make(max_bs=16, preferred=(4, 8), delay_us=1000, **kw):
    clock = Clock()
    return DynamicBatcher(max_bs, preferred, delay_us, clock=clock, **kw), clock


def rows_of(batch):
    return [p.rows for p in batch]


def test_waits_below_preferred_until_the_delay_passes():
    b, clock = make()
    b.add("a")
    assert b.next_batch() is None
    assert b.deadline() == clock.now + 0.001
    clock.advance(990)
    assert b.next_batch() is None
    clock.advance(20)
    assert [p.item for p in b.next_batch()] == ["a"]
    assert len(b) == 0 and b.rows == 0


def test_sends_the_largest_reachable_preferred_size():
    b, _ = make()
    for i in range(6):
        b.add(i)
    batch = b.next_batch()
    assert [p.item for p in batch] == [0, 1, 2, 3]  # [4, 8] with 6 queued: 4 go, 2 stay
    assert len(b) == 2


def test_eight_queued_go_as_one_batch_of_eight():
    b, _ = make()
    for i in range(9):
        b.add(i)
    assert len(b.next_batch()) == 8
    assert len(b) == 1


def test_rows_not_requests_are_counted():
    b, _ = make()
    b.add("a", rows=3)
    assert b.next_batch() is None
    b.add("b", rows=1)
    assert rows_of(b.next_batch()) == [3, 1]


def test_requests_are_never_split_and_max_batch_is_respected():
    b, clock = make(max_bs=8, preferred=(8,), delay_us=0)
    b.add("a", rows=5)
    b.add("b", rows=5)
    batch = b.next_batch()
    assert rows_of(batch) == [5]  # 5 + 5 > 8: send now, without splitting b
    assert rows_of(b.next_batch()) == [5]


def test_delay_exceeded_sends_everything_pending():
    b, clock = make(preferred=(4, 8))
    for i in range(3):
        b.add(i)
    clock.advance(5000)
    assert len(b.next_batch()) == 3


def test_zero_delay_never_waits():
    b, _ = make(preferred=(8,), delay_us=0)
    b.add("a")
    assert len(b.next_batch()) == 1


def test_a_preferred_size_is_sent_even_with_zero_delay():
    b, _ = make(preferred=(2,), delay_us=0)
    for i in range(3):
        b.add(i)
    assert len(b.next_batch()) == 2


def test_max_preferred_reached_sends_the_walk():
    b, _ = make(max_bs=16, preferred=(4,), delay_us=10_000)
    b.add("a", rows=3)
    b.add("b", rows=3)
    assert rows_of(b.next_batch()) == [3, 3]  # 6 passed the largest preferred size (4) without hitting it


def test_shape_change_sends_now():
    b, _ = make(preferred=(8,), delay_us=10_000)
    b.add("a", key=(3,))
    b.add("b", key=(3,))
    b.add("c", key=(5,))
    assert [p.item for p in b.next_batch()] == ["a", "b"]
    assert [p.item for p in b.queue] == ["c"]


def test_busy_worker_only_gets_a_batch_that_cannot_grow():
    b, clock = make(preferred=(4, 8), delay_us=1000)
    for i in range(5):
        b.add(i)
    assert b.next_batch(idle=False) is None  # could still grow to 8 while the worker is busy
    for i in range(3):
        b.add(i)
    assert len(b.next_batch(idle=False)) == 8
    b.add("late")
    clock.advance(1000)
    assert b.next_batch(idle=False) is None  # past its delay, but it can still grow until the worker frees
    b.add("later")
    assert [p.item for p in b.next_batch(idle=True)] == ["late", "later"]


def test_without_dynamic_batching_each_request_runs_alone():
    b, _ = make(enabled=False)
    b.add("a")
    b.add("b")
    assert [p.item for p in b.next_batch()] == ["a"]
    assert b.deadline() is None


def test_push_front_keeps_order_and_age():
    b, clock = make()
    b.add("a")
    t0 = next(iter(b.queue)).enqueued
    taken = b.take_all()
    clock.advance(10)
    b.add("b")
    b.push_front(taken)
    assert [p.item for p in b.queue] == ["a", "b"]
    assert next(iter(b.queue)).enqueued == t0
    assert b.rows == 2


# -- queue policies and priorities (Triton's §2.2 semantics) -----------------------------------
from gepool.scheduler.queues import DELAY, Policy, PolicyQueues  # noqa: E402


def make_q(policy=Policy(), levels=1, default_level=1, per_level=None, **kw):
    clock = Clock()
    q = PolicyQueues(levels, default_level, policy, per_level)
    return DynamicBatcher(16, (4, 8), 0, clock=clock, queues=q, **kw), clock


def test_full_queue_refuses_at_once():
    b, _ = make_q(Policy(max_queue_size=2))
    assert b.add("a") and b.add("b")
    assert not b.add("c")
    assert len(b) == 2 and b.rows == 2


def test_default_timeout_rejects_and_nothing_waits_for_a_batch():
    b, clock = make_q(Policy(default_timeout_us=1000))
    b.add("a")
    assert b.timeout_deadline() == clock.now + 0.001
    clock.advance(500)
    assert b.expire() == []
    clock.advance(600)
    assert [p.item for p in b.expire()] == ["a"]
    assert len(b) == 0 and b.rows == 0 and b.timeout_deadline() is None


def test_request_timeout_only_shortens_and_only_when_allowed():
    b, clock = make_q(Policy(default_timeout_us=1000, allow_timeout_override=True))
    b.add("short", timeout_us=100)
    b.add("long", timeout_us=5000, deadline_us=5000)  # longer than the default: the default applies
    clock.advance(200)
    assert [p.item for p in b.expire()] == ["short"]
    clock.advance(900)
    (long,) = b.expire()
    assert long.item == "long" and long.expires > clock()  # the policy's timeout, before its client's


@pytest.mark.parametrize("policy", [
    Policy(default_timeout_us=1000),  # override not allowed
    Policy(default_timeout_us=1000, allow_timeout_override=True),
])
def test_a_clients_deadline_never_changes_the_policy_timeout(policy):
    """deadline_us is how long the client waits, not a timeout override: a deadline shorter than the
    policy's takes the request out at the deadline as its client's (not as a policy timeout), and a
    timeout_us with override not allowed leaves the policy's timeout as it is."""
    b, clock = make_q(policy)
    b.add("waits-less", deadline_us=300)
    b.add("asks-less", timeout_us=300, deadline_us=60_000)
    clock.advance(400)
    gone = b.expire()
    assert [p.item for p in gone] == (["waits-less", "asks-less"] if policy.allow_timeout_override
                                      else ["waits-less"])
    assert gone[0].client_gone(clock()) and not any(p.client_gone(clock()) for p in gone[1:])
    clock.advance(700)
    assert [p.item for p in b.expire()] == ([] if policy.allow_timeout_override else ["asks-less"])


@pytest.mark.parametrize("policy", [
    Policy(allow_timeout_override=True),  # default 0: Triton ignores the override as a queue timeout
    Policy(default_timeout_us=1000),  # override not allowed
    Policy(default_timeout_us=50, timeout_action=DELAY),  # delayed first, then its client gives up
])
def test_a_clients_deadline_always_takes_its_request_out(policy):
    b, clock = make_q(policy)
    b.add("x", deadline_us=100)
    b.add("patient")
    clock.advance(60)
    b.expire()
    clock.advance(60)
    (gone,) = b.expire()
    assert gone.item == "x" and gone.expires <= clock()
    assert [p.item for p in b.queue] == ["patient"] and b.rows == 1


def test_delay_action_moves_behind_live_requests():
    b, clock = make_q(Policy(default_timeout_us=1000, timeout_action=DELAY))
    b.add("old")
    clock.advance(2000)
    b.add("new")
    assert b.expire() == []  # not rejected...
    assert [p.item for p in b.queue] == ["new", "old"]  # ...but served after the live one


def test_priority_levels_go_first_and_default_level_applies():
    b, _ = make_q(levels=3, default_level=2)
    b.add("low", priority=3)
    b.add("default")  # priority 0 -> level 2
    b.add("bogus", priority=9)  # out of range -> default level
    b.add("high", priority=1)
    assert [p.item for p in b.queue] == ["high", "default", "bogus", "low"]
    assert [p.item for p in b.next_batch()] == ["high", "default", "bogus", "low"]


def test_a_retry_keeps_its_priority_and_its_clients_deadline():
    """A batch whose worker died goes back at the head of each request's own level, and a retried request
    whose client stops waiting leaves the queue at that deadline, as its client's, without running."""
    b, clock = make_q(Policy(default_timeout_us=1000), levels=3, default_level=2)
    b.add("queued-default")
    b.add("queued-high", priority=1)
    b.retry([("low", 1, None, clock(), 0, 3, None), ("high", 1, None, clock(), 0, 1, clock() + 0.0005)])
    assert [p.item for p in b.queue] == ["high", "queued-high", "queued-default", "low"]
    clock.advance(600)
    (gone,) = b.expire()
    assert gone.item == "high" and gone.client_gone(clock())
    clock.advance(500)  # the policy's timeout is the queued requests', not the retried ones'
    assert sorted(p.item for p in b.expire()) == ["queued-default", "queued-high"]
    assert [p.item for p in b.queue] == ["low"] and b.rows == 1


def test_taken_requests_no_longer_time_out():
    b, clock = make_q(Policy(default_timeout_us=1000))
    for i in range(4):
        b.add(i)
    assert len(b.next_batch()) == 4
    clock.advance(5000)
    assert b.expire() == [] and b.timeout_deadline() is None


# -- the adaptive policy: it may only shorten the static wait --------------------------------------------
def feed(b, clock, gaps_us, busy=False):
    """Requests arriving after the given gaps, each taken at once (as if an idle worker ran them)."""
    for gap in gaps_us:
        clock.advance(gap)
        b.add("warm", busy=busy)
        b.take_all()


def test_adaptive_sends_sparse_traffic_at_once():
    b, clock = make(preferred=(16,), delay_us=5000, adaptive=True)
    b.observe_cost(0.004)
    feed(b, clock, [10_000] * 8)  # a lone client: one request per 10 ms
    clock.advance(10_000)
    b.add("a")
    assert [p.item for p in b.next_batch()] == ["a"]


def test_static_policy_keeps_waiting_on_the_same_traffic():
    b, clock = make(preferred=(16,), delay_us=5000)
    b.observe_cost(0.004)
    feed(b, clock, [10_000] * 8)
    clock.advance(10_000)
    b.add("a")
    assert b.next_batch() is None and b.deadline() == clock.now + 0.005


def test_adaptive_waits_for_a_burst_to_end():
    b, clock = make(preferred=(16,), delay_us=5000, adaptive=True)
    b.observe_cost(0.030)  # waiting may cost up to 3 ms
    feed(b, clock, [20_000] + [500] * 15 + [20_000] + [500] * 15)  # bursts, 500 us apart
    quiet = b.quiet_time()
    assert quiet == pytest.approx(3 * 500e-6)  # QUIET_FACTOR times the short gaps' 90th percentile
    clock.advance(20_000)
    for _ in range(3):
        b.add("x")
        clock.advance(500)
        assert b.next_batch() is None  # more of the burst is on its way
    assert abs(b.deadline() - (clock.now - 500e-6 + quiet)) < 1e-9
    clock.advance(1000)
    assert rows_of(b.next_batch()) == [1, 1, 1]


def test_adaptive_outwaits_a_hiccup_inside_a_fast_burst():
    """Gaps of 15 us with a client's 400 us stall now and then: the quiet time is QUIET_FLOOR_S, not
    3 x 15 us, or the stall would send part of the burst and leave the rest for a second batch."""
    b, clock = make(preferred=(16,), delay_us=5000, adaptive=True)
    b.observe_cost(0.020)  # waiting may cost up to 2 ms
    feed(b, clock, [20_000] + [15] * 15 + [20_000] + [15] * 15)
    assert b.quiet_time() == pytest.approx(batcher.QUIET_FLOOR_S)
    clock.advance(20_000)
    for gap in [15] * 7 + [400] + [15] * 7:
        b.add("x")
        clock.advance(gap)
        assert b.next_batch() is None
    b.add("x")
    clock.advance(batcher.QUIET_FLOOR_S * 1e6)
    assert len(b.next_batch()) == 16


def test_adaptive_never_waits_longer_than_the_delay():
    b, clock = make(preferred=(16,), delay_us=1000, adaptive=True)
    b.observe_cost(0.100)  # a slow model would allow a 10 ms quiet time; the delay caps it
    feed(b, clock, [400] * 20)
    assert b.quiet_time() == pytest.approx(0.001)
    b.add("a")
    for _ in range(9):
        clock.advance(100)
        b.add("b")  # arrivals keep coming, so the burst is not over
    assert b.next_batch() is None
    clock.advance(100)
    assert len(b.next_batch()) == 10  # the oldest reached the delay: the static rule sends


def test_adaptive_leaves_a_queue_built_during_a_batch_to_the_static_rules():
    b, clock = make(preferred=(16,), delay_us=5000, adaptive=True)
    b.observe_cost(0.004)
    feed(b, clock, [10_000] * 8)
    clock.advance(10_000)
    b.add("a", busy=True)  # its client may be waiting on the running batch's company
    assert b.next_batch() is None and b.deadline() == clock.now + 0.005


def test_adaptive_without_history_waits_like_the_static_policy():
    b, clock = make(preferred=(16,), delay_us=5000, adaptive=True)
    b.add("a")
    assert b.quiet_time() is None and b.next_batch() is None and b.deadline() == clock.now + 0.005
