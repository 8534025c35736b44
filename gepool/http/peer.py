"""Who is on the other end of a loopback TCP connection: the uid the kernel records for the peer's socket.

The kernel is asked for exactly one socket, the peer's end of the connection, through the sock_diag
netlink interface (an exact lookup, about 50 us); where netlink is not available, the matching row of
/proc/net/tcp{,6} (a scan of every socket on the host) answers instead. Only a socket that is still
established and still open in some process counts: once its owner closes it, the kernel reports it
as uid 0 (root), which must never be mistaken for the caller being root.
"""

import ipaddress
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
TCP_ESTABLISHED = 1
_NOCOOKIE = 0xFFFFFFFF
_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI")
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_SOCKID_BYTES = 48
NETLINK_TIMEOUT_S = 1.0


class Unidentified(Exception):
    """The peer's uid cannot be known (not loopback, closed, or no way to ask the kernel)."""


def peer_uid(peername, sockname) -> int:
    """The uid owning the peer's socket of the connection ``peername`` -> ``sockname`` (as the
    transport reports them); Unidentified says why not."""
    if not peername or not sockname:
        raise Unidentified("the connection is not TCP")
    peer_ip, peer_port = _ip(peername[0]), int(peername[1])
    local_ip, local_port = _ip(sockname[0]), int(sockname[1])
    if local_ip.is_unspecified:  # the listener's wildcard address, not the connection's local one
        if not peer_ip.is_loopback:
            raise Unidentified(f"the peer {peer_ip} is not on this host's loopback")
        return _proc_any_local(peer_ip, peer_port, local_port)
    if not (peer_ip.is_loopback or peer_ip == local_ip):
        raise Unidentified(f"the peer {peer_ip} is not on this host's loopback")
    if peer_ip.version != local_ip.version:
        raise Unidentified("the peer and local addresses are of different families")
    try:
        return _netlink(peer_ip, peer_port, local_ip, local_port)
    except OSError:
        return _proc(peer_ip, peer_port, local_ip, local_port)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # an IPv4 client of a dual-stack listener has an AF_INET socket
    return ip


def _netlink(peer_ip, peer_port: int, local_ip, local_port: int) -> int:
    family = socket.AF_INET if peer_ip.version == 4 else socket.AF_INET6
    sockid = (struct.pack("!HH", peer_port, local_port) + peer_ip.packed.ljust(16, b"\0")
              + local_ip.packed.ljust(16, b"\0") + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE))
    req = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_ESTABLISHED) + sockid
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(NETLINK_TIMEOUT_S)
        nl.send(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + req)
        data = nl.recv(8192)
    if len(data) < _NLMSG.size:
        raise OSError("short sock_diag reply")
    _, kind, _, _, _ = _NLMSG.unpack_from(data)
    if kind == NLMSG_ERROR:
        raise Unidentified("no open socket of this host is the peer of the connection")
    need = _NLMSG.size + _MSG_HEAD.size + _SOCKID_BYTES + _MSG_TAIL.size
    if len(data) < need:
        raise OSError("short sock_diag reply")
    _, state, _, _ = _MSG_HEAD.unpack_from(data, _NLMSG.size)
    _, _, _, uid, inode = _MSG_TAIL.unpack_from(data, _NLMSG.size + _MSG_HEAD.size + _SOCKID_BYTES)
    return _checked(state, uid, inode)


def _checked(state: int, uid: int, inode: int) -> int:
    if state != TCP_ESTABLISHED or inode == 0:  # closed or orphaned: the kernel says uid 0 for those
        raise Unidentified("the peer's socket is no longer open")
    return uid


def _proc_hex(ip, port: int) -> str:
    """An address as /proc/net/tcp prints it: the address in host-order 32-bit words, then the port."""
    words = struct.unpack(f"={len(ip.packed) // 4}I", ip.packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _proc_any_local(peer_ip, peer_port: int, local_port: int) -> int:
    """The uid of the one socket of this host at ``peer_ip:peer_port`` connected to port ``local_port`` of any
    address. Two such sockets (one source port reused towards two of the listener's addresses) could be
    another user's and the caller's: then neither is trusted."""
    table = "/proc/net/tcp" if peer_ip.version == 4 else "/proc/net/tcp6"
    want_local, want_port = _proc_hex(peer_ip, peer_port), f":{local_port:04X}"
    found = []
    try:
        with open(table) as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if (len(cols) > 9 and cols[1] == want_local and cols[2].endswith(want_port)
                        and int(cols[3], 16) == TCP_ESTABLISHED):
                    found.append(cols)
    except OSError as exc:
        raise Unidentified(f"cannot read {table}: {exc.strerror}") from None
    if not found:
        raise Unidentified("no open socket of this host is the peer of the connection")
    if len(found) > 1:
        raise Unidentified("more than one socket of this host could be the peer of the connection")
    cols = found[0]
    return _checked(int(cols[3], 16), int(cols[7]), int(cols[9]))


def _proc(peer_ip, peer_port: int, local_ip, local_port: int) -> int:
    table = "/proc/net/tcp" if peer_ip.version == 4 else "/proc/net/tcp6"
    want_local, want_remote = _proc_hex(peer_ip, peer_port), _proc_hex(local_ip, local_port)
    try:
        with open(table) as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[1] == want_local and cols[2] == want_remote:
                    return _checked(int(cols[3], 16), int(cols[7]), int(cols[9]))
    except OSError as exc:
        raise Unidentified(f"cannot read {table}: {exc.strerror}") from None
    raise Unidentified("no open socket of this host is the peer of the connection")
