"""AsyncLLMEngine's delivery order: a step's outputs reach the event loop once the next step's forward pass is
queued (so streaming overlaps the device), and the last step's as soon as nothing is left to run."""
import asyncio
import time
from types import SimpleNamespace

from tierllm.engine.async_engine import AsyncLLMEngine
from tierllm.sampling import SamplingParams


class _StubEngine:
    """Three steps for one request; records what happened in order."""

    def __init__(self, events: list):
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4))
        self.events, self.steps, self.groups = events, 0, {}

    def validate_request(self, prompt, params):
        pass

    def add_request(self, request_id, prompt, params):
        self.groups[request_id] = True

    def has_unfinished_requests(self):
        return bool(self.groups) and self.steps < 3

    def step(self, on_launched=None):
        self.steps += 1
        self.events.append(f"launch {self.steps}")
        on_launched()
        time.sleep(0.2)                                 # the device computes; the event loop streams meanwhile
        finished = self.steps == 3
        if finished:
            self.groups.clear()
        return [SimpleNamespace(request_id="r", finished=finished, step=self.steps)]

    def close(self):
        pass


def test_outputs_are_delivered_after_the_next_launch_and_the_last_at_once():
    events: list = []

    async def main():
        engine = AsyncLLMEngine(_StubEngine(events), max_queue=4)
        engine.start()
        try:
            async for output in engine.generate("r", [1, 2], SamplingParams(max_tokens=3)):
                events.append(f"got {output.step}")
        finally:
            engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert events.index("got 1") > events.index("launch 2")
    assert events.index("got 2") > events.index("launch 3")
    assert events[-1] == "got 3"                        # no fourth step: delivered without waiting for one
