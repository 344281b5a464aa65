"""A local Slurm cluster for the tests: slurmctld and one slurmd per node, each in a network namespace of its own
(:mod:`tests.netns`), with one munged they all share.

The nodes are ``node1``... on a bridge; the controller is the last namespace (``node<count + 1>``), where the client
commands (:meth:`Cluster.client`) run too. Every file (config, key, spool, state, logs) lives under one directory;
nothing of the host's Slurm or munge configuration is read or written. Daemons are stopped by their pids at
:meth:`Cluster.close` and only the namespaces made here are removed, after a failure too. Needs root, iproute2,
util-linux and ``apt-get install -y slurm-wlm munge`` (Slurm 22.05); :func:`unavailable` says why not where one is
missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests import netns

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "squeue", "scontrol", "nsenter")
CPUS_PER_NODE = 2


def unavailable() -> str | None:
    """Why the cluster cannot start here (None: it can)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install -y slurm-wlm munge)"
    return netns.unavailable()


def slurm_conf(directory: Path, controller: tuple[str, str], nodes: list[tuple[str, str]], munge_socket: Path) -> str:
    """The cluster's slurm.conf: root runs everything, no cgroup confinement or accounting (what works inside network
    namespaces: shared/design.md), per-node spool, pid and log files."""
    host, address = controller
    lines = [
        "ClusterName=moerl-test",
        f"SlurmctldHost={host}({address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "MessageTimeout=30",
        f"StateSaveLocation={directory / 'ctld'}",
        f"SlurmctldPidFile={directory / 'ctld' / 'slurmctld.pid'}",
        f"SlurmctldLogFile={directory / 'logs' / 'slurmctld.log'}",
        f"SlurmdSpoolDir={directory / 'spool' / '%n'}",
        f"SlurmdPidFile={directory / 'spool' / '%n' / 'slurmd.pid'}",
        f"SlurmdLogFile={directory / 'logs' / 'slurmd-%n.log'}",
        *(
            f"NodeName={name} NodeAddr={addr} CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
            for name, addr in nodes
        ),
        f"PartitionName=test Nodes={','.join(name for name, _ in nodes)} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


class Cluster:
    """``count`` Slurm nodes ``node1``... (:attr:`nodes`: their namespaces and addresses) and a controller, up once
    every node is idle. :meth:`client` runs a Slurm command against it, :meth:`sbatch` submits a batch script and
    :meth:`wait` waits for a job to end; :meth:`close` stops it all."""

    def __init__(self, directory: Path, count: int = 3, start_timeout_s: float = 30):
        self.directory = directory
        self.count = count
        self.conf = directory / "slurm.conf"
        self.daemons: list[tuple[str, subprocess.Popen]] = []  # (log name, process)
        self.nodes = netns.Nodes(count + 1)  # the last one is the controller's
        try:
            self._start(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return self.nodes.hostnames[: self.count]

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client command (and, through sbatch's --export=ALL, of a job's steps)."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _daemon(self, args: list[str], node: int | None, log: str) -> None:
        command = args if node is None else self.nodes.entered(node, args)
        with open(self.directory / "logs" / log, "ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env, cwd=self.directory
            )
        self.daemons.append((log, proc))

    def _start(self, timeout_s: float) -> None:
        d = self.directory
        for sub in ("ctld", "logs", "munge", *(f"spool/{name}" for name in self.names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        munge = d / "munge"
        munge.chmod(0o700)  # munged refuses a socket directory others could write to
        key, socket = munge / "munge.key", munge / "munge.socket"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        controller = len(self.nodes.names)
        self.conf.write_text(
            slurm_conf(
                d,
                (self.nodes.hostnames[-1], self.nodes.address(controller)),
                [(name, self.nodes.address(i + 1)) for i, name in enumerate(self.names)],
                socket,
            )
        )
        (d / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        self._daemon(
            [
                "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket}",
                f"--pid-file={munge / 'munged.pid'}", f"--log-file={d / 'logs' / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            None,
            "munged.out",
        )  # fmt: skip
        self._wait(lambda: socket.exists(), timeout_s, "munged did not create its socket")
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], controller, "slurmctld.out")
        for i, name in enumerate(self.names, 1):
            self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", name], i, f"slurmd-{name}.out")
        self._wait(self._all_idle, timeout_s, "the nodes did not come up idle")

    def _all_idle(self) -> bool:
        for log, proc in self.daemons:
            if proc.poll() is not None:
                logs = "\n".join(
                    f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.directory / "logs").iterdir())
                )
                raise RuntimeError(f"a daemon ended ({log}: exit code {proc.returncode}):\n{logs}")
        out = self.client(["sinfo", "--noheader", "--format=%t"], check=False).stdout.split()
        return len(out) > 0 and all(state == "idle" for state in out)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout_s} s (logs in {self.directory / 'logs'})")
            time.sleep(0.2)

    def client(self, args: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, sbatch, scontrol...) run on the controller's host."""
        return subprocess.run(
            self.nodes.entered(len(self.nodes.names), args),
            capture_output=True,
            text=True,
            check=check,
            env=kwargs.pop("env", self.env),
            **kwargs,
        )

    def sbatch(self, args: list[str], **kwargs) -> int:
        """Submit a batch job (sbatch ``args``); its id."""
        out = self.client(["sbatch", "--parsable", *args], **kwargs).stdout.strip()
        return int(out.split(";")[0])

    def state(self, job: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED...), from squeue while it is queued or running, then
        from scontrol (which keeps an ended job for MinJobAge, 300 s)."""
        out = self.client(["scontrol", "show", "job", "-o", str(job)], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.removeprefix("JobState=")
        return "UNKNOWN"

    def wait(self, job: int, timeout_s: float) -> str:
        """Wait for the job to end (polling: ``sbatch --wait`` polls every 10 s); its final state."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job)) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
            if time.monotonic() > deadline:
                self.client(["scancel", str(job)], check=False)
                raise TimeoutError(f"job {job} still {state} after {timeout_s} s")
            time.sleep(0.5)
        return state

    def close(self) -> None:
        """Stop the daemons (by pid; munged last, as the others use it), then the nodes (whatever jobs left there) and
        their namespaces."""
        for _, proc in reversed(self.daemons):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.nodes.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
