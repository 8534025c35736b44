"""A model name's statistics are its versions', added up when asked for: each request is counted once."""

from gepool.ipc.protocol import Origin
from gepool.scheduler.stats import BACKEND, REJECTED, ModelStats


def record(stats: ModelStats, k: int) -> None:
    """Every kind of event ModelStats counts, with values that differ by ``k`` (binary fractions: sums
    in any order are exact)."""
    stats.dispatched(2 + k, [k / 1024, 1 / 4096], k / 65536, [Origin.HTTP, Origin.LIBRARY])
    stats.computed(2 + k, k / 256, 1 / 65536)
    stats.answered(k / 512, Origin.HTTP)
    stats.answered(1 / 4, Origin.LIBRARY)
    stats.ensemble_answered(1, 1 / 128, 1 / 512, 1 / 256, Origin.HTTP)
    stats.failed(BACKEND if k % 2 else REJECTED, Origin.HTTP)
    stats.client_timed_out(Origin.LIBRARY)
    stats.cache_hit(100 * k)
    stats.cache_missed(50, lookup=True)


def test_summed_equals_counting_everything_in_one():
    one, parts = ModelStats(), [ModelStats() for _ in range(3)]
    for k, part in enumerate(parts, 1):
        record(one, k)
        record(part, k)
    summed = ModelStats.summed(parts)
    got, want = summed.as_dict(), one.as_dict()
    got.pop("last_inference"), want.pop("last_inference")
    assert got == want
    assert got["requests"] == 9 and got["protocols"]["http"]["requests"] == 6
    assert summed.last_inference == max(p.last_inference for p in parts)


def test_summed_leaves_its_parts_alone():
    part = ModelStats()
    record(part, 1)
    before = part.as_dict()
    ModelStats.summed([part, part])
    assert part.as_dict() == before
    assert ModelStats.summed([]).as_dict() == ModelStats().as_dict()
