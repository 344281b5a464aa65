"""A rollout manager run in the test's own event loop, driven as the trainer drives it (orders in, events out), against
engines served by the test; and the manager's generation alone, asking in chunks as the length-aware schedule does."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class ManagerRun:
    """A rollout manager run in the test's event loop, as the trainer drives it: orders in, events out."""

    def __init__(self, orders, events, manager: asyncio.Task):
        self.orders, self.events, self.manager = orders, events, manager

    async def order(self, message) -> None:
        import zmq

        while True:  # a PUSH socket refuses until the manager, in this event loop, has connected
            try:
                return self.orders.send_pyobj(message, zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(0.02)

    async def next_event(self, *kinds):
        """The next event of one of ``kinds`` (others are skipped); a RolloutFailed fails the test unless asked for."""
        import pickle

        from moerl.orchestrator.messages import EVENTS, RolloutFailed, checked

        while True:
            while not self.events.poll(0):
                if self.manager.done():  # it ended without a word: its exception says why
                    raise AssertionError(f"the rollout manager ended: {self.manager.result()!r}")
                await asyncio.sleep(0.02)
            head, *arrays = self.events.recv_multipart()
            event = checked(pickle.loads(head, buffers=[bytearray(a) for a in arrays]), EVENTS)
            assert not isinstance(event, RolloutFailed) or RolloutFailed in kinds, event.message
            if isinstance(event, kinds):
                return event


@asynccontextmanager
async def manager_run(tmp_path, model_dir, urls: str | list[str], overrides: list[str]):
    """A :class:`RolloutManager` for ``model_dir`` served at ``urls``, its config the defaults with ``overrides``;
    stopped (and awaited) at the end."""
    import zmq

    from moerl.orchestrator.config import load_config, to_yaml
    from moerl.orchestrator.manager import RolloutManager
    from moerl.orchestrator.messages import ManagerSpec, Stop, Stopped

    ctx = zmq.Context()
    orders, events = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    ports = orders.bind_to_random_port("tcp://127.0.0.1"), events.bind_to_random_port("tcp://127.0.0.1")
    cfg = load_config(None, [f"run.dir={tmp_path}", "rollout.generation_workers=0", *overrides])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    spec = ManagerSpec(
        str(tmp_path / "config.yaml"),
        str(model_dir),
        [urls] if isinstance(urls, str) else urls,
        f"tcp://127.0.0.1:{ports[0]}",
        f"tcp://127.0.0.1:{ports[1]}",
        cursor=0,
        reissue=[],
    )
    manager = asyncio.create_task(RolloutManager(load_config(spec.config, []), spec).run())
    run = ManagerRun(orders, events, manager)
    try:
        yield run
        await run.order(Stop())
        await run.next_event(Stopped)
        await manager
    finally:
        manager.cancel()
        orders.close(linger=0)
        events.close(linger=0)
        ctx.term()


def chunked_generation(client, new_tokens: int, chunk: int, samples: int):
    """The manager's requests to ``client``'s engines under the length-aware schedule: ``samples`` completions of
    ``new_tokens`` a prompt, each asked ``chunk`` tokens a request, sampled at top_k 8 and top_p 0.9 with kept sets."""
    from moerl.orchestrator.adapters import Adapters
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.generation import Generation

    cfg = load_config(
        None,
        [
            f"rollout.max_new_tokens={new_tokens}",
            f"rollout.samples_per_prompt={samples}",
            "rollout.top_k=8",
            "rollout.top_p=0.9",
            "trainer.replay.sampling_mask=true",
            "rollout.schedule.policy=length_aware",
            f"rollout.schedule.chunk_tokens={chunk}",
        ],
    )

    async def report() -> None:
        pass

    generation = Generation(cfg, client, Adapters(client), asyncio.Event(), report, "salt", [])
    generation.serving.set()
    return generation
