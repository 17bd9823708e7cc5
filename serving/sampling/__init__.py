"""Sampling: the settings a request sends, what they do to the model's logits, the draw, the
speculative rejection sampler and the logprobs reported, shared by the engine and drafters."""
