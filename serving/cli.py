"""The `tierserve` command: one small function per subcommand, registered in `COMMANDS`.

Expected failures (a missing or malformed checkpoint, a prompt that does not fit) print one
line and exit with status 2; only bugs show a traceback.
"""

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from router.cli import add_eval_router_args, run_eval_router
from router.learned import RouterFileError
from router.outcomes import OutcomeError
from serving.config import CheckpointError
from serving.engine import EngineConfig, EngineInputError, LLMEngine
from serving.gateway_config import GatewayConfigError
from serving.loadtest import LoadTestError, add_loadtest
from serving.sampling_params import SamplingParams
from serving.tokenizer import TokenizerError
from speculative.config import SpeculativeConfig
from training.cli import add_train
from training.config import ConfigError
from training.sandbox import ISOLATION_CHOICES, ISOLATION_ENV, SandboxUnavailable

# Errors that mean "bad input", not "bug".
USER_ERRORS = (
    CheckpointError,
    ConfigError,
    TokenizerError,
    EngineInputError,
    OSError,
    json.JSONDecodeError,
    GatewayConfigError,
    RouterFileError,
    OutcomeError,
    LoadTestError,
    SandboxUnavailable,
)


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.model_validate_json(text)
    except ValidationError as e:
        raise argparse.ArgumentTypeError(_first_error(e)) from None


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
        help=f"KV cache budget in MiB (default {defaults.kv_cache_bytes >> 20})",
    )
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        metavar="JSON",
        help='speculative decoding, as vLLM: \'{"method": "mtp"|"ngram"|"draft", '
        '"model": DRAFT_DIR, "num_speculative_tokens": 4}\'',
    )


def run_engine(args: argparse.Namespace) -> None:
    from serving.server import serve  # FastAPI and uvicorn only when serving

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        engine_config=_engine_config(args),
        model_name=args.served_model_name,
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
    parser.set_defaults(run=run_engine)


def run_generate(args: argparse.Namespace) -> None:
    engine = LLMEngine.from_checkpoint(args.model, _engine_config(args))
    tokenizer = engine.tokenizer
    assert tokenizer is not None  # from_checkpoint always loads one
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    [[output]] = engine.generate([tokenizer.encode(prompt)], params)
    print(output.text)


def add_generate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="complete one prompt offline and print it")
    _add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="render the chat template first")
    parser.add_argument("prompt")
    parser.set_defaults(run=run_generate)


def run_init_checkpoint(args: argparse.Namespace) -> None:
    from training.init_checkpoint import init_checkpoint, read_shape

    shape = read_shape(args.shape) if args.shape else None
    print(init_checkpoint(args.out, shape, seed=args.seed))


def add_init_checkpoint(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "init-checkpoint", help="write a random-weight checkpoint with a trained tokenizer"
    )
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--shape", type=Path, help="a config.json, or a card with the config under 'config'"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run_init_checkpoint)


def run_quantize(args: argparse.Namespace) -> None:
    from serving.quantization import quantize_checkpoint

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


def run_sandbox_exec(args: argparse.Namespace) -> None:
    from training.sandbox import Limits, run_code

    limits = Limits() if args.timeout is None else Limits(timeout_s=args.timeout)
    result = run_code(args.lang, args.file.read_text(), limits=limits, isolation=args.isolation)
    print(json.dumps(result.to_json()))


def add_sandbox(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("sandbox", help="run untrusted code in the execution sandbox")
    actions = parser.add_subparsers(required=True, metavar="ACTION")
    exec_parser = actions.add_parser("exec", help="run one file and print the JSON result")
    exec_parser.add_argument("--lang", required=True, choices=["python", "bash"])
    exec_parser.add_argument("file", type=Path)
    exec_parser.add_argument("--timeout", type=float, help="wall-clock seconds (default 5)")
    exec_parser.add_argument(
        "--isolation",
        choices=ISOLATION_CHOICES,
        help=f"default ${ISOLATION_ENV}, else auto: bubblewrap, else unshare, else refuse; "
        "rlimits: no namespaces, only if you accept running the file nearly unconfined",
    )
    exec_parser.set_defaults(run=run_sandbox_exec)


def run_eval(args: argparse.Namespace) -> None:
    if args.what == "router":
        run_eval_router(args)
        return
    if args.model is None and args.url is None and args.reference is None:
        args.parser.error("one of --model, --url or --reference is required")
    from training import eval as harness

    records = asyncio.run(
        harness.run(
            args.domains.split(","),
            args.difficulty,
            args.n,
            args.seed,
            args.concurrency,
            model_dir=args.model,
            url=args.url,
            served_model=args.served_model,
            api_key=args.api_key,
            reference=args.reference,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
        )
    )
    result = harness.report(records)
    print(harness.format_table(result["summary"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.baseline:
        failures = harness.regressions(
            result["summary"], json.loads(args.baseline.read_text()), args.max_drop
        )
        for failure in failures:
            print(f"regression: {failure}", file=sys.stderr)
        if failures:
            sys.exit(1)


def add_eval(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help="score a model on held-out tasks of the domains (or, `eval router`, the routers)",
    )
    parser.add_argument(
        "what",
        nargs="?",
        choices=["router"],
        help="`router`: the routers' quality-vs-cost curves on paired outcomes",
    )
    add_eval_router_args(parser)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--model", type=Path, help="a checkpoint directory, served in process")
    target.add_argument("--url", help="an OpenAI-compatible API root, e.g. http://host:8100/v1")
    target.add_argument(
        "--reference", choices=["think", "short"], help="play the reference solutions instead"
    )
    parser.add_argument("--served-model", help="the model name to ask for at --url")
    parser.add_argument("--api-key", default=os.environ.get("TIERSERVE_API_KEY"))
    parser.add_argument("--domains", default="math,code,terminal,tools")
    parser.add_argument("--n", type=int, default=20, help="tasks per domain and difficulty")
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out tasks")
    parser.add_argument("--difficulty", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512, help="per assistant turn")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", type=Path, help="write the summary and every record here")
    parser.add_argument("--baseline", type=Path, help="an earlier --json: exit 1 on a drop")
    parser.add_argument(
        "--max-drop", type=float, default=5.0, help="allowed drop in completion, in points"
    )
    parser.set_defaults(run=run_eval, parser=parser)


def run_serve(args: argparse.Namespace) -> None:
    from serving.gateway import serve_gateway
    from serving.gateway_config import check_checkpoints, load_config

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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_serve,
    add_engine,
    add_generate,
    add_init_checkpoint,
    add_quantize,
    add_sandbox,
    add_eval,
    add_train,
    add_loadtest,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierserve", description="Tiered LLM inference serving over one sparse MoE family."
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except USER_ERRORS as e:
        print(f"tierserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it once it has shut down cleanly
        sys.exit(130)
