"""`vllm serve` data-parallel flags (vLLM's names): --data-parallel-size / -dp, --data-parallel-backend,
--data-parallel-routing, --ray-address, --data-parallel-gpus-per-replica (docs/scaling.md)."""

from __future__ import annotations

import argparse
import logging

from vllm_omni.entrypoints.cli.help import serve_group
from vllm_omni.entrypoints.replicas.routing import RoutingPolicy

logger = logging.getLogger(__name__)


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = serve_group(parser, "parallelism")
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="Engine replicas, each on its own GPU, behind this one server (>1 needs "
        "--data-parallel-backend ray; docs/scaling.md).",
    )
    group.add_argument(
        "--data-parallel-backend",
        "-dpb",
        choices=("mp", "ray"),
        default="mp",
        help="How replicas run: 'ray' (Ray Serve replicas on this host or a Ray cluster). 'mp' serves "
        "one replica only.",
    )
    group.add_argument(
        "--data-parallel-routing",
        choices=[p.value for p in RoutingPolicy],
        default=RoutingPolicy.WORK.value,
        help="Which replica gets a request: least remaining denoise work (default), fewest requests, "
        "or in turn.",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="Join this Ray cluster (else RAY_ADDRESS; else start a local Ray, stopped on exit).",
    )
    group.add_argument(
        "--data-parallel-gpus-per-replica",
        type=float,
        default=None,
        metavar="G",
        help="Ray num_gpus of each replica (default 1 on CUDA, 0 on CPU; 0.5 puts two on one GPU).",
    )


def replica_options_from_args(args: argparse.Namespace):
    """`ReplicaOptions` for `--data-parallel-size` > 1 with the ray backend, None for one engine (a
    no-effect warning for the Ray flags given then); ValueError naming the flag for what cannot run."""
    size = args.data_parallel_size
    if size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {size}")
    gpus = args.data_parallel_gpus_per_replica
    if gpus is not None and gpus < 0:
        raise ValueError(f"--data-parallel-gpus-per-replica must be >= 0, got {gpus}")
    if size == 1:
        given = {"--ray-address": args.ray_address, "--data-parallel-gpus-per-replica": gpus}
        for flag in (flag for flag, value in given.items() if value is not None):
            # the no-effect line of vllm-omni's flags (compat_flags.py), which it was with one engine
            logger.warning(
                "%s has no effect here: one engine runs in this process; add --data-parallel-size N "
                "--data-parallel-backend ray for replicas on Ray",
                flag,
            )
        return None
    if args.data_parallel_backend != "ray":
        raise ValueError(
            f"--data-parallel-size {size} needs --data-parallel-backend ray (the 'mp' backend serves one "
            "replica)"
        )
    if getattr(args, "lora_modules", None) or getattr(args, "lora_runtime_dir", None):
        raise ValueError(
            "--lora-modules / --lora-runtime-dir are not served across replicas yet: start without them "
            "or with --data-parallel-size 1"
        )
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "--data-parallel-backend ray needs Ray Serve, which is not installed: "
            "pip install 'vllm-omni-step[ray]' (or start with --data-parallel-size 1)"
        )
    from vllm_omni.entrypoints.replicas.server import ReplicaOptions

    return ReplicaOptions(
        num_replicas=size,
        routing=args.data_parallel_routing,
        ray_address=args.ray_address,
        num_gpus_per_replica=gpus,
    )
