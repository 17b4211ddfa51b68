"""Stop conditions and streamed text: EOS (unless ignore_eos), stop_token_ids, stop strings and max_tokens end
a request with vLLM's finish reasons, and the streamed deltas always add up to the final text, multi-byte
UTF-8 characters included."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from engine_loop_driver import assert_idle_and_all_free, generate, greedy, make_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.engine.loop.detokenize import IncrementalText
from kvtune.engine.loop.llm_engine import LLMEngine

PROMPTS = {"a": "Hello", "b": "The capital of France is", "c": "1 2 3 4 5", "d": "Once upon a time"}
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def free_run(tiny_dir: Path) -> tuple[list[int], list[int]]:
    """A prompt and its greedy continuation with nothing stopping it early."""
    engine = make_engine(tiny_dir)
    prompt = engine.tokenizer.encode(PROMPTS["a"])
    done = generate(engine, {"a": prompt}, lambda _: greedy(NEW_TOKENS, ignore_eos=True))
    return prompt, done.tokens("a")


def _first_fresh_position(tokens: list[int], start: int) -> int:
    """The first position at or after `start` whose token does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def _decode_bytes(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_eos_of_the_checkpoint_stops_with_reason_stop_and_stays_out_of_the_text(
    tiny_dir: Path, tmp_path: Path, free_run: tuple[list[int], list[int]]
) -> None:
    prompt, tokens = free_run
    at = _first_fresh_position(tokens, 5)
    # The same weights, with one of the tokens greedy decoding emits declared an end-of-sequence token.
    eos_dir = Path(shutil.copytree(tiny_dir, tmp_path / "eos"))
    generation_config = json.loads((eos_dir / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [*generation_config["eos_token_id"], tokens[at]]
    (eos_dir / "generation_config.json").write_text(json.dumps(generation_config))
    engine = make_engine(eos_dir)
    stopped = generate(engine, {"s": prompt}, lambda _: greedy(NEW_TOKENS))
    assert stopped.tokens("s") == tokens[: at + 1]
    assert stopped["s"].finish_reason == "stop"
    assert stopped["s"].text == engine.tokenizer.decode(tokens[:at])
    ignoring = generate(engine, {"i": prompt}, lambda _: greedy(NEW_TOKENS, ignore_eos=True))
    assert ignoring.tokens("i") == tokens
    assert ignoring["i"].finish_reason == "length"
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_stop_with_reason_stop_even_when_eos_is_ignored(
    tiny_dir: Path, free_run: tuple[list[int], list[int]], ignore_eos: bool
) -> None:
    prompt, tokens = free_run
    at = _first_fresh_position(tokens, 5)
    engine = make_engine(tiny_dir)
    params = greedy(NEW_TOKENS, stop_token_ids=[tokens[at]], ignore_eos=ignore_eos)
    done = generate(engine, {"s": prompt}, lambda _: params)
    assert done.tokens("s") == tokens[: at + 1]
    assert done["s"].finish_reason == "stop"
    assert done["s"].text == engine.tokenizer.decode(tokens[:at])
    assert engine.counters.finished == {"stop": 1}


def test_max_tokens_finishes_with_reason_length(
    tiny_dir: Path, free_run: tuple[list[int], list[int]]
) -> None:
    prompt, tokens = free_run
    engine = make_engine(tiny_dir)
    done = generate(engine, {"m": prompt}, lambda _: greedy(7, ignore_eos=True))
    assert done.tokens("m") == tokens[:7]
    assert done["m"].finish_reason == "length" and done["m"].num_output_tokens == 7
    assert engine.counters.finished == {"length": 1}


def _stop_string(text: str, start: int) -> tuple[str, int]:
    """A two-character stop string that first occurs at or after `start` in `text` (no replacement char)."""
    for i in range(start, len(text) - 1):
        candidate = text[i : i + 2]
        if "\ufffd" not in candidate and text.find(candidate) == i:
            return candidate, i
    raise AssertionError(f"no fresh two-character string in {text!r}")


def _engine_and_first_stop(tiny_dir: Path, tokens: list[int]) -> tuple[LLMEngine, str, str, int]:
    """A fresh engine, the free run's text, and the stop string both stop-string tests cut it at (where)."""
    engine = make_engine(tiny_dir)
    full = engine.tokenizer.decode(tokens)
    stop, at = _stop_string(full, 6)
    return engine, full, stop, at


def test_stop_string_truncates_the_text_and_finishes_with_reason_stop(
    tiny_dir: Path, free_run: tuple[list[int], list[int]]
) -> None:
    prompt, tokens = free_run
    engine, full, stop, at = _engine_and_first_stop(tiny_dir, tokens)
    later, _ = _stop_string(full, at + 3)
    done = generate(engine, {"s": prompt}, lambda _: greedy(NEW_TOKENS, stop=[later, stop]))
    assert done["s"].text == full[:at]
    assert done["s"].finish_reason == "stop"
    assert done.tokens("s") == tokens[: len(done.tokens("s"))]
    assert stop in engine.tokenizer.decode(done.tokens("s")), "it ran on past the stop string"
    assert stop not in engine.tokenizer.decode(done.tokens("s")[:-1]), "it ran on past the stop string"
    assert_idle_and_all_free(engine)


def test_stop_string_completed_by_the_last_allowed_token_finishes_with_reason_stop(
    tiny_dir: Path, free_run: tuple[list[int], list[int]]
) -> None:
    prompt, tokens = free_run
    engine, full, stop, at = _engine_and_first_stop(tiny_dir, tokens)
    needed = next(m for m in range(1, len(tokens) + 1) if stop in engine.tokenizer.decode(tokens[:m]))
    done = generate(engine, {"s": prompt}, lambda _: greedy(needed, stop=[stop]))
    assert done["s"].text == full[:at]
    assert done["s"].finish_reason == "stop"
    assert engine.counters.finished == {"stop": 1}


def test_streamed_deltas_add_up_to_the_final_text_with_multibyte_characters(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    prompts = {rid: engine.tokenizer.encode(text) for rid, text in PROMPTS.items()}
    done = generate(engine, prompts, lambda _: greedy(64, ignore_eos=True))
    multibyte = 0
    for rid in prompts:
        final = engine.tokenizer.decode(done.tokens(rid))
        assert done[rid].text == final
        multibyte += sum(1 for ch in final if ord(ch) > 0x7F and ch != "\ufffd")
        # A lead byte alone is never sent as a replacement character that a later byte would change.
        sent = ""
        for delta in done[rid].deltas:
            sent += delta
            assert final.startswith(sent)
    assert multibyte > 0, "the greedy outputs held no multi-byte character: the test proves nothing"


def test_stop_string_with_a_multibyte_character_cuts_the_stream(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    prompts = {rid: engine.tokenizer.encode(text) for rid, text in PROMPTS.items()}
    free = generate(engine, prompts, lambda _: greedy(64, ignore_eos=True))
    finals = {rid: engine.tokenizer.decode(free.tokens(rid)) for rid in prompts}
    rid, at = next(
        (rid, i)
        for rid, final in finals.items()
        for i, ch in enumerate(final)
        if ord(ch) > 0x7F and ch != "\ufffd"
    )
    final = finals[rid]
    stop = final[at]
    done = generate(make_engine(tiny_dir), {rid: prompts[rid]}, lambda _: greedy(64, stop=[stop]))
    assert done[rid].text == final[:at] and done[rid].finish_reason == "stop"


# --- IncrementalText on its own, with a plain UTF-8 byte decoder ------------------------------------------


def _stream(
    ids: Sequence[int], stop: Sequence[str] = (), final_at_end: bool = True
) -> tuple[list[str], str | None]:
    text = IncrementalText(_decode_bytes, stop)
    deltas = []
    for i in range(1, len(ids) + 1):
        deltas.append(text.update(ids[:i], final=final_at_end and i == len(ids)))
        if text.stopped_by is not None:
            break
    return deltas, text.stopped_by


def test_a_character_is_sent_only_once_all_its_bytes_are_there() -> None:
    euro = list("€".encode())
    deltas, _ = _stream([ord("a"), *euro, ord("b")])
    assert deltas == ["a", "", "", "€", "b"]


def test_a_tail_that_could_become_a_stop_string_is_held_back() -> None:
    deltas, stopped = _stream(list(b"xyz<en"), stop=["<end>"], final_at_end=False)
    assert "".join(deltas) == "xy" and stopped is None  # "z<en" is as long as "<end>" less one: held
    deltas, stopped = _stream(list(b"xyz<end>more"), stop=["<end>"])
    assert "".join(deltas) == "xyz" and stopped == "<end>"
    deltas, stopped = _stream(list(b"xyz<en"), stop=["<end>"])
    assert "".join(deltas) == "xyz<en" and stopped is None  # the end flushes what was held


def test_a_stop_string_made_of_multibyte_characters_is_found_across_updates() -> None:
    deltas, stopped = _stream(list("né — fin".encode()), stop=["—"])
    assert "".join(deltas) == "né " and stopped == "—"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    pieces=st.lists(
        st.sampled_from(["a", "b", " ", "é", "€", "🚀", "ѽ", "\xff", "\xc3", "\xe2\x82"]),
        min_size=1,
        max_size=30,
    ),
    stop=st.lists(st.sampled_from(["ab", "b a", "€", "é€", "🚀b", "aaa", "x"]), max_size=3),
)
def test_streamed_text_adds_up_to_the_decoded_output_cut_at_the_first_stop(
    pieces: list[str], stop: list[str]
) -> None:
    raw = b"".join(p.encode("latin-1") if p in ("\xff", "\xc3", "\xe2\x82") else p.encode() for p in pieces)
    ids = list(raw)
    deltas, stopped = _stream(ids, stop)
    full = _decode_bytes(ids)
    cuts = [i for i in (full.find(s) for s in stop) if i != -1]
    expected = full[: min(cuts)] if cuts else full
    assert "".join(deltas) == expected
    assert (stopped is not None) == bool(cuts)
