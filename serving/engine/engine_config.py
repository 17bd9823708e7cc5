"""The engine's settings, as `tierserve engine` and `generate` take them on the command line
(`serving/commands.py`); apart from the engine so that its parts can read them."""

from dataclasses import dataclass

from speculative.config import SpeculativeConfig

CPU_KV_CACHE_BYTES = 256 << 20


@dataclass
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    # None: CPU_KV_CACHE_BYTES on a CPU; on a GPU, what gpu_memory_utilization leaves.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # vLLM's: the GPU's share this engine may use
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    dtype: str = "auto"  # what `from_checkpoint` loads the weights in (`serving/model/dtype.py`)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype
    device: str = "auto"  # where `from_checkpoint` loads the model; the engine runs there
    # vLLM's flag: no compiled decode steps on a CPU (`serving/model/graphs/decode.py`), no
    # CUDA graphs on a GPU (`serving/model/graphs/cuda_graphs.py`). Eager here, so tests, training
    # rollouts and scripts start at once; `tierserve engine` and `generate` and gateway tiers
    # capture unless given --enforce-eager, as vLLM does.
    enforce_eager: bool = True
    # A server's decode graphs past the one-row graph compile in a process of their own
    # (`serving/engine/compile_process.py`), so it is ready, and serves undisturbed, sooner;
    # only an engine made `from_checkpoint` can start one.
    compile_graphs_apart: bool = False
