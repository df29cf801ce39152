"""Test hosts on one machine: network namespaces with their own address and their
own /dev/shm, for tests and benchmarks of what crosses hosts.

Theory of operation
-------------------
:class:`TestHosts` (a context manager; needs root and iproute2) builds a switch and N
hosts:

- the switch is a network namespace of its own holding a bridge; nothing is added to
  the machine's own namespace, and nothing leaves the machine;
- each host is a network namespace joined to the bridge by a veth pair, with one
  address of 198.18.0.0/15 (the block reserved for benchmarking networks, RFC 2544):
  host ``i`` is ``198.18.X.(i+1)``, with ``X`` picked per :class:`TestHosts` from the
  process id and a counter;
- each host's shared memory is a tmpfs of its own. A process of a host runs in the
  host's network namespace and in a private mount namespace in which that tmpfs is
  mounted on /dev/shm (:meth:`Host.popen`), so processes of one host share segments and
  the handshake's shared-memory probe tells "same host" only between them.

Faults are made with nftables in a host's namespace (:meth:`Host.partition`,
:meth:`Host.lose`): a partition drops every packet to and from the host's link, loss
drops a random share of them. Latency (:meth:`Host.delay`) is an iptables rule that
queues the packets coming in on the link (NFQUEUE) for a listener that lets each go a
fixed time later (:mod:`shoal.netdelay`), since not every kernel has netem. Leaving
the block (and on any failure while building) kills the processes started through the
hosts, deletes the namespaces and unmounts the tmpfs mounts.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .netdelay import check_delay

__all__ = ["Host", "TestHosts", "available", "traffic_of"]

_RUN = itertools.count()
_NFT_TABLE = "shoal_faults"
_NFT_COUNTS = "shoal_counts"
_DELAY_QUEUE = "1"  # the NFQUEUE number of a host's delay (queues are per namespace)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def available() -> str | None:
    """None if test hosts can be built here; otherwise why not (not root, no iproute2
    or util-linux, namespaces refused)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces and tmpfs mounts)"
    for tool in ("ip", "unshare", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"test hosts need {tool!r} (iproute2, util-linux)"
    return None


class Host:
    """One test host: ``name``, ``netns`` (its network namespace), ``ip`` (its address),
    ``shm_dir`` (the tmpfs that its processes see as /dev/shm)."""

    def __init__(self, hosts: TestHosts, index: int, netns: str, ip: str, link: str, shm_dir: str):
        self._hosts = hosts
        self.index = index
        self.name = f"host{index}"
        self.netns = netns
        self.ip = ip
        self.link = link
        self.shm_dir = shm_dir
        self._faults: dict[str, str] = {}
        self._delay: subprocess.Popen[str] | None = None
        self.packets_delayed = 0  # by the delays healed so far

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.ip}>"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host: in its network namespace, with its /dev/shm."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', self.shm_dir, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (``subprocess.Popen`` keywords pass through); the
        process is stopped when the hosts are torn down, if it still runs."""
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(argv), **kwargs)
        self._hosts.processes.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on this host to its end (``subprocess.run``)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def shm_files(self) -> list[str]:
        """The names in this host's /dev/shm now."""
        return sorted(os.listdir(self.shm_dir))

    # -- what crosses this host's link

    def count_traffic(self, peer: str) -> None:
        """Count the bytes this host sends to and receives from the address ``peer``
        (IP packets, headers included) from now on, read with :meth:`traffic`; counting
        again starts from zero. Needs nft (Debian's nftables)."""
        self._nft_table("ip " + _NFT_COUNTS, -10, f"ip saddr {peer} counter", f"ip daddr {peer} counter",
                        "counting traffic")

    def traffic(self) -> tuple[int, int]:
        """``(sent, received)``: the bytes counted since :meth:`count_traffic`."""
        return traffic_of(self.netns)

    # -- faults of this host's link

    def partition(self) -> None:
        """Drop every packet to and from this host's link (its peers see silence, not
        refusals), until :meth:`heal`."""
        self._set_fault("partition", f'iifname "{self.link}" drop\n    oifname "{self.link}" drop')

    def lose(self, percent: float) -> None:
        """Drop about ``percent`` % of the packets to and from this host's link (whole
        percents), until :meth:`heal`."""
        share = int(round(percent))
        if not 0 < share <= 100:
            raise ValueError(f"loss must be 1-100 percent, not {percent!r}")
        self._set_fault("loss", f'iifname "{self.link}" numgen random mod 100 < {share} drop\n'
                                f'    oifname "{self.link}" numgen random mod 100 < {share} drop')

    def delay(self, ms: float) -> None:
        """Hold every packet that comes in on this host's link for ``ms`` milliseconds,
        until :meth:`heal`: ``ms`` more for every round trip to this host. Needs
        iptables-legacy (Debian's iptables).

        The packets wait on their way in, not out: a packet held on its way out is
        still charged to its sending socket, and TCP's small-queue limit would then
        hold the sender to a few packets per delay (netem, which this stands in for,
        lets go of that charge; a netfilter queue cannot)."""
        check_delay(ms)  # before anything starts
        if shutil.which("iptables-legacy") is None:
            raise OSError("latency between test hosts needs iptables-legacy (Debian's iptables)")
        self._stop_delay()
        listener = self.popen([sys.executable, "-m", "shoal.netdelay", _DELAY_QUEUE, str(ms)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert listener.stdout is not None and listener.stderr is not None
        if listener.stdout.readline().strip() != "bound":
            listener.wait(30)
            raise OSError(f"the delay listener on {self.name} did not start: {listener.stderr.read().strip()}")
        self._delay = listener
        self._iptables("-A")

    def heal(self) -> None:
        """Remove this host's faults and its delay."""
        self._stop_delay()
        self._faults.clear()
        self._apply_faults()

    def _iptables(self, op: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.netns, "iptables-legacy", op, "INPUT", "-i", self.link,
                               "-j", "NFQUEUE", "--queue-num", _DELAY_QUEUE, "--queue-bypass"],
                              capture_output=True, text=True, timeout=30, check=op == "-A")

    def _stop_delay(self) -> None:
        listener, self._delay = self._delay, None
        if listener is None:
            return
        self._iptables("-D")  # new packets pass; the listener lets go of those it holds
        listener.terminate()
        out, _ = listener.communicate(timeout=30)
        for line in out.splitlines():
            if line.startswith("held "):
                self.packets_delayed += int(line.split()[1])

    def _set_fault(self, kind: str, rules: str) -> None:
        self._faults[kind] = rules
        self._apply_faults()

    def _apply_faults(self) -> None:
        body = "\n    ".join(self._faults.values())
        self._nft_table("inet " + _NFT_TABLE, 0, body, body, "faults")

    def _nft_table(self, table: str, priority: int, input_rules: str, output_rules: str, what: str) -> None:
        """Replace the nftables ``table`` ("family name") of this host's namespace by
        one whose input and output chains (at ``priority``) hold these rules; no rules:
        none. ``what``: what the table is for, in the error when nft is missing."""
        if shutil.which("nft") is None:
            raise OSError(f"{what} between test hosts needs nft (Debian's nftables)")
        subprocess.run(["ip", "netns", "exec", self.netns, "nft", "delete", "table", *table.split()],
                       capture_output=True, timeout=30)
        if not input_rules and not output_rules:
            return
        script = (f"table {table} {{\n"
                  f"  chain input {{ type filter hook input priority {priority}; policy accept;\n    {input_rules}\n  }}\n"
                  f"  chain output {{ type filter hook output priority {priority}; policy accept;\n"
                  f"    {output_rules}\n  }}\n"
                  "}\n")
        done = subprocess.run(["ip", "netns", "exec", self.netns, "nft", "-f", "-"], input=script,
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise OSError(f"nft on {self.name}: {done.stderr.strip()}")


def traffic_of(netns: str) -> tuple[int, int]:
    """``(sent, received)`` bytes counted in the network namespace ``netns`` by
    :meth:`Host.count_traffic` (a function of its own: a process that knows only the
    namespace's name, such as a benchmark's client on another host, reads it too)."""
    import json

    done = subprocess.run(["ip", "netns", "exec", netns, "nft", "-j", "list", "table", "ip", _NFT_COUNTS],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"no traffic counted in {netns}: {done.stderr.strip()}")
    by_chain: dict[str, int] = {}
    for item in json.loads(done.stdout)["nftables"]:
        rule = item.get("rule")
        if rule is None:
            continue
        for expr in rule["expr"]:
            if "counter" in expr:
                by_chain[rule["chain"]] = by_chain.get(rule["chain"], 0) + int(expr["counter"]["bytes"])
    return by_chain.get("output", 0), by_chain.get("input", 0)


def _kill_namespace(netns: str) -> None:
    """SIGKILL every process left in network namespace ``netns``."""
    for _ in range(3):  # (one that forked meanwhile leaves a child: look again)
        done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
        pids = [int(p) for p in done.stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:  # reaped by whoever is their parent; wait until they are gone
            deadline = time.monotonic() + 5.0
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rpartition(")")[2].split()[0] == "Z":
                            break  # a zombie: dead, its parent reaps it
                except OSError:
                    break
                time.sleep(0.01)


class TestHosts:
    """``n`` test hosts (see the module); ``shm_size``: each host's /dev/shm (a tmpfs
    size, as ``mount -o size=``)."""

    __test__ = False  # not a pytest class

    def __init__(self, n: int, shm_size: str = "1g"):
        if n < 1:
            raise ValueError("at least one test host")
        if n > 250:
            raise ValueError("at most 250 test hosts")
        self.n = n
        self.shm_size = shm_size
        run = next(_RUN)
        self.tag = f"shoal{os.getpid() % 100000}x{run}"
        self.subnet = f"198.18.{(os.getpid() + run) % 256}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen[Any]] = []
        self._namespaces: list[str] = []
        self._mounts: list[str] = []
        self._base: str | None = None

    def __enter__(self) -> TestHosts:
        why = available()
        if why is not None:
            raise OSError(why)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Any:
        return iter(self.hosts)

    def _build(self) -> None:
        self._base = tempfile.mkdtemp(prefix=f"{self.tag}-")
        _ip("netns", "add", self.switch)
        self._namespaces.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            netns = f"{self.tag}-h{i}"
            _ip("netns", "add", netns)
            self._namespaces.append(netns)
            inner, outer = f"sh{i}", f"{self.tag[-6:]}p{i}"[-15:]
            # made in the host's namespace: no name can clash with the machine's links
            _ip("-n", netns, "link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("-n", netns, "link", "set", outer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", outer, "master", "br0", "up")
            ip = f"{self.subnet}.{i + 1}"
            _ip("-n", netns, "addr", "add", f"{ip}/24", "dev", inner)
            _ip("-n", netns, "link", "set", inner, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            shm_dir = os.path.join(self._base, f"shm{i}")
            os.mkdir(shm_dir)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.shm_size},mode=1777", "tmpfs", shm_dir],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise OSError(f"cannot mount a tmpfs for {netns}: {done.stderr.strip()}")
            self._mounts.append(shm_dir)
            self.hosts.append(Host(self, i, netns, ip, inner, shm_dir))

    def close(self) -> None:
        """Stop what runs on the hosts, delete the namespaces, unmount the tmpfs mounts."""
        for p in self.processes:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    p.terminate()
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                p.wait()
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        self.processes.clear()
        # what those started in turn in sessions of their own (an sshd's logins) is
        # still in the namespaces: it goes too
        for netns in self._namespaces:
            _kill_namespace(netns)
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
        self._namespaces.clear()
        for path in self._mounts:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        self._mounts.clear()
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None
