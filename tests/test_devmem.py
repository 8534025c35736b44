"""The device memory pool: size classes, reuse across batches, and the cap."""

import pytest

from gepool.workers.devmem import DeviceMemoryPool, PoolExhausted, size_class


class Device:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.next = 0x10000
        self.mallocs = 0

    def malloc(self, n: int) -> int:
        self.mallocs += 1
        ptr, self.next = self.next, self.next + n
        self.live[ptr] = n
        return ptr

    def free(self, ptr: int) -> None:
        del self.live[ptr]


def test_classes_are_256_aligned():
    assert [size_class(n) for n in (1, 256, 257, 1000, 1 << 20, (1 << 20) + 1)] == \
        [256, 256, 512, 1024, 1 << 20, 2 << 20]
    assert all(size_class(n) % 256 == 0 for n in range(1, 5000, 37))


def test_blocks_are_reused_by_class():
    dev = Device()
    pool = DeviceMemoryPool(dev.malloc, dev.free)
    a = pool.alloc(1000)
    pool.free(a)
    assert pool.alloc(900) == a  # same class: no new device allocation
    assert dev.mallocs == 1
    pool.close()
    assert dev.live == {}


def test_cap_trims_the_cache_then_refuses_with_the_setting_named():
    dev = Device()
    pool = DeviceMemoryPool(dev.malloc, dev.free, cap=4096, label="ascend:0")
    a = pool.alloc(2048)
    pool.free(a)
    b = pool.alloc(4096)  # the cached 2048 block is returned to the device to make room
    assert pool.held == 4096 and list(dev.live.values()) == [4096]
    with pytest.raises(PoolExhausted, match="memory_pool_size"):
        pool.alloc(256)
    pool.free(b)
    pool.close()
    assert dev.live == {}
