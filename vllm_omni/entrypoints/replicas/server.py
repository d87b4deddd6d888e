"""`vllm serve MODEL --omni --data-parallel-size N --data-parallel-backend ray`: our OpenAI server in this
process, N `DiffusionEngine` replicas as a Ray Serve deployment, reached through its handle.

Start: bind the port -> Ray (a local instance, or the cluster at `--ray-address` / `RAY_ADDRESS`) ->
Serve with no HTTP proxy of its own -> the replicas (each loads the model) -> the app over a
`ReplicatedEngine` -> serve. Stop (SIGINT / SIGTERM): the HTTP drain as with one engine, then the Serve
application is deleted (each replica shuts its engine down), then Ray is shut down when we started
it; a cluster we joined is left up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass

from vllm_omni.config import OmniDiffusionConfig

logger = logging.getLogger(__name__)

APP_NAME = "vllm-omni-replicas"
DELETE_TIMEOUT_S = 40
"""How long stopping the replicas may take (each drains its engine: 30 s graceful shutdown)."""


def _delete_app() -> None:
    from ray import serve

    try:
        serve.delete(APP_NAME)
    except Exception:  # a cluster that went away already
        logger.warning("could not delete the Serve application", exc_info=True)


@dataclass(frozen=True)
class ReplicaOptions:
    """What `--data-parallel-*` and `--ray-address` ask for (`cli/replica_args.py`)."""

    num_replicas: int
    routing: str = "work"
    """`--data-parallel-routing`: work, least-requests or round-robin."""
    ray_address: str | None = None
    """`--ray-address` (else `RAY_ADDRESS`); None starts a local Ray instance."""
    num_gpus_per_replica: float | None = None
    """None: 1 on CUDA, 0 on CPU; a fraction puts several replicas on one GPU."""
    num_cpus_per_replica: float | None = None
    """None: Ray's default (1)."""
    autoscaling_config: dict | None = None
    """Serve's `autoscaling_config` (then `num_replicas` is the floor /health compares with)."""


class ReplicaCluster:
    """The running replicas and how to stop what we started."""

    def __init__(self, config: OmniDiffusionConfig, options: ReplicaOptions):
        import ray

        address = options.ray_address or os.environ.get("RAY_ADDRESS")
        self.connected = not ray.is_initialized()
        """We connected (a caller that initialised Ray itself keeps it)."""
        self.started_ray = address is None and self.connected
        if self.connected:
            main = threading.current_thread() is threading.main_thread()
            previous = signal.getsignal(signal.SIGTERM) if main else None
            # "local": a new instance even when another runs on this machine (ray.init() would join it)
            ray.init(address=address or "local", include_dashboard=False, log_to_driver=True)
            if previous is not None:
                # ray.init puts its own SIGTERM handlers in (a C++ one that aborts the process): ours
                # back, so a stop unwinds through shutdown() and nothing we started is left
                signal.signal(signal.SIGTERM, previous)
        logger.info("Ray: %s", "started a local instance" if self.started_ray else f"joined {address}")
        try:
            self._start(config, options)
        except BaseException:  # a replica that cannot load, an interrupt: leave nothing we started
            self.shutdown()
            raise

    def _start(self, config: OmniDiffusionConfig, options: ReplicaOptions) -> None:
        from ray import serve

        from vllm_omni.entrypoints.replicas.client import ReplicatedEngine
        from vllm_omni.entrypoints.replicas.ray_serve import replica_deployment

        serve.start(proxy_location="Disabled")
        key = uuid.uuid4().hex
        app = replica_deployment(
            config,
            options.num_replicas,
            key,
            options.routing,
            num_gpus=options.num_gpus_per_replica,
            num_cpus=options.num_cpus_per_replica,
            autoscaling_config=options.autoscaling_config,
        )
        handle = serve.run(app, name=APP_NAME, route_prefix=None, blocking=False)
        self.client = ReplicatedEngine(config, handle, APP_NAME, key, options.num_replicas)
        self.client.start()
        logger.info("%d replicas ready (routing: %s)", options.num_replicas, options.routing)

    def shutdown(self) -> None:
        """Delete the application (replicas drain their engines); stop Ray if we started it."""
        import ray

        # a Ray that lost its raylet (a Ctrl-C to the whole process group) would block the delete forever
        deleting = threading.Thread(target=_delete_app, name="serve-delete", daemon=True)
        deleting.start()
        deleting.join(DELETE_TIMEOUT_S)
        if deleting.is_alive():
            logger.warning("the replicas did not stop within %d s; stopping Ray", DELETE_TIMEOUT_S)
        ours = _descendants(os.getpid()) if self.started_ray else []
        if self.connected:
            # a local instance we started: stops every process of it (replicas included); a cluster we
            # joined: only disconnects, the cluster stays up
            ray.shutdown()
        # Ray's agent processes can outlive ray.shutdown() (seen while replicas were still loading)
        _stop_survivors(ours)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _stop_survivors(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then after `grace_s` SIGKILL, the processes of `pids` still alive."""
    survivors = [p for p in pids if _alive(p)]
    if not survivors:
        return
    logger.info("stopping %d Ray process(es) left after ray.shutdown()", len(survivors))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in survivors:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while (survivors := [p for p in survivors if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not survivors:
            return


def run_replicated_server(config: OmniDiffusionConfig, server_args, options: ReplicaOptions) -> None:
    """Bind, start the replicas, serve until SIGINT / SIGTERM, then stop what we started."""
    from vllm_omni.entrypoints.openai.api_server import _exit_on_sigterm, bind_socket, build_app
    from vllm_omni.entrypoints.openai.http_limits import DrainingServer, uvicorn_config
    from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger
    from vllm_omni.entrypoints.replicas.metrics import ReplicaMetrics

    sock = bind_socket(server_args.host, server_args.port)
    cluster = None
    # from here on SIGTERM unwinds (SystemExit), so a stop while the replicas load still stops the Ray
    # we started: killed outright, Ray's agent processes would outlive the server
    _exit_on_sigterm()
    try:
        cluster = ReplicaCluster(config, options)
        metrics = PrometheusStatLogger(config, server_args.served_model_names[0])
        ReplicaMetrics(cluster.client, metrics.registry)
        app = build_app(cluster.client, server_args, metrics)
        limits = server_args.http_limits
        uv_config = uvicorn_config(app, limits, server_args.log_level, server_args.tls, server_args.root_path)
        logger.info(
            "serving %s on %d replicas at %s://%s:%d%s/v1",
            server_args.served_model_names[0],
            options.num_replicas,
            "http" if server_args.tls is None else "https",
            server_args.host,
            server_args.port,
            server_args.root_path,
        )
        DrainingServer(uv_config, app.state.shutdown_gate, limits.shutdown_drain_timeout_s).run(
            sockets=[sock]
        )
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    finally:
        if cluster is not None:
            cluster.shutdown()
        sock.close()
