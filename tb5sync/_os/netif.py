"""Network interfaces by name: ``--bind bridge0:8873``, ``--allow bridge0``, IPv6 zones.

A Thunderbolt bridge between Macs has self-assigned addresses (169.254/16, fe80::/64) that
change when the cable or the peer changes, so the daemon's options also take an interface's
name. Interfaces and their addresses come from ``ifaddr`` (pure Python over ``getifaddrs(3)``:
the same call on macOS and Linux), never from ``/proc`` or ioctls.

- :func:`bind_host`: an interface name -> one of its addresses (IPv4 first, then a global
  IPv6, then a link-local IPv6 with its zone: ``fe80::1%bridge0``); an address or host name as
  given.
- :class:`AllowList`: CIDR networks and interface names (each meaning that interface's
  subnets, IPv4 and IPv6; a link-local subnet only with the same zone), re-read at most every
  :data:`REFRESH` seconds so that an address that changes is followed.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterable

from tb5sync.errors import UsageError

__all__ = ["interfaces", "interface_networks", "bind_host", "peer_address", "AllowList", "REFRESH"]

#: Seconds an interface's subnets are kept before they are read again (AllowList).
REFRESH = 2.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def interfaces() -> dict[str, list[tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, str | None]]]:
    """Every interface's name -> its addresses as ``(address/prefix, zone)``; ``zone`` is the
    interface's name for a link-local IPv6 address, else None.

    Raises
    ------
    UsageError
        The interfaces cannot be enumerated (``ifaddr`` not installed, or ``getifaddrs`` failed).
    """
    try:
        import ifaddr
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise UsageError("interface names need the ifaddr package (pip install ifaddr)") from exc
    try:
        adapters = ifaddr.get_adapters(include_unconfigured=False)
    except OSError as exc:
        raise UsageError(f"cannot list network interfaces: {exc}") from exc
    out: dict[str, list[tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, str | None]]] = {}
    for ad in adapters:
        name = ad.name if isinstance(ad.name, str) else ad.name.decode(errors="replace")
        addrs = out.setdefault(name, [])
        for ip in ad.ips:
            if isinstance(ip.ip, tuple):  # IPv6: (address, flowinfo, scope_id)
                iface6 = ipaddress.IPv6Interface(f"{ip.ip[0].split('%')[0]}/{ip.network_prefix}")
                addrs.append((iface6, name if iface6.ip.is_link_local else None))
            else:
                addrs.append((ipaddress.IPv4Interface(f"{ip.ip}/{ip.network_prefix}"), None))
    return out


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def interface_networks(name: str) -> list[tuple[Network, str | None]]:
    """The subnets of interface ``name`` as ``(network, zone)``, IPv4 and IPv6 (zone as in :func:`interfaces`).

    Raises
    ------
    UsageError
        No interface of that name (the message lists the ones there are).
    """
    table = interfaces()
    if name not in table:
        raise UsageError(f"no network interface named {name!r} (there are: {', '.join(sorted(table)) or 'none'})")
    return [(a.network, zone) for a, zone in table[name]]


def bind_host(host: str) -> str:
    """The address to listen on for ``host``: an interface's name becomes one of its addresses.

    IPv4 first, then a global IPv6 address, then a link-local one with its zone
    (``fe80::1%bridge0``); an address (with or without a zone), a host name or ``""`` is
    returned as it is. A name is an interface's only if it is not an address and an interface
    has it (so ``localhost`` stays a host name unless an interface is so named).

    One address, so one family: ``lo`` listens on 127.0.0.1; for its IPv6 one give the address
    (``[::1]:PORT``), or ``[::]:PORT`` for every address of both families (IPv4 ones as mapped
    addresses where the system's ``IPV6_V6ONLY`` default is off, as on Linux and macOS).

    Raises
    ------
    UsageError
        The interface has no address, or ``host`` is neither an interface nor a name that resolves
        (the message lists the interfaces there are).
    """
    if not host or _is_address(host):
        return host
    table = interfaces()
    if host not in table:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise UsageError(f"no network interface or host named {host!r} "
                             f"(interfaces: {', '.join(sorted(table)) or 'none'})") from None
        return host
    addrs = table[host]
    order = sorted(addrs, key=lambda a: (a[0].version, a[1] is not None))
    if not order:
        raise UsageError(f"network interface {host!r} has no address to listen on")
    addr, zone = order[0]
    return f"{addr.ip}%{zone}" if zone else str(addr.ip)


def peer_address(addr: object) -> str:
    """A peer's address from a socket address tuple (``accept``, ``getpeername``): an IPv6 one with
    a scope (link-local) gets its zone, ``fe80::2%bridge0``, so that :class:`AllowList` can tell
    which link it came in on (``None`` or an unknown shape: ``""``)."""
    if not isinstance(addr, tuple) or not addr:
        return ""
    host = str(addr[0])
    if len(addr) >= 4 and addr[3] and "%" not in host:
        try:
            host = f"{host}%{socket.if_indextoname(addr[3])}"
        except OSError:
            host = f"{host}%{addr[3]}"
    return host


class AllowList:
    """Client networks allowed to connect: CIDR strings and interface names.

    Parameters
    ----------
    items : iterable of str
        ``"10.0.0.0/8"``, ``"fd00::/8"``, an address (a /32 or /128), or an interface's name
        (``"bridge0"``, ``"lo"``): every subnet of that interface, IPv4 and IPv6, read again at
        most every :data:`REFRESH` seconds; its link-local IPv6 subnet admits only peers whose
        zone is that interface.

    Raises
    ------
    UsageError
        An item that is neither a network nor an interface's name.

    Notes
    -----
    Empty means everyone (``bool(allow)`` is False). ``ip in allow`` takes the peer address as
    ``getpeername`` gives it (``"fe80::2%bridge0"``, IPv4-mapped IPv6 as its IPv4).
    """

    def __init__(self, items: Iterable[str] = ()) -> None:
        self.networks: list[Network] = []
        self.names: list[str] = []
        for item in items:
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
                continue
            except ValueError as exc:
                error = exc
            if "/" in item or _is_address(item.split("%")[0]) or not item:
                raise UsageError(f"bad --allow network: {error}")
            try:
                interface_networks(item)  # exists now, else a clear error at start
            except UsageError as exc:
                raise UsageError(f"bad --allow entry {item!r}: neither a network (CIDR) nor an interface's name ({exc})") from None
            self.names.append(item)
        self._lock = threading.Lock()
        self._cache: tuple[float, list[tuple[Network, str | None]]] = (float("-inf"), [])

    def __bool__(self) -> bool:
        return bool(self.networks or self.names)

    def _named(self) -> list[tuple[Network, str | None]]:
        if not self.names:
            return []
        with self._lock:
            at, nets = self._cache
            if time.monotonic() - at > REFRESH:
                table = interfaces()
                nets = [(a.network, zone) for n in self.names for a, zone in table.get(n, [])]
                self._cache = (time.monotonic(), nets)
            return nets

    def __contains__(self, ip: object) -> bool:
        if not isinstance(ip, str):
            return False
        text, _, zone = ip.partition("%")
        try:
            addr = ipaddress.ip_address(text)
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if any(addr in net for net in self.networks):
            return True
        return any(addr in net and (want is None or want == zone) for net, want in self._named())
