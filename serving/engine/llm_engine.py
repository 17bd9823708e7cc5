"""The engine: requests in, token and text deltas out, one scheduled step at a time."""

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.engine import compile_process
from serving.engine.block_manager import BlockManager
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.engine_config import CPU_KV_CACHE_BYTES, EngineConfig
from serving.engine.hybrid_setup import check_num_blocks, hybrid_parts
from serving.engine.json_constraint import JsonObjectConstraint
from serving.engine.model_runner import ModelRunner, SampledTokens
from serving.engine.outputs import RequestOutput, SequenceOutput
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence
from serving.engine.state_slots import StateSlots
from serving.engine.token_vocabulary import json_vocabulary
from serving.engine.tool_constraint import OptionalToolCallConstraint, ToolCallConstraint
from serving.model.causal_lm import CausalLM
from serving.model.config import ModelConfig
from serving.model.device import kv_cache_budget, resolve_device
from serving.model.dtype import resolve_kv_cache_dtype
from serving.model.families import load_model
from serving.model.graphs import cuda_graphs
from serving.model.graphs.decode import DecodeGraphs, Progress, graph_sizes
from serving.model.host_memory import retain_freed_memory
from serving.model.host_threads import TorchThreads
from serving.model.hybrid.model import HybridCausalLM
from serving.model.paged import PagedModel, kv_bytes_per_block
from serving.model.tokenizer import Tokenizer
from serving.sampling.params import SamplingParams, TokenLogprob
from speculative.config import SpeculativeConfig
from speculative.counts import SpecCounts
from speculative.draft_model import DraftModelProposer
from speculative.mtp import MTPProposer
from speculative.ngram import NgramProposer
from speculative.proposer import Proposer
from speculative.speculator import Speculator


class EngineInputError(ValueError):
    """A request the engine cannot run as given (the server answers 400)."""


@dataclass(frozen=True)
class EngineRequest:
    """A prompt and its parameters that `LLMEngine.validate` accepted. API edges validate
    once and pass this inward; nothing further in checks it again."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    sent_first: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(
        self,
        model: CausalLM | HybridCausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: list[int] | None = None,
        compile_apart: compile_process.CompileApart | None = None,
    ) -> None:
        """`compile_apart`: see `EngineConfig.compile_graphs_apart`."""
        self.config = config = config or EngineConfig()
        self.compile_apart = compile_apart
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = set(
            eos_token_ids
            if eos_token_ids is not None
            else (tokenizer.eos_token_ids if tokenizer else [])
        )
        weight = model.embed_tokens.weight
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, weight.dtype, weight.device)
        budget = config.kv_cache_bytes
        if budget is None and weight.device.type == "cuda":
            budget = kv_cache_budget(weight.device, config.gpu_memory_utilization)
        elif budget is None:
            budget = CPU_KV_CACHE_BYTES
        if weight.device.type == "cpu":
            retain_freed_memory()
        self.threads = TorchThreads()  # this thread's count, for the thread that steps
        eos = sorted(self.eos_token_ids)
        self.state_slots: StateSlots | None = None
        if isinstance(model, HybridCausalLM):
            paged, self.blocks, self.state_slots = hybrid_parts(model, config, budget, kv_dtype)
        else:
            per_block = kv_bytes_per_block(model.config, config.block_size, kv_dtype)
            if config.speculative and config.speculative.method == "draft":
                # The draft model keeps as many blocks as the target (`_proposer`): one budget.
                draft = ModelConfig.from_file(Path(config.speculative.model) / "config.json")
                per_block += kv_bytes_per_block(draft, config.block_size, weight.dtype)
            num_blocks = check_num_blocks(budget // per_block, budget)
            self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
            paged = PagedModel(
                model,
                num_blocks,
                config.block_size,
                kv_dtype,
                None if config.enforce_eager else self._graph_sizes(config, weight.device),
                compile_apart,
            )
        self.runner = ModelRunner(paged, eos)
        num_blocks = self.blocks.num_blocks
        self.max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.state_slots
        )
        self.requests: dict[str, _Request] = {}
        proposer = self._proposer(config.speculative) if config.speculative else None
        self.speculator = (
            Speculator(config.speculative, proposer, self.max_model_len) if proposer else None
        )
        # Compiled steps, warmed up in the background: the target's, then the MTP drafter's.
        self.graphs = [
            g
            for g in (
                paged.graphs if isinstance(paged.graphs, DecodeGraphs) else None,
                proposer.graphs if isinstance(proposer, MTPProposer) else None,
            )
            if g is not None
        ]

    @staticmethod
    def _graph_sizes(config: EngineConfig, device: torch.device) -> list[int]:
        """The compiled decode steps' sizes: CUDA graphs at vLLM's capture sizes; on a CPU
        the batch sizes, and a speculating engine's verify step of one sequence (its most
        drafts and the token before them)."""
        if cuda_graphs.captured_on(device):
            return cuda_graphs.capture_sizes(config.max_num_seqs)
        spec = config.speculative
        return graph_sizes(config.max_num_seqs, spec.num_speculative_tokens + 1 if spec else 0)

    def _proposer(self, config: SpeculativeConfig) -> Proposer:
        """The configured drafter, wired to the target's runner and blocks."""
        vocab = self.runner.model.config.vocab_size
        if config.method == "ngram":
            return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        if config.method == "mtp":
            return MTPProposer(self.runner.paged, self.blocks, vocab)
        # The draft model's own blocks, as many as the target's: a shadow of a sequence
        # never holds more tokens than the sequence.
        blocks = BlockManager(self.blocks.num_blocks, self.blocks.block_size, False)
        return DraftModelProposer(
            config.model, blocks, vocab, self.runner.paged.dtype, self.runner.paged.device
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: EngineConfig | None = None) -> "LLMEngine":
        config = config or EngineConfig()
        device = resolve_device(config.device)
        model = load_model(path, config.dtype, device)
        compile_apart = None
        if config.compile_graphs_apart:
            compile_apart = compile_process.CompileApart(
                functools.partial(compile_process.spawn, Path(path), config)
            )
        return cls(model, config, Tokenizer.from_dir(path), compile_apart=compile_apart)

    def warmup(self) -> Progress:
        """How far the compiled steps are, the target's and the MTP drafter's together
        (`DecodeGraphs.progress`): until they are done, steps of some batch sizes run
        eagerly, several times slower. Ready once the target's are: the drafter's compile
        after them, and until one is in the engine decodes without drafts
        (`MTPProposer.ready`), at plain decoding's full speed. An engine without them
        (`enforce_eager`, or CUDA graphs, captured while it is built) is warm at once."""
        parts = [g.progress() for g in self.graphs]
        return Progress(
            sum(p.compiled for p in parts),
            sum(p.wanted for p in parts),
            parts[0].ready if parts else True,
            all(p.done for p in parts),
        )

    def wait_warm(self) -> None:
        """Until every compiled step is built (benchmarks and tests)."""
        for graphs in self.graphs:
            graphs.wait()

    # -- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        """What this engine can run, given its vocabulary, context length and tokenizer;
        raises EngineInputError with a message meant for the client."""
        if not prompt_token_ids:
            raise EngineInputError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise EngineInputError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise EngineInputError(f"stop_token_ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise EngineInputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(prompt_token_ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        if params.max_tokens < 1 or params.n < 1:
            raise EngineInputError("max_tokens and n must be at least 1")
        if params.json_object and params.tool_names is not None:
            raise EngineInputError("json_object and a forced tool call cannot be combined")
        if params.tool_names is not None and not params.tool_names:
            raise EngineInputError("a forced tool call needs at least one function name")
        constrained = params.json_object or params.tool_names is not None
        if constrained and (self.tokenizer is None or not self.eos_token_ids):
            raise EngineInputError("constrained decoding needs a tokenizer with an EOS token")
        return EngineRequest(list(prompt_token_ids), params)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """The offline entry (`generate`, benchmarks): validates, then enqueues."""
        self.enqueue(request_id, self.validate(prompt_token_ids, params))

    def enqueue(self, request_id: str, request: EngineRequest) -> None:
        if request_id in self.requests:
            raise EngineInputError(f"request id {request_id!r} is already running")
        prompt_token_ids, params = request.prompt_token_ids, request.params
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(
                request_id, list(prompt_token_ids), params, index=i, device=self.runner.paged.device
            )
            seq.prefill_leader = seqs[0] if seqs else None
            if (
                i == 0
                and params.n > 1
                and self.state_slots is not None
                and len(prompt_token_ids) > 1
            ):
                seq.fork_at = len(prompt_token_ids) - 1  # the samples fork here (`Scheduler`)
            if params.json_object:
                vocab = json_vocabulary(self.tokenizer.raw)
                seq.constraint = JsonObjectConstraint(vocab, self.eos_token_ids)
            elif params.tool_names is not None:
                vocab = json_vocabulary(self.tokenizer.raw)
                kind = (
                    OptionalToolCallConstraint if params.tool_call_optional else ToolCallConstraint
                )
                seq.constraint = kind(
                    vocab, self.eos_token_ids, params.tool_names, params.tool_parameters
                )
            seqs.append(seq)
        detoks = [
            IncrementalDetokenizer(self.tokenizer.raw, prompt_token_ids, params)
            if self.tokenizer
            else None
            for _ in seqs
        ]
        self.requests[request_id] = _Request(request_id, seqs, detoks)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        return True

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.speculator:
            self.speculator.release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def idle(self) -> None:
        """Called when there is nothing to run: a held compile process goes on meanwhile."""
        if self.compile_apart is not None:
            self.compile_apart.hold(False)

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.threads.adopt()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        if self.compile_apart is not None:  # a lone stream has its full speed already
            self.compile_apart.hold(len(plan.scheduled) == 1)
        start = time.monotonic()
        for seq, _ in plan.scheduled:
            seq.scheduled_time = seq.scheduled_time or start  # queue time ends here
        for fork in plan.forks:  # only a hybrid model's scheduler forks
            self.runner.paged.fork(fork.parent_slot, fork.child_slot, fork.block_copies)
        step = self.runner.run(plan.scheduled)
        now = time.monotonic()
        verified = {s.seq.seq_id for s in step.sampled if s.num_draft_tokens}
        for seq, n in plan.scheduled:
            if seq.seq_id not in verified:
                seq.num_computed_tokens += n
                self.blocks.register_computed(seq)
        deltas: dict[str, list[SequenceOutput]] = {}
        for s in step.sampled:
            deltas.setdefault(s.seq.request_id, []).append(self._commit(s, now))
        if self.speculator:
            self.speculator.propose(step, self.scheduler.running)
        outputs = []
        for request_id, outs in deltas.items():
            req = self.requests[request_id]
            out = self._request_output(req, outs)
            if out.finished:
                del self.requests[request_id]
            outputs.append(out)
        return outputs

    def _commit(self, s: SampledTokens, now: float) -> SequenceOutput:
        """Append what a sequence got this step: one token, or the drafts the target kept
        and one more, each exactly as if decoded alone (stops, max_tokens, streaming)."""
        seq = s.seq
        if not s.num_draft_tokens:
            return self._append(seq, s.token_ids[0], s.logprobs[0] if s.logprobs else None, now)
        self.speculator.record(seq, s.num_draft_tokens, len(s.token_ids) - 1)
        if seq.state_slot is not None:  # a hybrid model's DeltaNet state drops the rejected
            self.runner.paged.keep_verified(seq.state_slot, len(s.token_ids))
        delta = SequenceOutput(seq.index)
        for i, token in enumerate(s.token_ids):
            seq.num_computed_tokens += 1  # the token before this one is now in the cache
            self.blocks.register_computed(seq)
            delta.extend(self._append(seq, token, s.logprobs[i] if s.logprobs else None, now))
            if seq.is_finished:
                return delta
        self.blocks.free_unused(seq, seq.num_computed_tokens)  # rejected drafts' blocks
        return delta

    def _append(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float
    ) -> SequenceOutput:
        seq.token_ids.append(token)
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        req = self.requests[seq.request_id]
        detok = req.detokenizers[seq.index]
        p = seq.params
        delta = SequenceOutput(seq.index, token_ids=[token], logprobs=[logprob] if logprob else [])
        may_stop = seq.num_output_tokens >= p.min_tokens
        if seq.constraint is not None:
            seq.constraint.advance(token)
        # A closed JSON object allows only EOS, which ends it despite ignore_eos or min_tokens.
        json_done = seq.constraint is not None and seq.constraint.complete
        if token in self.eos_token_ids and (json_done or (may_stop and not p.ignore_eos)):
            delta.finish_reason = "stop"
        elif may_stop and token in p.stop_token_ids:
            delta.finish_reason, delta.stop_reason = "stop", token
        if detok is not None and (delta.finish_reason is None or p.include_stop_str_in_output):
            delta.text = detok.add([token])
            if detok.stop_reason is not None and delta.finish_reason is None:
                delta.finish_reason, delta.stop_reason = "stop", detok.stop_reason
        if delta.finish_reason is None and (
            seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len
        ):
            delta.finish_reason = "length"
        if delta.finish_reason is not None:
            if detok is not None and detok.stop_reason is None:
                delta.text += detok.flush()
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
            self._finish(seq)
        return delta

    def _request_output(self, req: _Request, outs: list[SequenceOutput]) -> RequestOutput:
        first = req.seqs[0]
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outs,
            finished=req.finished,
            num_cached_tokens=first.num_cached_tokens,
            arrival_time=first.arrival_time,
            first_scheduled_time=first.scheduled_time,
            first_token_time=first.first_token_time,
        )
        if self.speculator and out.finished:
            out.spec = SpecCounts()
            for seq in req.seqs:
                out.spec.merge(seq.spec)
        if not req.sent_first:
            req.sent_first = True
            if first.params.prompt_logprobs is not None:
                out.prompt_logprobs = first.prompt_logprobs
        return out

    # -- offline use ----------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[SequenceOutput]]:
        """Run prompts to completion; per prompt, its n accumulated outputs."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        results = {
            rid: [SequenceOutput(j) for j in range(p.n)] for rid, p in zip(ids, plist, strict=True)
        }
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                for delta in out.outputs:
                    results[out.request_id][delta.index].extend(delta)
        self.idle()
        return [results[rid] for rid in ids]
