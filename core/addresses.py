"""Which address an engine advertises to its peers, checked before anything is sent.

An engine *binds* its side channel to ``WorkerConfig.side_channel_host`` and *advertises* an
address to its peers (D puts it in ``PUSH_REG``, heartbeats and ``CANCEL`` so P can handshake
back). The two differ when the bind address is a wildcard (``0.0.0.0``) or when a NAT or a
container network sits in between. The rule (documented in docs/deployment.md):

1. ``side_channel_advertise_host`` set: advertise it (it must not be a wildcard).
2. else ``network_interface`` set: advertise that interface's IPv4 address (else its
   global IPv6 address: an IPv6-only host).
3. else the bind address, unless it is a wildcard: a wildcard binds every interface and names
   none, so the configuration must say which one (``ConfigError``).

And before D advertises anything to a P: a loopback address (or a wildcard) is only good for a
P on loopback too. Advertising ``127.0.0.1`` to a P at ``10.0.0.7`` would make P knock on its
own door; :func:`check_reachable_from` refuses it with a ``ConfigError`` naming the setting.

Pure functions; the only system access is :func:`interface_address` (one ``ioctl``) and name
resolution in :func:`is_loopback` (``getaddrinfo``; both injectable for tests).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvpush.core.errors import ConfigError

if TYPE_CHECKING:
    from kvpush.core.worker import WorkerConfig

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
SIOCGIFADDR = 0x8915
IFNAMSIZ = 16

Resolver = Callable[[str], Iterable[str]]
"""Host name -> its IP addresses (``getaddrinfo`` by default)."""
InterfaceLookup = Callable[[str], str]
"""Interface name -> its IPv4 address (else its global IPv6 one)."""


def _strip(host: str) -> str:
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (IPv6 bare or ``[bracketed]``); None for a host name."""
    try:
        return ipaddress.ip_address(_strip(host))
    except ValueError:
        return None


def is_ipv6(host: str, resolver: Resolver | None = None) -> bool:
    """True for an IPv6 literal (bare or ``[bracketed]``) and for a name that resolves to IPv6
    addresses only: a ZMQ socket needs ``zmq.IPV6`` to bind or connect it."""
    ip = ip_literal(host)
    if ip is not None:
        return ip.version == 6
    addresses = [a for a in (resolver or resolve)(_strip(host)) if ip_literal(a) is not None]
    return bool(addresses) and all(ip_literal(a).version == 6 for a in addresses)  # type: ignore[union-attr]


def check_host(host: object, what: str = "host") -> str:
    """``host`` as given, if it is an IP literal (IPv4, IPv6 bare or ``[bracketed]``) or a
    host name; ``ConfigError`` naming ``what`` otherwise (a port or scheme glued on, brackets
    around something that is not IPv6, an empty string, whitespace)."""
    if not isinstance(host, str) or not host or host != host.strip():
        raise ConfigError(f"{what} must be an IP address or host name, got {host!r}")
    if host.startswith("[") or host.endswith("]"):
        ip = ip_literal(host) if host.startswith("[") and host.endswith("]") else None
        if ip is None or ip.version != 6:
            raise ConfigError(f"{what} {host!r}: brackets are only for an IPv6 address, e.g. '[fd00::1]'")
        return host
    if ip_literal(host) is not None:
        return host
    if (
        ":" in host
        or "/" in host
        or len(host) > 253
        or not all(
            label and len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label)
            for label in host.rstrip(".").split(".")
        )
    ):
        raise ConfigError(
            f"{what} {host!r} is neither an IP address nor a host name (an IPv6 address is written "
            f"bare or in brackets, without a port: 'fd00::1' or '[fd00::1]')"
        )
    return host


def canonical_host(host: object, what: str = "host") -> str:
    """:func:`check_host`, then one spelling per IP address: an IPv6 literal bare and compressed
    (``[FD00:0::1]`` -> ``fd00::1``), so two spellings of one engine's address compare equal;
    an IPv4-mapped IPv6 address as its IPv4 address (``::ffff:10.0.0.1`` -> ``10.0.0.1``: the
    same P, and loopback when it is ``::ffff:127.0.0.1``); a host name in lower case (DNS
    names are case-insensitive); IPv4 addresses as given."""
    checked = check_host(host, what)
    ip = ip_literal(checked)
    if ip is None:
        return checked.lower()
    if ip.version == 6 and ip.ipv4_mapped is not None and not ip.scope_id:
        return str(ip.ipv4_mapped)
    return str(ip) if ip.version == 6 else checked


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 literal in brackets (``tcp://[fd00::1]:5600``)."""
    ip = ip_literal(host)
    return f"[{ip}]" if ip is not None and ip.version == 6 else _strip(host)


def host_port(host: str, port: int | str) -> str:
    """``host:port`` for messages and URLs, an IPv6 literal bracketed (``[fd00::1]:5600``)."""
    return f"{url_host(host)}:{port}"


def tcp_url(host: str, port: int | str) -> str:
    """``tcp://host:port`` with an IPv6 literal bracketed."""
    return f"tcp://{host_port(host, port)}"


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` resolves to (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::``, ``*`` or empty: binds every interface, reachable at none."""
    return host.strip() in WILDCARDS or ((ip := ip_literal(host)) is not None and ip.is_unspecified)


def is_loopback(host: str, resolver: Resolver | None = None) -> bool:
    """True for ``127.0.0.0/8``, ``::1`` and names that resolve only to loopback addresses
    (``localhost``, or a host name Debian's ``/etc/hosts`` maps to ``127.0.1.1``)."""
    ip = ip_literal(host)
    if ip is not None:
        return ip.is_loopback
    name = _strip(host).lower()
    if name in LOOPBACK_NAMES:
        return True
    addresses = [a for a in (resolver or resolve)(name) if ip_literal(a) is not None]
    return bool(addresses) and all(ip_literal(a).is_loopback for a in addresses)  # type: ignore[union-attr]


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``, else its global IPv6 address
    (``ConfigError`` when it has neither)."""
    if not name or len(name.encode()) >= IFNAMSIZ or "/" in name:
        raise ConfigError(f"network_interface {name!r} is not an interface name (e.g. 'eth0')")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError as err:
            v6 = interface_ipv6_address(name)  # an IPv6-only interface (many clusters are)
            if v6 is not None:
                return v6
            known = ", ".join(n for _, n in socket.if_nameindex()) or "none"
            raise ConfigError(
                f"network_interface {name!r} has no IPv4 address and no global IPv6 address here "
                f"({err.strerror}); interfaces: {known}. Set network_interface to one of them or set "
                f"side_channel_advertise_host to the address peers should use"
            ) from None
    return socket.inet_ntoa(packed[20:24])


IF_INET6 = "/proc/net/if_inet6"
IFA_F_UNUSABLE = 0x08 | 0x20 | 0x40  # IFA_F_DADFAILED, IFA_F_DEPRECATED, IFA_F_TENTATIVE


def interface_ipv6_address(name: str, table: str = IF_INET6) -> str | None:
    """The lowest global-scope IPv6 address of interface ``name`` that is usable (not
    deprecated, tentative or failed DAD), from ``/proc/net/if_inet6``; None when it has none."""
    try:
        with open(table) as rows:
            lines = rows.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        fields = line.split()
        global_scope = len(fields) == 6 and fields[5] == name and int(fields[3], 16) == 0
        if global_scope and not int(fields[4], 16) & IFA_F_UNUSABLE:
            found.append(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return str(min(found)) if found else None


def advertised_host(
    bind_host: str,
    *,
    advertise_host: str | None = None,
    interface: str | None = None,
    interface_lookup: InterfaceLookup = interface_address,
) -> str:
    """The address an engine whose side channel binds ``bind_host`` tells its peers.

    ``advertise_host`` (``side_channel_advertise_host``) wins, then ``interface``'s address
    (``network_interface``), then ``bind_host`` itself unless it is a wildcard.
    """
    if advertise_host is not None:
        if is_wildcard(advertise_host):
            raise ConfigError(
                f"side_channel_advertise_host is {advertise_host!r}, a wildcard; peers need one "
                f"address they can connect to: set it to this host's address on the network P "
                f"and D share (or set network_interface)"
            )
        return _strip(advertise_host)
    if interface is not None:
        return interface_lookup(interface)
    if is_wildcard(bind_host):
        raise ConfigError(
            f"side_channel_host is {bind_host!r}: the side channel binds every interface, so there "
            f"is no single address to tell P; set side_channel_advertise_host to the address P "
            f"should connect to, or network_interface to the interface whose address it is"
        )
    return _strip(bind_host)


def check_reachable_from(
    advertised: str,
    peer_host: str,
    *,
    setting: str = "side_channel_advertise_host",
    resolver: Resolver | None = None,
) -> None:
    """Refuse to advertise a loopback or wildcard address to a peer that is not on loopback.

    ``peer_host`` is where this engine reaches the peer (D: ``kv_transfer_params['remote_host']``).
    The error names ``setting``, the field to change.
    """
    if is_wildcard(advertised):
        raise ConfigError(
            f"this engine would advertise {advertised!r} (a wildcard) to the peer at {peer_host}; "
            f"set {setting} to an address the peer can connect to"
        )
    if is_loopback(peer_host, resolver) or not is_loopback(advertised, resolver):
        return
    raise ConfigError(
        f"this engine would advertise its side channel at {advertised} (loopback) to the peer at "
        f"{peer_host}, which cannot reach it there; bind the side channel to a routable address "
        f"(side_channel_host) or set {setting} (or network_interface) to this host's address on "
        f"the network it shares with {peer_host}"
    )


def side_channel_advertise(
    bind_host: str,
    peer_host: str,
    *,
    advertise_host: str | None = None,
    interface: str | None = None,
    interface_lookup: InterfaceLookup = interface_address,
    resolver: Resolver | None = None,
) -> str:
    """:func:`advertised_host` checked with :func:`check_reachable_from` for ``peer_host``:
    the address D puts in ``PUSH_REG`` / heartbeats / ``CANCEL`` for a P at ``peer_host``."""
    host = advertised_host(
        bind_host, advertise_host=advertise_host, interface=interface, interface_lookup=interface_lookup
    )
    setting = "side_channel_advertise_host" if advertise_host is not None else "side_channel_host"
    if interface is not None and advertise_host is None:
        setting = "network_interface"
    check_reachable_from(host, peer_host, setting=setting, resolver=resolver)
    return host


def advertise_for_config(config: WorkerConfig, peer_host: str) -> str:
    """:func:`side_channel_advertise` from a ``WorkerConfig`` (``side_channel_host``,
    ``side_channel_advertise_host``, ``network_interface``); raises ``ConfigError``."""
    return side_channel_advertise(
        config.side_channel_host,
        peer_host,
        advertise_host=config.side_channel_advertise_host,
        interface=config.network_interface,
    )
