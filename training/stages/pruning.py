"""Depth pruning: a student made of some of a trained model's decoder layers.

On a CPU a decode step of these small models is bound by per-layer operator overhead, so a
model with half the layers decodes nearly twice as fast; the highspeed tier can be such a
student, repaired by distillation from the full tier (as Minitron prunes and distils). The
embeddings, final norm, head and MTP module are kept whole.
"""

import dataclasses

from serving.model.causal_lm import CausalLM
from training.config import ConfigError


def keep_layers(model: CausalLM, layers: list[int]) -> CausalLM:
    """A new model holding `model`'s decoder layers `layers`, in that order, renumbered from 0.

    Dense layers (`mlp_only_layers`) stay dense; a model whose sparse layers follow
    `decoder_sparse_step` > 1 cannot be renumbered that way and is refused."""
    config = model.config
    n = config.num_hidden_layers
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < n for i in layers):
        raise ConfigError(f"keep_layers {layers}: distinct layers of 0..{n - 1} expected")
    if config.decoder_sparse_step != 1:
        raise ConfigError("keep_layers: models with decoder_sparse_step > 1 are not supported")
    dense = [new for new, old in enumerate(layers) if old in config.mlp_only_layers]
    student_config = dataclasses.replace(
        config, num_hidden_layers=len(layers), mlp_only_layers=dense
    )
    renumber = {str(old): str(new) for new, old in enumerate(layers)}
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if index not in renumber:
                continue
            name = f"layers.{renumber[index]}.{rest}"
        state[name] = tensor
    student = CausalLM.empty(student_config)
    student.load_state_dict(state, assign=True, strict=True)
    if student_config.tie_word_embeddings:
        student.lm_head.weight = student.embed_tokens.weight
    student.rotary.cos, student.rotary.sin = model.rotary.cos, model.rotary.sin
    return student.train(model.training)
