"""The front's copy of an arena input into a slot: through a mapping (SIGBUS if the client truncates its
segment) against os.preadv on the segment's fd (what the front does), per size, for --seconds in all."""

import argparse
import mmap
import os
import time

SIZES = (4096, 65536, 1 << 20, 8 << 20)
OFFSET = 256  # past the arena's token header, as a real input lies


def _per_copy(copy, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        copy()
        n += 1
    return elapsed / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=4.0, help="total time, split over sizes and methods")
    args = p.parse_args()
    size = max(SIZES) + OFFSET
    path = f"/dev/shm/gepool-bench-arena-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        src = mmap.mmap(fd, size)
        src[:] = b"\x01" * size
        slot = memoryview(mmap.mmap(-1, size))
        view = memoryview(src)
        each = args.seconds / (2 * len(SIZES))
        print(f"{'bytes':>9}  {'mapped us':>10}  {'preadv us':>10}  ratio")
        for n in SIZES:
            def mapped(n=n):
                slot[:n] = view[OFFSET:OFFSET + n]

            def pread(n=n):
                os.preadv(fd, [slot[:n]], OFFSET)
            a, b = _per_copy(mapped, each), _per_copy(pread, each)
            print(f"{n:>9}  {a * 1e6:>10.2f}  {b * 1e6:>10.2f}  {b / a:5.2f}")
        view.release()
        slot.release()
        src.close()
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
