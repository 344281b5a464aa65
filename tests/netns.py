"""Several network hosts on one machine, for the multi-node tests: Linux network namespaces joined by a bridge.

Each node is a namespace with one interface (``eth0``) and its own address on a private subnet, and runs its commands
under its own hostname (a UTS namespace) with an ``/etc/hosts`` that names every node (``ip netns exec`` mounts
``/etc/netns/<ns>/hosts`` over it). The bridge lives in a namespace of its own, so nothing here touches the machine's
own network. Needs root and iproute2; :func:`unavailable` says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

SUBNET = "10.231.{}.{}"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "network namespaces need iproute2's ip and util-linux's unshare"
    name = f"moerl-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Nodes:
    """``count`` nodes ``node1``... on a bridge; :meth:`address` of each, :meth:`popen` on one, :meth:`cut` and
    :meth:`restore` its interface, and :meth:`close` (every process in them killed, everything made removed)."""

    def __init__(self, count: int = 3):
        tag = uuid.uuid4().hex[:5]
        self.prefix = f"mr{tag}"  # interface names stay within 15 characters
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-n{i + 1}" for i in range(count)]
        self.subnet = int(tag, 16) % 200 + 20
        self.hostnames = [f"node{i + 1}" for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def address(self, node: int) -> str:
        """Node ``node``'s address (nodes count from 1)."""
        return SUBNET.format(self.subnet, node)

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(i + 1)} {host}\n" for i, host in enumerate(self.hostnames)
        )
        for i, name in enumerate(self.names, 1):
            _ip("netns", "add", name)
            inside, outside = f"{self.prefix}v{i}a", f"{self.prefix}v{i}b"
            _ip("link", "add", inside, "netns", name, "type", "veth", "peer", "name", outside, "netns", self.switch)
            _ip("-n", name, "link", "set", inside, "name", "eth0")
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", outside, "master", "br0")
            _ip("-n", self.switch, "link", "set", outside, "up")
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def command(self, node: int, args: list[str]) -> list[str]:
        """``args`` as run on node ``node``: in its namespace, under its hostname."""
        name, host = self.names[node - 1], self.hostnames[node - 1]
        return [
            "ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *args,
        ]  # fmt: skip

    def entered(self, node: int, args: list[str]) -> list[str]:
        """``args`` as run on node ``node`` for a daemon that needs the host's /sys: :meth:`command` enters through
        ``ip netns exec``, which mounts a /sys of the namespace's own without the cgroup mounts slurmd needs, so this
        enters the network namespace with ``nsenter`` and bind-mounts the node's hosts file in a mount namespace of its
        own (the host's /etc/hosts untouched)."""
        name, host = self.names[node - 1], self.hostnames[node - 1]
        script = f'mount --bind /etc/netns/{name}/hosts /etc/hosts && hostname {host} && exec "$@"'
        return [
            "nsenter", f"--net=/run/netns/{name}", "unshare", "--uts", "--mount", "--propagation", "slave",
            "sh", "-c", script, "sh", *args,
        ]  # fmt: skip

    def popen(self, node: int, args: list[str], **kwargs) -> subprocess.Popen:
        """Start ``args`` on node ``node`` in a session of its own (killed with everything else at :meth:`close`)."""
        proc = subprocess.Popen(self.command(node, args), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def cut(self, node: int) -> None:
        """Node ``node``'s network goes away (its interface down)."""
        _ip("-n", self.names[node - 1], "link", "set", "eth0", "down")

    def restore(self, node: int) -> None:
        _ip("-n", self.names[node - 1], "link", "set", "eth0", "up")

    def running(self, node: int) -> list[int]:
        """The processes running in node ``node``'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.names[node - 1]], capture_output=True, text=True)
        return [int(pid) for pid in out.stdout.split()]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in [*self.names, self.switch]:
            for _ in range(50):  # what the sessions above left (a process may have started a session of its own)
                pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
