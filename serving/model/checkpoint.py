"""Hugging Face checkpoint directories in and out of our model: `config.json`,
`model.safetensors` (tensor names in hf_state_dict.py), the tokenizer files and
`generation_config.json`; FP4 checkpoints in compressed-tensors' layout (quantization.py)
are loaded into FP4 modules, and `quantize_checkpoint` writes them.

The MTP head's tensors live in a sub-folder, `mtp/model.safetensors`, where transformers and
vLLM do not look: both refuse or warn about tensors their architecture does not have, and
the rest of the directory is then a plain Qwen3-MoE checkpoint they load unchanged. Our
loader reads both files (and MTP tensors inside `model.safetensors`, as older checkpoints
hold them).
"""

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kernels import ops
from kernels.formats import FP4Format
from serving.model import quantization
from serving.model.causal_lm import CausalLM, rope_table
from serving.model.config import CheckpointError, ModelConfig
from serving.model.device import CPU
from serving.model.dtype import DTYPES, resolve_dtype
from serving.model.hf_state_dict import FP4_PARTS, from_hf_state_dict, to_hf_state_dict
from serving.model.hybrid.config import HybridConfig, is_hybrid_checkpoint

MTP_FILE = Path("mtp") / "model.safetensors"
MTP_PREFIX = "mtp."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# The generation_config.json fields a request inherits when it leaves them unset (those of
# vLLM's `get_diff_sampling_param`, less max_new_tokens).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GenerationConfigMode = Literal["auto", "vllm"]


def _safetensors_files(path: Path) -> list[Path]:
    """`model.safetensors`, or the shards its index names, and the MTP head's file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed index: {e!r}") from e
    elif (path / "model.safetensors").exists():
        names = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors")
    if (path / MTP_FILE).exists():
        names.append(str(MTP_FILE))
    return [path / name for name in names]


def read_safetensors(path: Path, device: torch.device = CPU) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards its index names, and of the MTP
    head's file, read straight onto `device` (no staging copy in host memory for a GPU)."""
    tensors = {}
    for f in _safetensors_files(path):
        try:
            with safe_open(f, framework="pt", device=str(device)) as st:
                for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[k] = st.get_tensor(k)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors file: {e}") from e
    return tensors


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`model.safetensors` with the model's tensors, and the MTP head's apart in `mtp/`."""
    head = {k: v.contiguous() for k, v in tensors.items() if k.startswith(MTP_PREFIX)}
    main = {k: v.contiguous() for k, v in tensors.items() if not k.startswith(MTP_PREFIX)}
    save_file(main, path / "model.safetensors", metadata={"format": "pt"})
    if head:
        (path / MTP_FILE).parent.mkdir(exist_ok=True)
        save_file(head, path / MTP_FILE, metadata={"format": "pt"})
    else:
        (path / MTP_FILE).unlink(missing_ok=True)


def check_checkpoint(path: str | Path) -> str | None:
    """What can be checked of a checkpoint without reading its weights, as `tierserve serve`
    does before it starts a tier: config.json (a hybrid model's too), and for an FP4
    checkpoint its format and the shapes of its packed codes and scales (the safetensors
    headers) against config.json. Returns the weights' dtype as saved (`--dtype auto`'s)."""
    path = Path(path)
    if is_hybrid_checkpoint(path):
        return HybridConfig.from_file(path / "config.json").dtype
    config = ModelConfig.from_file(path / "config.json")
    if config.quantization is None:
        return config.dtype
    fmt = quantization.checkpoint_format(config.quantization)
    shapes = {}
    for f in _safetensors_files(path):
        try:
            with safe_open(f, framework="pt") as st:
                for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[k] = st.get_slice(k).get_shape()
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors file: {e}") from e
    quantization.check_fp4_layout(shapes, config, fmt)
    return config.dtype


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device = CPU,
    keep_fp4: bool | None = None,
) -> CausalLM:
    """The model in `dtype` on `device`: a torch dtype, or a `--dtype` name (`auto`: the
    checkpoint's).

    FP4 weights stay FP4 (`keep_fp4=None`) where kernels read them as they are: the Triton
    kernels on CUDA, the C++ ops of `kernels/cpu_fp4.py` on a CPU. Where those cannot be
    built (a warning says so), they are dequantized once, at load, to `dtype`, in the memory
    of a `dtype` checkpoint; `keep_fp4=False` asks for that anywhere. An FP4 checkpoint whose
    packed codes or scales disagree with its config.json is refused (`CheckpointError`).

    Where `auto` computes wider than the checkpoint's dtype (a bf16 checkpoint on a CPU
    without native bf16: fp32), the weights of the decoder layers and MTP layers (projections,
    routers, experts) stay in the checkpoint's dtype and are widened as they are used: inside
    the compiled decode and draft steps' fused loops and C++ ops, per call in eager steps,
    only the used experts in grouped ones. Widening bf16 is exact, so the model computes
    what it would with fp32 weights, in half their memory, and no slower (a compiled step
    reads half the bytes); FP4 weights dequantized at load are held in the checkpoint's dtype
    there too. A dtype named explicitly converts everything else to it."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    config = ModelConfig.from_file(path / "config.json")
    widened, stored = False, dtype
    if isinstance(dtype, str):
        auto = dtype == "auto"
        dtype = resolve_dtype(dtype, config.dtype, device)
        stored = DTYPES.get(config.dtype or "float32", torch.float32)
        widened = auto and dtype.itemsize > stored.itemsize
    model = CausalLM.empty(config)
    hf = read_safetensors(path, device)
    if config.quantization is not None:
        fmt = quantization.checkpoint_format(config.quantization)
        quantization.check_fp4_layout({k: v.shape for k, v in hf.items()}, config, fmt)
        quantization.check_fp4_values(hf, fmt)
        hf = quantization.unpack_state_dict(hf)
        if keep_fp4 is None:
            keep_fp4 = ops.has_fp4_kernels(device)
        if keep_fp4:
            with torch.device("meta"):
                quantization.use_quantized_modules(model, hf, fmt)
        else:  # a plain model now: saving it must not claim FP4 weights
            hf = quantization.dequantize_state_dict(hf, fmt, stored if widened else dtype)
            config.quantization = None
    state = from_hf_state_dict(hf, model)
    # FP4 arrays keep their dtypes (uint8 codes and scales, fp32 row scales).
    state = {
        k: v
        if k.rpartition(".")[2] in FP4_PARTS or (widened and _held_narrow(k, v))
        else v.to(dtype)
        for k, v in state.items()
    }
    model.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Non-persistent buffers (RoPE tables) were created on meta: rebuild them.
    cos, sin = rope_table(config.head_dim, config.max_position_embeddings, config.rope_theta)
    model.rotary.cos, model.rotary.sin = cos.to(device), sin.to(device)
    return model.eval()


def _held_narrow(name: str, value: torch.Tensor) -> bool:
    """A decoder or MTP layer's weight matrix or an expert weight: what `auto` keeps in the
    checkpoint's dtype where it computes wider. The embedding (gathered, and the tied LM head
    packed for oneDNN) and the norms are widened at load."""
    leaf = name.rpartition(".")[2]
    return leaf in ("gate_up", "down") or (
        name.startswith(("layers.", "mtp.")) and value.dim() >= 2
    )


def save_checkpoint(
    model: CausalLM,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    generation_config: dict | None = None,
) -> None:
    """Write a directory that transformers, vLLM and our loader all read."""
    write_directory(model, path, model.config.to_dict(), to_hf_state_dict(model),
                    tokenizer_dir, generation_config)  # fmt: skip


def write_directory(
    model: torch.nn.Module,
    path: str | Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    tokenizer_dir: str | Path | None = None,
    generation_config: dict | None = None,
) -> None:
    """A checkpoint directory of either family: `config` (config.json's fields, the dtype
    added from the model's embedding), `tensors` under transformers' names, the tokenizer
    files from `tokenizer_dir`, and generation_config.json with the model's special tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config, dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(path, tensors)
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != path.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy(Path(tokenizer_dir) / name, path / name)
    gen = generation_config or {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            gen.setdefault(key, config[key])
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def sampling_defaults(path: str | Path, mode: GenerationConfigMode) -> dict[str, float]:
    """The sampling settings the checkpoint's creator recommends (`auto`: its
    generation_config.json), which requests that leave a field unset inherit, as vLLM's
    `--generation-config`; `vllm` ignores the file, so unset fields get the neutral defaults
    (temperature 1.0)."""
    file = Path(path) / "generation_config.json"
    if mode == "vllm" or not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: {e}") from e
    defaults = {}
    for key in SAMPLING_DEFAULT_FIELDS:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{file}: {key} must be a number, not {value!r}")
        defaults[key] = int(value) if key == "top_k" else float(value)
    return defaults


def quantize_checkpoint(
    src: Path, out: Path, format: FP4Format, all_linear: bool, dtype: torch.dtype | None = None
) -> None:
    """Post-training quantization of a checkpoint directory into a new one. The FP4 weights
    are quantized from fp32; what stays in full precision (embeddings, norms, routers, the
    LM head) is stored in `dtype`, by default the source's."""
    source = ModelConfig.from_file(Path(src) / "config.json")
    if source.quantization is not None:
        raise CheckpointError(f"{src}: already quantized")
    dtype = dtype or getattr(torch, source.dtype or "float32")
    model = load_checkpoint(src)
    state = quantization.quantize_state_dict(to_hf_state_dict(model), format, all_linear)
    state = {k: v if ".weight_" in k else v.to(dtype) for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    model.config.quantization = quantization.quantization_config(format, all_linear)
    config = model.config.to_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out, state)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
