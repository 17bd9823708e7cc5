"""Training the hybrid family: our loss and its gradients over a whole sequence (the chunked
delta rule under autograd) against transformers' Qwen3-Next on the same weights; a model
trained a few steps saved in fp32 and loaded by transformers and by our engine; and
`tierserve train` running a stage on a hybrid shape end to end.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.families import load_model, new_model, save_model
from serving.model.hybrid.checkpoint import load_hybrid_checkpoint, to_hf_hybrid_state_dict
from serving.model.hybrid.model import HybridCausalLM
from serving.sampling.params import SamplingParams
from tests.serving.model.hybrid_tiny import TINY, VOCAB, hf_hybrid_model
from tests.training.trainer_runs import TIERSERVE, env, read_log
from training.data.datasets import IGNORE, Batch
from training.objectives.losses import hidden_states, token_loss_sum

transformers = pytest.importorskip("transformers")

LENGTHS = [70, 33]  # the longer crosses the delta rule's 64-token chunk
# L F L F, dense MLPs: transformers then holds every tensor under its on-disk name.
DENSE = dict(full_attention_interval=2, num_experts=0)
SHAPE = {"architectures": ["Qwen3NextForCausalLM"], **TINY, **DENSE}


def _batch(seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    mask = torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]
    ids = torch.randint(0, VOCAB, (len(LENGTHS), width), generator=g) * mask
    labels = ids.roll(-1, 1).masked_fill(~mask.roll(-1, 1) | ~mask, IGNORE)
    return Batch(ids, labels, mask)


def _ours_loss(model: HybridCausalLM, batch: Batch) -> torch.Tensor:
    return token_loss_sum(model.compute_logits(hidden_states(model, batch)), batch.labels)


def _hf_logits(hf: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return hf(input_ids=batch.input_ids, attention_mask=batch.padding_mask.long()).logits


def test_loss_and_gradients_match_transformers(tmp_path: Path) -> None:
    hf = hf_hybrid_model(**DENSE)
    hf.save_pretrained(tmp_path)
    ours = load_hybrid_checkpoint(tmp_path).train()
    batch = _batch()
    loss = _ours_loss(ours, batch)
    loss.backward()
    hf_loss = token_loss_sum(_hf_logits(hf, batch), batch.labels)
    hf_loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= 1e-4 * hf_loss.item()
    # Our gradients under transformers' names: the writer's mapping applied to a copy of the
    # model whose parameters hold them.
    grads = HybridCausalLM(ours.config)
    grads.load_state_dict({n: p.grad for n, p in ours.named_parameters()})
    ours_by_name = to_hf_hybrid_state_dict(grads)
    hf_by_name = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours_by_name) == set(hf_by_name)
    for name, grad in hf_by_name.items():
        assert grad.abs().max() > 0, name  # every tensor takes part
        torch.testing.assert_close(ours_by_name[name], grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "over",
    [
        dict(full_attention_interval=2, mlp_only_layers=[1]),  # experts and a dense layer
        dict(tie_word_embeddings=True, decoder_sparse_step=2),  # tied head, every other sparse
    ],
)
def test_saved_experts_and_tied_heads_load_in_transformers(over: dict, tmp_path: Path) -> None:
    hf = hf_hybrid_model(**over)
    hf.save_pretrained(tmp_path / "hf")
    save_model(load_hybrid_checkpoint(tmp_path / "hf"), tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = _batch()
    with torch.no_grad():
        diff = (_hf_logits(again, batch) - _hf_logits(hf, batch)).abs()
    assert diff[batch.padding_mask].max() <= 1e-5


def test_trained_model_saved_loads_in_transformers_and_the_engine(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = new_model(SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batch()
    losses = []
    for _ in range(4):
        loss = _ours_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    with torch.no_grad():
        ours = model.compute_logits(hidden_states(model, batch))
        mask = batch.padding_mask
        assert (ours - _hf_logits(hf, batch)).abs()[mask].max() <= 1e-4
        # The loader reads back the same model.
        loaded = load_model(tmp_path)
        assert (loaded.compute_logits(hidden_states(loaded, batch)) - ours).abs().max() == 0
    # The engine serves it: greedy tokens as one full forward per token gives them.
    prompt = batch.input_ids[0, :20].tolist()
    engine = LLMEngine(load_model(tmp_path), EngineConfig(kv_cache_bytes=1 << 20), eos_token_ids=[])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = engine.generate([prompt], params)[0][0].token_ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model.compute_logits(model(torch.tensor([ids]))[0][0, -1]).argmax()))
    assert got == ids[len(prompt) :]


def test_pretrain_stage_trains_a_hybrid_shape(random_checkpoint: Path, tmp_path: Path) -> None:
    """The stages' own path: a hybrid `shape`, the shared trainer (DeepSpeed, ZeRO 0), the
    bf16 export, which transformers loads; an MTP loss is refused for this family, in
    pretraining and in SFT."""
    shape = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SHAPE.items() if k != "vocab_size")
    config = tmp_path / "hybrid.toml"
    config.write_text(
        f'stage = "pretrain"\n[shape]\n{shape}\n[data]\nexamples = 30\n'
        "[train]\nsteps = 6\nmicro_batch = 2\nseq_len = 128\nsave_every = 6\n"
        "[train.optim]\nlr = 1e-2\nwarmup_steps = 0\n"
    )
    out = tmp_path / "run"
    args = ["train", "pretrain", "--config", str(config), "--tokenizer", str(random_checkpoint)]
    subprocess.run(
        [*TIERSERVE, *args, "--out", str(out)], env=env(), check=True, capture_output=True,
        timeout=300,
    )  # fmt: skip
    log = read_log(out)
    assert log[-1]["loss"] < log[0]["loss"]
    raw = json.loads((out / "model" / "config.json").read_text())
    assert raw["model_type"] == "qwen3_next" and raw["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    ours = load_model(out / "model")
    ids = torch.randint(0, raw["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.compute_logits(ours(ids)[0])
        assert (got - hf(input_ids=ids).logits).abs().max() <= 1e-4
    refused = subprocess.run(
        [*TIERSERVE, *args, "--out", str(tmp_path / "mtp"), "--set", "train.mtp_weight=0.3"],
        env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode != 0 and "no MTP layers" in refused.stderr
    sft = ["train", "sft", "--init", str(out / "model"), "--out", str(tmp_path / "sft")]
    refused = subprocess.run(
        [*TIERSERVE, *sft, "--set", "data.examples=2", "--set", "train.mtp_weight=0.3"],
        env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode != 0 and "the MoE family's alone" in refused.stderr
