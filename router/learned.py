"""The learned policy: logistic regression over hashed word n-grams plus the complexity
features, predicting the probability that the highspeed tier fails a request.

Hashing (crc32 of unigrams and bigrams into a fixed number of buckets) needs no vocabulary,
so the model is one weight vector, scored in microseconds with no dependency beyond numpy.
It is trained on `tierserve eval` outcomes of both tiers on the same prompts and saved as
one `.npz` file with its calibrated threshold.
"""

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from router.calibration import threshold_for_share
from router.features import FEATURE_NAMES, RouteRequest, features
from router.policy import sigmoid

HASH_BUCKETS = 1 << 16
_BIGRAM_MULTIPLIER = np.uint64(1_000_003)


def ngram_buckets(request: RouteRequest) -> np.ndarray:
    """The distinct hash buckets of the request's unigrams and bigrams. A bigram's hash
    combines its words' crc32s, so each word is hashed once."""
    words = request.words
    unigrams = np.fromiter((zlib.crc32(w.encode()) for w in words), np.uint64, len(words))
    bigrams = (unigrams[:-1] * _BIGRAM_MULTIPLIER + unigrams[1:] + 1) & 0xFFFFFFFF
    return np.unique(np.concatenate([unigrams, bigrams]) % HASH_BUCKETS).astype(np.int64)


def dense_features(request: RouteRequest) -> np.ndarray:
    values = features(request)
    return np.array([values[name] for name in FEATURE_NAMES], dtype=np.float64)


class RouterFileError(ValueError):
    """A router file that is missing, unreadable or of another format."""


@dataclass
class LearnedPolicy:
    hashed: np.ndarray  # [HASH_BUCKETS] weights of the n-gram buckets
    dense: np.ndarray  # [len(FEATURE_NAMES)] weights of the complexity features
    bias: float
    threshold: float
    target_full_share: float
    name: str = "learned"

    def score(self, request: RouteRequest) -> float:
        buckets = ngram_buckets(request)
        # Each n-gram weighs 1/sqrt(count), so long prompts do not saturate the logit.
        hashed = self.hashed[buckets].sum() / np.sqrt(max(len(buckets), 1))
        return sigmoid(float(self.bias + hashed + self.dense @ dense_features(request)))

    def save(self, path: str | Path) -> None:
        np.savez(
            path,
            hashed=self.hashed.astype(np.float32),
            dense=self.dense,
            bias=self.bias,
            threshold=self.threshold,
            target_full_share=self.target_full_share,
            feature_names=np.array(FEATURE_NAMES),
            hash_buckets=HASH_BUCKETS,
        )

    @classmethod
    def load(cls, path: str | Path) -> "LearnedPolicy":
        try:
            with np.load(path, allow_pickle=False) as f:
                names = tuple(f["feature_names"].tolist())
                if names != FEATURE_NAMES or int(f["hash_buckets"]) != HASH_BUCKETS:
                    raise RouterFileError(
                        f"{path}: trained with other features; "
                        "retrain with `tierserve train router`"
                    )
                return cls(
                    hashed=f["hashed"].astype(np.float64),
                    dense=f["dense"],
                    bias=float(f["bias"]),
                    threshold=float(f["threshold"]),
                    target_full_share=float(f["target_full_share"]),
                )
        except (OSError, KeyError, ValueError) as e:
            if isinstance(e, RouterFileError):
                raise
            raise RouterFileError(f"{path}: not a router file ({e})") from e


def train(
    requests: Sequence[RouteRequest],
    full_needed: Sequence[bool],
    target_full_share: float,
    l2: float = 1e-3,
    steps: int = 400,
    learning_rate: float = 0.05,
) -> LearnedPolicy:
    """Fit by full-batch Adam on the L2-regularised log loss, then calibrate the threshold so
    `target_full_share` of the training prompts go to the full tier."""
    n = len(requests)
    if n == 0 or len(full_needed) != n:
        raise ValueError("train needs one label per request, and at least one request")
    y = np.asarray(full_needed, dtype=np.float64)
    dense_x = np.stack([dense_features(r) for r in requests])
    bucket_lists = [ngram_buckets(r) for r in requests]
    rows = np.repeat(np.arange(n), [len(b) for b in bucket_lists])
    cols = np.concatenate(bucket_lists)
    vals = np.concatenate([np.full(len(b), 1 / np.sqrt(max(len(b), 1))) for b in bucket_lists])

    params = [np.zeros(HASH_BUCKETS), np.zeros(dense_x.shape[1]), np.zeros(1)]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(1, steps + 1):
        hashed, dense, bias = params
        logits = dense_x @ dense + bias[0] + np.bincount(rows, vals * hashed[cols], minlength=n)
        err = (1 / (1 + np.exp(-logits)) - y) / n
        grads = [
            np.bincount(cols, vals * err[rows], minlength=HASH_BUCKETS) + l2 * hashed,
            dense_x.T @ err + l2 * dense,
            np.array([err.sum()]),
        ]
        for p, g, (m, v) in zip(params, grads, moments, strict=True):
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            p -= learning_rate * (m / (1 - beta1**step)) / (np.sqrt(v / (1 - beta2**step)) + eps)
    policy = LearnedPolicy(params[0], params[1], float(params[2][0]), 0.5, target_full_share)
    policy.threshold = threshold_for_share([policy.score(r) for r in requests], target_full_share)
    return policy
