"""Are two ``calibrl demo`` output folders the same run, less what depends on the clock?

    python scripts/compare_demo_runs.py BEFORE_DIR AFTER_DIR

Compares ``results.json`` and every ``runs/<name>/metrics.jsonl`` of the two folders, after
dropping what a refactor cannot keep equal on one machine: wall times, the load average in
the machine line, stage seconds (stage titles are kept), training-process spans, and the
judge server's batch shapes and cache counters (how many batches, how full, how many cache
hits: they follow how requests interleaved in time). Everything else must be equal, value for
value (floats exactly).
Prints each difference as a path with both values; exit status 0 when there is none, 1
otherwise, 2 when a folder lacks results.json.

Use it to show that a change to the demo changed no result: run the demo before and after
with the same command on the same machine (``calibrl demo --quick --out DIR``), then this.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Iterator, Sequence, Union

Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]

# results.json keys dropped wherever they appear: each one is a duration or a point in time
TIMING_KEYS = frozenset({"wall_s", "seconds", "start_s", "end_s", "pair_overlap_s", "judge_model_seconds"})
# the judge server's figures that follow how callers' requests interleaved (its calls and items stay):
# the batch shapes, and its cache counters (two arms that send the same item at the same moment both
# miss; a moment apart, the second hits), with the items computed in batches that follow from them
BATCH_SHAPE_KEYS = frozenset({"batches", "mean_batch_size", "shared_batches", "beside_batches",
                              "cache_hits", "cache_misses", "batch_items"})
TIMING_PREFIX = "timing/"  # metrics.jsonl: per-step durations (trainer.step_log.StepTimes)
_LOAD = re.compile(r", load average [0-9.]+ at the start")


def normalised_results(results: dict[str, Json]) -> Json:
    """``results.json`` less its timing: stages keep their titles, the machine line loses its load."""
    copy = dict(results)
    if isinstance(copy.get("machine"), str):
        copy["machine"] = _LOAD.sub("", str(copy["machine"]))
    stages = copy.get("stages")
    if isinstance(stages, list):
        copy["stages"] = [stage[0] if isinstance(stage, list) and stage else stage for stage in stages]
    return _drop(copy, TIMING_KEYS | BATCH_SHAPE_KEYS)


def normalised_step(record: dict[str, Json]) -> dict[str, Json]:
    """One metrics.jsonl record less its ``timing/*`` keys."""
    return {key: value for key, value in record.items() if not key.startswith(TIMING_PREFIX)}


def _drop(value: Json, keys: frozenset[str]) -> Json:
    if isinstance(value, dict):
        return {k: _drop(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_drop(v, keys) for v in value]
    return value


def differences(before: Json, after: Json, path: str = "") -> Iterator[str]:
    """``path: before != after`` for every leaf that differs (NaN equals NaN)."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            where = f"{path}/{key}"
            if key not in after:
                yield f"{where}: only before"
            elif key not in before:
                yield f"{where}: only after"
            else:
                yield from differences(before[key], after[key], where)
    elif isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            yield f"{path}: {len(before)} items before, {len(after)} after"
        for i, (b, a) in enumerate(zip(before, after)):
            yield from differences(b, a, f"{path}[{i}]")
    elif before != after and not (before != before and after != after):  # NaN != NaN
        yield f"{path}: {before!r} != {after!r}"


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Json]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def compare(before: pathlib.Path, after: pathlib.Path) -> list[str]:
    """Every difference between two demo output folders, less timing (module doc)."""
    found = [f"results.json{d}" for d in differences(
        normalised_results(json.loads((before / "results.json").read_text(encoding="utf-8"))),
        normalised_results(json.loads((after / "results.json").read_text(encoding="utf-8"))))]
    runs_before = {p.parent.name: p for p in sorted(before.glob("runs/*/metrics.jsonl"))}
    runs_after = {p.parent.name: p for p in sorted(after.glob("runs/*/metrics.jsonl"))}
    for name in sorted(set(runs_before) ^ set(runs_after)):
        found.append(f"runs/{name}/metrics.jsonl: only {'before' if name in runs_before else 'after'}")
    for name in sorted(set(runs_before) & set(runs_after)):
        steps_before = [normalised_step(r) for r in _read_jsonl(runs_before[name])]
        steps_after = [normalised_step(r) for r in _read_jsonl(runs_after[name])]
        found += [f"runs/{name}/metrics.jsonl{d}" for d in differences(steps_before, steps_after)]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=pathlib.Path, help="a demo output folder")
    parser.add_argument("after", type=pathlib.Path, help="another, from the same command on the same machine")
    args = parser.parse_args(argv)
    for folder in (args.before, args.after):
        if not (folder / "results.json").is_file():
            print(f"error: {folder} holds no results.json (not a finished demo run)", file=sys.stderr)
            return 2
    found = compare(args.before, args.after)
    runs = len(list(args.before.glob("runs/*/metrics.jsonl")))
    for line in found:
        print(line)
    print(f"{len(found)} difference(s) in results.json and {runs} metrics.jsonl file(s), timing left out")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
