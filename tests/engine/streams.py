"""Reading a real engine's streams in the engine tests: every event of one request, and the
events of several requests submitted together."""

import asyncio


async def events_of(engine, prompt, params) -> list:
    """Every GenerationEvent of one request, in order."""
    return [event async for event in engine.submit(prompt, params)]


def run_together(engine, requests) -> list[list]:
    """requests: [(prompt, params)], submitted at once -> each one's events."""
    async def run_all():
        return await asyncio.gather(*(events_of(engine, prompt, params) for prompt, params in requests))

    return asyncio.run(run_all())
