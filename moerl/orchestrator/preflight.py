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
from moerl.orchestrator.config import RunConfig, Scorer, scorers, served_by, sglang_lora_problem
from moerl.orchestrator.run_state import latest_checkpoint
from moerl.tasks import DEMO, DEMO_SCORERS

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
    if not cfg.engines.urls and served_by(cfg.engines, cfg.simulation) == "sglang":
        if cfg.model.path is not None:
            check_served_right(cfg.model.path, "model.path", "engines.server=embedded")
        import torch

        if cfg.engines.quantization == "fp8" and not torch.cuda.is_available():
            raise ConfigError(
                "engines.quantization=fp8 with engines.server=sglang on the CPU: SGLang's CPU build computes FP8 "
                "with Intel AMX kernels that moerl's CPU support does not stand in for; use engines.server=embedded, "
                "which emulates the same FP8 arithmetic on the CPU"
            )
    check_task(cfg)
    check_reward(cfg)
    check_process(cfg)
    check_teacher(cfg)
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
    from moerl.checkpoint.hf import read_config
    from moerl.orchestrator import memory

    if cfg.model.path is None:
        from moerl.models.tiny import ALL_SPARSE, TINY_QWEN3

        model_config = dict(TINY_QWEN3, **ALL_SPARSE, architectures=["Qwen3MoeForCausalLM"])
    else:
        model_config = read_config(cfg.model.path)
    return (memory.check if checked else memory.plan_for)(cfg, model_config, world, scorer_params(cfg))


def scorer_params(cfg: RunConfig) -> dict[str, int]:
    """Each scorer's parameters, by section (a demo's counted from its config: made with the engines, after the
    plan)."""
    from moerl.checkpoint.hf import HFReader
    from moerl.models.tiny import ALL_SPARSE, tiny_param_count

    params = {}
    for scorer in scorers(cfg):
        if scorer.model == DEMO:
            demo = DEMO_SCORERS[scorer.key]
            params[scorer.key] = tiny_param_count(demo.architecture, **(ALL_SPARSE if demo.all_sparse else {}))
        else:
            reader = HFReader(scorer.model)
            params[scorer.key] = sum(math.prod(reader.shape(name)) for name in reader.names())
    return params


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
    from moerl.models import is_classifier, is_process_reward_model, unserved_classifier

    w = cfg.reward
    if w.model is None:
        return
    architectures = _scorer_architectures(cfg, "reward")
    if is_process_reward_model(architectures):
        raise ConfigError(
            f"reward.model={w.model} is a process reward model ({', '.join(architectures)}), one score a step: "
            "serve it as reward.process.model"
        )
    if problem := unserved_classifier(architectures):
        raise ConfigError(f"reward.model={w.model}: {problem}")
    classifier = is_classifier(architectures)
    if (w.kind == "discriminative") != classifier:
        raise ConfigError(
            f"reward.model={w.model} is {'a sequence-classification' if classifier else 'a generative'} model "
            f"({', '.join(architectures) or 'no architectures named'}), and reward.kind={w.kind}: set "
            f"reward.kind={'discriminative' if classifier else 'generative'}"
        )
    _check_scorer_engines(cfg, "reward")


def check_process(cfg: RunConfig) -> None:
    """The process reward model has a per-token head (the embedded engine serves ``*ForTokenClassification``), and its
    engines given by URL answer."""
    from moerl.models import is_process_reward_model

    w = cfg.reward.process
    if w.model is None:
        return
    architectures = _scorer_architectures(cfg, "reward.process")
    if not is_process_reward_model(architectures):
        raise ConfigError(
            f"reward.process.model={w.model} is {', '.join(architectures) or 'no named architecture'}: a process "
            "reward model scores each step at its step token, a token-classification head (*ForTokenClassification)"
        )
    if w.model != DEMO:  # a demo is made later, and checked where it is loaded
        from transformers import AutoTokenizer

        from moerl.checkpoint.hf import read_config

        config = read_config(w.model)
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if labels not in (1, 2):
            raise ConfigError(
                f"reward.process.model={w.model} has {labels} labels: a process reward model's head has 2 (p(correct) "
                "of their softmax) or 1 (its sigmoid)"
            )
        ids = AutoTokenizer.from_pretrained(w.model)(w.step_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ConfigError(
                f"reward.process.step_token={w.step_token!r} is {len(ids)} tokens in {w.model}'s tokenizer; it must be "
                "one: name the token its training put after each step"
            )
    _check_scorer_engines(cfg, "reward.process")


def check_teacher(cfg: RunConfig) -> None:
    """The teacher is a generative model with the student's tokenizer (where both are given: a demo's is checked once
    made, before the engines start), and its engines given by URL answer."""
    from moerl.models import is_classifier, is_process_reward_model

    t = cfg.teacher
    if t.model is None:
        return
    architectures = _scorer_architectures(cfg, "teacher")
    if is_classifier(architectures) or is_process_reward_model(architectures):
        raise ConfigError(
            f"teacher.model={t.model} is a classifier ({', '.join(architectures)}): a teacher scores tokens, so it is "
            "a causal language model"
        )
    if t.model != DEMO and (student := model_dir(cfg, simulation_profile(cfg))) is not None:
        check_tokenizers(Path(student), Path(t.model))
    _check_scorer_engines(cfg, "teacher")


def _scorer(cfg: RunConfig, key: str) -> Scorer:
    (scorer,) = (s for s in scorers(cfg) if s.key == key)
    return scorer


def _scorer_architectures(cfg: RunConfig, key: str) -> list[str]:
    """The architectures the scorer of section ``key`` names (``demo``: its demo models', :data:`DEMO_SCORERS`)."""
    from moerl.checkpoint.hf import CheckpointError, read_config

    scorer = _scorer(cfg, key)
    if scorer.model == DEMO:
        demo = DEMO_SCORERS[key]
        if cfg.task.name not in demo.models:
            raise ConfigError(
                f"{key}.model=demo: task.name={cfg.task.name} has no demo {key} model (those that have one: "
                f"{', '.join(demo.models)}); set {key}.model to a model directory"
            )
        return [demo.architecture]
    try:
        return read_config(scorer.model).get("architectures") or []
    except CheckpointError as e:
        raise ConfigError(f"{key}.model: {e}") from None


def _check_scorer_engines(cfg: RunConfig, key: str) -> None:
    """The scorer's engines given by URL answer, and SGLang serves its model right (a demo's is made later, as SGLang
    serves it)."""
    scorer = _scorer(cfg, key)
    given = None if scorer.model == DEMO else scorer.model
    if scorer.engines.urls:
        check_engine_urls(scorer.engines.urls, key=f"{key}.engines.urls", served=given)
    elif served_by(scorer.engines) == "sglang" and given is not None:
        check_served_right(given, f"{key}.model", f"{key}.engines.server=embedded")


def check_tokenizers(student: Path, teacher: Path) -> None:
    """The teacher reads the student's token ids as the student does: the same id for every token, and a logit for
    each of them. A teacher with another tokenizer would score other text than the student wrote."""
    from transformers import AutoTokenizer

    from moerl.checkpoint.hf import read_config

    ours, theirs = (AutoTokenizer.from_pretrained(d) for d in (student, teacher))
    mine, other = ours.get_vocab(), theirs.get_vocab()
    differ = sorted((i, t) for t, i in mine.items() if other.get(t) != i)
    extra = sorted(set(other) - set(mine))
    if differ or extra:
        what = (
            f"{len(differ)} of the student's {len(mine)} tokens have another id there or none (first: {differ[0][1]!r},"
            f" id {differ[0][0]} in the student's, {other.get(differ[0][1])} in the teacher's)"
            if differ
            else f"it has {len(extra)} tokens the student's lacks (first: {extra[0]!r})"
        )
        raise ConfigError(
            f"teacher.model={teacher}: its tokenizer is not the student's ({student}): {what}; the teacher scores the "
            "student's token ids, so both must share one tokenizer: distill from a teacher of the student's family"
        )
    vocab = int(read_config(teacher).get("vocab_size") or 0)
    if vocab < len(ours):
        raise ConfigError(
            f"teacher.model={teacher}: its vocab_size={vocab} has no logit for the student's ids at and past it (the "
            f"tokenizer has {len(ours)}); it cannot score every token the student may sample"
        )


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
