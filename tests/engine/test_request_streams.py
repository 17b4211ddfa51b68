"""How the engine thread hands outputs to the event loop: a streamed request's at every step, a whole one's
(a non-streamed answer) in one list once every choice has finished, with the same outputs either way."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from engine_loop_driver import greedy, make_engine, random_prompt

from kvtune.engine.loop.output import RequestOutput
from kvtune.engine.loop.thread import AsyncEngine


async def _lists(
    engine: AsyncEngine, request_id: str, prompt: list[int], n: int, whole: bool
) -> list[list[RequestOutput]]:
    stream = await engine.add_request(request_id, prompt, greedy(12, n=n), whole=whole)
    return [outputs async for outputs in stream]


def _tokens(lists: list[list[RequestOutput]]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for outputs in lists:
        for out in outputs:
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def test_a_whole_stream_gets_every_output_in_one_list_a_streamed_one_at_every_step(tiny_dir: Path) -> None:
    engine = AsyncEngine(make_engine(tiny_dir))
    engine.start()
    prompt = random_prompt(random.Random(3), 40)

    async def both() -> tuple[list[list[RequestOutput]], ...]:
        return await asyncio.gather(
            _lists(engine, "streamed", prompt, 2, whole=False), _lists(engine, "whole", prompt, 2, whole=True)
        )

    try:
        streamed, whole = asyncio.run(both())
    finally:
        engine.shutdown()
    assert len(whole) == 1 and len(streamed) >= 12
    assert _tokens(whole) == _tokens(streamed)
    assert all(len(tokens) == 12 for tokens in _tokens(whole).values())
    assert sum(out.finished for out in whole[0]) == 2  # both choices' last outputs, in the one list
