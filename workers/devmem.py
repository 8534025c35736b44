"""The device memory pool: 256-byte aligned blocks by size class, reused, under a cap.

Buffers for a batch are asked for at load and again when a worker reloads, so blocks are kept by
size class instead of being returned to the device; the cap (``memory_pool_size``) bounds what a
model may hold, and passing it fails the load with a message that names the setting, never the device.
"""

from collections.abc import Callable

ALIGN = 256
LARGE = 1 << 20  # above this, classes are whole MiB rather than powers of two


class PoolExhausted(MemoryError):
    pass


def size_class(nbytes: int) -> int:
    if nbytes <= LARGE:
        return max(ALIGN, 1 << (max(nbytes, 1) - 1).bit_length())
    return (nbytes + LARGE - 1) // LARGE * LARGE


class DeviceMemoryPool:
    """``malloc(size) -> ptr`` and ``free(ptr)`` are the device's own calls (acl.rt.malloc / free, already
    checked); the pool decides when to call them."""

    def __init__(self, malloc: Callable[[int], int], free: Callable[[int], None], cap: int = 0,
                 label: str = "device") -> None:
        self._malloc, self._free, self.cap, self.label = malloc, free, cap, label
        self.cached: dict[int, list[int]] = {}  # class -> free blocks
        self.in_use: dict[int, int] = {}  # ptr -> class
        self.held = 0  # bytes taken from the device: in use plus cached

    @property
    def bytes_in_use(self) -> int:
        return sum(self.in_use.values())

    def alloc(self, nbytes: int) -> int:
        cls = size_class(nbytes)
        blocks = self.cached.get(cls)
        if blocks:
            ptr = blocks.pop()
        else:
            if self.cap and self.held + cls > self.cap:
                self.trim()
            if self.cap and self.held + cls > self.cap:
                raise PoolExhausted(
                    f"{self.label} memory pool: {cls} more bytes would pass memory_pool_size "
                    f"({self.cap} bytes; {self.bytes_in_use} in use). Raise the model's 'memory_pool_size' "
                    f"parameter or GE_BACKEND_SHARED_MEMORY_POOL_SIZE")
            ptr = self._malloc(cls)
            self.held += cls
        self.in_use[ptr] = cls
        return ptr

    def free(self, ptr: int) -> None:
        cls = self.in_use.pop(ptr)
        self.cached.setdefault(cls, []).append(ptr)

    def trim(self) -> None:
        """Returns every cached block to the device."""
        for cls, blocks in self.cached.items():
            for ptr in blocks:
                self._free(ptr)
                self.held -= cls
        self.cached.clear()

    def close(self) -> None:
        for ptr in list(self.in_use):
            self.free(ptr)
        self.trim()
