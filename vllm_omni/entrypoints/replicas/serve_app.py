"""The Ray Serve application for users who run Serve themselves (`serve run` / `serve deploy`):

    serve run vllm_omni.entrypoints.replicas.serve_app:build model=Qwen/Qwen-Image step_execution=true \\
        data_parallel_size=4

Its arguments are `vllm serve`'s flags without the dashes (`max_num_seqs=8`, `enforce_eager=true`);
they are parsed and checked by the same parser, so a bad one fails the deploy with the flag's message.
Two deployments: `OpenAIIngress` (our FastAPI app as Serve's ingress, behind Serve's HTTP proxy) and
`DiffusionReplica` (one engine each), which a Serve config may override like any deployment
(`num_replicas`, `autoscaling_config`, `ray_actor_options`).
"""

from __future__ import annotations

from ray import serve

from vllm_omni.config import OmniDiffusionConfig

SERVE_OWNED_FLAGS = ("host", "port", "ssl_keyfile", "ssl_certfile", "ray_address", "data_parallel_backend")
"""Flags Serve's own HTTP proxy and cluster answer for: refused as arguments."""


def _argv(args: dict) -> list[str]:
    """`{"model": M, "step_execution": "true", "max_num_seqs": 8}` -> `serve` argv."""
    argv = [str(args["model"])] if "model" in args else []
    for key, value in args.items():
        if key == "model":
            continue
        if key in SERVE_OWNED_FLAGS:
            raise ValueError(f"{key}: Serve's HTTP proxy and cluster set this; configure it in Serve")
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            if str(value).lower() == "true":
                argv.append(flag)
            continue
        argv += [flag, str(value)]
    return argv


@serve.ingress()
class OpenAIIngress:
    """Our OpenAI app over a `ReplicatedEngine` of the `DiffusionReplica` deployment's handle."""

    def __init__(
        self, replicas, config: OmniDiffusionConfig, server_args, router_key: str, num_replicas: int
    ):
        from vllm_omni.entrypoints.replicas.client import ReplicatedEngine

        app_name = serve.get_replica_context().app_name
        self.server_args = server_args
        self.client = ReplicatedEngine(config, replicas, app_name, router_key, num_replicas)

    def __serve_build_asgi_app__(self):
        from vllm_omni.entrypoints.openai.api_server import build_app
        from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger
        from vllm_omni.entrypoints.replicas.metrics import ReplicaMetrics

        metrics = PrometheusStatLogger(self.client.config, self.server_args.served_model_names[0])
        ReplicaMetrics(self.client, metrics.registry)
        return build_app(self.client, self.server_args, metrics)


def build(args: dict):
    """Serve's application builder: `serve` flags as arguments (module docstring)."""
    import uuid

    from vllm_omni.entrypoints.cli.main import build_parser
    from vllm_omni.entrypoints.cli.replica_args import replica_options_from_args
    from vllm_omni.entrypoints.cli.serve import (
        engine_config_from_args,
        server_args_from_args,
        unsupported_flag_errors,
    )
    from vllm_omni.entrypoints.replicas.ray_serve import replica_deployment

    parsed = build_parser().parse_args(["serve", *_argv(args), "--data-parallel-backend", "ray"])
    errors = unsupported_flag_errors(parsed)
    if errors:
        raise ValueError("; ".join(errors))
    config, server_args = engine_config_from_args(parsed), server_args_from_args(parsed)
    options = replica_options_from_args(parsed)
    num_replicas = 1 if options is None else options.num_replicas
    key = uuid.uuid4().hex
    replicas = replica_deployment(
        config,
        num_replicas,
        key,
        "work" if options is None else options.routing,
        num_gpus=None if options is None else options.num_gpus_per_replica,
    )
    # the HTTP work is light next to a replica's, and a CPU box may have no CPU left for it
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, config, server_args, key, num_replicas)
