"""The main job's config: typed omegaconf sections, read from YAML plus ``key=value`` overrides.

Unknown keys, wrong types and impossible combinations fail at load time with the key named.

Values are read as YAML 1.2 reads them, not YAML 1.1: only ``true``/``false`` are booleans, so an enum
value such as ``trainer.replay.routing=off`` stays the string ``off`` (boolean fields still take
``on``/``off``/``yes``/``no``: omegaconf converts those strings). On the command line a string field
takes its text verbatim (``task.system_prompt=Answer: yes`` is that sentence, ``run.dir=0123`` a
directory named 0123); quote it to have it read as YAML.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moerl.choices import check_choices, choices, literal_text
from moerl.engines.protocol import MAX_N
from moerl.errors import ConfigError, MoerlError
from moerl.megatron.lora_config import LoRAConfig
from moerl.rewards.judge import DEFAULT_JUDGE_PROMPT
from moerl.tasks import TaskConfig
from moerl.trainer.config import TrainerConfig

Mode = Literal["sync", "periodic", "async"]
Placement = Literal["separate", "colocated"]
Partial = Literal["in_place", "retry"]
SchedulePolicy = Literal["groups", "length_aware"]
Server = Literal["auto", "sglang", "embedded"]
# auto: bfloat16 with CUDA, float32 without; else MODEL_DTYPES
EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "fp8"]
SyncMethod = Literal["broadcast", "disk"]
Resume = Literal["false", "true", "auto"]


@dataclass
class RunSection:
    dir: str = "runs/qwen_moe_grpo"
    mode: Mode = "async"  # sync (generate, train, sync) | periodic (on-policy, overlapped) | async (bounded staleness)
    # separate: engines on GPUs of their own | colocated: engines on the trainer's GPUs, their memory released while it
    # trains, weights handed over on the machine (update_weights_from_tensor; sync.method is not read)
    placement: Placement = "separate"
    steps: int = 40  # optimizer steps (policy versions) to reach
    save_every: int = 0  # trainer checkpoint every N steps (0: only the last step)
    # false: a new run (refused where dir holds one) | true: continue from the newest checkpoint under dir (one must be
    # there) | auto: continue if there is one, else start: for launchers that start the job again (torchrun
    # --max-restarts)
    resume: Resume = "false"
    cache_dir: str = "~/.cache/moerl"  # the tiny demo model and converted checkpoints, made once
    progress: bool = True  # a progress bar on stderr (rank 0)
    trainer_ranks: int = 0  # torchrun ranks of the trainer (0: trainer.tp * pp * ep); the rest of the node's GPUs serve
    device_memory_gb: float | None = (
        None  # GPU memory the memory plan is made for (default: the visible GPU's, else 80)
    )
    # A trainer rank not heard from for this long (its node's network or process gone) stops the job: collectives wait
    # for hours (moerl.megatron.peers)
    peer_silence_s: float = 60.0

    def __post_init__(self) -> None:
        check_choices(self, "run")
        if not self.peer_silence_s > 0:
            raise ConfigError(f"run.peer_silence_s must be > 0 (got {self.peer_silence_s})")


@dataclass
class ModelSection:
    path: str | None = None  # HF model directory; null: the tiny warmed-up Qwen3-MoE of the CPU demo
    mcore: str | None = None  # its converted Megatron checkpoint; null: converted once into the cache


@dataclass
class EngineSection:
    server: Server = "auto"  # auto: sglang with CUDA, else embedded
    urls: list[str] = field(default_factory=list)  # engines already running (multi-node); empty: start them here
    replicas: int = 1
    gpus_per_replica: int = 1
    dtype: EngineDtype = "auto"
    mem_fraction_static: float = 0.7
    # SGLang: tokens of KV cache each replica holds (--max-total-tokens); null: sized from mem_fraction_static on a GPU,
    # 16384 on the CPU (where SGLang would size it from the host's free memory)
    kv_tokens: int | None = None
    extra_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 900.0
    # Health: a generate request past this deadline marks its replica suspect, as a transport error does (a hung
    # engine is caught by it); a suspect replica is probed every health_interval_s and is dead after health_failures
    # failed probes in a row; with no healthy replica for down_timeout_s the run stops with one error.
    # null: 600 s plus what rollout.max_new_tokens take at SLOWEST_DECODE_TOKENS_PER_S, so that a response running to
    # its limit on a full replica is not cut and re-issued from scratch as if its engine hung. In a simulation it
    # counts simulated seconds, as the engines' work does.
    request_timeout_s: float | None = None
    health_interval_s: float = 2.0
    health_failures: int = 3
    down_timeout_s: float = 600.0
    # A replica the job started itself is restarted whenever it dies, unless that would be its max_restarts + 1-th
    # restart within restart_window_s (a crash loop): then it is given up on. Engines given by URL are polled back in.
    max_restarts: int = 3
    restart_window_s: float = 3600.0

    def __post_init__(self) -> None:
        check_choices(self, "engines")


@dataclass
class PolicyEngineSection(EngineSection):
    """The policy's replicas (``engines``), which the trainer's pushes reach."""

    # fp8: they serve the policy in block-wise FP8 (moerl.fp8: 128x128 weight blocks, per-token-group activations),
    # started from an FP8 copy of the checkpoint made once into run.cache_dir, every push quantized by the trainer, so
    # that they hold exactly what it computed
    quantization: Quantization = "none"

    def __post_init__(self) -> None:
        check_choices(self, "engines")


RewardKind = Literal["discriminative", "generative"]


@dataclass
class RewardEngineSection(EngineSection):
    """The reward model's replicas (``reward.engines``): as the policy's, without weight updates."""

    def __post_init__(self) -> None:
        check_choices(self, "reward.engines")


@dataclass
class ProcessEngineSection(EngineSection):
    """The process reward model's replicas (``reward.process.engines``): moerl's embedded engine serves them (SGLang
    0.5.23 serves no per-token head)."""

    server: Server = "embedded"

    def __post_init__(self) -> None:
        check_choices(self, "reward.process.engines")


@dataclass
class ProcessSection:
    """Process rewards (:mod:`moerl.rewards.process`): how a single-turn response is cut into steps (an episode's
    are its turns), and a process reward model served by engines of its own that scores every step;
    ``trainer.loss.credit`` says how step scores become token advantages."""

    separator: str = "\n\n"  # a step of a single-turn response ends at each one
    model: str | None = None  # its HF directory (a *ForTokenClassification); demo: the task's tiny one; null: none
    engines: ProcessEngineSection = field(default_factory=ProcessEngineSection)
    step_token: str = "<extra_0>"  # what the model reads after each step: one token of its tokenizer


@dataclass
class RewardSection:
    """A reward model served by engines of its own (:mod:`moerl.rewards`), scored as each group finishes;
    its score and the task's reward make the reward by ``combine``."""

    model: str | None = None  # its HF directory; null: the task's reward alone
    kind: RewardKind = "discriminative"  # a sequence-classification head (/classify), or a generative judge
    engines: RewardEngineSection = field(default_factory=RewardEngineSection)
    # model | rule_times_model | rule_plus_model | "package.module:function" f(rule_reward, model_score) -> reward
    combine: str = "model"
    # a judge's question ({prompt}, {response}, {answer}), how its greedy answer becomes a score (last_number | yes_no |
    # "package.module:function" f(text) -> float), and the most tokens it may answer with
    judge_prompt: str = DEFAULT_JUDGE_PROMPT
    verdict: str = "last_number"
    judge_max_new_tokens: int = 32
    process: ProcessSection = field(default_factory=ProcessSection)

    def __post_init__(self) -> None:
        check_choices(self, "reward")


@dataclass
class TeacherEngineSection(EngineSection):
    """The teacher's replicas (``teacher.engines``): as the policy's, without weight updates."""

    def __post_init__(self) -> None:
        check_choices(self, "teacher.engines")


@dataclass
class TeacherSection:
    """On-policy distillation's teacher (:mod:`moerl.rewards.teacher`), served by engines of its own: it scores every
    token the student sampled, given the tokens before it, as each group finishes; ``trainer.loss.distill`` says how
    the student learns from that."""

    model: str | None = None  # its HF directory (the student's tokenizer); demo: the task's tiny one; null: none
    engines: TeacherEngineSection = field(default_factory=TeacherEngineSection)


@dataclass
class ScheduleSection:
    """How the rollout manager hands a group's completions to the replicas (:mod:`moerl.orchestrator.scheduling`)."""

    # groups: a group's completions are one request (the engine shares the prompt's prefill among them), on the replica
    # running the fewest of the manager's requests. length_aware: each completion is a request of its own; the group's
    # first `probes` go first, the rest longest predicted first (a group's prediction: the longest of its finished
    # completions, else the median of all groups' last ones), each on the replica with the fewest predicted tokens left
    # to decode.
    policy: SchedulePolicy = "groups"
    probes: int = 1  # length_aware: a group's completions that go before its siblings, to learn its length
    # length_aware: the most tokens one request decodes, a tail request's excepted; a completion that goes on is asked
    # again from its output, on the replica with the fewest predicted tokens left, its routing and versions carried on
    # (0: never cut)
    chunk_tokens: int = 0
    # length_aware: requests the manager keeps running on each replica; those beyond wait in its queue, in the order
    # above (0: no bound: every request goes at once, and the engines queue what they cannot run)
    max_running: int = 0
    # length_aware: a request whose completion is predicted to run this many tokens in all (its group's prediction from
    # finished completions, or twice what it has decoded) goes to the replica running the fewest requests, so that it
    # decodes fast enough to end within its staleness window; a replica running one takes others only while it runs
    # fewer than tail_running (0: no tail requests)
    tail_tokens: int = 0
    tail_running: int = 8

    def __post_init__(self) -> None:
        check_choices(self, "rollout.schedule")


@dataclass
class RolloutSection:
    groups_per_step: int = 8  # prompts (GRPO groups) per optimizer step
    samples_per_prompt: int = 8  # group size n
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 16  # a finite top_k: the sampling mask needs one (SGLang refuses top_k=-1 with masks)
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)  # stop tokens besides the tokenizer's end token
    max_staleness: int = 1  # async: groups whose oldest token is more versions old than this are dropped
    # async depth bound (in flight + buffered); default groups_per_step * max(1, max_staleness), plus oversample
    max_outstanding_groups: int | None = None
    # Dynamic sampling (DAPO, moerl.tasks.filters): which scored groups to train on. none | zero_variance (those whose
    # rewards differ) | "package.module:function" (function(samples) -> bool). A group turned away is dropped as
    # filtered, and another prompt is issued in its place.
    filter_groups: str = "none"
    # Groups filtered while a step collects its groups past which the run stops (its data can no longer fill a step);
    # null: 4 x groups_per_step
    max_filtered_per_step: int | None = None
    oversample: int = 0  # groups issued beyond what a step needs, so that a filtered one does not hold it up
    # rollouts in flight at a weight update: in_place (continue, per-token versions) | retry (abort, regenerate)
    partial: Partial = "in_place"
    # re-issues of a prompt whose replica failed (same seed, another replica); then dropped as engine_failure
    engine_retries: int = 3
    # Processes beside the rollout manager that carry its generations: each makes the HTTP requests and reads and
    # decodes the answers (JSON, routing, kept sets: ~20 us per response token of a 48-layer top-8 model), so only
    # compact arrays reach the manager and one manager keeps up with many engines. 0: the manager does it all.
    generation_workers: int = 4
    seed: int = 0
    # Agentic episodes (moerl.episodes): "package.module:function", an ``async def agent(episode, record)`` returning
    # the episode's reward or None (the task's reward function scores its final answer); each of a group's
    # samples_per_prompt samples is then an episode of many turns, max_new_tokens each. null: one completion per sample.
    agent: str | None = None
    tools: list[str] = field(default_factory=list)  # the episodes' tools: calculator, or "package.module:TOOL"
    max_episode_tokens: int = 4096  # the most tokens an episode's stream may hold, prompt included
    episode_timeout_s: float = 600.0  # an agent past this ends its episode: a failed episode, not a failed run
    schedule: ScheduleSection = field(default_factory=ScheduleSection)

    def __post_init__(self) -> None:
        check_choices(self, "rollout")

    @property
    def outstanding(self) -> int:
        # Generation runs ahead of training by this many groups: one batch per version of staleness
        # allowed. A deeper queue only fills with groups that are dropped as stale when their turn comes.
        return (self.max_outstanding_groups or self.groups_per_step * max(1, self.max_staleness)) + self.oversample

    @property
    def filter_bound(self) -> int:
        return 4 * self.groups_per_step if self.max_filtered_per_step is None else self.max_filtered_per_step


@dataclass
class SyncSection:
    # broadcast (NCCL/gloo group with the engines) | disk (safetensors + update_weights_from_disk)
    method: SyncMethod = "broadcast"
    bucket_mb: int = 512
    # After each update: every engine reports the new version, engines agree on their weight checksums, and
    # each one's log-probs of a fixed probe are within verify_tolerance (mean |delta|) of the trainer's.
    verify: bool = False
    # default: 1e-4 where engines and trainer (FP8 engines: the engines alone) compute in fp32, else 5e-2
    verify_tolerance: float | None = None
    # Each push sends, per tensor, only the elements whose bits changed since the version the engines hold (positions
    # and values, or a bitmask and values, whichever is smaller; the tensor whole where over half changed), through
    # /update_weights_from_tensor and moerl's weight loader in the engine (moerl.engines.delta), in place of
    # sync.method's transport. Global rank 0 keeps the pushed policy in host memory to compare against.
    delta: bool = False

    def __post_init__(self) -> None:
        check_choices(self, "sync")


@dataclass
class SimulationSection:
    # A simulation profile (YAML, format in moerl/simulation.py; e.g. bench/profiles/): the job runs its own
    # orchestrator (rollout manager, buffer, modes, syncs, checkpoints, metrics) against simulated engines and a
    # simulated trainer that take their time from it, on one process for the trainer. null: a real run.
    profile: str | None = None
    time_scale: float = 1.0  # simulated seconds per real second (the orchestrator's own CPU time is real, never scaled)
    trainer_gpus: int = 8  # GPUs the simulated trainer stands for: its rate is the profile's per-GPU rate times this
    replicas_per_process: int = 8  # simulated engines one process serves (each process costs an interpreter, ~0.5 GB)


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    engines: PolicyEngineSection = field(default_factory=PolicyEngineSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sync: SyncSection = field(default_factory=SyncSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardSection = field(default_factory=RewardSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # per-expert adapters; enabled: base frozen, adapters synced alone
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    simulation: SimulationSection = field(default_factory=SimulationSection)


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's implicit types: booleans are true/false only (YAML 1.1 also
    reads on/off/yes/no/y/n, which turns ``routing=off`` into False), floats need no dot (1e-6), and
    nothing is read as a date."""


_BOOL, _FLOAT, _TIMESTAMP = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$"
        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def read_yaml(text: str) -> object:
    return yaml.load(text, Loader=_Yaml12Loader)


def schema_type(key: str) -> typing.Any:
    """The declared type of the dotted ``key`` in :class:`RunConfig` (None for a key it does not have)."""
    tp: typing.Any = RunConfig
    for part in key.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _is_text(tp: typing.Any) -> bool:
    """A string field, or an enum's (a Literal of strings: ``run.resume=true`` is the word, not a boolean)."""
    return (
        tp is str
        or choices(tp) is not None
        or (isinstance(tp, types.UnionType) and set(typing.get_args(tp)) == {str, type(None)})
    )


def override_value(key: str, text: str) -> object:
    """The value of ``key=text`` on the command line: a string or enum field's text as typed (``null`` is None
    where the field may be null; quoted text is read as YAML), anything else read as YAML 1.2."""
    tp = schema_type(key)
    if _is_text(tp) and not (len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""):
        return None if text in ("null", "~") and type(None) in typing.get_args(tp) else text
    return read_yaml(text) if text else None


def parse_overrides(overrides: list[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. run.steps=20 run.dir=/tmp/r)")
    conf = OmegaConf.create()
    for override in overrides:
        key, text = override.split("=", 1)
        OmegaConf.update(conf, key.strip(), override_value(key.strip(), text), merge=True)
    return conf


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """The YAML file (if any) and ``section.key=value`` overrides on the typed schema."""
    try:
        merged = OmegaConf.structured(RunConfig)
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            merged = OmegaConf.merge(
                merged, OmegaConf.create(literal_text(RunConfig, read_yaml(Path(path).read_text()) or {}))
            )
        merged = OmegaConf.merge(merged, parse_overrides(list(overrides)))
        cfg = OmegaConf.to_object(merged)
        assert isinstance(cfg, RunConfig), "a structured config's object is its dataclass"
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        options = choices(schema_type(key)) if key else None
        if options is not None:  # omegaconf's own words for a Literal, as this module's other choice errors read
            raise ConfigError(f"{key}={e.value!r}: expected one of {', '.join(options)}") from None
        raise ConfigError(f"config{' ' + key if key else ''}: {str(e).splitlines()[0]}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config: not valid YAML: {str(e).splitlines()[0]}") from None
    except MoerlError as e:  # a section's own check (__post_init__)
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    resolve_defaults(cfg)
    check(cfg)
    return cfg


def resolve_defaults(cfg: RunConfig) -> None:
    """Defaults that depend on other sections."""
    loss = cfg.trainer.loss
    if loss.aggregation == "seq_mean_token_sum_norm" and loss.max_response_len is None:
        # Dr. GRPO divides by a constant length: the generation limit, not the batch's longest response
        # (which would move the loss scale from step to step).
        loss.max_response_len = cfg.rollout.max_new_tokens
    replay = cfg.trainer.replay
    if replay.trace_samples and replay.trace_dir is None:
        replay.trace_dir = f"{cfg.run.dir}/replay_trace"


def served_by(engines: EngineSection, simulation: SimulationSection | None = None) -> str:
    """The engine server the job starts: simulated engines in a simulation, else ``engines.server``, with auto meaning
    SGLang where CUDA is and a usable SGLang is installed (:func:`~moerl.engines.sglang.sglang_problem`), else the
    embedded engine."""
    if simulation is not None and simulation.profile is not None:
        return "simulated"
    if engines.server != "auto":
        return engines.server
    import torch

    from moerl.engines.sglang import sglang_problem

    return "sglang" if torch.cuda.is_available() and sglang_problem() is None else "embedded"


def sglang_lora_problem(cfg: RunConfig) -> str | None:
    """Why this run's adapters cannot reach SGLang engines, if they cannot."""
    if cfg.lora.enabled and cfg.sync.method == "broadcast":
        return (
            "lora.enabled with SGLang engines needs sync.method=disk: SGLang takes adapter tensors only from processes "
            "on its own machine (pickled per TP rank), so adapters reach it as adapter directories"
        )
    return None


def check(cfg: RunConfig) -> None:
    r = cfg.rollout
    problems = []
    if r.groups_per_step < 1 or not 2 <= r.samples_per_prompt <= MAX_N:
        problems.append(
            f"rollout.groups_per_step must be >= 1 and samples_per_prompt in [2, {MAX_N}] (GRPO compares within a "
            "group)"
        )
    if r.max_staleness < 0:
        problems.append("rollout.max_staleness must be >= 0")
    if r.outstanding < r.groups_per_step:
        problems.append(
            f"rollout.max_outstanding_groups={r.max_outstanding_groups} is below groups_per_step={r.groups_per_step}: "
            "a step could never fill"
        )
    if cfg.trainer.replay.sampling_mask and not 1 < r.top_k:
        problems.append(f"trainer.replay.sampling_mask needs a finite rollout.top_k > 1 (got {r.top_k})")
    server = served_by(cfg.engines, cfg.simulation)
    if server == "sglang" and (problem := sglang_lora_problem(cfg)):
        problems.append(problem)
    if server == "sglang" and any(
        a.split("=")[0] == "--enable-deterministic-inference" for a in cfg.engines.extra_args
    ):
        problems.append(
            "engines.extra_args: --enable-deterministic-inference makes SGLang 0.5.23 sample all n completions of a "
            "prompt with one seed, so each group's completions would come out identical (no advantage to learn "
            "from); leave it out"
        )
    if server == "embedded" and cfg.engines.gpus_per_replica != 1 and not cfg.engines.urls:
        problems.append(
            f"engines.gpus_per_replica={cfg.engines.gpus_per_replica}: the embedded engine serves on one device; "
            "use engines.server=sglang for tensor-parallel replicas"
        )
    if cfg.run.steps < 1:
        problems.append("run.steps must be >= 1")
    if cfg.trainer.replay.trace_samples < 0:
        problems.append("trainer.replay.trace_samples must be >= 0")
    if r.engine_retries < 0 or r.generation_workers < 0:
        problems.append("rollout.engine_retries and rollout.generation_workers must be >= 0")
    e = cfg.engines
    if (
        min(
            1 if e.request_timeout_s is None else e.request_timeout_s,
            e.health_interval_s,
            e.down_timeout_s,
            e.restart_window_s,
        )
        <= 0
        or e.health_failures < 1
        or e.max_restarts < 0
        or (e.kv_tokens is not None and e.kv_tokens < 1)
    ):
        problems.append(
            "engines.request_timeout_s (null: derived), health_interval_s, down_timeout_s and restart_window_s must be "
            "> 0, health_failures and kv_tokens (null: sized by the server) >= 1 and max_restarts >= 0"
        )
    problems += filter_problems(r)
    problems += reward_problems(cfg)
    problems += teacher_problems(cfg)
    problems += process_problems(cfg)
    problems += scorer_engine_problems(cfg)
    problems += colocation_problems(cfg)
    problems += episode_problems(cfg)
    problems += schedule_problems(cfg)
    problems += simulation_problems(cfg)
    problems += push_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def filter_problems(r: RolloutSection) -> list[str]:
    """What dynamic sampling needs: a filter that loads, and bounds that are counts."""
    from moerl.tasks.filters import load_filter

    problems = []
    if r.filter_bound < 0 or r.oversample < 0:
        problems.append("rollout.max_filtered_per_step and rollout.oversample must be >= 0")
    try:
        load_filter(r.filter_groups)
    except ConfigError as err:
        problems.append(str(err))
    return problems


def reward_problems(cfg: RunConfig) -> list[str]:
    """What a reward model needs: functions that load, and engines that can serve it."""
    from moerl.rewards.combine import COMBINATIONS
    from moerl.rewards.judge import VERDICTS

    w = cfg.reward
    if w.model is None:
        return []
    problems = []
    for registry, value in ((COMBINATIONS, w.combine), (VERDICTS, w.verdict)):
        try:
            registry.check(value)
        except ConfigError as err:
            problems.append(str(err))
    if w.kind == "generative":
        try:
            w.judge_prompt.format(prompt="", response="", answer="")
        except (KeyError, IndexError, ValueError) as err:
            problems.append(
                f"reward.judge_prompt: {type(err).__name__} {err}: it may name {{prompt}}, {{response}} and {{answer}}"
            )
    if w.judge_max_new_tokens < 1:
        problems.append("reward.judge_max_new_tokens must be >= 1")
    if cfg.simulation.profile is not None:
        problems.append("reward.model in a simulation: simulated engines serve no reward model")
    return problems


def teacher_problems(cfg: RunConfig) -> list[str]:
    """What distillation needs: a teacher and a loss that learns from it, each with the other, and engines that can
    serve the teacher."""
    t, distill = cfg.teacher, cfg.trainer.loss.distill
    if t.model is None:
        return (
            [
                "trainer.loss.distill: distillation learns from a teacher; set teacher.model (or distill.coef=0 and "
                "distill.top_k=0)"
            ]
            if distill.enabled
            else []
        )
    problems = []
    if not distill.enabled:
        problems.append(
            f"teacher.model={t.model}: a teacher is for distillation; set trainer.loss.distill.coef > 0 (or "
            "distill.top_k > 0), or leave teacher.model null"
        )
    if cfg.simulation.profile is not None:
        problems.append("teacher.model in a simulation: simulated engines serve no teacher")
    return problems


def process_problems(cfg: RunConfig) -> list[str]:
    """What process rewards need: a separator, and engines that can serve the process reward model."""
    from moerl.models import SGLANG_PRM_GAP

    w = cfg.reward.process
    problems = [] if w.separator else ["reward.process.separator is empty: a step needs something to end it"]
    if w.model is None:
        return problems
    if not w.step_token:
        problems.append("reward.process.step_token is empty: the model reads one token after each step")
    if served_by(w.engines) == "sglang":
        problems.append(f"reward.process.engines.server=sglang: {SGLANG_PRM_GAP}")
    if cfg.simulation.profile is not None:
        problems.append("reward.process.model in a simulation: simulated engines serve no process reward model")
    return problems


def scorer_engine_problems(cfg: RunConfig) -> list[str]:
    """What the scorers' replicas the job starts need of their server: the embedded engine serves on one device."""
    return [
        f"{s.key}.engines.gpus_per_replica={s.engines.gpus_per_replica}: the embedded engine serves on one device"
        for s in started_scorers(cfg)
        if served_by(s.engines) == "embedded" and s.engines.gpus_per_replica != 1
    ]


@dataclass(frozen=True)
class Scorer:
    """A model served beside the policy that scores its samples and takes no weight update: the reward model
    (``reward``), the process reward model (``reward.process``) or the teacher (``teacher``), by the config section it
    comes from."""

    key: str  # the section: reward | reward.process | teacher
    model: str  # as configured (a directory, or demo)
    engines: EngineSection

    @property
    def started(self) -> bool:
        """Whether the job starts its replicas (not given by URL)."""
        return not self.engines.urls

    @property
    def gpus(self) -> int:
        """The GPUs its replicas take."""
        return self.engines.replicas * self.engines.gpus_per_replica


def scorers(cfg: RunConfig) -> list[Scorer]:
    """The run's scorers, reward model first: the order their pools start in and take GPUs in."""
    w = cfg.reward
    sections = (
        ("reward", w.model, w.engines),
        ("reward.process", w.process.model, w.process.engines),
        ("teacher", cfg.teacher.model, cfg.teacher.engines),
    )
    return [Scorer(key, model, engines) for key, model, engines in sections if model is not None]


def started_scorers(cfg: RunConfig) -> list[Scorer]:
    """The scorers whose replicas the job starts."""
    return [s for s in scorers(cfg) if s.started]


def colocation_problems(cfg: RunConfig) -> list[str]:
    """What colocated placement (:class:`~moerl.orchestrator.placement.Colocated`) needs: turns (the engines generate
    only while the trainer does not), engines the job starts on its own GPUs, and full weights to push (a released
    engine keeps no base weights for adapters)."""
    if cfg.run.placement != "colocated":
        return []
    problems = []
    if cfg.run.mode != "sync":
        problems.append(
            f"run.placement=colocated runs in run.mode=sync (got {cfg.run.mode}): periodic and async generate while "
            "the trainer trains, and colocated engines give their GPUs to the trainer then; set run.mode=sync, or "
            "run.placement=separate"
        )
    if cfg.engines.urls:
        problems.append(
            "run.placement=colocated: the job starts its engines on the trainer's own GPUs; leave engines.urls empty"
        )
    if cfg.lora.enabled:
        problems.append(
            "run.placement=colocated pushes full weights: released engines keep no base weights for adapters to "
            "apply to; set lora.enabled=false, or run.placement=separate"
        )
    if cfg.simulation.profile is not None:
        problems.append("run.placement=colocated: a simulation runs separate placement; leave run.placement=separate")
    return problems


def episode_problems(cfg: RunConfig) -> list[str]:
    """What agentic episodes need: an agent that loads, tools that load, and budgets that leave room for a turn."""
    r = cfg.rollout
    if r.agent is None:
        return ["rollout.tools: tools are for an agent's episodes; set rollout.agent"] if r.tools else []
    from moerl.episodes.agents import SIMULATED, load_agent, load_tools

    problems = []
    try:
        if r.agent != SIMULATED:
            load_agent(r.agent)
        load_tools(r.tools)
    except ConfigError as e:
        problems.append(str(e))
    if r.episode_timeout_s <= 0 or r.max_episode_tokens <= r.max_new_tokens:
        problems.append("rollout.episode_timeout_s must be > 0 and rollout.max_episode_tokens > max_new_tokens")
    if (cfg.simulation.profile is not None) != (r.agent == SIMULATED):
        problems.append(
            f"rollout.agent={r.agent}: simulated engines generate no text for an agent to read, so a simulation runs "
            f"rollout.agent={SIMULATED} (the episodes of its profile's episodes section) and a real run any other"
        )
    return problems


def schedule_problems(cfg: RunConfig) -> list[str]:
    """What the length-aware schedule can do: single-turn groups (an episode's turns keep to its group's replica),
    and cut requests only where a completion may go on across versions under the weights' own version names."""
    r, s = cfg.rollout, cfg.rollout.schedule
    if s.policy == "groups":
        return []
    problems = []
    if not 0 <= s.probes < r.samples_per_prompt or min(s.chunk_tokens, s.max_running, s.tail_tokens) < 0:
        problems.append(
            f"rollout.schedule.probes must be in [0, samples_per_prompt={r.samples_per_prompt}) and chunk_tokens, "
            "max_running and tail_tokens >= 0"
        )
    if s.tail_running < 1:
        problems.append(f"rollout.schedule.tail_running must be >= 1, got {s.tail_running}")
    if r.agent is not None:
        problems.append(
            "rollout.schedule.policy=length_aware schedules single-turn groups; an agent's episodes keep each group "
            "on one replica (its prompt's prefix): set rollout.schedule.policy=groups"
        )
    if s.chunk_tokens and r.partial != "in_place":
        problems.append(
            "rollout.schedule.chunk_tokens: a cut completion goes on under the policy of its next request, which "
            "rollout.partial=retry forbids; set rollout.partial=in_place or chunk_tokens=0"
        )
    if s.chunk_tokens and cfg.lora.enabled:
        problems.append(
            "rollout.schedule.chunk_tokens with lora.enabled: a completion's chunks may use different adapters under "
            "one weight version, which its per-token versions cannot tell apart; set chunk_tokens=0"
        )
    return problems


def simulation_problems(cfg: RunConfig) -> list[str]:
    """What a simulation cannot do: it has no weights to read back or adapters to train, and one trainer process."""
    s = cfg.simulation
    if s.profile is None:
        return []
    problems = []
    if not s.time_scale > 0 or s.trainer_gpus < 1 or s.replicas_per_process < 1:
        problems.append("simulation.time_scale must be > 0, simulation.trainer_gpus and replicas_per_process >= 1")
    if cfg.sync.verify:
        problems.append("sync.verify: simulated engines hold no weights to check; set sync.verify=false")
    if cfg.lora.enabled:
        problems.append("lora.enabled: the simulation moves full weights only; set lora.enabled=false")
    if cfg.engines.server != "auto" and not cfg.engines.urls:
        problems.append(
            f"engines.server={cfg.engines.server}: a simulation serves simulated engines; leave engines.server=auto"
        )
    if cfg.trainer.replay.trace_samples:
        problems.append("trainer.replay.trace_samples: the simulated trainer runs no routers to trace; set it to 0")
    return problems


def push_problems(cfg: RunConfig) -> list[str]:
    """What FP8 engines (``engines.quantization``) and delta pushes (``sync.delta``) need: full weights of the
    policy pushed to engines of their own."""
    problems = []
    fp8, delta = cfg.engines.quantization == "fp8", cfg.sync.delta
    for wanted, key in ((fp8, "engines.quantization=fp8"), (delta, "sync.delta=true")):
        if not wanted:
            continue
        if cfg.lora.enabled:
            problems.append(f"{key} pushes full weights: lora.enabled pushes adapters only; set lora.enabled=false")
        if cfg.simulation.profile is not None:
            problems.append(f"{key}: simulated engines hold no weights; leave it out of a simulation")
    if delta and cfg.run.placement == "colocated":
        problems.append(
            "sync.delta=true: colocated engines take the weights from the trainer's own GPUs (no bytes cross a "
            "network); set sync.delta=false"
        )
    if delta and cfg.sync.method != "broadcast":
        problems.append(
            f"sync.delta=true sends every push through /update_weights_from_tensor; sync.method={cfg.sync.method} "
            "would not be used: leave sync.method=broadcast"
        )
    return problems


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# Per request, below a full replica's rate for the models the recipes serve: Qwen3-30B-A3B on an H100 EP2 replica
# decodes 4664 tokens/s over 128 running requests, 36 each (bench/profiles/qwen3_30b_a3b_h100.yaml), so a 32K-token
# response takes about 900 s there, past a fixed 600 s deadline.
SLOWEST_DECODE_TOKENS_PER_S = 20.0


def request_timeout_real_s(cfg: RunConfig) -> float:
    """A generate request's deadline in real seconds: ``engines.request_timeout_s``, or by default 600 s plus
    ``rollout.max_new_tokens`` at :data:`SLOWEST_DECODE_TOKENS_PER_S`. A simulation's engines take a response's
    simulated time divided by ``simulation.time_scale``: its deadline is scaled alike, or at time x0.5 a 600 s deadline
    would cut every response past 300 simulated seconds (long ones were re-issued from scratch at 32 trainer + 96 engine
    GPUs)."""
    e = cfg.engines
    deadline = (
        e.request_timeout_s
        if e.request_timeout_s is not None
        else 600.0 + cfg.rollout.max_new_tokens / SLOWEST_DECODE_TOKENS_PER_S
    )
    return deadline / (cfg.simulation.time_scale if cfg.simulation.profile else 1.0)
