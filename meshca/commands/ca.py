"""`meshca ca`: run the certificate authority (Istio's CA API)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ca_server import add_ca_arguments
from ca_server.config import CaConfig, ConfigError
from meshca.listen import ListenError, check_can_listen
from meshca.logs import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_ca_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ca_server import (
        CaSetupError,
        SupervisorCaches,
        WorkerSupervisor,
        apply_cpu_scheduling,
        check_data_dir,
        check_rpc_server,
        default_worker_count,
        run_ca,
        worker_argv,
    )

    configure_logging(args.log_level)
    try:
        config = CaConfig.from_args(args, os.environ)
        # Before anything starts: `completion-queue` asked for by name and not runnable here.
        check_rpc_server(config.rpc_server)
    except ConfigError as exc:
        print(f"meshca ca: {exc}", file=sys.stderr)
        return 2
    try:
        check_data_dir(config.data_dir)  # workers check again; the supervisor writes nothing
    except CaSetupError as exc:
        print(f"meshca ca: cannot start: {exc}", file=sys.stderr)
        return 2
    if config.worker is None:
        try:
            for flag, address in config.listen_addresses():
                check_can_listen(flag, address)
        except ListenError as exc:
            print(f"meshca ca: {exc}", file=sys.stderr)
            return 1
    # Before any thread or worker exists: they inherit it (`ca_server.serving.cpu_scheduling`).
    apply_cpu_scheduling(config.cpu_scheduling)
    workers = args.workers or default_worker_count()
    if workers > 1 and config.worker is None:
        # Workers run `meshca` with this process's own arguments (`meshca.cli.main` keeps them).
        argv = getattr(args, "argv", None) or sys.argv[1:]
        try:
            shared = SupervisorCaches.for_config(config)
            return WorkerSupervisor(config, workers, worker_argv(argv), shared=shared).run()
        except CaSetupError as exc:
            print(f"meshca ca: cannot start: {exc}", file=sys.stderr)
            return 2
        except ListenError as exc:
            print(f"meshca ca: {exc}", file=sys.stderr)
            return 1
    try:
        asyncio.run(run_ca(config))
    except CaSetupError as exc:
        print(f"meshca ca: cannot start: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"meshca ca: {exc}", file=sys.stderr)
        return 1
    return 0
