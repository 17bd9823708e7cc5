"""Serving's subcommands: the gateway (`serve`, `loadtest`), one tier (`engine`), offline
generation (`generate`) and FP4 conversion (`quantize`)."""

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from serving.engine.llm_engine import (
    CPU_KV_CACHE_BYTES,
    EngineConfig,
    EngineInputError,
    LLMEngine,
)
from serving.gateway.config import GatewayConfigError
from serving.gateway.loadtest import LoadTestError, add_loadtest
from serving.model.checkpoint import sampling_defaults
from serving.model.config import CheckpointError
from serving.model.device import DEVICE_CHOICES, UnsupportedDeviceError
from serving.model.dtype import DTYPE_CHOICES, UnsupportedDtypeError
from serving.model.tokenizer import TokenizerError
from serving.sampling.params import SamplingParams
from speculative.config import SpeculativeConfig

USER_ERRORS = (
    CheckpointError,
    TokenizerError,
    EngineInputError,
    GatewayConfigError,
    LoadTestError,
    UnsupportedDtypeError,
    UnsupportedDeviceError,
)


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.model_validate_json(text)
    except ValidationError as e:
        raise argparse.ArgumentTypeError(_first_error(e)) from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _first_error(e: ValidationError) -> str:
    error = e.errors()[0]
    where = ".".join(map(str, error["loc"]))
    return f"{where}: {error['msg']}" if where else error["msg"]


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        speculative=args.speculative_config,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
    )
    if args.kv_cache_memory is not None:
        config.kv_cache_bytes = args.kv_cache_memory << 20
    return config


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        metavar="MIB",
        help=f"KV cache budget in MiB (default: {CPU_KV_CACHE_BYTES >> 20} on a CPU; on a GPU, "
        "what --gpu-memory-utilization leaves after the weights)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=defaults.gpu_memory_utilization,
        help="the GPU's memory share this engine may take, the KV cache getting what the "
        "weights leave of it (as vLLM's; ignored on a CPU)",
    )
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        metavar="JSON",
        help='speculative decoding, as vLLM: \'{"method": "mtp"|"ngram"|"draft", '
        '"model": DRAFT_DIR, "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=defaults.dtype,
        help="weights and activations (auto: the checkpoint's); logits and sampling stay fp32",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=DTYPE_CHOICES,
        default=defaults.kv_cache_dtype,
        help="the KV cache's (auto: the model's --dtype)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default=defaults.device,
        help="where weights, KV cache and sampling live (auto: cuda when present)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no compiled decode steps on a CPU (they take seconds to "
        "load at start, minutes the first time; the cache is in $TIERSERVE_CACHE_DIR, default "
        "~/.cache/tierserve) and no CUDA graphs on a GPU",
    )
    parser.add_argument(
        "--generation-config",
        choices=["auto", "vllm"],
        default="auto",
        help="sampling fields a request leaves unset: auto = the checkpoint's "
        "generation_config.json, vllm = the neutral defaults (temperature 1.0)",
    )


def run_engine(args: argparse.Namespace) -> None:
    from serving.api_server.api_server import serve  # FastAPI and uvicorn only when serving

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.standby:
        from serving.gateway.supervisor import STANDBY_READY
        from serving.model.graphs.inductor_setup import import_compiler

        import_compiler()
        # Stdin is a socket from the gateway, which reads this there; a pipe's read end refuses it.
        with contextlib.suppress(OSError):
            os.write(sys.stdin.fileno(), STANDBY_READY)
        if not sys.stdin.readline():  # the gateway closed it: it is gone or stopping
            return
    config = _engine_config(args)
    config.compile_graphs_apart = True  # a server: ready at one stream's full speed sooner
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        engine_config=config,
        model_name=args.served_model_name,
        generation_config=args.generation_config,
    )


def add_engine(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("engine", help="serve one checkpoint with the OpenAI API")
    _add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TIERSERVE_API_KEY"),
        help="require this bearer key (default: $TIERSERVE_API_KEY)",
    )
    parser.add_argument(
        "--served-model-name", help="the model name clients use (default: the directory's)"
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="import everything, then wait for a line on stdin before loading the model "
        "(the gateway keeps such a process ready to replace a tier that dies)",
    )
    parser.set_defaults(run=run_engine)


def run_generate(args: argparse.Namespace) -> None:
    engine = LLMEngine.from_checkpoint(args.model, _engine_config(args))
    tokenizer = engine.tokenizer
    assert tokenizer is not None  # from_checkpoint always loads one
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    settings = sampling_defaults(args.model, args.generation_config)
    if args.temperature is not None:
        settings["temperature"] = args.temperature
    params = SamplingParams(max_tokens=args.max_tokens, **settings)
    [[output]] = engine.generate([tokenizer.encode(prompt)], params)
    print(output.text)


def add_generate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="complete one prompt offline and print it")
    _add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--temperature", type=float, help="default: --generation-config's (auto: the checkpoint's)"
    )
    parser.add_argument("--chat", action="store_true", help="render the chat template first")
    parser.add_argument("prompt")
    parser.set_defaults(run=run_generate)


def run_quantize(args: argparse.Namespace) -> None:
    from serving.model.checkpoint import quantize_checkpoint

    quantize_checkpoint(args.model, args.out, args.format, args.all_linear)
    print(args.out)


def add_quantize(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "quantize", help="write an FP4 copy of a checkpoint (compressed-tensors layout)"
    )
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--format", required=True, choices=["mxfp4", "nvfp4"])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--all-linear",
        action="store_true",
        help="also the attention and dense MLP projections (default: expert weights only)",
    )
    parser.set_defaults(run=run_quantize)


def run_serve(args: argparse.Namespace) -> None:
    from serving.gateway.app import serve_gateway
    from serving.gateway.config import check_checkpoints, load_config

    config = load_config(args.config)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    config = config.model_validate(config.model_dump() | updates)
    check_checkpoints(config)
    if not config.json_logs:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call
    serve_gateway(config)


def add_serve(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve", help="serve the gateway over both tiers (starting embedded tiers)"
    )
    parser.add_argument("--config", type=Path, help="YAML or JSON (default: the shipped tiers)")
    parser.add_argument("--host", help="overrides the config's host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="overrides the config's port (default 8000)")
    parser.set_defaults(run=run_serve)


def add_commands(sub: argparse._SubParsersAction) -> None:
    for add in (add_serve, add_engine, add_generate, add_quantize, add_loadtest):
        add(sub)
