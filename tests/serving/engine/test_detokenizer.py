"""Incremental detokenizer: deltas equal a full decode, partial characters and stop-string
prefixes are held back, stop strings cut exactly."""

import random

import pytest
import tokenizers

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.sampling.params import SamplingParams

PROMPT = "<|im_start|>héllo wörld, 日本語 please:"
WORDS = ["the", "quick", "héllo", "wörld", "日本語", "😀", "🦀", "𝄞", "東京", "naïve", "END", "EN"]


def stream(
    tokenizer: tokenizers.Tokenizer, text: str, chunk: int = 1, **kw
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds the tokens of `text` `chunk` at a time; returns the deltas and the detokenizer."""
    ids = tokenizer.encode(text).ids
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT).ids, SamplingParams(**kw))
    return [det.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)], det


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_and_flush_concatenate_to_the_full_decode(tiny_tokenizer, skip_special_tokens):
    rng = random.Random(0)
    prompt = tiny_tokenizer.encode(PROMPT).ids
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):  # random ids: split and invalid UTF-8, special tokens anywhere
        ids = [rng.randrange(tiny_tokenizer.get_vocab_size()) for _ in range(rng.randint(1, 40))]
        det = IncrementalDetokenizer(tiny_tokenizer, prompt, params)
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            deltas.append(det.add(ids[i : i + n]))
            i += n
        deltas.append(det.flush())
        expected = tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == det.text == expected


def test_valid_text_never_emits_a_replacement_character(tiny_tokenizer):
    rng = random.Random(1)
    held = 0
    for _ in range(100):
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 15)))
        deltas, det = stream(tiny_tokenizer, text)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == text and det.flush() == ""
        held += deltas.count("")
    assert held > 0  # some tokens did end inside a character


def test_a_split_character_is_emitted_once_complete(tiny_tokenizer):
    crab = tiny_tokenizer.encode("🦀").ids  # 4 bytes, unseen in training
    assert len(crab) > 1
    det = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams())
    deltas = [det.add([i]) for i in [*tiny_tokenizer.encode("a").ids, *crab]]
    assert deltas == ["a", *[""] * (len(crab) - 1), "🦀"]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_spanning_tokens_cuts_exactly(tiny_tokenizer, chunk, include):
    text, stop = "the quick 日本語 brown fox jumps over the lazy dog", "本語 brown fo"
    assert len(tiny_tokenizer.encode(stop).ids) > 3
    stops = ["zzz", stop, "lazy"]
    deltas, det = stream(
        tiny_tokenizer, text, chunk, stop=stops, include_stop_str_in_output=include
    )
    expected = "the quick 日" + (stop if include else "")
    assert "".join(deltas) == det.text == expected and det.stop_reason == stop
    assert det.add(tiny_tokenizer.encode(" more").ids) == "" and det.flush() == ""


def test_the_earliest_ending_stop_wins(tiny_tokenizer):
    det = stream(tiny_tokenizer, "the quick brown fox", 1000, stop=["brown fox", "quick"])[1]
    assert det.text == "the " and det.stop_reason == "quick"


def test_only_possible_stop_prefixes_are_held_back(tiny_tokenizer):
    text, stop = "a E b EN c END d 日本 ENDE END! tail", "END!"
    ids = tiny_tokenizer.encode(text).ids
    det = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=[stop]))
    for n in range(1, len(ids) + 1):
        det.add(ids[n - 1 : n])
        if det.stop_reason:
            break
        decoded = tiny_tokenizer.decode(ids[:n])
        assert decoded.startswith(det.text)
        if not decoded.endswith("\ufffd"):  # else the whole token's text waits
            held = max(k for k in range(len(stop)) if stop.startswith(decoded[len(decoded) - k :]))
            assert det.text == decoded[: len(decoded) - held]
    assert det.text == "a E b EN c END d 日本 ENDE " and det.stop_reason == stop


def test_flush_releases_a_held_prefix_when_no_stop_matched(tiny_tokenizer):
    deltas, det = stream(tiny_tokenizer, "the answer is EN", stop=["END!"])
    assert "".join(deltas) == "the answer is "
    assert det.flush() == "EN" and det.text == "the answer is EN" and det.stop_reason is None


def test_stop_strings_wait_for_min_tokens(tiny_tokenizer):
    text = "the END then the END"
    n = len(tiny_tokenizer.encode(text).ids)
    assert stream(tiny_tokenizer, text, stop=["END"])[1].text == "the "
    assert stream(tiny_tokenizer, text, stop=["END"], min_tokens=n)[1].text == "the END then the "


def test_skip_special_tokens(tiny_tokenizer):
    ids = [*tiny_tokenizer.encode("hi").ids, tiny_tokenizer.token_to_id("<|im_end|>")]
    ids += tiny_tokenizer.encode(" there").ids
    for skip, expected in [(True, "hi there"), (False, "hi<|im_end|> there")]:
        det = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(skip_special_tokens=skip))
        assert "".join(det.add([i]) for i in ids) + det.flush() == expected


def test_each_call_decodes_only_a_short_window(tiny_tokenizer):
    class Recording:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            self.longest = max(self.longest, len(ids))
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(random.Random(2).choices(WORDS, k=400))
    ids, recording = tiny_tokenizer.encode(text).ids, Recording()
    det = IncrementalDetokenizer(recording, [1, 2, 3, 4, 5, 6, 7], SamplingParams(stop=["zzz"]))
    assert "".join(det.add([i]) for i in ids) + det.flush() == text
    assert len(ids) > 500 and recording.longest <= 12
