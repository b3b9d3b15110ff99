"""``python -m worker`` / ``llmpool worker``: load the model and serve the gateway over ZeroMQ."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from common.config import add_flags, from_namespace
from common.logs import setup_logging
from common.model_source import bundle_tokenizer, load_tokenizer, read_chat_template, resolve_model
from worker.config import ALL_WORKER_FLAGS, EXIT_UNSUPPORTED, WorkerConfig

if TYPE_CHECKING:  # torch comes with these: imported after the arguments are parsed
    from common.model_source import ModelSource
    from worker.engine import Engine
    from worker.proc import WorkerProc
    from worker.stepper import StepThread


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpool worker", description=__doc__)
    add_flags(parser, "worker", ALL_WORKER_FLAGS)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config = from_namespace(WorkerConfig, build_parser().parse_args(argv))
    setup_logging("worker", config.log_level, config.log_format)
    from worker import cpu

    cpu.cap_torch()  # LLMPOOL_CPU_ISA caps torch's kernels too; ATen and oneDNN read theirs once, so before torch
    name = config.worker_name or f"{socket.gethostname()}-{os.getpid()}"
    curve_keys = (
        (config.curve_client_secret_key, config.curve_server_public_key) if config.curve_client_secret_key else None
    )
    from worker.parallel.topology import resolve, start_local_ranks  # no torch yet

    try:  # --tensor-parallel-size: this machine's other ranks start now, their imports beside ours
        topology = resolve(config)
        children = start_local_ranks(topology, argv) if topology is not None else []
    except ValueError as exc:
        fail_to_start(config, name, curve_keys, exc)
    from worker.stepper import StepThread

    stepper = StepThread()  # steps run off the socket thread, on the thread that loads the model
    config, group, engine, source, bundle = _start(config, name, curve_keys, topology, children, stepper)
    proc = _proc(config, name, curve_keys, engine, source, bundle, stepper)
    proc.install_signal_handlers()
    # Everything loaded so far (model modules, tokenizer, torch's own objects) lives as long as the
    # process: keep it out of the collector's scans. A full collection walked it all, costing 263 ms
    # over 128 batch-1 decode steps (2 ms a token on average, in pauses of tens of ms); after
    # freezing, 4 ms.
    gc.freeze()
    runner = engine.runner
    logging.getLogger(__name__).info(
        "worker ready: %s on %s (%s), %d KV blocks", source.name, runner.device, runner.dtype, runner.num_blocks
    )
    if group is not None:
        group.arm()
    proc.run()
    if group is not None:
        group.close()  # the step thread has ended (proc.run stops it): no step's collectives are left
    if engine.kv_store is not None:
        engine.kv_store.close()


def _start(
    config: WorkerConfig,
    name: str,
    curve_keys: tuple[str, str] | None,
    topology: object,
    children: list,
    stepper: StepThread,
) -> tuple:
    """Step 1: the parallel group joined, the engine built on the step thread, the tokenizer bundled.
    Any failure is said once, to the log and to the gateways, and ends the process."""
    from worker.build import build_engine  # heavy imports (torch) after argument parsing
    from worker.parallel import group as parallel

    group = None
    try:
        config, group = parallel.start(config, topology, children)  # the group joined
        if group is not None and not group.topology.leader:
            engine = stepper.call(build_engine, resolve_model(config.model, config.served_model_name), config)
            follow_rank_zero(engine, stepper)
        source = resolve_model(config.model, config.served_model_name)
        # first: an unsupported model is refused before anything else
        engine = stepper.call(build_engine, source, config)
        tokenizer = load_tokenizer(source, config.cache_dir)  # cached after the first run (GGUF: about 3 s once)
        template = read_chat_template(config.chat_template, getattr(tokenizer, "chat_template", None))
        bundle = bundle_tokenizer(tokenizer, template, source, config.mm_processor_kwargs)
    except Exception as exc:  # the exit code tells the launcher
        fail_to_start(config, name, curve_keys, exc)
    return config, group, engine, source, bundle


def _proc(
    config: WorkerConfig,
    name: str,
    curve_keys: tuple[str, str] | None,
    engine: Engine,
    source: ModelSource,
    bundle: object,
    stepper: StepThread,
) -> WorkerProc:
    """Step 2: the socket loop around the engine, with its adaptive thread team and KV events."""
    from worker.proc import WorkerProc

    runner = engine.runner
    team = None
    if config.adaptive_threads and runner.device.type == "cpu":
        import torch

        from worker.threads import AdaptiveTeam

        team = AdaptiveTeam(runner.threads, torch.set_num_threads)  # set on the engine thread, in its steps
    proc = WorkerProc(
        engine,
        config.gateway_address,
        name,
        source.name,
        str(runner.device),
        str(runner.dtype).removeprefix("torch."),
        config.heartbeat_interval,
        config.heartbeat_liveness,
        config.drain_timeout,
        curve_keys,
        bundle,
        stepper,
        team,
    )
    if config.kv_events_endpoint:
        from worker.kv_events import KvEventPublisher

        engine.blocks.events = KvEventPublisher(
            config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint
        )
        stepper.call(engine.blocks.events.start)  # the engine thread owns the socket
    return proc


def follow_rank_zero(engine: object, stepper: object) -> None:
    """A rank other than 0: run the steps rank 0 broadcasts (on the step thread, as rank 0 runs
    them) until it stops the group, then exit."""
    from worker.parallel.group import current
    from worker.parallel.steps import follow

    group = current()
    logging.getLogger(__name__).info("rank %d ready: following rank 0", group.topology.rank)
    group.arm()
    stepper.call(follow, engine.runner, group.control)
    sys.exit(0)


def fail_to_start(config: WorkerConfig, name: str, curve_keys: tuple[str, str] | None, exc: Exception) -> None:
    """Log why, tell the gateways (their /health reports it; rank 0 alone), and exit: with ``EXIT_UNSUPPORTED``
    when the model or the flags can never work (a refusal, a flag that does not apply), so the
    launcher gives up at once; with 1 otherwise, so it retries with a backoff."""
    from worker.handshake import report_start_failure

    log = logging.getLogger(__name__)
    permanent = isinstance(exc, ValueError)  # UnsupportedModel and every refused flag combination
    message = str(exc) if permanent else f"{type(exc).__name__}: {exc}"
    log.error("cannot start: %s", message, exc_info=None if permanent else exc)
    if os.environ.get("RANK", "0") == "0" or config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        report_start_failure(config.gateway_address, name, message, curve_keys)
    sys.exit(EXIT_UNSUPPORTED if permanent else 1)


if __name__ == "__main__":
    main()
