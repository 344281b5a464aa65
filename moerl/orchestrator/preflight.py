"""What the job checks before any rank starts (the recipe runs it before torchrun, rank 0 again at start): the
layout, the run directory, the engines given by URL, the task, the model's config and tensors, and the memory plan.
Every problem is one :class:`~moerl.errors.ConfigError` naming it."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.errors import ConfigError
from moerl.orchestrator.config import RunConfig, served_by, sglang_lora_problem
from moerl.orchestrator.run_state import latest_checkpoint
from moerl.tasks import DEMO, DEMO_REWARD_MODELS

if TYPE_CHECKING:
    from moerl.engines.protocol import ServerInfo
    from moerl.orchestrator.memory import MemoryPlan
    from moerl.simulation import Profile


def trainer_world_size(cfg: RunConfig) -> int:
    if cfg.simulation.profile is not None:
        return 1  # one process stands for the simulated trainer
    t = cfg.trainer
    return cfg.run.trainer_ranks or t.tp * t.pp * t.ep


def check_layout(cfg: RunConfig, world: int) -> None:
    from moerl.layout import Layout, LayoutError

    if cfg.simulation.profile is not None:
        if world != 1:
            raise ConfigError(
                f"simulation.profile: a simulated trainer runs as one process, not {world} (launch the recipe, which "
                "starts one)"
            )
        return
    try:
        Layout(tp=cfg.trainer.tp, pp=cfg.trainer.pp, ep=cfg.trainer.ep).check_world(world)
    except LayoutError as e:
        raise ConfigError(
            f"trainer layout (tp={cfg.trainer.tp}, pp={cfg.trainer.pp}, ep={cfg.trainer.ep}) on {world} rank(s): {e}"
        ) from None


def check_model(cfg: RunConfig, hf: Path, converting: bool) -> None:
    """The model at ``hf`` can be trained at the configured layout (and, when it is to be converted, its
    tensors are all there with the right shapes): one error line before minutes of preparation."""
    from moerl.checkpoint.hf import HFReader, check_hf_tensors, read_config
    from moerl.layout import Layout
    from moerl.models import family_for

    raw = read_config(hf)
    family = family_for(raw)
    model = family.normalize(raw)
    family.check(model)
    family.check_layout(model, Layout(tp=cfg.trainer.tp, pp=cfg.trainer.pp, ep=cfg.trainer.ep))
    if converting:
        check_hf_tensors(HFReader(hf), family, model)


def preflight(cfg: RunConfig, world: int) -> None:
    """Everything that can be checked before the ranks start (the recipe runs it before torchrun): the
    layout, the run directory, the engines given by URL, the task and the model's config and tensors."""
    check_layout(cfg, world)
    run_dir = Path(cfg.run.dir)
    if (run_dir / "metrics.jsonl").exists() and cfg.run.resume == "false":
        raise ConfigError(
            f"run.dir={run_dir} already holds a run: pass run.resume=true to continue it, or choose another run.dir"
        )
    if cfg.run.resume == "true" and latest_checkpoint(run_dir) is None:
        raise ConfigError(
            f"run.resume=true: {run_dir / 'checkpoints'} holds no checkpoint to continue from "
            "(run.resume=auto starts the run where there is none)"
        )
    if cfg.engines.urls:
        check_engine_urls(
            cfg.engines.urls,
            simulated=cfg.simulation.profile is not None,
            sglang_refused=sglang_lora_problem(cfg),
            served=cfg.model.path,
        )
    elif cfg.engines.server == "sglang":
        from moerl.engines.sglang import sglang_problem

        if problem := sglang_problem():
            raise ConfigError(f"engines.server=sglang: {problem}; or set engines.server=embedded")
    if not cfg.engines.urls and served_by(cfg.engines, cfg.simulation) == "sglang" and cfg.model.path is not None:
        check_served_right(cfg.model.path, "model.path", "engines.server=embedded")
    check_task(cfg)
    check_reward(cfg)
    profile = simulation_profile(cfg)
    if (model_path := model_dir(cfg, profile)) is not None:
        hf = Path(model_path)
        if not (hf / "config.json").is_file():
            raise ConfigError(f"model.path={hf} is not a HF model directory (no config.json)")
        check_model(cfg, hf, converting=profile is None and not cfg.model.mcore)
    if profile is None:  # a simulation's trainer holds no memory to plan
        print(memory_plan(cfg, world, checked=True).table(), file=sys.stderr)


def simulation_profile(cfg: RunConfig) -> Profile | None:
    """The :class:`~moerl.simulation.Profile` of a simulation (one that times a trainer too), None for a real run."""
    from moerl.simulation import Profile

    if cfg.simulation.profile is None:
        return None
    profile = Profile.load(cfg.simulation.profile)
    if profile.trainer is None:
        raise ConfigError(
            f"simulation.profile={cfg.simulation.profile} has no trainer section: the job's simulation needs its "
            "trainer's rate (tokens_per_s_per_gpu, optimizer_step_s)"
        )
    if cfg.rollout.agent is not None and profile.episodes is None:
        raise ConfigError(
            f"rollout.agent={cfg.rollout.agent}: simulation.profile={cfg.simulation.profile} has no episodes section "
            "(turns, tool_seconds, observation_tokens) for the simulated agent to follow"
        )
    return profile


def model_dir(cfg: RunConfig, profile: Profile | None) -> str | None:
    """The HF directory given for the run (a simulation's profile may name one), None for the CPU demo's tiny model."""
    return cfg.model.path or (profile.model if profile is not None else None)


def memory_plan(cfg: RunConfig, world: int, checked: bool) -> MemoryPlan:
    """The memory plan (:mod:`moerl.orchestrator.memory`) of the configured model on ``world`` trainer ranks;
    ``checked``: a plan that does not fit raises :class:`ConfigError`."""
    from moerl.checkpoint.hf import HFReader, read_config
    from moerl.orchestrator import memory

    if cfg.model.path is None:
        from moerl.models.tiny import ALL_SPARSE, TINY_QWEN3

        model_config = dict(TINY_QWEN3, **ALL_SPARSE, architectures=["Qwen3MoeForCausalLM"])
    else:
        model_config = read_config(cfg.model.path)
    reward_params = 0
    if cfg.reward.model == DEMO:  # made with the engines, after this plan
        from moerl.models.tiny import tiny_param_count

        reward_params = tiny_param_count("Qwen3ForSequenceClassification")
    elif cfg.reward.model is not None:
        reader = HFReader(cfg.reward.model)
        reward_params = sum(math.prod(reader.shape(name)) for name in reader.names())
    return (memory.check if checked else memory.plan_for)(cfg, model_config, world, reward_params)


def check_task(cfg: RunConfig) -> None:
    """The prompts load and the reward function resolves, before the rollout manager needs them."""
    from moerl.rewards import Rewarder
    from moerl.tasks import DEMO_MODELS, load_records

    if model_dir(cfg, simulation_profile(cfg)) is None and cfg.task.name not in DEMO_MODELS:
        raise ConfigError(
            f"task.name={cfg.task.name} has no demo model: set model.path (demo models: {', '.join(DEMO_MODELS)})"
        )
    load_records(cfg.task)
    Rewarder(cfg.task)


def check_reward(cfg: RunConfig) -> None:
    """The reward model is a model directory of the configured kind, and its engines given by URL answer."""
    from moerl.checkpoint.hf import CheckpointError, read_config
    from moerl.models import is_classifier, unserved_classifier

    w = cfg.reward
    if w.model is None:
        return
    if w.model == DEMO:
        if cfg.task.name not in DEMO_REWARD_MODELS:
            raise ConfigError(
                f"reward.model=demo: task.name={cfg.task.name} has no demo reward model (those that have one: "
                f"{', '.join(DEMO_REWARD_MODELS)}); set reward.model to a model directory"
            )
        architectures = ["Qwen3ForSequenceClassification"]
    else:
        try:
            architectures = read_config(w.model).get("architectures") or []
        except CheckpointError as e:
            raise ConfigError(f"reward.model: {e}") from None
    if problem := unserved_classifier(architectures):
        raise ConfigError(f"reward.model={w.model}: {problem}")
    classifier = is_classifier(architectures)
    if (w.kind == "discriminative") != classifier:
        raise ConfigError(
            f"reward.model={w.model} is {'a sequence-classification' if classifier else 'a generative'} model "
            f"({', '.join(architectures) or 'no architectures named'}), and reward.kind={w.kind}: set "
            f"reward.kind={'discriminative' if classifier else 'generative'}"
        )
    given = None if w.model == DEMO else w.model  # the demo's is made later, as SGLang serves it
    if w.engines.urls:
        check_engine_urls(w.engines.urls, key="reward.engines.urls", served=given)
    elif served_by(w.engines) == "sglang" and given is not None:
        check_served_right(given, "reward.model", "reward.engines.server=embedded")


def check_served_right(model: str | Path, key: str, instead: str) -> None:
    """SGLang serves the model at ``model`` (``key``'s) as transformers computes it (:func:`~moerl.engines.sglang.
    served_wrong`); ``instead``: what else serves it."""
    from moerl.engines.sglang import served_wrong

    if problem := served_wrong(model):
        raise ConfigError(f"{key}: {problem}; serve it with {instead}, or change the checkpoint")


def check_engine_urls(
    urls: list[str],
    simulated: bool = False,
    sglang_refused: str | None = None,
    key: str = "engines.urls",
    served: str | Path | None = None,
) -> None:
    """Every engine answers, those that are SGLang servers run a release whose API moerl speaks (and none is, with
    ``sglang_refused``: why this run cannot use one) and serve the model at ``served`` (where given) as transformers
    computes it, and they are simulated engines exactly when the run is a simulation (a simulation's hollow checkpoints
    would load as zeros into a real engine; a simulated one answers a real run with random tokens). The config's own
    check cannot see that an engine given by URL is SGLang. ``key``: the config key that gave the URLs, named in each
    error."""
    from moerl.engines.client import EngineClient
    from moerl.engines.sglang import sglang_problem

    async def health() -> tuple[list[bool], list[ServerInfo]]:
        async with EngineClient(urls, retries=0) as client:
            up = await client.healthy()
            return up, (await client.server_info() if all(up) else [])

    up, infos = asyncio.run(health())
    down = [u for u, ok in zip(urls, up, strict=True) if not ok]  # one answer per URL
    if down:
        raise ConfigError(
            f"{key}: {', '.join(down)} unreachable (no 200 from /health); start the engines or fix the URLs"
        )
    for url, info in zip(urls, infos, strict=True):  # all answered: every URL's info
        engine = str(info.get("engine"))
        if (engine == "moerl-simulated") != simulated:
            raise ConfigError(
                f"{key}: {url} is {'a' if engine == 'moerl-simulated' else 'not a'} simulated engine and this "
                f"run {'is' if simulated else 'is not'} a simulation (simulation.profile)"
            )
        if engine.startswith("moerl-"):
            continue
        if problem := sglang_problem(str(info.get("version"))):
            raise ConfigError(f"{key}: {url} runs {problem}")
        if sglang_refused:
            raise ConfigError(f"{key}: {url} is an SGLang server, and {sglang_refused}")
        if served is not None:
            check_served_right(served, f"{key}: {url} (SGLang)", "moerl serve")
