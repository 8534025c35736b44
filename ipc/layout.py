"""Where tensors sit inside a slot's data area: packed in order, each 256-byte aligned."""

ALIGN = 256
ARENA_TOKEN_BYTES = 32  # a client arena's registration token, at its offset 0
ARENA_HEADER = ALIGN  # the arena bytes before its first tensor: the token's, never allocated


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def pack(sizes: list[int], start: int = 0) -> tuple[list[int], int]:
    """Offsets for tensors of the given byte sizes placed one after another from ``start``,
    and the aligned end of the last one."""
    offsets = []
    pos = align(start)
    for size in sizes:
        offsets.append(pos)
        pos = align(pos + size)
    return offsets, pos
