"""`fedhop netsim CONFIG`: the run's roles on emulated hosts, with real wire bytes and shaped links.

Each emulated host is a network namespace with one interface, `eth0`, whose veth peer sits on a
bridge in a switch namespace (so nothing touches this machine's own network).  Addresses come
from 10.213.0.0/16, inside those namespaces only.  A host's link can be rate-limited with a
token bucket (`tc tbf`) on both ends of its veth pair: the host's egress (upload) and the
switch's egress towards it (download).  The kernel has no netem here, so there is no delay or
loss emulation (shared/research/environment.md section 6).

By default every process is its own host (`server`, `edge-<e>`, `client-<k>`), so each host's
interface carries exactly one link class: client hosts carry the client-server or client-edge
link, the server host the edge-server link (or client-server in a star).  The roles are started
by `deploy.launch.hosts.Launch` with the remote command template `ip netns exec {host}`: the same code
path as `fedhop launch` over ssh.

At the end the interface counters of every host (kernel `stats64`: bytes and packets sent and
received, Ethernet frames) are turned into TCP payload bytes by subtracting one Ethernet + IPv4
+ TCP header per packet (14 + 20 + 32 = 66 bytes: Linux sends the timestamps option on every
segment, no SACK blocks without loss; counted per skb, so it holds for GSO super-packets too:
a veth counts the skb before segmentation).  IPv6 is off and the neighbour tables are static,
so no other packets cross the links.  These figures are printed beside the ledger's framed
bytes for the same host and link, and written to RUN_DIR/netsim.json.

Everything needs root (CAP_NET_ADMIN); names carry the prefix `fh-<pid>-`, and every
namespace, veth and /etc/netns entry is removed on exit, on error and at the next start.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from fedhop.common.config import Config, ConfigError, load_config
from fedhop.common.util.cliparser import ArgumentParser, new_folder_problem
from fedhop.common.util.nodeids import client_node
from fedhop.deploy.launch.engine import process_launch_problem
from fedhop.deploy.launch.hosts import HostsError, HostsFile, HostSpec, Role, load_hosts, plan_roles, run_launch

SUBNET = "10.213"                 # 10.213.0.0/16, used only inside our namespaces
IFNAME = "eth0"
FRAME_OVERHEAD = 66               # Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12 (bytes per packet)
MSS = 1448                        # TCP payload per full segment at MTU 1500 with timestamps
NETNS_DIR = Path("/etc/netns")    # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts
_SEQ = itertools.count()
_VETH_SEQ = itertools.count()
_NS_RE = re.compile(r"^fh-(\d+)-")
_VETH_RE = re.compile(r"^fh([0-9a-f]+)[xy][0-9a-f]+$")


class NetsimError(RuntimeError):
    """A namespace, link or shaping command failed."""


def _run(argv: list[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, input=input, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetsimError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
    return res


def netns_unavailable() -> str | None:
    """Why emulated hosts cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 ('ip' and 'tc') is not installed"
    probe = f"fh-{os.getpid()}-probe"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    try:
        res = subprocess.run(["ip", "-n", probe, "link", "add", "fhprobe0", "type", "veth", "peer", "name",
                              "fhprobe1"], capture_output=True, text=True)
        if res.returncode != 0:
            return f"cannot create a veth pair: {res.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove namespaces, /etc/netns entries and veths left by fedhop processes that are gone."""
    removed = []
    res = _run(["ip", "netns", "list"], check=False)
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    if NETNS_DIR.is_dir():
        for d in NETNS_DIR.iterdir():
            m = _NS_RE.match(d.name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
    res = _run(["ip", "-j", "link", "show"], check=False)
    try:
        links = json.loads(res.stdout or "[]")
    except json.JSONDecodeError:
        links = []
    for link in links:
        name = link.get("ifname", "")
        m = _VETH_RE.match(name)
        if m and not _pid_alive(int(m.group(1), 16)):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


def parse_rate(text: str | int | float) -> int:
    """'10mbit', '1.5gbit', '500kbit', '2mbps' (bytes) or a number of bit/s -> bit/s."""
    if isinstance(text, (int, float)):
        if not text >= 1:   # NaN too
            raise ValueError(f"bandwidth {text!r}: at least 1 bit/s")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?\s*", text.lower())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected e.g. '10mbit', '1gbit', '500kbit' or '2mbps' (bytes/s)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    if m.group(3) == "bps":
        value *= 8
    if value <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    if value < 1:   # tc shapes whole bits per second: a rate that rounds to 0 would shape nothing
        raise ValueError(f"bandwidth {text!r}: at least 1 bit/s")
    return int(value)


# ----------------------------------------------------------------------------- counters
@dataclass
class IfCounters:
    """One host interface's kernel counters (Ethernet frames) and its namespace's TCP retransmissions."""

    tx_bytes: int = 0
    tx_packets: int = 0
    rx_bytes: int = 0
    rx_packets: int = 0
    retrans_segs: int = 0

    @property
    def tx_payload(self) -> int:
        """TCP payload bytes sent: frame bytes less one 66-byte header per packet."""
        return self.tx_bytes - FRAME_OVERHEAD * self.tx_packets

    @property
    def rx_payload(self) -> int:
        return self.rx_bytes - FRAME_OVERHEAD * self.rx_packets

    def minus(self, other: "IfCounters") -> "IfCounters":
        return IfCounters(*(a - b for a, b in zip(astuple_(self), astuple_(other))))

    def as_dict(self) -> dict:
        return {**asdict(self), "tx_payload": self.tx_payload, "rx_payload": self.rx_payload}


def astuple_(c: IfCounters) -> tuple[int, ...]:
    return (c.tx_bytes, c.tx_packets, c.rx_bytes, c.rx_packets, c.retrans_segs)


# ----------------------------------------------------------------------------- the network
@dataclass
class EmuHost:
    name: str
    netns: str
    address: str
    peer: str                 # the veth end on the bridge, in the switch namespace
    rate: int | None = None   # bit/s, both directions
    aliases: list[str] = field(default_factory=list)


class EmulatedNetwork:
    """Hosts as network namespaces on one bridge; a context manager that always cleans up."""

    def __init__(self) -> None:
        self.tag = f"fh-{os.getpid()}-{next(_SEQ)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, EmuHost] = {}
        self._namespaces: list[str] = []
        self._veths: list[str] = []
        self._created = False

    def __enter__(self) -> "EmulatedNetwork":
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns_add(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        for key in ("all", "default"):
            _run(["ip", "netns", "exec", name, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def create(self) -> None:
        if self._created:
            return
        self._created = True
        try:
            self._ns_add(self.switch)
            # no multicast on the bridge: its own IGMP reports would otherwise reach every host's link
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "multicast", "off"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str, rate: int | None = None, aliases: Iterable[str] = ()) -> EmuHost:
        """A namespace with eth0 on the bridge, address 10.213.<i // 250>.<i % 250 + 1>/16."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", name):
            raise NetsimError(f"host name {name!r}: use letters, digits, '-' and '.'")
        idx = len(self.hosts)
        ns = f"{self.tag}-{idx}"
        seq = next(_VETH_SEQ)
        inner, outer = f"fh{os.getpid():x}x{seq:x}", f"fh{os.getpid():x}y{seq:x}"
        address = f"{SUBNET}.{idx // 250}.{idx % 250 + 1}"
        try:
            self._ns_add(ns)
            _run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
            self._veths += [inner, outer]
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "netns", self.switch])
            _run(["ip", "-n", ns, "link", "set", inner, "name", IFNAME])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/16", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            _run(["ip", "-n", self.switch, "link", "set", outer, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", outer, "up"])
            self._pin_rps(ns, IFNAME)
            self._pin_rps(self.switch, outer)
        except BaseException:
            self.close()
            raise
        host = EmuHost(name, ns, address, outer, None, list(aliases))
        self.hosts[name] = host
        if rate:
            self.shape(host, rate)
        return host

    @staticmethod
    def _pin_rps(ns: str, dev: str) -> None:
        """Steer the device's received packets to one CPU.  A veth hands each packet to the backlog
        of whichever CPU sent it, so a flow whose sender moves between CPUs arrives out of order and
        TCP retransmits spuriously (DSACK): on this 2-core VM ~100 segments per 40 MB without this,
        none with it.  Pinning keeps the kernel's byte counters free of retransmissions."""
        _run(["ip", "netns", "exec", ns, "sh", "-c",
              f"for f in /sys/class/net/{dev}/queues/rx-*/rps_cpus; do echo 1 > $f; done"], check=False)

    def shape(self, host: EmuHost, rate: int) -> None:
        """Token bucket at `rate` bit/s on the host's egress and on the switch's egress towards it.
        Burst: 5 ms at the rate (at least 16 KB); queue: up to 200 ms at the rate."""
        burst = max(16_000, rate // 8 // 200)
        for ns, dev in ((host.netns, IFNAME), (self.switch, host.peer)):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                  "burst", str(burst), "latency", "200ms"])
        host.rate = rate

    def finalize(self) -> None:
        """Name resolution (/etc/netns/<ns>/hosts), static neighbour entries (no ARP on the links) and a
        static forwarding table on the bridge (no frame is flooded to a host it is not meant for)."""
        lines = ["127.0.0.1 localhost"] + [f"{h.address} {h.name} {' '.join(h.aliases)}".rstrip()
                                           for h in self.hosts.values()]
        macs = {}
        for h in self.hosts.values():
            info = json.loads(_run(["ip", "-n", h.netns, "-j", "link", "show", "dev", IFNAME]).stdout)
            macs[h.name] = info[0]["address"]
        for h in self.hosts.values():
            d = NETNS_DIR / h.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")
            batch = "".join(f"neigh replace {o.address} lladdr {macs[o.name]} nud permanent dev {IFNAME}\n"
                            for o in self.hosts.values() if o.name != h.name)
            if batch:
                _run(["ip", "-n", h.netns, "-batch", "-"], input=batch)
        fdb = "".join(f"fdb replace {macs[h.name]} dev {h.peer} master static\n" for h in self.hosts.values())
        if fdb:
            _run(["bridge", "-n", self.switch, "-batch", "-"], input=fdb)

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def counters(self, name: str) -> IfCounters:
        h = self.hosts[name]
        info = json.loads(_run(["ip", "-n", h.netns, "-s", "-j", "link", "show", "dev", IFNAME]).stdout)
        st = info[0]["stats64"]
        snmp = _run(["ip", "netns", "exec", h.netns, "cat", "/proc/net/snmp"]).stdout
        tcp = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
        retrans = int(dict(zip(tcp[0][1:], tcp[1][1:])).get("RetransSegs", 0)) if len(tcp) >= 2 else 0
        return IfCounters(st["tx"]["bytes"], st["tx"]["packets"], st["rx"]["bytes"], st["rx"]["packets"], retrans)

    def close(self) -> None:
        for ns in reversed(self._namespaces):
            _run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(NETNS_DIR / ns, ignore_errors=True)
        for v in self._veths:  # normally gone with their namespace; not if we failed before moving them
            if Path(f"/sys/class/net/{v}").exists():
                _run(["ip", "link", "del", v], check=False)
        try:
            NETNS_DIR.rmdir()   # only when empty: others' entries stay
        except OSError:
            pass
        self._namespaces.clear()
        self._veths.clear()


# ----------------------------------------------------------------------------- layouts
def host_kind(h: HostSpec) -> str:
    return "server" if h.server else ("edge" if h.edges else "client")


def default_hosts(cfg: Config) -> HostsFile:
    """One emulated host per process of the config's process plan (common/topologies/plan.py)."""
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.common.util.nodeids import id_spec
    plan = plan_processes(cfg)
    hosts = [HostSpec("server", address="", server=True)]
    hosts += [HostSpec(e.node_id, address="", edges=[e.edge]) for e in plan.edges if e.edge is not None]   # every edge has its index
    hosts += [HostSpec(f"client-{k}", address="", clients=id_spec(p.clients)) for k, p in enumerate(plan.clients)]
    return HostsFile(hosts=hosts)


def host_rates(hf: HostsFile, bandwidth: dict[str, str]) -> dict[str, int | None]:
    """Rate per host: `--bandwidth NAME=` beats the hosts file's `bandwidth`, which beats
    `--bandwidth client|edge|server=` (the host's kind)."""
    known = {h.name for h in hf.hosts} | {"client", "edge", "server"}
    for key in bandwidth:
        if key not in known:
            raise HostsError(f"--bandwidth {key}=...: '{key}' is neither a host nor one of client, edge, server")
    out = {}
    for h in hf.hosts:
        text: str | None
        if bandwidth.get(h.name):
            text, source = bandwidth[h.name], f"--bandwidth {h.name}="
        elif h.bandwidth:
            text, source = h.bandwidth, "the hosts file"
        else:
            text, source = bandwidth.get(host_kind(h)), f"--bandwidth {host_kind(h)}="
        try:
            out[h.name] = parse_rate(text) if text else None
        except ValueError as exc:
            raise HostsError(f"host '{h.name}' ({source}): {exc}") from None
    return out


# ----------------------------------------------------------------------------- ledger vs kernel
def _role(node: str) -> str:
    return "server" if node == "server" else node.split("-", 1)[0]


def node_hosts(roles: list[Role]) -> dict[str, str]:
    """Ledger node ids (server, edge-e, client-procK, client-<id>) -> host name."""
    out = {}
    for r in roles:
        out[r.node_id] = r.host.name
        for c in r.clients:
            out[client_node(c)] = r.host.name
    return out


def physical_link(src: str, dst: str) -> str:
    """The link a message crossed, from its endpoints' roles (control messages included)."""
    a, b = sorted((_role(src), _role(dst)))
    return {("client", "server"): "client-server", ("client", "edge"): "client-edge",
            ("edge", "server"): "edge-server", ("edge", "edge"): "edge-edge",
            ("client", "client"): "client-client"}.get((a, b), "other")


def ledger_messages(run_dir: Path) -> list[dict]:
    """Each message once (the sender's record, else the receiver's) from run.db."""
    from fedhop.common.records.runstore import RunStore
    store = RunStore(run_dir / "run.db", create=False)
    try:
        rows = store.messages()
    finally:
        store.close()
    chosen: dict[str, dict] = {}
    for r in rows:
        have = chosen.get(r["msg_id"])
        if have is None or (have["role"] == "receiver" and r["role"] == "sender"):
            chosen[r["msg_id"]] = r
    return list(chosen.values())


def wire_report(run_dir: Path, roles: list[Role], counters: dict[str, IfCounters],
                rates: dict[str, int | None]) -> dict:
    """Ledger framed bytes beside kernel TCP payload bytes, per host and (one role per host) per link."""
    where = node_hosts(roles)
    kinds: dict[str, set[str]] = {}
    for r in roles:
        kinds.setdefault(r.host.name, set()).add(r.kind)
    msgs = ledger_messages(run_dir)
    per_host: dict[str, dict[str, Any]] = {h: {"ledger_sent": 0, "ledger_received": 0, "messages": 0} for h in counters}
    per_link: dict[str, dict] = {}
    unplaced = 0
    for m in msgs:
        sh, dh = where.get(m["src"]), where.get(m["dst"])
        if sh is None or dh is None:
            unplaced += 1
            continue
        if sh == dh:
            continue  # between processes of one host: never on its link
        per_host[sh]["ledger_sent"] += m["framed_bytes"]
        per_host[dh]["ledger_received"] += m["framed_bytes"]
        per_host[sh]["messages"] += 1
        per_host[dh]["messages"] += 1
        link = per_link.setdefault(physical_link(m["src"], m["dst"]),
                                   {"ledger_framed": 0, "ledger_tensor": 0, "messages": 0, "calls": 0})
        link["ledger_framed"] += m["framed_bytes"]
        link["ledger_tensor"] += m["tensor_bytes"]
        link["messages"] += 1
        link["calls"] += 0 if m["method"].endswith(".reply") else 1
    hosts_out: dict[str, dict[str, Any]] = {}
    for h, c in counters.items():
        row = per_host[h]
        kernel = c.tx_payload + c.rx_payload
        ledger = row["ledger_sent"] + row["ledger_received"]
        hosts_out[h] = {**row, "kinds": sorted(kinds.get(h, ())), "rate_bit_s": rates.get(h),
                        "kernel": c.as_dict(), "kernel_payload": kernel, "retrans_bytes_est": c.retrans_segs * MSS,
                        "ratio": ledger / kernel if kernel > 0 else None}
    # per link, when each host runs one kind of role: client hosts carry the client link, the server
    # host the link below the server; edge-edge is what is left on the edge hosts (each byte seen twice)
    single = all(len(k) == 1 for k in kinds.values())
    if single:
        def total(kind: str) -> int:
            return sum(hosts_out[h]["kernel_payload"] for h, k in kinds.items() if k == {kind})
        client_link = "client-edge" if "client-edge" in per_link else "client-server"
        if client_link in per_link:
            per_link[client_link]["kernel_payload"] = total("client")
        if "edge-server" in per_link:
            per_link["edge-server"]["kernel_payload"] = total("server")
        if "edge-edge" in per_link:
            rest = total("edge") - per_link.get("client-edge", {}).get("kernel_payload", 0) \
                - per_link.get("edge-server", {}).get("kernel_payload", 0)
            per_link["edge-edge"]["kernel_payload"] = rest // 2
        for row in per_link.values():
            k = row.get("kernel_payload")
            if k:
                row["ratio"] = row["ledger_framed"] / k
                row["remainder"] = k - row["ledger_framed"]
                row["remainder_per_call"] = row["remainder"] / max(1, row["calls"])
    return {"hosts": hosts_out, "links": per_link, "unplaced_messages": unplaced,
            "frame_overhead_bytes": FRAME_OVERHEAD, "retrans_segs": sum(c.retrans_segs for c in counters.values())}


def round_times(run_dir: Path, roles: list[Role], rates: dict[str, int | None]) -> list[dict]:
    """Per round: measured wall seconds (server), the bandwidth prediction and the virtual clock's
    seconds where the run recorded them.  Prediction: for each rate-limited host, the framed bytes
    that crossed its link in the round, plus one 66-byte header per 1448-byte segment (the token
    bucket counts frames), over its rate; the slowest such host sets the round."""
    from fedhop.common.records.runstore import RunStore
    where = node_hosts(roles)
    per_round: dict[int, dict[str, int]] = {}
    for m in ledger_messages(run_dir):
        sh, dh = where.get(m["src"]), where.get(m["dst"])
        if sh is None or dh is None or sh == dh:
            continue
        row = per_round.setdefault(m["round"], {})
        for h in (sh, dh):
            if rates.get(h):
                row[h] = row.get(h, 0) + m["framed_bytes"]
    store = RunStore(run_dir / "run.db", create=False)
    try:
        rounds = store.rounds()
    finally:
        store.close()
    limited = {h: rate for h, rate in rates.items() if rate}   # the hosts in `per_round`
    out = []
    for r in rounds:
        loads = per_round.get(r["round"], {})
        predicted = max((b * (1 + FRAME_OVERHEAD / MSS) * 8 / limited[h] for h, b in loads.items()), default=None)
        out.append({"round": r["round"], "measured_seconds": r["wall_seconds"], "predicted_seconds": predicted,
                    "sim_seconds": r.get("sim_seconds"),
                    "bytes_on_slowest_link": max(loads.values(), default=0)})
    return out


def format_report(report: dict) -> str:
    from fedhop.deploy.launch.launcher import human_bytes
    lines = ["  kernel counters per emulated host (TCP payload = frame bytes - 66 B x packets):",
             f"  {'host':<12}{'rate':>10}{'sent':>12}{'received':>12}{'ledger sent':>14}{'ledger recv':>14}"
             f"{'retrans':>9}{'ledger/kernel':>15}"]
    for h, row in report["hosts"].items():
        k = row["kernel"]
        rate = f"{row['rate_bit_s'] / 1e6:g}Mbit" if row["rate_bit_s"] else "-"
        ratio = f"{row['ratio']:.5f}" if row["ratio"] else "-"
        lines.append(f"  {h:<12}{rate:>10}{human_bytes(k['tx_payload']):>12}{human_bytes(k['rx_payload']):>12}"
                     f"{human_bytes(row['ledger_sent']):>14}{human_bytes(row['ledger_received']):>14}"
                     f"{k['retrans_segs']:>9}{ratio:>15}")
    if any("kernel_payload" in r for r in report["links"].values()):
        lines.append(f"  {'link':<14}{'ledger framed':>15}{'kernel payload':>16}{'ratio':>9}{'remainder/call':>16}")
        for link, r in sorted(report["links"].items()):
            if "kernel_payload" in r:
                lines.append(f"  {link:<14}{human_bytes(r['ledger_framed']):>15}{human_bytes(r['kernel_payload']):>16}"
                             f"{r.get('ratio', 0):>9.5f}{r.get('remainder_per_call', 0):>14.0f} B")
    for h, c in (report.get("capture") or {}).items():
        if "frames" not in c:
            lines.append(f"  capture on {h}: {c.get('error')}")
            continue
        o = c["overhead"]
        lines.append(f"  HTTP/2 on {h}'s link: TCP payload {c['tcp_payload']} B = DATA payload "
                     f"{c['data_payload_bytes']} B (ledger framed {c['ledger_framed']} B) + {o['total']} B: "
                     f"frame headers {o['frame_headers']}, HEADERS/trailers {o['headers_and_trailers']}, "
                     f"WINDOW_UPDATE {o['window_updates']}, PING {o['pings']}, SETTINGS {o['settings']}, "
                     f"GOAWAY/RST_STREAM {o['other_frames']}, prefaces {o['prefaces']}; kernel - capture = {c['kernel_minus_capture']} B "
                     f"(retransmitted {c['retransmitted_bytes']} B, SYN options)"
                     + (f"; capture incomplete: {c['broken'][:2]}" if c.get("broken") else ""))
    rt = report.get("round_times") or []
    if any(r["predicted_seconds"] for r in rt):
        lines.append(f"  {'round':<7}{'measured s':>12}{'bytes/bandwidth s':>19}{'virtual clock s':>17}")
        for r in rt:
            sim = f"{r['sim_seconds']:.3f}" if r.get("sim_seconds") is not None else "-"
            pred = f"{r['predicted_seconds']:.3f}" if r["predicted_seconds"] else "-"
            lines.append(f"  {r['round']:<7}{r['measured_seconds']:>12.3f}{pred:>19}{sim:>17}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command
@dataclass
class NetsimResult:
    status: int
    run_dir: Path
    report: dict | None
    roles: list[Role]


class Capture:
    """deploy/launch/h2capture.py running in one emulated host: HTTP/2 frames on its link."""

    def __init__(self, net: EmulatedNetwork, host: str, out: Path) -> None:
        self.host = host
        self.path = out / f"capture-{host}.json"
        self.proc = subprocess.Popen(net.exec_prefix(host) + [sys.executable, "-m", "fedhop.deploy.launch.h2capture", "--iface",
                                                              IFNAME, "--out", str(self.path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        if "capturing" not in line:
            self.proc.kill()
            raise NetsimError(f"packet capture on {host} did not start: {self.proc.stderr.read()[-500:]}")

    def finish(self) -> dict:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return json.loads(self.path.read_text()) if self.path.exists() else {"error": "no capture written"}


def capture_report(captured: dict, host_row: dict) -> dict:
    """The capture's breakdown beside the ledger and the kernel for the same host."""
    frames = captured.get("frames", {})
    ledger = host_row["ledger_sent"] + host_row["ledger_received"]
    other = captured.get("tcp_payload", 0) - captured.get("data_payload_bytes", 0)
    return {**captured, "ledger_framed": ledger, "kernel_payload": host_row["kernel_payload"],
            "data_payload_minus_ledger": captured.get("data_payload_bytes", 0) - ledger,
            "kernel_minus_capture": host_row["kernel_payload"] - captured.get("tcp_payload", 0),
            "overhead": {"frame_headers": captured.get("frame_header_bytes", 0),
                         "headers_and_trailers": frames.get("HEADERS", {}).get("payload_bytes", 0),
                         "window_updates": frames.get("WINDOW_UPDATE", {}).get("payload_bytes", 0),
                         "pings": frames.get("PING", {}).get("payload_bytes", 0),
                         "settings": frames.get("SETTINGS", {}).get("payload_bytes", 0),
                         "prefaces": captured.get("preface_bytes", 0),
                         "other_frames": sum(v.get("payload_bytes", 0) for k, v in frames.items()
                                             if k not in ("DATA", "HEADERS", "WINDOW_UPDATE", "PING", "SETTINGS")),
                         "total": other}}


def capture_problem(hf: HostsFile, capture: Sequence[str]) -> str | None:
    """Why `--capture` names a host the run does not have, or None."""
    names = [h.name for h in hf.hosts]
    unknown = sorted(set(capture) - set(names))
    return f"--capture {unknown[0]}: no such host (hosts: {', '.join(names)})" if unknown else None


def run_netsim(cfg: Config, out: Path, hf: HostsFile | None = None, bandwidth: dict[str, str] | None = None,
               quiet: bool = True, show_table: bool = False, capture: Sequence[str] = ()) -> NetsimResult:
    """Run `cfg` on emulated hosts (one per process unless `hf` groups them); returns the status and the
    wire report (also written to OUT/netsim.json).  `capture`: hosts whose link is also captured and
    parsed as HTTP/2 (deploy/launch/h2capture.py), to break the bytes beyond the ledger's down."""
    reason = netns_unavailable()
    if reason:
        raise NetsimError(reason)
    cleanup_stale()
    if not cfg.security.certs_dir and not cfg.security.insecure:
        # emulated hosts share one machine on a private namespace network: plaintext, said aloud
        cfg.security.insecure = True
        print("fedhop netsim: plaintext gRPC between the emulated hosts (security.insecure = true); set "
              "security.certs_dir to a `fedhop certs` directory for TLS", file=sys.stderr)
    hf = hf if hf is not None else default_hosts(cfg)
    problem = capture_problem(hf, capture)
    if problem:
        raise HostsError(problem)
    rates = host_rates(hf, bandwidth or {})
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger").mkdir(exist_ok=True)
    with EmulatedNetwork() as net:
        for h in hf.hosts:
            eh = net.add_host(h.name, rates[h.name])
            h.address, h.target, h.server_listen = eh.address, eh.netns, ""
        net.finalize()
        # every emulated host shares this machine's files: the roles run in the user's folder
        hf.remote, hf.workdir, hf.python = "ip netns exec {host}", str(Path.cwd()), sys.executable
        roles = plan_roles(hf, cfg)
        captures = [Capture(net, h, out) for h in capture]
        before = {h: net.counters(h) for h in net.hosts}
        try:
            status = run_launch(hf, cfg, out, quiet=quiet, remote_run=str(out), roles=roles, show_table=show_table,
                                shared_fs=True)
        finally:
            captured = {c.host: c.finish() for c in captures}
        counters = {h: net.counters(h).minus(before[h]) for h in net.hosts}
    report = None
    if (out / "run.db").exists():
        report = wire_report(out, roles, counters, rates)
        report["round_times"] = round_times(out, roles, rates)
        report["capture"] = {h: capture_report(c, report["hosts"][h]) for h, c in captured.items()}
        report["layout"] = {r.node_id: {"host": r.host.name, "address": r.address, "clients": r.clients}
                            for r in roles}
        (out / "netsim.json").write_text(json.dumps(report, indent=2))
    return NetsimResult(status, out, report, roles)


def parse_bandwidth(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise HostsError(f"--bandwidth {item!r}: expected WHO=RATE, e.g. client=20mbit")
        try:
            parse_rate(value)
        except ValueError as exc:
            raise HostsError(f"--bandwidth {key}=: {exc}") from None
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop netsim", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="experiment TOML file")
    ap.add_argument("--out", help="run directory, new or empty (default runs/NAME-seedS-TIMESTAMP)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--hosts", help="hosts file grouping roles on emulated hosts (addresses and targets are "
                                    "assigned here; 'bandwidth' per host is honoured)")
    ap.add_argument("--bandwidth", action="append", default=[], metavar="WHO=RATE",
                    help="link rate of a host (by name) or of every client|edge|server host, e.g. client=20mbit")
    ap.add_argument("--capture", action="append", default=[], metavar="HOST",
                    help="also capture this host's link and break its bytes down by HTTP/2 frame type")
    ap.add_argument("--verbose", action="store_true", help="echo every process's output")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        hf = load_hosts(args.hosts, addresses=False) if args.hosts else None   # netsim assigns them
        bandwidth = parse_bandwidth(args.bandwidth)
    except (ConfigError, HostsError, ValueError, OSError) as exc:
        print(f"fedhop netsim: {exc}", file=sys.stderr)
        return 2
    engine_problem = process_launch_problem(cfg, "fedhop netsim")
    if engine_problem:
        print(engine_problem, file=sys.stderr)
        return 2
    try:
        hosts = hf if hf is not None else default_hosts(cfg)
        problem = capture_problem(hosts, args.capture) or (new_folder_problem(args.out, "--out") if args.out else None)
        host_rates(hosts, bandwidth)   # every rate, the hosts file's too, read before anything starts
    except (HostsError, ValueError) as exc:
        problem = str(exc)
    if problem:
        print(f"fedhop netsim: {problem}", file=sys.stderr)
        return 2
    from fedhop.deploy.launch.launcher import default_run_dir
    out = Path(args.out) if args.out else default_run_dir(cfg)
    started = time.monotonic()
    try:
        res = run_netsim(cfg, out, hf, bandwidth, quiet=not args.verbose, show_table=True, capture=args.capture)
    except (NetsimError, HostsError) as exc:
        print(f"fedhop netsim: {exc}", file=sys.stderr)
        return 1
    if res.report is not None:
        print(format_report(res.report))
        print(f"  netsim: {len(res.report['hosts'])} emulated hosts, {time.monotonic() - started:.1f}s; "
              f"figures in {res.run_dir / 'netsim.json'}")
    return res.status


if __name__ == "__main__":
    sys.exit(main())
