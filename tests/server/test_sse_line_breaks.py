"""Server-sent events stay one line whatever text they carry: a client that splits on Unicode line breaks
(str.splitlines, some JavaScript parsers) must never cut an event in two."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvtune.engine.http.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from kvtune.engine.http.streaming import sse

SPLITLINES_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# Engine text is decoded from bytes, so it is always encodable UTF-8 (no lone surrogates).
TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(SPLITLINES_BREAKS)))


def the_one_data_line(event: str) -> dict:
    """The event split the way a Unicode-aware client splits it: one data line and the blank terminator."""
    lines = event.splitlines()
    assert len(lines) == 2 and lines[1] == "", lines
    assert lines[0].startswith("data: ")
    assert event.endswith("\n\n")
    return json.loads(lines[0].removeprefix("data: "))


def test_every_splitlines_separator_is_escaped() -> None:
    breaks = "".join(char for char in map(chr, range(0x3000)) if len(f"a{char}b".splitlines()) > 1)
    assert set(breaks) == set(SPLITLINES_BREAKS)  # the list the serialiser escapes is complete
    assert the_one_data_line(sse({"text": breaks}))["text"] == breaks


@given(TEXT)
def test_completion_chunk_is_one_event_and_round_trips(text: str) -> None:
    chunk = CompletionResponse(id="cmpl-1", model="tiny", choices=[CompletionChoice(index=0, text=text)])
    assert the_one_data_line(sse(chunk))["choices"][0]["text"] == text


@given(TEXT)
def test_chat_chunk_is_one_event_and_round_trips(text: str) -> None:
    delta = ChatDelta(content=text)
    chunk = ChatCompletionChunk(id="c-1", model="tiny", choices=[ChatChunkChoice(index=0, delta=delta)])
    assert the_one_data_line(sse(chunk))["choices"][0]["delta"]["content"] == text


@given(TEXT)
def test_error_event_is_one_event_and_round_trips(text: str) -> None:
    assert the_one_data_line(sse({"error": {"message": text}}))["error"]["message"] == text
