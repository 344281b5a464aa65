"""The replay trace: for a few samples a step, the experts each MoE layer used at each position, beside the rollout's,
and the check that replay fed every router what it should (``moerl check-replay RUN_DIR``).

Global rank 0 writes the reference: each traced sample as the rollout gave it, before it was planned, packed and sent
(its fed tokens, its routing at every MoE layer, its group). Each rank then writes what it saw of the samples it
traced: its pipeline stage's MoE layers and, under sequence parallelism, its chunk of the positions. A sample is keyed
by its data-parallel replica and its index in that replica's shard, which every rank of the replica shares. Per
(sample, layer, position) a rank holds:

- ``rollout``: the engine's experts as the rank received them; ``tokens_fed``: the tokens its first pipeline stage
  fed the model (from the micro-batch the model ran);
- ``native``: what the trainer's routers choose themselves in the old-policy pass, ``train_native`` in the training
  pass;
- ``score``: the experts the old-policy pass used; ``train``: those the training forward used; ``recompute``: those the
  recomputed forward used in the backward pass (activation recompute only).

The check compares everything against the reference, so a routing row or token placed one position off, sent to the
wrong rank or the wrong column, shows: the received routing and fed tokens equal the reference's; under R3 every used
set equals the reference's routing; under R2 the training pass's (and the recompute's) equal the old-policy pass's;
every pass the rank should have recorded is there; every layer and position of every traced sample was recorded by some
rank. Sets are compared as sets (a router lists its top-k in its own order). A comparison only shows replay working
where the trainer's own routing would have been different (``informative``): with none, the trace cannot tell replay
from none, and the report says so.

Layout: ``RUN_DIR/replay_trace/step{version:06d}/`` holds ``source.npz`` and ``rank{rank:05d}.npz``; each has ``meta``
(JSON) and per sample ``{j}/{array}``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moerl.errors import MoerlError

TRACE_DIR = "replay_trace"
PASSES = ("score", "train", "recompute")


class TraceError(MoerlError):
    """A replay trace that is missing or unreadable."""


@dataclass
class TracedSample:
    key: str  # "dp{replica}-i{index in the replica's shard}": the same on every rank that holds the sample
    fed_len: int
    start: int  # the positions this rank recorded: [start, stop)
    stop: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def step_dir(directory: str | Path, version: int) -> Path:
    return Path(directory) / f"step{version:06d}"


def clear_step(directory: str | Path, version: int) -> None:
    """Global rank 0, before it hands out the step's first instalment (so before any rank can write): remove what an
    earlier run, or an update that was skipped and kept the version, left for this version."""
    shutil.rmtree(step_dir(directory, version), ignore_errors=True)
    step_dir(directory, version).mkdir(parents=True)


def write_source(directory: str | Path, version: int, originals: list[list], count: int) -> None:
    """Global rank 0: the reference of the first ``count`` samples of each replica's shard, as given to the trainer."""
    traced = [(f"dp{d}-i{i}", s) for d, shard in enumerate(originals) for i, s in enumerate(shard[:count])]
    meta = {"samples": [{"key": key, "group": int(s.group_id), "fed_len": s.fed_len} for key, s in traced]}
    arrays = {}
    for j, (_, s) in enumerate(traced):
        arrays[f"{j}/tokens"], arrays[f"{j}/routing"] = s.fed_ids().astype(np.int64), s.routing
        if s.routing_starts is not None:
            arrays[f"{j}/routing_starts"] = s.routing_starts
    np.savez_compressed(step_dir(directory, version) / "source.npz", meta=np.array(json.dumps(meta)), **arrays)


def write_rank(
    directory: str | Path,
    version: int,
    rank: int,
    mode: str,
    moe_layers: list[int],
    columns: list[int],
    passes: list[str],
    samples: list[TracedSample],
) -> Path:
    """One rank's trace of one step. ``columns``: the index in ``moe_layers`` of each of this rank's routers;
    ``passes``: those it recorded for every sample (a missing one is a failure of the check)."""
    meta = {
        "mode": mode,
        "moe_layers": moe_layers,
        "columns": columns,
        "passes": passes,
        "samples": [{"key": s.key, "fed_len": s.fed_len, "start": s.start, "stop": s.stop} for s in samples],
    }
    arrays = {f"{j}/{name}": array for j, s in enumerate(samples) for name, array in s.arrays.items()}
    path = step_dir(directory, version) / f"rank{rank:05d}.npz"
    # The keys are "{j}/{name}", never savez_compressed's allow_pickle, which mypy cannot know of a dict.
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]  # numpy's stub
    return path


@dataclass
class Mismatch:
    step: str
    sample: str
    group: int
    # "tokens", "received" (the routing the rank was sent), "overwritten" (a routing patch over earlier rows), or a pass
    what: str
    layer: int | None
    position: int
    expected: list[int]
    got: list[int]

    def __str__(self) -> str:
        where = f"{self.step} sample {self.sample} (group {self.group}) position {self.position}"
        if self.what == "tokens":
            return f"{where}: fed token {self.got} where the sample has {self.expected}"
        if self.what == "overwritten":
            return (
                f"{where}: answer {self.got[0]}'s routing rows start here, within those an earlier answer gave from "
                f"position {self.expected[0]}: the routing earlier turns were sampled under was overwritten"
            )
        if self.what == "received":
            return f"{where} layer {self.layer}: the rank received routing {self.got}, the rollout's is {self.expected}"
        return f"{where} layer {self.layer}: {self.what} used experts {self.got}, expected {self.expected}"


@dataclass
class CheckReport:
    steps: int = 0
    samples: int = 0
    checked: int = 0  # (sample, layer, position, pass) sets compared
    informative: int = 0  # of those, where the trainer's own routing differs from what replay had to give it
    mode: str = ""
    mismatches: list[Mismatch] = field(default_factory=list)
    mismatch_count: int = 0
    uncovered: list[str] = field(default_factory=list)  # what should have been recorded and was not
    passes: set[str] = field(default_factory=set)
    # of the positions and layers recorded, the fraction routed natively as the rollout
    native_agree: float = float("nan")

    @property
    def ok(self) -> bool:
        return self.steps > 0 and not self.mismatch_count and not self.uncovered

    def summary(self, shown: int = 20) -> str:
        lines = [
            f"replay trace: {self.steps} steps, {self.samples} samples, mode {self.mode}, "
            f"passes {', '.join(sorted(self.passes))}: "
            f"{self.checked} (sample, layer, position, pass) sets compared, {self.informative} of them where the "
            "trainer's own routing differs from what replay gives it; native routing agreed with the rollout's at "
            f"{self.native_agree:.4f} of the recorded sets"
        ]
        if self.mode in ("R2", "R3") and not self.informative:
            lines.append(
                "UNINFORMATIVE: wherever replay was checked the trainer's routers would have chosen the same experts "
                "themselves, so this trace cannot tell replay from no replay"
                + (
                    " (under R2 the training pass runs at the old-policy pass's weights, one optimizer step per batch)"
                    if self.mode == "R2"
                    else " (an engine that computes as the trainer does; a bf16 engine shows flips)"
                )
            )
        if self.ok:
            lines.append(
                "replay OK: every recorded router used what it should, at every layer and position, with the tokens "
                "and routing of the rollout"
            )
            return "\n".join(lines)
        if self.mismatch_count:
            lines.append(
                f"REPLAY MISMATCH: {self.mismatch_count} sets or tokens differ; "
                f"the first {min(shown, len(self.mismatches))}:"
            )
            lines += [f"  {m}" for m in self.mismatches[:shown]]
        if self.uncovered:
            lines.append("NOT RECORDED (what the trace should hold and does not, so it cannot be checked):")
            lines += [f"  {u}" for u in self.uncovered[:shown]]
        return "\n".join(lines)


def _sets_differ(expected: np.ndarray, got: np.ndarray) -> np.ndarray:
    """bool [positions, layers]: the two top-k sets differ."""
    return (np.sort(expected.astype(np.int64), axis=-1) != np.sort(got.astype(np.int64), axis=-1)).any(-1)


def _load(path: Path) -> tuple[dict, dict[int, dict[str, np.ndarray]]]:
    try:
        data = np.load(path)
        meta = json.loads(str(data["meta"]))
        per_sample: dict[int, dict[str, np.ndarray]] = {}
        for name in data.files:
            if name != "meta":
                j, array = name.split("/", 1)
                per_sample.setdefault(int(j), {})[array] = data[name]
    except (OSError, ValueError, KeyError) as e:
        raise TraceError(f"{path} is not a replay trace file: {e}") from None
    return meta, per_sample


class _Checker:
    def __init__(self, report: CheckReport, keep: int):
        self.report, self.keep, self.agree = report, keep, [0, 0]

    def mismatch(self, *args) -> None:
        self.report.mismatch_count += 1
        if len(self.report.mismatches) < self.keep:
            self.report.mismatches.append(Mismatch(*args))

    def step(self, step: Path) -> None:
        report = self.report
        if not (step / "source.npz").exists():
            report.uncovered.append(f"{step.name}: no source.npz (global rank 0 writes it before the step)")
            return
        source_meta, source = _load(step / "source.npz")
        samples = {s["key"]: (j, s) for j, s in enumerate(source_meta["samples"])}
        covered: dict[str, np.ndarray] = {}  # per sample key: bool [layers, positions] some rank recorded
        for path in sorted(step.glob("rank*.npz")):
            meta, arrays = _load(path)
            if report.mode and meta["mode"] != report.mode:
                raise TraceError(f"{path}: mode {meta['mode']}, other ranks or steps {report.mode}")
            report.mode = meta["mode"]
            layers, columns = meta["moe_layers"], meta["columns"]
            for j, s in enumerate(meta["samples"]):
                if s["key"] not in samples:
                    raise TraceError(f"{path}: sample {s['key']} is not in {step.name}/source.npz")
                ref_j, ref = samples[s["key"]]
                cover = covered.setdefault(s["key"], np.zeros((len(layers), ref["fed_len"]), dtype=bool))
                cover[np.ix_(columns, np.arange(s["start"], s["stop"]))] = True
                self.sample(step.name, path.name, meta, s, arrays.get(j, {}), ref, source[ref_j])
        report.samples += len(samples)
        for key, (j, ref) in samples.items():
            self.patches(step.name, key, ref, source[j].get("routing_starts"))
        for key, (_, ref) in samples.items():
            recorded = covered.get(key)
            if recorded is None:
                report.uncovered.append(f"{step.name} sample {key} (group {ref['group']}): no rank recorded it")
                continue
            for c, row in enumerate(recorded):
                missing = np.flatnonzero(~row)
                if missing.size:
                    report.uncovered.append(
                        f"{step.name} sample {key} (group {ref['group']}) layer {layers[c]}: positions "
                        f"{missing[0]}..{missing[-1]} ({missing.size} of {row.size}) not recorded"
                    )

    def patches(self, step: str, key: str, ref: dict, starts: np.ndarray | None) -> None:
        """A multi-turn sample's routing came in one patch per engine answer, each asked from where the rows so far
        ended: one that starts within an earlier one's rows overwrote the routing that earlier tokens were sampled
        under (a turn asking for its whole sequence's routing again)."""
        if starts is None:
            return
        for k in range(1, len(starts)):
            earlier = int(starts[:k].max())  # the rows from there on were an earlier answer's
            if starts[k] <= earlier:
                self.mismatch(step, key, ref["group"], "overwritten", None, int(starts[k]), [earlier], [k])

    def sample(self, step: str, rank: str, meta: dict, s: dict, arrays: dict, ref: dict, source: dict) -> None:
        report, mode = self.report, meta["mode"]
        layers, columns, start, stop = meta["moe_layers"], meta["columns"], s["start"], s["stop"]
        where = (step, s["key"], ref["group"])
        needed = ["rollout", "native", *meta["passes"]] + (["train_native"] if "train" in meta["passes"] else [])
        absent = [name for name in needed if name not in arrays]
        if absent:
            report.uncovered.append(f"{step} {rank} sample {s['key']}: {', '.join(absent)} not recorded")
            return
        reference = source["routing"][start:stop][:, columns]
        if "tokens_fed" in arrays:
            for p in np.flatnonzero(arrays["tokens_fed"] != source["tokens"][start:stop]):
                self.mismatch(
                    *where,
                    "tokens",
                    None,
                    start + int(p),
                    [int(source["tokens"][start + p])],
                    [int(arrays["tokens_fed"][p])],
                )
        for p, c in zip(*np.nonzero(_sets_differ(reference, arrays["rollout"])), strict=True):
            self.mismatch(
                *where,
                "received",
                layers[columns[c]],
                start + int(p),
                sorted(reference[p, c].tolist()),
                sorted(arrays["rollout"][p, c].tolist()),
            )
        native_same = ~_sets_differ(reference, arrays["native"])
        self.agree[0] += int(native_same.sum())
        self.agree[1] += native_same.size
        for name in meta["passes"]:
            report.passes.add(name)
            if mode == "R3":
                expected, own = reference, arrays["native"]
            elif mode == "R2" and name != "score":
                expected, own = arrays["score"], arrays["train_native"]
            else:
                continue  # off replays nothing; under R2 the old-policy pass is what the others replay
            differ = _sets_differ(expected, arrays[name])
            report.checked += differ.size
            report.informative += int(_sets_differ(expected, own).sum())
            for p, c in zip(*np.nonzero(differ), strict=True):
                self.mismatch(
                    *where,
                    name,
                    layers[columns[c]],
                    start + int(p),
                    sorted(expected[p, c].tolist()),
                    sorted(arrays[name][p, c].tolist()),
                )


def check_replay(run_dir: str | Path, keep: int = 1000) -> CheckReport:
    """Check every traced step under ``run_dir`` (its ``replay_trace/``, or the trace directory itself)."""
    root = Path(run_dir)
    root = root / TRACE_DIR if (root / TRACE_DIR).is_dir() else root
    steps = sorted(p for p in root.glob("step*") if p.is_dir())
    if not steps:
        raise TraceError(
            f"no replay trace under {run_dir}: run with trainer.replay.trace_samples > 0 (the job writes it to "
            f"RUN_DIR/{TRACE_DIR})"
        )
    report = CheckReport(steps=len(steps))
    checker = _Checker(report, keep)
    for step in steps:
        checker.step(step)
    report.native_agree = checker.agree[0] / checker.agree[1] if checker.agree[1] else float("nan")
    return report
