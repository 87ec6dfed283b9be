"""Wall time of `calibrl demo`, each run a fresh process into a fresh folder, against the targets:
`calibrl demo --quick` under 2 minutes and the full demo under 12 minutes on 2 CPU cores.

    python benchmarks/bench_demo_time.py --modes quick --repeats 3 --record benchmarks/records/demo-time.json

Each run's wall time is the `calibrl demo` process's, from start to exit (servers started and
stopped, report written); the stage times are those the demo writes to its `results.json`.
The verdict reads the slowest run of a mode.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import bench_record  # benchmarks/ is on the path of a script run from it

TARGET_S = {"quick": 120.0, "full": 720.0}


def run_demo(mode: str, out: pathlib.Path) -> tuple[float, list[list]]:
    """Run one demo of ``mode`` into ``out``; its wall time and the stages of its record."""
    command = [sys.executable, "-m", "calibrl", "demo", "--out", str(out), "--no-progress"]
    if mode == "quick":
        command.insert(4, "--quick")
    started = time.perf_counter()
    finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {finished.returncode}:\n{finished.stdout[-4000:]}")
    stages = json.loads((out / "results.json").read_text(encoding="utf-8"))["stages"]
    return wall, stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="quick", help="comma-separated: quick, full")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode")
    parser.add_argument("--workdir", default="", help="folder for the runs' outputs (default: a temp folder)")
    parser.add_argument("--record", metavar="PATH", help="write the tables as a benchmark record")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(TARGET_S))
    if unknown or not modes:
        parser.error(f"--modes: {unknown or modes} (one or more of {sorted(TARGET_S)})")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be >= 1")
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="calibrl-demo-time-"))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    walls: dict[str, list[float]] = {m: [] for m in modes}
    stages: dict[str, list[list[list]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):  # modes interleaved, so a change of load hits each alike
        for mode in modes:
            wall, run_stages = run_demo(mode, work / f"{mode}-{repeat}")
            walls[mode].append(wall)
            stages[mode].append(run_stages)
            print(f"{mode} run {repeat + 1}: {wall:.1f} s", flush=True)

    tables, notes = [], []
    summary = []
    for mode in modes:
        worst = max(walls[mode])
        met = worst < TARGET_S[mode]
        summary.append([f"calibrl demo{' --quick' if mode == 'quick' else ''}", len(walls[mode]),
                        f"{min(walls[mode]):.1f}", f"{worst:.1f}", f"{TARGET_S[mode]:.0f}", bench_record.verdict(met)])
        notes.append(f"calibrl demo{' --quick' if mode == 'quick' else ''}: slowest of {len(walls[mode])} runs "
                     f"{worst:.1f} s (target < {TARGET_S[mode]:.0f} s): {bench_record.verdict(met)}")
        names = [name for name, _ in stages[mode][0]]
        rows = [[name, *(f"{run[i][1]:.1f}" for run in stages[mode])] for i, name in enumerate(names)]
        rows.append(["process wall time", *(f"{w:.1f}" for w in walls[mode])])
        tables.append(bench_record.table(f"`calibrl demo{' --quick' if mode == 'quick' else ''}`, seconds per stage "
                                         f"of each run", ["stage", *(f"run {r + 1}" for r in range(len(walls[mode])))],
                                         rows))
    tables.insert(0, bench_record.table(
        f"Wall time per run, seconds (load average {load_before:.1f} at the start)",
        ["command", "runs", "fastest", "slowest", "target", "verdict"], summary))
    bench_record.print_tables(tables)
    print()
    for note in notes:
        print(note)
    if args.record:
        bench_record.write_record(args.record, tables, libraries=("torch", "transformers", "grpcio"), notes=notes)


if __name__ == "__main__":
    main()
