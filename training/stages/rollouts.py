"""Rollouts: a policy plays sampled episodes of the task domains through our own engine.

Every episode's current turn runs in one continuously batched engine. The G episodes of a
task render the same first prompt: they go as one request with n = G, whose prompt is
prefilled once and its KV blocks shared by the G sequences. Sampled tokens carry their
log-probabilities (the model's distribution before filters; rollouts sample at temperature
1, so it is the distribution they were drawn from). Multi-turn episodes (terminal, tools)
feed each answer back through the domain, which runs the sandbox or the tool and appends the
observation; those steps run in parallel threads, one per episode. Requests are seeded
(sequence i of a request draws from seed + i), so a rollout is a function of the weights and
the seed, the tasks and the turn, whatever else shares the batch: a resumed run samples
exactly what the uninterrupted one did.
"""

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from serving.engine.llm_engine import EngineConfig, EngineInputError, LLMEngine
from serving.model.causal_lm import CausalLM
from serving.model.tokenizer import Tokenizer
from serving.sampling.params import SamplingParams
from tasks import DOMAINS, Domain, Episode, Style, Task
from training.config import DataConfig
from training.stages.qat import served_state_dict


@dataclass
class Turn:
    """One assistant turn: the prompt it followed (the rendered conversation so far) and the
    tokens the policy sampled, with their log-probabilities."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    truncated: bool = False  # cut by the token budget


@dataclass
class Rollout:
    task: Task
    sample: int  # which of the task's G samples
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # the verdict's (steps, passed...)
    off_policy: bool = False  # the domain's reference answer, not sampled (no logprobs)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)


def inference_copy(model: CausalLM, tokenizer: Tokenizer, config: EngineConfig) -> LLMEngine:
    """An engine over a copy of the training model's current weights as its forward pass sees
    them (under QAT: FP4-rounded), in fp32 (the engine packs its model's weights for inference,
    so it cannot share the trainer's)."""
    copy = CausalLM(model.config)
    state = served_state_dict(model)
    copy.load_state_dict({k: v.detach().float().clone() for k, v in state.items()})
    return LLMEngine(copy.eval(), config, tokenizer)


def mixed_tasks(data: DataConfig, seeds: list[int]) -> list[Task]:
    """A task per seed, the mix's domains and the difficulties taken in turn: every domain
    and level about equally often, however few the tasks."""
    names = list(data.mix)
    return [
        DOMAINS[names[i % len(names)]].generate(seed, data.difficulties[i % len(data.difficulties)])
        for i, seed in enumerate(seeds)
    ]


def reference_rollout(tokenizer: Tokenizer, task: Task, style: Style, sample: int) -> Rollout:
    """The domain's reference solution in `style`, played as one more episode of the task:
    each turn's prompt rendered as a sampled turn's is, its completion tokenized as SFT
    tokenizes an answer (the text, then the end of the turn), its verdict the verifier's."""
    eos = tokenizer.raw.token_to_id(tokenizer.eos_token)
    rollout = Rollout(task, sample, off_policy=True)
    domain = DOMAINS[task.domain]
    episode = domain.start(task)
    try:
        for text in domain.reference(task, style):
            ids = [*tokenizer.encode(text), eos]
            rollout.turns.append(Turn(_prompt(tokenizer, episode), ids, text=text))
            if episode.step(text):
                break
    finally:
        _score(rollout, episode)
    return rollout


def _prompt(tokenizer: Tokenizer, episode: Episode) -> list[int]:
    text = tokenizer.apply_chat_template(episode.messages, tools=episode.task.tools)
    return tokenizer.encode(text)


def play(
    engine: LLMEngine,
    domains: dict[str, Domain],
    tasks: list[Task],
    group_size: int,
    max_tokens: int,
    seed: int,
    max_turns: int = 8,
    temperature: float = 1.0,
) -> list[list[Rollout]]:
    """`group_size` sampled episodes of each task, grouped by task, in the tasks' order."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None, "rollouts render chats: the engine needs its tokenizer"
    groups = [[Rollout(task, g) for g in range(group_size)] for task in tasks]
    live: dict[str, tuple[Rollout, Episode]] = {}
    for rollouts in groups:
        for r in rollouts:
            key = f"{r.task.domain}-{r.task.seed}-{r.sample}"
            live[key] = (r, domains[r.task.domain].start(r.task))
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(live)))) as pool:
        try:
            for turn in range(max_turns):
                if not live:
                    break
                outputs = _sample_turn(engine, live, max_tokens, seed, turn, temperature)
                keys = list(live)
                done = pool.map(_feed, [(*live[k], outputs.get(k)) for k in keys])
                for key, finished in zip(keys, done, strict=True):
                    if finished:
                        _score(*live.pop(key))
        finally:
            for rollout, episode in live.values():  # out of turns: scored as they stand
                _score(rollout, episode)
    return groups


def _sample_turn(
    engine: LLMEngine,
    live: dict[str, tuple[Rollout, Episode]],
    max_tokens: int,
    seed: int,
    turn: int,
    temperature: float,
) -> dict[str, Turn]:
    """Every live episode's next turn, sampled in one continuously batched run. Episodes at
    the same conversation (a task's G samples at their first turn) go as one request with
    n = their number, so the prompt is prefilled once and its blocks shared. An episode
    whose conversation no longer fits the context gets no turn (its key is absent)."""
    tokenizer = engine.tokenizer
    same: dict[tuple[int, ...], list[str]] = {}
    for key, (_, episode) in live.items():
        same.setdefault(tuple(_prompt(tokenizer, episode)), []).append(key)
    turns: dict[str, Turn] = {}
    members: dict[str, list[str]] = {}  # request id -> its episodes, by sequence index
    for ids, keys in same.items():
        first = live[keys[0]][0]
        params = SamplingParams(
            n=len(keys),
            max_tokens=max(1, min(max_tokens, engine.max_model_len - len(ids))),
            temperature=temperature,
            seed=_request_seed(seed, first, turn),
            logprobs=0,
        )
        try:
            engine.add_request(keys[0], list(ids), params)
        except EngineInputError:
            continue
        members[keys[0]] = keys
        turns |= {key: Turn(list(ids)) for key in keys}
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.outputs:
                t = turns[members[out.request_id][delta.index]]
                t.completion_ids += delta.token_ids
                t.logprobs += [lp.logprob for lp in delta.logprobs]
                t.text += delta.text
                t.truncated = t.truncated or delta.finish_reason == "length"
    return turns


def _request_seed(seed: int, rollout: Rollout, turn: int) -> int:
    """Stable across processes (unlike `hash` of a str): resume must sample the same."""
    key = f"{seed}:{rollout.task.domain}:{rollout.task.seed}:{rollout.sample}:{turn}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def _feed(job: tuple[Rollout, Episode, Turn | None]) -> bool:
    """Give the episode its turn (may run the sandbox); True when the episode is over."""
    rollout, episode, turn = job
    if turn is None:
        return True
    rollout.turns.append(turn)
    return episode.step(turn.text)


def _score(rollout: Rollout, episode: Episode) -> None:
    try:
        verdict = episode.verdict()
        rollout.reward, rollout.reason = verdict.reward, verdict.reason
        rollout.metrics = verdict.metrics
    finally:
        episode.close()
