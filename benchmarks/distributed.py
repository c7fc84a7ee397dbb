"""The search fanned out over a Ray cluster: measured on a local cluster, simulated beyond it.

Usage: python benchmarks/distributed.py [--out docs/results/distributed.md] [--rounds 2]

1. Measured: a model of 12 distinct regions (pre-LN transformer layers of three widths, joined by projections, and a
   head) planned on the cpu backend, one thread per search, by the serial search and by ``--executor ray`` on a
   local cluster of 2 workers (one core each), each a fresh ``fusion-planner plan`` process as a user runs it, in
   alternating order (serial, ray, ray, serial, ...), after one untimed serial run that fills the kernel cache.
   The regions' search time (the cluster's start included for ray) and the whole command's, and the plans each
   chose, region by region.
   Then, on one standing cluster, serial searches alternate with ray searches that take the workers an earlier
   search kept (``--keep-workers``, the default with ``--ray-address``).
2. Simulated: the same pool (``planner.cluster.pool.RayPool``, its real dispatch loop) with workers that sleep each
   region's measured search time (scaled down) instead of searching, for 1, 2, 8 and 32 workers and 12 and 48
   regions; beside it the list-scheduling model of the same (regions in order, each to the first free worker),
   plus the measured start of that many workers.
3. Extrapolated (a model, labelled as such): a 4B-parameter decoder (32 layers, d=3072) has few distinct regions
   once deduplicated; the search time against workers for it and for the same layers all distinct.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import heapq
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from planner.cluster.jobs import Budget, RegionJob
from planner.cluster.pool import ExecutorOptions, RayPool, preloaded_modules
from planner.core.cost import load_device
from planner.core.examples import attention_ops, layer_norm_ops, transformer
from planner.core.graph import Graph, GraphBuilder
from planner.core.machine import describe
from planner.core.regions import split_regions
from planner.pipeline import PlanOptions
from planner.registry import device_for
from planner.rules.load import load_rules


def layers_of_widths(widths: tuple[int, ...] = (512, 768, 1024), seq: int = 128, dtype: str = "fp32") -> Graph:
    """Pre-LN transformer layers (attention, GELU MLP), one per width, joined by projections, then a head: every
    region distinct (12 for three widths)."""
    b = GraphBuilder("layers-" + "-".join(map(str, widths)))
    x = b.input("x", (seq, widths[0]), dtype)

    def linear(name: str, inp: str, d_in: int, d_out: int) -> str:
        b.input(f"{name}.w", (d_in, d_out), dtype)
        b.input(f"{name}.b", (d_out,), dtype)
        return b.op(f"{name}.bias", "BiasAdd", [b.op(f"{name}.mm", "MatMul", [inp, f"{name}.w"]), f"{name}.b"])

    for i, d in enumerate(widths):
        p = f"l{i}"
        if i:
            x = linear(f"{p}.proj", x, widths[i - 1], d)
        h = layer_norm_ops(b, x, d, dtype, f"{p}.ln1.")
        q, k, v = (linear(f"{p}.{t}", h, d, d) for t in "qkv")
        att = attention_ops(b, f"{p}.attn", (q, k, v), batch=1, seq=seq, heads=d // 64, width=d)
        x = b.op(f"{p}.res1", "Add", [x, linear(f"{p}.o", att, d, d)])
        h = layer_norm_ops(b, x, d, dtype, f"{p}.ln2.")
        u = b.op(f"{p}.gelu", "GeluTanh", [linear(f"{p}.up", h, d, 4 * d)])
        x = b.op(f"{p}.res2", "Add", [x, linear(f"{p}.down", u, 4 * d, d)])
    return b.build([linear("head", x, widths[-1], widths[0])])


# -------------------------------------------------------------------------------------------- 1. measured


def plan_cli(graph_file: Path, budget_s: float, *extra: str) -> tuple[float, dict[str, Any]]:
    """``fusion-planner plan`` in a fresh process, as a user runs it: its wall time and its JSON."""
    cmd = [sys.executable, "-m", "planner", "plan", "--graph", str(graph_file), "--backend", "cpu", "--threads", "1",
           "--time-budget", str(budget_s), "--no-cache", "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
    return time.perf_counter() - t0, json.loads(out.stdout)


PORT = "6390"
CONTENDERS = {"serial": ("--by-region",), "ray": ("--executor", "ray", "--workers", "2"),
              "joined": ("--executor", "ray", "--ray-address", "auto"), "whole": ()}


@contextlib.contextmanager
def running_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs started beforehand (``ray start --head``, its worker processes importing the
    planner as they start), as a standing cluster is; its workers end with it."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    preload = json.dumps({"preload_python_modules": preloaded_modules("cpu")})  # as docs/scaling.md starts one
    subprocess.run([ray_cli, "start", "--head", "--num-cpus", "2", "--port", PORT, "--include-dashboard=false",
                    f"--system-config={preload}"], check=True, capture_output=True, timeout=120)
    try:
        yield
    finally:
        subprocess.run([ray_cli, "stop", "--force"], check=True, capture_output=True, timeout=120)


def timed(kind: str, graph_file: Path, budget_s: float) -> tuple[float, dict[str, Any]]:
    if kind != "joined":
        return plan_cli(graph_file, budget_s, *CONTENDERS[kind])
    with running_cluster():
        return plan_cli(graph_file, budget_s, *CONTENDERS[kind])


def measured(graph: Graph, rounds: int, budget_s: float, folder: Path) -> dict[str, Any]:
    graph_file = folder / "graph.json"
    graph_file.write_text(graph.dumps())
    plan_cli(graph_file, budget_s, *CONTENDERS["serial"])  # fills the kernel cache for the contenders
    times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    searching: dict[str, list[float]] = {"serial": [], "ray": [], "joined": []}  # the regions' search
    plans: dict[str, list[dict[str, Any]]] = {"serial": [], "ray": [], "joined": []}
    for r in range(rounds):
        order = ("serial", "ray", "joined", "whole") if r % 2 == 0 else ("joined", "ray", "serial", "whole")
        for kind in order:
            seconds, doc = timed(kind, graph_file, budget_s)
            times[kind].append(seconds)
            if kind in searching:
                searching[kind].append(doc["times_s"]["plan_regions"])
                plans[kind].append({rp["key"]: rp for rp in doc["region_plans"]})
            print(f"round {r + 1} {kind}: {seconds:.1f}s", flush=True)
    same, differ = 0, []
    for serial, fanned in zip(plans["serial"] * 2, plans["ray"] + plans["joined"], strict=True):
        for key, region in serial.items():
            if fanned[key]["plan"]["kernels"] == region["plan"]["kernels"]:
                same += 1
            else:  # each plan's speedup over the unfused plan, interleaved with it on the device that chose it
                differ.append(f"#{key[:6]} (x{region['speedup_vs_unfused']:.2f} vs x{fanned[key]['speedup_vs_unfused']:.2f}"
                              " over the unfused plan)")
    durations = {key: statistics.median(run[key]["search_s"] for run in plans["serial"]) for key in plans["serial"][0]}
    return {"times": times, "searching": searching, "same": same, "compared": same + len(differ), "differ": differ,
            "durations": durations, "kept": kept_workers(graph_file, rounds, budget_s)}


def kept_workers(graph_file: Path, rounds: int, budget_s: float) -> dict[str, list[float]]:
    """A standing cluster whose workers are kept between searches (``--ray-address``'s default): one untimed
    search starts them, then serial and ray searches alternate, each ray search taking the kept workers."""
    searching: dict[str, list[float]] = {"serial": [], "kept": []}
    with running_cluster():
        plan_cli(graph_file, budget_s, *CONTENDERS["joined"])  # starts the workers; they stay for the next search
        for r in range(rounds):
            for kind in ("serial", "kept") if r % 2 == 0 else ("kept", "serial"):
                seconds, doc = plan_cli(graph_file, budget_s, *CONTENDERS["joined" if kind == "kept" else kind])
                if kind == "kept" and not any("kept from an earlier search" in n for n in doc["executor"]):
                    raise SystemExit(f"the kept workers were not taken: {doc['executor']}")
                searching[kind].append(doc["times_s"]["plan_regions"])
                print(f"kept workers, round {r + 1} {kind}: {seconds:.1f}s", flush=True)
    return searching


# ------------------------------------------------------------------------------------------- 2. simulated


@dataclasses.dataclass
class Slept:
    title: str
    worker: str


class SleepWorker:
    """A worker that sleeps a region's search time instead of searching (made as RegionWorker is)."""

    def __init__(self, name: str, backend: str, spec: Any, options: dict[str, Any], device: str,
                 torch_ops: tuple[str, ...], env: dict[str, str]) -> None:
        self.name, self.durations = name, options["durations"]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "device": "simulated"}

    def search(self, job: RegionJob) -> Slept:
        time.sleep(self.durations[job.title])
        return Slept(job.title, self.name)


def list_schedule(durations: list[float], workers: int) -> float:
    """The makespan of the regions in order, each to the first free worker (the pool's policy)."""
    free = [0.0] * workers
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def simulated(jobs: list[RegionJob], durations: dict[str, float], scale: float) -> list[dict[str, Any]]:
    rows = []
    ray.init(num_cpus=32, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        for count in (12, 48):
            batch = [dataclasses.replace(jobs[i % len(jobs)], title=f"{jobs[i % len(jobs)].title} #{i}")
                     for i in range(count)]
            slept = {j.title: durations[j.region.key] * scale for j in batch}
            for workers in (1, 2, 8, 32):
                t0 = time.perf_counter()
                pool = RayPool(ExecutorOptions("ray", workers), "model", load_device("h200"), {"durations": slept},
                               "cpu", worker=SleepWorker)
                start_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                done = list(pool.run(batch, Budget(1e6, count)))
                run_s = time.perf_counter() - t1
                pool.close()
                assert len(done) == count
                model_s = list_schedule([slept[j.title] for j in batch], workers)
                rows.append({"regions": count, "workers": workers, "start_s": start_s, "run_s": run_s / scale,
                             "model_s": model_s / scale, "overhead_ms": (run_s - model_s) * 1e3})
                print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    return rows


# ------------------------------------------------------------------------------------------ 3. extrapolated


def extrapolated(per_region_s: float, start_s: float) -> list[dict[str, Any]]:
    """Search time against workers for a 4B-parameter decoder (32 layers, d=3072, 128 tokens), deduplicated and
    with every region distinct, at ``per_region_s`` a region (a model, not a measurement)."""
    graph = transformer(32, 3072, 128, "fp16")
    regions = split_regions(graph)
    rows = []
    for label, count in (("deduplicated", len({r.key for r in regions})), ("every region distinct", len(regions))):
        for workers in (1, 2, 8, 32, 128):
            split = workers // count if count < workers else 1  # fewer regions than workers: each in parts
            t = list_schedule([per_region_s / split] * (count * split), workers) + start_s
            rows.append({"model": label, "regions": count, "workers": workers, "search_s": t})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/distributed.md")
    ap.add_argument("--rounds", type=int, default=3, help="serial/ray pairs, alternating which goes first")
    ap.add_argument("--budget", type=float, default=1200.0, help="the search's time budget (seconds); large, so that "
                    "the searches end on their candidate limits and the two executors search alike")
    ap.add_argument("--widths", default="512,768,1024", help="the layers' widths (three: 12 regions)")
    ap.add_argument("--seq", type=int, default=128, help="tokens")
    ap.add_argument("--scale", type=float, default=0.1, help="the simulation sleeps this fraction of each search")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    graph = layers_of_widths(tuple(int(w) for w in args.widths.split(",")), args.seq)
    with tempfile.TemporaryDirectory() as folder:
        m = measured(graph, args.rounds, args.budget, Path(folder))
    spec = device_for(None, "cpu")
    options = PlanOptions("cpu", spec, tuple(load_rules()))
    jobs = [options.job(r) for r in {r.key: r for r in split_regions(graph)}.values()]
    sim = simulated(jobs, m["durations"], args.scale)
    # on a cluster each machine starts its own workers at once: the start of 2 workers on 2 cores stands for any count
    start_s = next(row["start_s"] for row in sim if row["regions"] == 12 and row["workers"] == 2)
    ext = extrapolated(statistics.mean(m["durations"].values()), start_s)
    write(args, graph, m, sim, ext, started)


def kept_lines(kept: dict[str, list[float]]) -> list[str]:
    serial, fanned = statistics.median(kept["serial"]), statistics.median(kept["kept"])
    rows = [f"| {i + 1} | {a:.1f} | {b:.1f} |" for i, (a, b) in enumerate(zip(kept["serial"], kept["kept"], strict=True))]
    return [
        "### Kept workers: a standing cluster's next search",
        "",
        "On a cluster the command did not start (`--ray-address`), the workers stay for the next search of the same "
        "kind (`--keep-workers`, 600 s by default there): one untimed search on a freshly started cluster of 2 CPUs "
        "starts them, then serial and ray searches alternate (serial first, then ray first), each ray search taking "
        "the two kept workers, warm (imported, backend built, calibrated), as a standing cluster serves a team's "
        "searches one after another.",
        "",
        "| run | search s: serial | ray, kept workers |",
        "|---|---|---|",
        *rows,
        f"| median | {serial:.1f} | {fanned:.1f} |",
        "",
        f"**Search time, ray with kept workers over serial: {fanned / serial:.2f}x** (target <= 0.6x: "
        f"{'met' if fanned / serial <= 0.6 else 'not met'}).",
        "",
    ]


def write(args: argparse.Namespace, graph: Graph, m: dict[str, Any], sim: list[dict[str, Any]],
          ext: list[dict[str, Any]], started: datetime.datetime) -> None:
    serial, fanned = statistics.median(m["times"]["serial"]), statistics.median(m["times"]["ray"])
    search_ratio = statistics.median(m["searching"]["ray"]) / statistics.median(m["searching"]["serial"])
    lines = [
        "# The search on a Ray cluster",
        "",
        f"Command: `python benchmarks/distributed.py --rounds {args.rounds} --widths {args.widths} --seq {args.seq} "
        f"--scale {args.scale:g}`  ",
        f"Machine: {describe()}; shared and noisy  ",
        f"Date: {started:%Y-%m-%d %H:%M} UTC to {datetime.datetime.now(datetime.UTC):%H:%M} UTC; ray {ray.__version__}",
        "",
        "## Measured: 12 distinct regions, serial against a local cluster of 2 workers",
        "",
        f"Graph `{graph.name}`: {len(graph.ops)} ops in {len(split_regions(graph))} regions, all distinct "
        f"(pre-LN transformer layers of widths {args.widths.replace(',', ', ')}, {args.seq} tokens, fp32, joined by "
        "projections, and a head; `layers_of_widths` in the script). Backend cpu, one thread per search (`--threads 1`); the ray "
        "executor's workers each own one core, pinned. Search options: the defaults but a time budget of "
        f"{args.budget:g} s, so that the searches end on their own limits (candidates, patience) and both executors "
        "search the same space. Each run is a fresh `fusion-planner plan --graph layers.json --backend cpu --threads 1 "
        "--no-cache --json` process, plus `--by-region` (serial) or `--executor ray --workers 2`: both plan region "
        "by region (the ray executor always does). The last column is the serial search of the graph whole, one "
        "e-graph, its default for a graph whose regions do not repeat: a sampled search of a far larger space, "
        "shown for scale. Plan cache off; kernel cache filled by an untimed serial run first.",
        "",
        "| run | search s: serial | ray, cluster started | ray, cluster running | planning s: serial | "
        "ray, cluster started | ray, cluster running | serial, graph searched whole |",
        "|---|---|---|---|---|---|---|---|",
    ]
    columns = [m["searching"]["serial"], m["searching"]["ray"], m["searching"]["joined"], m["times"]["serial"],
               m["times"]["ray"], m["times"]["joined"], m["times"]["whole"]]
    for i, row in enumerate(zip(*columns, strict=True)):
        lines.append(f"| {i + 1} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    medians = [statistics.median(c) for c in columns]
    joined_ratio = medians[2] / medians[0]
    lines += [
        "| median | " + " | ".join(f"{x:.1f}" for x in medians) + " |",
        "",
        "*search*: the regions' search (`times_s.plan_regions` of the JSON: e-graphs and searches; for ray the "
        "workers' start, imports and backend, included, and where the command starts the cluster (`--workers 2`) "
        "the cluster's start too, about 3 s; *cluster running*: `--ray-address` to a local cluster of 2 CPUs "
        "started beforehand by `ray start --head`, joined with `--ray-address auto`, as a standing cluster is). *planning*: the whole command's wall "
        "time (interpreter, imports, the composite plan's check and timing included).",
        "",
        f"**Search time, ray over serial: {search_ratio:.2f}x with the cluster started by the command, "
        f"{joined_ratio:.2f}x joining a running one** (target <= 0.6x: "
        f"{'met' if search_ratio <= 0.6 else 'not met'}, {'met' if joined_ratio <= 0.6 else 'not met'}); the "
        f"whole planning {fanned / serial:.2f}x and {medians[5] / medians[3]:.2f}x. Same plan in "
        f"{m['same']} of {m['compared']} region searches"
        + ("." if not m["differ"] else "; where not, each plan's speedup over the unfused plan as its own search "
           "measured it, serial's vs ray's: " + "; ".join(m["differ"]) + "."),
        "",
        *kept_lines(m["kept"]),
        "## Simulated: 1 to 32 workers",
        "",
        "The pool's own dispatch loop (`RayPool.run`) on a local Ray cluster of 32 logical CPUs, with workers that "
        f"sleep {args.scale:g} of each region's measured search time (the medians of the serial runs above) instead "
        "of searching; 48 regions are the 12 four times over. Times are scaled back up. *model* is the list "
        "schedule (regions in order, each to the first free worker); *overhead* what the pool added over it, in "
        "unscaled milliseconds; *start* the measured start of that many workers (sleeping ones: a real worker also "
        "imports the planner and builds its backend, about 2 s). On this 2-core machine 8 and 32 worker processes, "
        "and the idle ones Ray starts for 32 logical CPUs, share two cores: the overhead and start of those rows "
        "are this machine's crowding; on a cluster each machine starts and runs its own.",
        "",
        "| regions | workers | search s (simulated) | model s | overhead ms | start s |",
        "|---|---|---|---|---|---|",
    ]
    for row in sim:
        lines.append(f"| {row['regions']} | {row['workers']} | {row['run_s']:.1f} | {row['model_s']:.1f} | "
                     f"{row['overhead_ms']:.0f} | {row['start_s']:.1f} |")
    per = statistics.mean(m["durations"].values())
    lines += [
        "",
        "## Extrapolated to a 4B-parameter decoder (a model, not a measurement)",
        "",
        "A 4B-parameter decoder, 32 layers of d=3072 with 128 tokens (`--example transformer --layers 32 --d-model "
        f"3072`), each region taking the mean search time measured above ({per:.1f} s; a region at that width times "
        "longer kernels, so read the figures as a floor) plus the start of 2 workers measured above (each machine "
        "of a cluster starts its own at once). Regions fan out first; where there are fewer regions than workers, "
        "each region is searched in parts (every part a share of its candidates), assumed here to divide its search "
        "evenly, the final comparison of the parts' bests not counted: an ideal, not a measurement.",
        "",
        "| model | regions searched | workers | search s (extrapolated) |",
        "|---|---|---|---|",
    ]
    for row in ext:
        lines.append(f"| {row['model']} | {row['regions']} | {row['workers']} | {row['search_s']:.0f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
