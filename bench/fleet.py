"""The gateway at scale, simulated: N model-less workers (bench/fake_worker.py ``--count``) registered
with two gateways, at several N. Three figures per N:

* routing: what the gateway's WorkerClient spends per request choosing a worker and queuing the
  request (``submit`` + the tick's ``_flush``), measured in-process against N registered workers
  (real DEALER sockets), in µs; with the cost of handling one worker heartbeat and of sending one
  (bench/fleet_routing.py);
* heartbeat CPU: the first gateway's process CPU time over a window with no request in flight, over
  the window's wall time (/proc/<pid>/stat), in % of a core;
* requests/s: short streamed chat requests through the first gateway at one concurrency.

``cProfile`` of the routing loop at the largest N goes to ``--out`` (fleet-routing.prof) and its top
lines into the results, so what grows with N is named.
"""

from __future__ import annotations

import asyncio
import cProfile
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import servers
from bench.fleet_routing import profile_top, routing_cost
from bench.load import run_level
from bench.stats import summarize
from common.model_source import DEFAULT_MODEL

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_percent(pids: list[int], window_s: float) -> list[float]:
    """Each process's CPU over ``window_s`` of wall time, in % of one core."""
    before, start = [cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - start
    return [round(100 * (cpu_seconds(p) - b) / wall, 2) for p, b in zip(pids, before, strict=True)]


# ---- end to end -----------------------------------------------------------------------------------


def _log(name: str):  # an open file
    """Each process's output in the temp folder (llmpool-fleet-NAME.log), to read after a run."""
    return open(Path(tempfile.gettempdir()) / f"llmpool-fleet-{name}.log", "wb")


def start_fleet(
    workers: int,
    processes: int,
    gateways: int,
    step_ms: float,
    interval: float,
    model_info: Path,
    root: Path,
    extra: list[str],
) -> tuple[list[subprocess.Popen], list[subprocess.Popen], list[str]]:
    """``gateways`` gateways and ``workers`` simulated workers in ``processes`` processes, each worker
    registered with every gateway; returns once every gateway lists them all."""
    ports = [(servers.free_port(), servers.free_port()) for _ in range(gateways)]
    heartbeat = ["--heartbeat-interval", str(interval)]
    gateway_procs = [
        _spawn(
            ["gateway", "--port", str(http), "--zmq-bind", f"tcp://127.0.0.1:{zmq_port}", *heartbeat, *extra],
            root,
            f"gateway-{i}",
        )
        for i, (http, zmq_port) in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{http}" for http, _ in ports]
    for url in urls:  # up first: workers that connect earlier re-register when the gateway is slow to start
        servers.wait_ready(url, "/workers", gateway_procs, lambda r: r.status_code == 200, timeout_s=180)
    addresses = ",".join(f"tcp://127.0.0.1:{zmq_port}" for _, zmq_port in ports)
    flags = ["--step-ms", str(step_ms), "--model-info", str(model_info), *heartbeat]
    fleet_procs = start_workers(workers, processes, addresses, flags, root)
    for url in urls:
        servers.wait_ready(
            url, "/workers", gateway_procs + fleet_procs, lambda r: len(r.json()["workers"]) == workers, timeout_s=180
        )
    return gateway_procs, fleet_procs, urls


def start_workers(workers: int, processes: int, addresses: str, flags: list[str], root: Path) -> list[subprocess.Popen]:
    """``workers`` simulated workers shared out as evenly as can be over ``processes`` fake_worker
    processes (none started with no share), each worker registered with every address."""
    shares = [workers // processes + (i < workers % processes) for i in range(processes)]
    return [
        _spawn(
            ["bench.fake_worker", "--gateway-address", addresses, "--count", str(share), "--name", f"fleet{i}", *flags],
            root,
            f"fleet{i}",
        )
        for i, share in enumerate(shares)
        if share
    ]


def _spawn(module: list[str], root: Path, name: str) -> subprocess.Popen:
    """``python -m MODULE...`` from ``root`` (its tree first on sys.path), its output in NAME's log."""
    return subprocess.Popen([sys.executable, "-m", *module], cwd=root, stdout=_log(name), stderr=subprocess.STDOUT)


def measure_fleet(workers: int, args, model_info: Path, root: Path) -> dict:
    """Heartbeat CPU of the idle gateways and fleet, then requests/s through the first gateway."""
    run = _event_loop_runner()
    gateway_procs, fleet_procs, urls = start_fleet(
        workers,
        args.fleet_processes,
        2,
        args.fake_step_ms,
        args.heartbeat_interval,
        model_info,
        root,
        args.extra_server_args,
    )
    try:
        time.sleep(args.heartbeat_interval * 2)  # registrations settle, heartbeats spread out
        idle = cpu_percent([p.pid for p in gateway_procs + fleet_procs], args.cpu_window)
        registered = [len(httpx.get(url + "/workers", timeout=30).json()["workers"]) for url in urls]
        prompts = [f"Say something about the number {i}." for i in range(64)]
        run(run_level(urls[0], DEFAULT_MODEL, prompts, 4, 8, args.output_len))  # warm-up
        found = {
            "workers": workers,
            "gateway_idle_cpu_pct": idle[:2],
            "fleet_idle_cpu_pct": idle[2:],
            "registered_after_idle": registered,
        }
        rows = []
        for level in args.fleet_levels:
            before = [cpu_seconds(p.pid) for p in gateway_procs]
            timings, wall = run(run_level(urls[0], DEFAULT_MODEL, prompts, level, args.fleet_requests, args.output_len))
            row = summarize(level, timings, wall)
            used = [cpu_seconds(p.pid) - b for p, b in zip(gateway_procs, before, strict=True)]
            row["gateway_cpu_s_per_request"] = round(used[0] / max(1, row["completed"]) * 1e6) / 1e6
            rows.append(row)
            print(
                f"  {workers} workers, concurrency {level}: {row['request_throughput']} requests/s, "
                f"TTFT median {row['median_ttft_ms']} ms, {row['errors']} errors {row['first_error'] or ''}",
                flush=True,
            )
        found["levels"] = rows
        snapshot = httpx.get(urls[0] + "/workers", timeout=30).json()
        assigned = [w["requests_assigned"] for w in snapshot["workers"]]
        found["spread"] = {
            "workers_used": sum(a > 0 for a in assigned),
            "max_per_worker": max(assigned),
            "departures": snapshot.get("departures", 0),
            "departure_reasons": sorted({d["reason"].split(" ", 2)[-1] for d in snapshot.get("departed", [])}),
        }
        return found
    finally:
        servers.stop(fleet_procs + gateway_procs)


def _event_loop_runner():
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


def run(args, out: Path, root: Path) -> dict:
    """Every N of ``args.fake_workers``: routing in-process, then the fleet end to end."""
    results: dict = {
        "mode": "fleet",
        "machine": {"cpus": os.cpu_count()},
        "heartbeat_interval_s": args.heartbeat_interval,
        "output_len": args.output_len,
        "fake_step_ms": args.fake_step_ms,
        "fleet_processes": args.fleet_processes,
        "gateways": 2,
        "routing": [],
        "fleet": [],
    }
    profile = cProfile.Profile()
    largest = max(args.fake_workers)
    for n in args.fake_workers:
        for batch in (1, 16):
            row = asyncio.run(routing_cost(n, args.routing_requests, batch, 200))
            results["routing"].append(row)
            hb_pct = 100 * n * (row["heartbeat_receive_us"] + row["heartbeat_send_us"]) / 1e6 / args.heartbeat_interval
            print(
                f"routing, {n} workers, {batch} per tick: {row['routing_us_median']} µs/request median ({row['routing_us_mean']} mean), "
                f"limits() {row['limits_us']} µs; "
                f"heartbeat handling {row['heartbeat_receive_us']} µs in + {row['heartbeat_send_us']} µs out = {hb_pct:.2f} % of a core",
                flush=True,
            )
    asyncio.run(
        routing_cost(largest, min(args.routing_requests, 5000), 1, 200, profile)
    )  # a profiled run apart: cProfile slows it
    out.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(str(out / "fleet-routing.prof"))
    results["routing_profile_top"] = profile_top(profile)
    if not args.routing_only:
        with tempfile.TemporaryDirectory() as folder:
            model_info = Path(folder) / "model-info.msgpack"
            from bench.fake_worker import load_model_info

            load_model_info(str(model_info), DEFAULT_MODEL)
            for n in args.fake_workers:
                results["fleet"].append(measure_fleet(n, args, model_info, root))
    print("\n" + table(results))
    path = out / "results-fleet.json"
    import json

    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")
    return results


def table(results: dict) -> str:
    """One row per N: routing µs/request (1 and 16 per tick), heartbeat CPU, requests/s."""
    routing = {(r["workers"], r["batch"]): r for r in results["routing"]}
    fleet = {f["workers"]: f for f in results["fleet"]}
    lines = [
        "| workers | routing µs/request (1 per tick) | (16 per tick) | limits() µs | heartbeat in+out µs | gateway idle CPU % | requests/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted({w for w, _ in routing}):
        one, many = routing[(n, 1)], routing.get((n, 16), {})
        f = fleet.get(n)
        cpu = f"{f['gateway_idle_cpu_pct'][0]}" if f else "-"
        rps = " / ".join(f"{row['request_throughput']} @{row['concurrency']}" for row in f["levels"]) if f else "-"
        lines.append(
            f"| {n} | {one['routing_us_median']} | {many.get('routing_us_median', '-')} | {one.get('limits_us', '-')} | "
            f"{one['heartbeat_receive_us']} + {one['heartbeat_send_us']} | {cpu} | {rps} |"
        )
    return "\n".join(lines)
