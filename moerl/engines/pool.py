"""Engine replicas the job (or ``moerl engines``) starts on this node: SGLang servers on their own GPUs with the flags
RL needs, or moerl's embedded or simulated engines, which speak the same HTTP API. Each replica is started,
health-checked, restarted when it dies (within a bound), optionally fronted by sglang-router, and stopped with its whole
process group.

The client talks to the replicas directly (least-loaded dispatch in :class:`~moerl.engines.client.EngineClient`) or to
the router's single URL.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from moerl.checkpoint.hf import read_config
from moerl.engines import sglang
from moerl.engines.client import health
from moerl.engines.delta import LOAD_FORMAT
from moerl.engines.protocol import DEFAULT_SAMPLING_MASK_MAX_TOKENS
from moerl.engines.sglang import sglang_problem
from moerl.env import child_env, die_with_parent, free_ports, group_left
from moerl.models import SGLANG_PRM_GAP, is_classifier, is_process_reward_model

log = logging.getLogger("moerl.engines")
# How often a start asks its replicas for /health: a replica is used this soon after it answers (a refused connection
# or SGLang's 503 before its warm-up costs a few milliseconds).
HEALTH_POLL_S = 0.2


@dataclass
class EnginePoolConfig:
    model_path: str
    # sglang | embedded (moerl serve: the same HTTP API, runs on CPU) | simulated (moerl serve --simulate)
    server: str = "sglang"
    replicas: int = 1
    gpus_per_replica: int = 1  # the tensor-parallel size of each replica
    host: str = "127.0.0.1"
    base_port: int = 30000  # replica i serves on base_port + i; 0: free ports picked at start (see EnginePool.start)
    dtype: str = "bfloat16"
    mem_fraction_static: float = 0.7
    kv_tokens: int | None = None  # SGLang's --max-total-tokens (None: its own sizing on a GPU, CPU_KV_TOKENS on a CPU)
    sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS
    enable_memory_saver: bool = True  # release/resume memory occupation around training
    # released weights come back from host memory on resume (a colocated model no push reaches: a reward model)
    weights_cpu_backup: bool = False
    lora_max_rank: int | None = None  # set to serve LoRA adapters (per-expert keys need triton_v2)
    lora_target_modules: list[str] | None = (
        None  # with lora_max_rank: the adapters' Hub modules (lora_target_modules())
    )
    router: bool = False  # front the replicas with sglang-router
    router_port: int = 29000
    log_dir: str | None = None
    extra_args: list[str] = field(default_factory=list)
    gpu_offset: int = 0  # first visible GPU for the engines (the trainer's ranks use those before it)
    simulate: str | None = None  # server simulated: the profile (moerl.simulation)
    time_scale: float = 1.0  # server simulated: simulated seconds per real second
    replicas_per_process: int = 1  # server simulated: replicas one process serves (each costs an interpreter otherwise)


def server_args(cfg: EnginePoolConfig, port: int, cuda: bool = True) -> list[str]:
    """``sglang.launch_server`` arguments of the replica serving on ``port``, on GPUs or (``cuda`` false) the CPU. A
    sequence classifier is served at /classify; a MoE model returns its routing. Never a process reward model, which
    config refuses on SGLang (:data:`~moerl.models.SGLANG_PRM_GAP`): a ValueError here."""
    model = read_config(cfg.model_path)
    if is_process_reward_model(model.get("architectures") or []):
        raise ValueError(f"{cfg.model_path} is a process reward model: {SGLANG_PRM_GAP}")
    args = [
        "--model-path",
        cfg.model_path,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--tp-size",
        str(cfg.gpus_per_replica),
        "--dtype",
        cfg.dtype,
        "--mem-fraction-static",
        str(cfg.mem_fraction_static),
    ]
    if is_classifier(model.get("architectures") or []):
        args.append("--is-embedding")
    else:
        # Keep Sampling Mask: the top-k/top-p kept set of each sampled token.
        args += ["--sampling-mask-max-tokens", str(cfg.sampling_mask_max_tokens)]
        # moerl's loader of delta pushes (sync.delta); registering it imports nothing until a push names it
        args += ["--custom-weight-loader", LOAD_FORMAT]
    if "num_experts_per_tok" in model:
        # Keep Routing: every token's routed experts come back with the completion (a dense model has none, and
        # SGLang's capturer fails at start for it).
        args.append("--enable-return-routed-experts")
    if not cuda:
        args += sglang.cpu_args(cfg.kv_tokens)
    elif cfg.kv_tokens is not None:
        args += ["--max-total-tokens", str(cfg.kv_tokens)]
    # On the CPU the memory saver would need libcuda: the scheduler dies at start.
    if cfg.enable_memory_saver and cuda:
        args.append("--enable-memory-saver")
    if cfg.weights_cpu_backup:
        args.append("--enable-weights-cpu-backup")
    if cfg.lora_max_rank is not None:
        if not cfg.lora_target_modules:
            raise ValueError(
                "a LoRA server needs the adapters' target modules: lora_target_modules(model, lora.targets)"
            )
        args += [
            "--enable-lora",
            "--max-lora-rank",
            str(cfg.lora_max_rank),
            "--lora-target-modules",
            *cfg.lora_target_modules,
            # Per-expert adapter keys (experts.<i>.<proj>) need the triton_v2 backend, which does
            # not run with an all-to-all MoE backend, and whose routed-expert LoRA layer refuses to
            # start (a ValueError per MoE layer) under any MoE runner but a LoRA one.
            "--lora-backend",
            "triton_v2",
            "--moe-a2a-backend",
            "none",
            "--moe-runner-backend",
            "lora_triton",
        ]
    return args + list(cfg.extra_args)


def launch_args(cfg: EnginePoolConfig, ports: list[int], cuda: bool = True) -> list[str]:
    """``python`` arguments that start a replica of ``cfg.server`` on each of ``ports`` (several: simulated replicas
    only), on GPUs or (``cuda`` false) the CPU."""
    if cfg.server == "simulated":
        return [
            "-m",
            "moerl.cli",
            "serve",
            "--simulate",
            str(cfg.simulate),
            "--time-scale",
            str(cfg.time_scale),
            "--model",
            cfg.model_path,
            "--host",
            cfg.host,
            "--ports",
            ",".join(map(str, ports)),
            "--sampling-mask-max-tokens",
            str(cfg.sampling_mask_max_tokens),
            *cfg.extra_args,
        ]
    if len(ports) != 1:
        raise ValueError(f"engines.server={cfg.server!r} serves one replica per process, not {len(ports)}")
    port = ports[0]
    if cfg.server == "sglang":
        return ["-m", "sglang.launch_server", *server_args(cfg, port, cuda)]
    if cfg.server == "embedded":
        return [
            "-m",
            "moerl.cli",
            "serve",
            "--model",
            cfg.model_path,
            "--host",
            cfg.host,
            "--port",
            str(port),
            "--dtype",
            cfg.dtype,
            "--device",
            "cuda" if cuda else "cpu",
            "--sampling-mask-max-tokens",
            str(cfg.sampling_mask_max_tokens),
            *(["--enable-weights-cpu-backup"] if cfg.weights_cpu_backup else []),
            *cfg.extra_args,
        ]
    raise ValueError(f"engines.server={cfg.server!r}: expected sglang, embedded or simulated")


def router_args(cfg: EnginePoolConfig, urls: list[str]) -> list[str]:
    return ["--worker-urls", *urls, "--host", cfg.host, "--port", str(cfg.router_port), "--policy", "round_robin"]


class EnginePool:
    """Start, health-check, restart and stop the engine replicas (and the router)."""

    def __init__(self, cfg: EnginePoolConfig, python: str | None = None):
        """``python``: the interpreter SGLang servers and the router run with (default
        :func:`~moerl.engines.sglang.server_python`); moerl's own engines run with this one."""
        self.cfg = cfg
        self.python = sys.executable
        if cfg.server == "sglang":
            chosen = python or sglang.server_python()
            if chosen is None:
                raise RuntimeError(f"engines.server=sglang: {sglang_problem()}")
            self.python = chosen
        self.procs: list[subprocess.Popen] = []  # the replicas in order, then the router
        self.ports: list[int] = [cfg.base_port + i for i in range(cfg.replicas)] if cfg.base_port else []
        self.logs: dict[int, Path] = {}  # pid -> log file
        self.log_offsets: dict[int, int] = {}  # pid -> where its part of the log starts
        self.restarts: dict[int, int] = {}  # replica -> times restarted by revive()
        self._restarted_at: dict[int, deque[float]] = {}  # replica -> when revive() restarted it, within the window
        self.given_up: set[int] = set()  # replicas restarted too often within the window: left dead
        self._next_restart: dict[int, float] = {}  # replica -> earliest monotonic time of its next restart (backoff)
        self._failed_starts: dict[int, int] = {}  # replica -> restarts in a row not yet seen answering /health
        # replica -> [when revive() first found its dead server's processes running, when it last said so]
        self._left_since: dict[int, list[float]] = {}

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://{self.cfg.host}:{port}" for port in self.ports]

    @property
    def urls(self) -> list[str]:
        """What the client should talk to: the router when there is one, else every replica."""
        return [f"http://{self.cfg.host}:{self.cfg.router_port}"] if self.cfg.router else self.replica_urls

    def _gpus(self, replica: int) -> str | None:
        if self.cfg.server == "simulated" or not _has_cuda():  # on the CPU
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        need = self.cfg.gpu_offset + self.cfg.replicas * self.cfg.gpus_per_replica
        devices = visible.split(",") if visible else [str(i) for i in range(_gpu_count())]
        if len(devices) < need:
            raise RuntimeError(
                f"{self.cfg.replicas} replicas x {self.cfg.gpus_per_replica} GPUs after {self.cfg.gpu_offset} "
                f"trainer GPU(s) need {need} GPUs; {len(devices)} visible"
            )
        start = self.cfg.gpu_offset + replica * self.cfg.gpus_per_replica
        return ",".join(devices[start : start + self.cfg.gpus_per_replica])

    def _spawn(self, args: list[str], env: dict, name: str, append: bool = False) -> subprocess.Popen:
        """Start ``args`` writing to its log (the child keeps the file; this process closes its own copy)."""
        if not self.cfg.log_dir:
            return self._popen(args, env, subprocess.DEVNULL)
        Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(self.cfg.log_dir) / f"{name}.log"
        with open(path, "a" if append else "w") as log:
            offset = log.tell()
            proc = self._popen(args, env, log)
        self.logs[proc.pid], self.log_offsets[proc.pid] = path, offset
        return proc

    @staticmethod
    def _popen(args: list[str], env: dict, log) -> subprocess.Popen:
        # Own process group: stopping the pool stops each server's workers too.
        return subprocess.Popen(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )

    def _spawn_replica(self, replica: int, port: int, restart: bool = False) -> subprocess.Popen:
        """A replica's server; a restart appends to its log, so the failed attempt's stays readable."""
        return self._spawn_replicas(replica, [port], restart)

    def _spawn_replicas(self, first: int, ports: list[int], restart: bool = False) -> subprocess.Popen:
        """The server of replicas ``first``, ``first + 1`` ... on ``ports`` (one process)."""
        gpus = self._gpus(first)
        cuda = _has_cuda()
        env = child_env(**({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}))
        if self.cfg.server == "sglang":
            env.update(sglang.server_env(cuda))
        return self._spawn(
            [self.python, *launch_args(self.cfg, ports, cuda)], env, f"{self.cfg.server}-{first}", append=restart
        )

    def start(self, timeout_s: float = 900) -> list[str]:
        """Start every replica (and the router) and wait until each answers ``/health``.

        With ``base_port=0`` each replica gets a port that is free when picked; a replica that finds it
        taken by the time it binds (its log says the address is in use) starts again on another port.
        """
        self.launch()
        return self.wait_started(timeout_s)

    def launch(self, avoid: Iterable[int] = ()) -> None:
        """The first half of :meth:`start`: every replica's server started, none waited for (something else, another
        pool's start, can run while they load); :meth:`wait_started` is the rest. ``avoid``: ports handed out to
        servers that may not have bound them yet (another pool's, launched too)."""
        try:
            if not self.cfg.base_port:
                self.ports = free_ports(self.cfg.replicas, avoid)
            # procs[i] is replica i's process, shared by the replicas it serves; a replica restarted gets one of its
            # own.
            per = self.cfg.replicas_per_process
            self.procs = []
            for first in range(0, len(self.ports), per):
                ports = self.ports[first : first + per]
                self.procs += [self._spawn_replicas(first, ports)] * len(ports)
        except BaseException:
            self.stop()
            raise

    def wait_started(self, timeout_s: float = 900) -> list[str]:
        """The rest of :meth:`start` after :meth:`launch`: until every replica answers (then the router); the URLs."""
        try:
            self.wait_healthy(lambda: self.replica_urls, timeout_s)
            if self.cfg.router:
                self.procs.append(
                    self._spawn(
                        [self.python, "-m", "sglang_router.launch_router", *router_args(self.cfg, self.replica_urls)],
                        child_env(),
                        "router",
                    )
                )
                self.wait_healthy(lambda: self.urls, 120)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def wait_healthy(self, urls: Callable[[], list[str]], timeout_s: float) -> None:
        """Until every URL of ``urls()`` answers ``/health``; fails at once when a process exits. A replica's server
        that finds its port taken (bound by another process since it was picked) starts again on another: one that
        exits, or one that stays up, unable to serve (SGLang's does); on a port of ``base_port``'s, it fails."""
        deadline = time.monotonic() + timeout_s
        healthy: set[str] = set()
        restarts = 0
        while pending := [url for url in urls() if url not in healthy]:
            for i, proc in enumerate(self.procs):
                if i and proc is self.procs[i - 1]:  # a process serving several replicas: once
                    continue
                replica = i < len(self.ports)
                if proc.poll() is None and not (replica and self.replica_urls[i] in pending):
                    continue
                taken = replica and "address already in use" in self._log_of(proc).lower()
                if taken and not self.cfg.base_port and restarts < 3:
                    restarts += 1
                    self._end(proc)
                    served = [j for j in range(i, len(self.ports)) if self.procs[j] is proc]
                    others = [port for j, port in enumerate(self.ports) if j not in served]
                    for j, port in zip(served, free_ports(len(served), avoid=others), strict=True):
                        self.ports[j] = port
                    restarted = self._spawn_replicas(i, [self.ports[j] for j in served], restart=True)
                    for j in served:
                        self.procs[j] = restarted
                    continue
                if proc.poll() is None and not taken:
                    continue
                said = self._last_words(proc)
                self._end(proc)
                what = f"found its address taken (port {self.ports[i]})" if taken else "exited during start-up"
                # !s: its args are the list of str it was started with, never the bytes typeshed allows
                raise RuntimeError(f"an engine process {what}: {proc.args!s}{said}")
            healthy.update(url for url, up in zip(pending, health(pending), strict=True) if up)
            waiting = [url for url in urls() if url not in healthy]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"engines not healthy after {timeout_s:.0f} s: {waiting}")
            if waiting:
                time.sleep(HEALTH_POLL_S)

    def _log_of(self, proc: subprocess.Popen) -> str:
        """What ``proc`` wrote to its log (a restarted replica's log holds its earlier servers' too)."""
        if (log := self.logs.get(proc.pid)) is None:
            return ""
        with open(log, "rb") as f:
            f.seek(self.log_offsets.get(proc.pid, 0))
            return f.read().decode(errors="replace")

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        """SIGKILL ``proc``'s process group (its server's workers too) and reap it."""
        _kill_group(proc.pid)
        proc.wait()

    def _last_words(self, proc: subprocess.Popen) -> str:
        log = self.logs.get(proc.pid)
        if log is None:
            return " (set log_dir to keep its log)"
        return f"; the end of {log}:\n{self._log_of(proc)[-3000:]}"

    def exited(self) -> list[str]:
        """Each replica whose server has exited (not restarted yet), with the end of its log: what explains an error
        that the replica's absence caused."""
        said: set[int] = set()
        found = []
        for i, proc in enumerate(self.procs[: len(self.ports)]):
            if proc.poll() is not None and proc.pid not in said:
                said.add(proc.pid)
                url = self.replica_urls[i]
                found.append(f"engine {i} ({url}) exited with {proc.returncode}{self._last_words(proc)}")
        return found

    def kill(self, urls: list[str]) -> list[str]:
        """SIGKILL the servers of those of ``urls`` this pool started, for :meth:`revive` to start them again; those."""
        killed = [url for url in urls if url in self.replica_urls]
        for url in killed:
            _kill_group(self.procs[self.replica_urls.index(url)].pid)
        return killed

    def revive(self, max_restarts: int, window_s: float = math.inf) -> list[str]:
        """Start again, on its own port and devices, each replica whose process has exited, once every process of its
        server has ended (what is left of it is killed here). A replica that would be restarted more than
        ``max_restarts`` times within ``window_s`` seconds (a crash loop) is given up on, for good; one that fails now
        and then is always restarted. Restarts that follow each other without the replica ever answering /health in
        between back off: 1, 2, 4 ... s; one that came up resets that. Returns the URLs restarted; each is reachable
        once it answers /health, and serves the model it started from until a weight sync reaches it."""
        now, restarted = time.monotonic(), []
        unconfirmed = [i for i in range(len(self.ports)) if self._failed_starts.get(i) and self.procs[i].poll() is None]
        for i, up in zip(
            unconfirmed, health([self.replica_urls[i] for i in unconfirmed]) if unconfirmed else [], strict=True
        ):
            if up:
                self._failed_starts[i], self._next_restart[i] = 0, 0.0
        for i, port in enumerate(self.ports):
            proc = self.procs[i]
            done = self.restarts.get(i, 0)
            if proc.poll() is None or i in self.given_up or now < self._next_restart.get(i, 0.0):
                continue
            recent = self._restarted_at.setdefault(i, deque())
            while recent and recent[0] <= now - window_s:
                recent.popleft()
            if len(recent) >= max_restarts:
                self.given_up.add(i)
                log.error(
                    "engine %d (port %d) exited with %s after %d restarts within %g s: not started again; its log: %s",
                    i,
                    port,
                    proc.returncode,
                    len(recent),
                    window_s,
                    self.logs.get(proc.pid),
                )
                continue
            _kill_group(proc.pid)  # its workers (SGLang's scheduler processes) may outlive it, holding its GPUs
            # A GPU's memory is free once every process that held it has ended: a server started before then finds too
            # little and fails, which costs one of the replica's restarts. A later call starts it.
            if left := group_left(proc.pid):
                since, said = self._left_since.setdefault(i, [now, -math.inf])
                if now - said >= 60:  # at once, then each minute
                    log.warning(
                        "engine %d (port %d) exited with %s; processes of its server still running (pids %s) after "
                        "SIGKILL, for %.0f s: it is started again once they have ended",
                        i,
                        port,
                        proc.returncode,
                        left[:8],
                        now - since,
                    )
                    self._left_since[i][1] = now
                continue
            self._left_since.pop(i, None)
            log.warning(
                "engine %d (port %d) exited with %s: restart %d (%d of %d within %g s); its log: %s",
                i,
                port,
                proc.returncode,
                done + 1,
                len(recent) + 1,
                max_restarts,
                window_s,
                self.logs.get(proc.pid),
            )
            self.procs[i] = self._spawn_replica(i, port, restart=True)
            self.restarts[i] = done + 1
            recent.append(now)
            failed = self._failed_starts.get(i, 0)
            self._next_restart[i] = now + (2.0 ** (failed - 1) if failed else 0.0)
            self._failed_starts[i] = failed + 1
            restarted.append(self.replica_urls[i])
        return restarted

    def stop(self, grace_s: float = 30) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []

    def __enter__(self) -> EnginePool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads, if any of it is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def route_address(host: str = "192.0.2.1") -> str | None:
    """This host's address on its route to ``host`` (no packet is sent; the default, in TEST-NET-1, picks the default
    route), else the one its hostname resolves to; None where neither is known."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return None
