"""The job's config as users type it: every enum value unquoted, every key that docs and messages name,
the README's command lines verbatim."""

from __future__ import annotations

import dataclasses
import io
import re
import shlex
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from moerl.choices import choice_fields
from moerl.env import child_env
from moerl.errors import ConfigError
from moerl.orchestrator.config import RunConfig, load_config, schema_type
from moerl.trainer.objectives import AGGREGATIONS, CORRECTIONS, POLICY_LOSSES
from tests import DATA, REPO

SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
# Overrides some values need to form a valid config on their own.
NEEDS = {("task.name", "file"): ["task.path=prompts.jsonl"], ("run.placement", "colocated"): ["run.mode=sync"]}


ENUM_VALUES = [(key, value) for key, options in choice_fields(RunConfig) for value in options] + [
    (registry.key, name) for registry in (POLICY_LOSSES, CORRECTIONS, AGGREGATIONS) for name in registry.names
]  # the objectives' choices: their registries' built-ins


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_config_declares_its_enums():
    keys = {key for key, _ in choice_fields(RunConfig)}
    assert {"run.mode", "run.placement", "trainer.replay.routing", "sync.method", "task.name"} <= keys


@pytest.mark.parametrize("key, value", ENUM_VALUES, ids=[f"{k}={v}" for k, v in ENUM_VALUES])
def test_every_enum_value_can_be_typed_unquoted(tmp_path, key, value):
    extra = NEEDS.get((key, value), [])
    assert _get(load_config(None, [f"{key}={value}", *extra]), key) == value
    # The same value in a YAML file, unquoted.
    *sections, leaf = key.split(".")
    text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections)) + f"{'  ' * len(sections)}{leaf}: {value}\n"
    (tmp_path / "c.yaml").write_text(text)
    assert _get(load_config(tmp_path / "c.yaml", extra), key) == value


@pytest.mark.e2e
def test_the_routing_ablation_through_the_recipe_as_typed():
    out = subprocess.run(
        ["bash", str(REPO / "recipes" / "qwen_moe_grpo.sh"), "trainer.replay.routing=off", "--show-config"],
        env=child_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "routing: 'off'" in out.stdout


def test_yaml_11_booleans_still_set_boolean_fields():
    for text, expected in (
        ("off", False),
        ("on", True),
        ("no", False),
        ("yes", True),
        ("false", False),
        ("true", True),
    ):
        assert load_config(None, [f"trainer.replay.sampling_mask={text}"]).trainer.replay.sampling_mask is expected


def test_string_fields_take_the_text_as_typed():
    cfg = load_config(
        None, ["task.system_prompt=Answer: yes # briefly", "run.dir=0123", "model.path=null", "task.reward='exact'"]
    )
    assert cfg.task.system_prompt == "Answer: yes # briefly" and cfg.run.dir == "0123"
    assert cfg.model.path is None and cfg.task.reward == "exact"


def test_a_bad_enum_names_the_full_key():
    with pytest.raises(ConfigError, match=r"trainer\.replay\.routing='R4': expected one of off, R2, R3"):
        load_config(None, ["trainer.replay.routing=R4"])


def test_dr_grpo_divides_by_the_generation_limit():
    cfg = load_config(None, ["trainer.loss.aggregation=seq_mean_token_sum_norm", "rollout.max_new_tokens=96"])
    assert cfg.trainer.loss.max_response_len == 96
    cfg = load_config(None, ["trainer.loss.aggregation=seq_mean_token_sum_norm", "trainer.loss.max_response_len=128"])
    assert cfg.trainer.loss.max_response_len == 128
    assert load_config(None, []).trainer.loss.max_response_len is None  # token_mean needs none


# ---- keys that docs, recipes, help texts and messages name ------------------------------------------
KEY = re.compile(rf"(?<![\w.])(?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*")


FILE_NAME = re.compile(r"\.(py|md|sh|yaml|yml|json|jsonl|txt)$")  # `lora.py` names a file, not the lora section's key


def doc_pages() -> list[Path]:
    """The README and every page of the docs site, benchmarks' pages included."""
    return [REPO / "README.md", *sorted(REPO.glob("docs/**/*.md"))]


def _python_strings(path: Path) -> str:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    # f-strings are STRING tokens before 3.12
    kinds = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return "\n".join(t.string for t in tokens if t.type in kinds)


def named_keys() -> dict[str, set[str]]:
    """key -> where it is named: ``key=value`` anywhere in docs, recipes and moerl's strings, and every
    backticked key in the markdown."""
    found: dict[str, set[str]] = {}
    texts = {p: p.read_text() for p in [*doc_pages(), *REPO.glob("recipes/**/*")] if p.is_file()}
    texts.update(
        {
            p: _python_strings(p)
            for p in [*REPO.glob("moerl/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("bench/*.py")]
        }
    )
    for path, text in texts.items():
        for match in re.finditer(KEY.pattern + "=", text):
            found.setdefault(match.group()[:-1], set()).add(str(path.relative_to(REPO)))
        # `key` or `key=value` spans (not `moerl.trainer.config`, `trainer.step(...)`, `lora.py`)
        if path.suffix == ".md":
            prose = re.sub(
                r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M
            )  # code blocks' backticks would pair spans wrongly
            for code in re.findall(r"`([^`]+)`", prose):
                match = KEY.match(code)
                if match and code[match.end() :][:1] in ("", "=") and not FILE_NAME.search(match.group()):
                    found.setdefault(match.group(), set()).add(str(path.relative_to(REPO)))
    return found


def test_every_key_named_in_docs_and_messages_exists():
    found = named_keys()
    assert "trainer.replay.routing" in found and "run.steps" in found  # the scan sees what it should
    stale = {key: sorted(where) for key, where in found.items() if schema_type(key) is None}
    assert not stale, stale


def readme_recipe_lines() -> list[list[str]]:
    lines = []
    for text in (p.read_text() for p in doc_pages()):
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip()
                if "recipes/qwen_moe_grpo.sh" in line:
                    lines.append(shlex.split(line))
    return lines


def test_the_readmes_recipe_lines_load_verbatim():
    lines = readme_recipe_lines()
    assert len(lines) >= 4
    for words in lines:
        args = words[words.index(next(w for w in words if w.endswith("recipes/qwen_moe_grpo.sh"))) + 1 :]
        args = [a for a in args if a not in ("--show-config", "--help")]
        config = REPO / "recipes" / "qwen_moe_grpo.yaml"
        if "--config" in args:
            i = args.index("--config")
            config = REPO / args[i + 1]
            args = args[:i] + args[i + 2 :]
        load_config(config, [a for a in args if "=" in a])


def test_a_request_deadline_outlasts_a_full_length_response_and_a_simulations_counts_simulated_seconds():
    """By default a response may run to rollout.max_new_tokens at the slowest per-request rate a full replica decodes
    at (a fixed 600 s cut 32K-token responses, which are re-issued from scratch as if the engine hung). Simulated
    engines take a response's simulated time divided by the time scale; a deadline left in real seconds cut long
    responses at 32:96 and time x0.5 (hundreds in a run)."""
    from moerl.orchestrator.config import SLOWEST_DECODE_TOKENS_PER_S, request_timeout_real_s

    profile = DATA / "simulation" / "tiny.yaml"
    assert request_timeout_real_s(load_config(None, ["engines.request_timeout_s=600"])) == 600
    long = request_timeout_real_s(load_config(None, ["rollout.max_new_tokens=32768"]))
    assert (
        long > 32768 / SLOWEST_DECODE_TOKENS_PER_S
        and long > request_timeout_real_s(load_config(None, ["rollout.max_new_tokens=4096"])) > 600
    )
    simulated = load_config(
        None, ["engines.request_timeout_s=600", f"simulation.profile={profile}", "simulation.time_scale=0.5"]
    )
    assert request_timeout_real_s(simulated) == 1200
    with pytest.raises(ConfigError, match="engines.request_timeout_s"):
        load_config(None, ["engines.request_timeout_s=0"])


def test_sglang_deterministic_inference_is_refused_for_it_seeds_a_whole_group_alike():
    """SGLang 0.5.23 reads sampling_seed only under --enable-deterministic-inference, and copies one request's sampling
    params to all its n completions: each GRPO group would be n copies of one completion."""
    for flag in ("--enable-deterministic-inference", "--enable-deterministic-inference=true"):
        with pytest.raises(ConfigError, match="identical"):
            load_config(None, ["engines.server=sglang", f"engines.extra_args=[{flag}]"])
    load_config(
        None, ["engines.server=embedded", "engines.extra_args=[--enable-deterministic-inference]"]
    )  # not SGLang's flag there


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["run.mode=async"], "run.mode=sync (got async)"),
        (["run.mode=periodic"], "run.mode=sync (got periodic)"),
        (["run.mode=sync", "engines.urls=[http://10.0.0.3:30000]"], "leave engines.urls empty"),
        (["run.mode=sync", "lora.enabled=true", "sync.method=disk"], "set lora.enabled=false"),
        (["run.mode=sync", f"simulation.profile={DATA / 'simulation' / 'tiny.yaml'}"], "leave run.placement=separate"),
    ],
)
def test_colocation_is_refused_where_engines_would_run_beside_training_or_lack_weights(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, ["run.placement=colocated", *overrides])
    load_config(None, ["run.placement=colocated", "run.mode=sync"])


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["reward.combine=product"], "reward.combine='product': expected one of model, rule_times_model"),
        (["reward.combine=no_such_module:f"], "reward.combine='no_such_module:f' cannot be loaded"),
        (["reward.verdict=maybe"], "reward.verdict='maybe': expected one of last_number, yes_no"),
        (["reward.kind=generative", "reward.judge_prompt=Grade {reply}"], "reward.judge_prompt: KeyError 'reply'"),
        (["reward.judge_max_new_tokens=0"], "reward.judge_max_new_tokens must be >= 1"),
        (["reward.engines.gpus_per_replica=2", "reward.engines.server=embedded"], "serves on one device"),
        (["reward.engines.server=vllm"], "reward.engines.server='vllm': expected one of auto, sglang, embedded"),
    ],
)
def test_a_reward_model_config_that_cannot_run_is_refused_naming_the_key(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, ["reward.model=/models/rm", *overrides])
    load_config(None, ["reward.model=/models/rm", "reward.kind=generative", "reward.combine=rule_times_model"])
    # colocated, released as the policy's engines are
    load_config(None, ["reward.model=/models/rm", "run.placement=colocated", "run.mode=sync"])


def test_the_preflight_refuses_a_reward_model_of_the_other_kind_or_none_at_all(tmp_path):
    from moerl.models.tiny import save_tiny_hf
    from moerl.orchestrator.preflight import check_reward

    classifier = save_tiny_hf("Qwen3ForSequenceClassification", tmp_path / "rm")
    check_reward(load_config(None, [f"reward.model={classifier}"]))
    with pytest.raises(
        ConfigError,
        match=r"is a sequence-classification model \(Qwen3ForSequenceClassification\), and "
        r"reward.kind=generative: set reward.kind=discriminative",
    ):
        check_reward(load_config(None, [f"reward.model={classifier}", "reward.kind=generative"]))
    check_reward(load_config(None, ["reward.model=demo"]))
    with pytest.raises(ConfigError, match="reward.model=demo: task.name=calc has no demo reward model"):
        check_reward(load_config(None, ["reward.model=demo", "task.name=calc"]))
    with pytest.raises(ConfigError, match=r"reward.model: .*no config.json"):
        check_reward(load_config(None, [f"reward.model={tmp_path / 'none'}"]))
    with pytest.raises(ConfigError, match=r"reward.engines.urls: http://127.0.0.1:9 unreachable"):
        check_reward(load_config(None, [f"reward.model={classifier}", "reward.engines.urls=[http://127.0.0.1:9]"]))


def test_a_shared_prompt_is_refused_outside_packed_micro_batches_and_with_the_replay_trace(tmp_path):
    with pytest.raises(ConfigError, match="feeds packed micro-batches: set trainer.micro_batch_format=packed"):
        load_config(None, ["trainer.shared_prompt=true"])
    with pytest.raises(ConfigError, match="set trainer.replay.trace_samples=0"):
        load_config(
            None,
            [
                "trainer.shared_prompt=true",
                "trainer.micro_batch_format=packed",
                "trainer.replay.trace_samples=2",
                f"trainer.replay.trace_dir={tmp_path}",
            ],
        )
    assert load_config(None, ["trainer.shared_prompt=true", "trainer.micro_batch_format=packed"]).trainer.shared_prompt


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["engines.quantization=fp8", "lora.enabled=true", "sync.method=disk"], "engines.quantization=fp8 pushes full"),
        (["sync.delta=true", "lora.enabled=true", "sync.method=disk"], "sync.delta=true pushes full weights"),
        (["sync.delta=true", "run.placement=colocated", "run.mode=sync"], "colocated engines take the weights"),
        (["sync.delta=true", "sync.method=disk"], "sync.method=disk would not be used"),
        (
            ["sync.delta=true", f"simulation.profile={DATA / 'simulation' / 'tiny.yaml'}"],
            "sync.delta=true: simulated engines hold no weights",
        ),
    ],
)
def test_fp8_engines_and_delta_pushes_are_refused_where_no_full_policy_is_pushed(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, overrides)
    assert load_config(None, ["engines.quantization=fp8", "sync.delta=true"]).sync.delta
