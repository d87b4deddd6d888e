"""The `serve` flags of vLLM-Omni and vLLM that a deployment may pass, as data.

Each entry says what this server does with the flag: HONOURED (a real flag in `serve.py`), NO_EFFECT
(accepted with one warning line, `compat_flags.NO_EFFECT_FLAGS`) or REFUSED (exit 2 with a message
saying what works, unless at its default). `tests/test_flags.py` walks the list: every flag parses,
does what its entry says, and is named in docs/serving.md, so the docs cannot go stale.

Sources: vLLM-Omni's `vllm_omni/entrypoints/cli/serve.py` (its OmniConfig group, December 2026; older
versions' flags that it dropped are kept) and vLLM's `serve` flags that deployment scripts carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["honoured", "no_effect", "refused"]


@dataclass(frozen=True)
class UpstreamFlag:
    """One spelling of an upstream flag and an example of it on a command line."""

    argv: tuple[str, ...]
    """The flag and its example value(s), e.g. `("--dtype", "half")`; `{tmp}` is a scratch folder."""
    kind: Kind
    source: Literal["vllm-omni", "vllm"]

    @property
    def flag(self) -> str:
        return self.argv[0]


def _flags(source: str, kind: Kind, *argvs: str) -> list[UpstreamFlag]:
    return [UpstreamFlag(tuple(a.split()), kind, source) for a in argvs]


VLLM_OMNI_FLAGS: tuple[UpstreamFlag, ...] = (
    *_flags(
        "vllm-omni",
        "honoured",
        "--omni",
        "--init-timeout 900",
        "--log-stats",
        "--log-file {tmp}/server.log",
        "--num-gpus 1",
        "--model-class-name QwenImagePipeline",
        "--diffusion-load-format dummy",
        "--usp 1",
        "--ulysses-degree 1",
        "--ring 1",
        "--ring-degree 1",
        "--cfg-parallel-size 1",
        "--diffusion-attention-backend SDPA",
        '--diffusion-attention-config {"default":{"backend":"SDPA"}}',
        '-dac {"default":{"backend":"SDPA"}}',
        "--diffusion-attention-config.default.backend SDPA",
        "--cache-backend none",
        "--cache-backend cache_dit",
        '--cache-backend tea_cache --cache-config {"rel_l1_thresh":0.3} --enable-cache-dit-summary',
        "--cache-config {}",
        "--enable-cache-dit-summary",
        '--diffusion-quantization-config {"method":"fp8"}',
        '--diffusion-quantization-config {"transformer":{"method":"fp8","ignored_layers":["img_mlp"]}}',
        "--step-execution",
        "--diffusion-batching-policy profile",
        "--vae-use-slicing",
        "--vae-use-tiling",
        "--flow-shift 3.0",
        '--default-sampling-params {"0":{"num_inference_steps":20}}',
        "--max-generated-image-size 1048576",
    ),
    *_flags(
        "vllm-omni",
        "no_effect",
        "--enable-sleep-mode",
        "--task-type t2i",
        "--forced-aligner m",
        "--forced-aligner-config c.yaml",
        "--forced-aligner-device 0",
        "--deploy-config d.yaml",
        "--strategy-config s.yaml",
        '--stage-overrides {"0":{}}',
        "--async-chunk",
        "--no-async-chunk",
        "--stage-id 0",
        "--replica-id 0",
        "--stage-init-timeout 600",
        "--stage-configs-path s.yaml",
        "--init-sleep-seconds 1",
        "--shm-threshold-bytes 65536",
        "--batch-timeout 10",
        "--worker-backend multi_process",
        "--ray-address a",
        "--omni-master-address a",
        "-oma a",
        "--omni-master-port 1",
        "-omp 1",
        "--omni-replica-address a",
        "-ora a",
        "--omni-dp-size-local 1",
        "--omni-lb-policy random",
        "--omni-heartbeat-timeout 30",
        "--lora-path a.safetensors",
        "--lora-backend peft",
        "--lora-scale 1.0",
        "--diffusion-compile-granularity regional",
        "--diffusion-compile-dynamic",
        "--no-diffusion-compile-dynamic",
        "--fa-deterministic",
        "--diffusers-load-kwargs {}",
        "--diffusers-call-kwargs {}",
        "--custom-pipeline-args {}",
        "--ulysses-mode strict",
        "--ulysses-a2a-permute",
        "--no-ulysses-a2a-permute",
        "--allgather-degree 1",
        "--cp 1",
        "--context-parallel-degree 1",
        "--force-cutlass-fp8",
        "--use-hsdp",
        "--hsdp-shard-size -1",
        "--hsdp-replicate-size 1",
        "--fastvideo-vsa-topk 1",
        "--video-output-transport {}",
        "--request-batch-max-wait-ms 0",
        "--disable-multithread-weight-load",
        "--enable-broadcast-weight-load",
        "--num-weight-load-threads 4",
        "--diffusion-offload-config {}",
        "--enable-cpu-offload",
        "--enable-layerwise-offload",
        "--enable-distributed-layerwise-offload",
        "--layerwise-num-gpu-layers 1",
        "--dlo-use-allgather",
        "--dlo-no-use-allgather",
        "--dlo-resident-layers 0",
        "--host-weight-runtime-mode disabled",
        "--host-weight-runtime-root r",
        "--dlo-host-registration-limit-gib 0",
        "--boundary-ratio 0.875",
        "--diffusion-kv-cache-dtype fp8",
        "--diffusion-kv-cache-skip-steps 0-9",
        "--diffusion-kv-cache-skip-layers 0,1",
        "--vae-patch-parallel-size 1",
        "--text-encoder-tp-size 1",
        "--vae-parallel-mode tile",
        "--diffusion-streaming-output",
        "--tts-max-instructions-length 500",
        "--no-guardrails",
        "--robot-openpi-idle-timeout 30",
        "--enable-diffusion-pipeline-profiler",
        "--enable-ar-profiler",
        "--enable-orch-monitor",
        "--auxiliary-text-encoder m",
    ),
    *_flags(
        "vllm-omni",
        "refused",
        "--cache-backend mag_cache",
        "--cache-backend sea_cache",
        "--cache-backend step_cache",
        '--cache-config {"rel_l1_thresh":0.3}',
        '--diffusion-quantization-config {"method":"int8"}',
        '--diffusion-quantization-config {"vae":{"method":"fp8"}}',
        "--diffusion-load-format custom_pipeline",
        "--diffusion-batching-policy compute_budget",
        "--diffusion-batching-config {}",
        "--cp 2",
        '--diffusion-attention-config {"per_role":{"cross":{"backend":"SAGE_ATTN"}}}',
    ),
)
"""vLLM-Omni's diffusion `serve` flags (its OmniConfig group, and `--trust-remote-code` from vLLM's)."""

VLLM_FLAGS: tuple[UpstreamFlag, ...] = (
    *_flags(
        "vllm",
        "honoured",
        "--gpu-memory-utilization 0.9",
        "--host 127.0.0.1",
        "--port 8001",
        "--api-key k",
        "--served-model-name m",
        "--dtype half",
        "--dtype float",
        "--dtype bfloat16",
        "--quantization fp8",
        "-q fp8",
        "--scheduling-policy fcfs",
        "--scheduling-policy priority",
        "--root-path /omni",
        "--ssl-keyfile {tmp}/key.pem --ssl-certfile {tmp}/cert.pem",
        "--ssl-ca-certs {tmp}/ca.pem --ssl-keyfile {tmp}/key.pem --ssl-certfile {tmp}/cert.pem",
        "--ssl-cert-reqs 0",
        "--uvicorn-log-level warning",
        '--allowed-origins ["*"]',
        '--allowed-methods ["POST"] --allowed-origins ["*"]',
        '--allowed-headers ["*"] --allowed-origins ["*"]',
        '--allow-credentials --allowed-origins ["*"]',
        "--enable-log-requests",
        "--disable-log-requests",
        "--disable-log-stats",
        "--tensor-parallel-size 1",
        "-tp 1",
        "--max-num-seqs 4",
        "--max-num-batched-tokens 8192 --step-execution",
        "--kv-cache-memory-bytes 1000000",
        "--seed 0",
        "--enforce-eager",
        "--load-format dummy",
        "--lora-modules a=/nonexistent",
        "--max-loras 2",
        "--max-lora-rank 16",
    ),
    *_flags(
        "vllm",
        "no_effect",
        "--trust-remote-code",
        "--max-log-len 100",
        "--disable-frontend-multiprocessing",
        "--api-server-count 1",
        "--enable-ssl-refresh",
        "--max-model-len 4096",
        "--tokenizer t",
        "--revision main",
        "--download-dir d",
        "--disable-uvicorn-access-log",
        "--disable-fastapi-docs",
    ),
    *_flags("vllm", "refused", "--api-server-count 2", "--quantization int8", "--quantization awq"),
)
"""vLLM's own `serve` flags that deployment scripts pass to a diffusion server."""

UPSTREAM_FLAGS: tuple[UpstreamFlag, ...] = VLLM_OMNI_FLAGS + VLLM_FLAGS
