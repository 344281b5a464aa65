"""A remote verifier (``task.reward_url``) in place of a reward function: ``POST {prompt, response, answer}`` answered
with ``{"reward": float}``, and where it scores the response's steps too, ``"steps": [float, ...]`` (process rewards:
:class:`~moerl.rewards.score.Score`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moerl.rewards.score import Score

if TYPE_CHECKING:
    import aiohttp


class Verifier:
    def __init__(self, url: str):
        self.url = url
        self._session: aiohttp.ClientSession | None = None  # made at the first call, in its event loop

    async def reward(self, response: str, answer: Any, prompt: str) -> Score:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        body = {"prompt": prompt, "response": response, "answer": answer}
        async with self._session.post(self.url, json=body) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"reward verifier {self.url} answered {resp.status}: {(await resp.text())[:500]}")
            answered = await resp.json()
        if not isinstance(answered, dict) or "reward" not in answered:
            raise RuntimeError(f'reward verifier {self.url} answered {answered!r}; expected {{"reward": float}}')
        return Score.of(Score(answered["reward"], answered.get("steps")), f"reward verifier {self.url}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
