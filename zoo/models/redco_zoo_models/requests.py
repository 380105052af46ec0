"""What a request to the engine (``redco_zoo_models.engine``) is: how it samples
(``Sampling``), what each of its samples holds so far (``Sample``), and the request itself
(``Request``), through which the engine reports tokens and ends."""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request samples: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1.0 cut
    nothing; ``n`` samples of the prompt; ``stop_token_ids`` end a sample as the model's EOS
    does; ``ignore_eos`` runs past the model's EOS to ``max_tokens`` (benchmarks; vLLM's
    field); ``seed`` None draws one."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        checks = {"max_tokens": self.max_tokens >= 1, "temperature": self.temperature >= 0,
                  "top_k": self.top_k >= 0, "top_p": 0 < self.top_p <= 1, "n": self.n >= 1}
        wrong = [name for name, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(f"Sampling {wrong[0]}={getattr(self, wrong[0])!r} is out of range: "
                             "max_tokens and n >= 1, temperature >= 0, top_k >= 0 (0: no cut), "
                             "0 < top_p <= 1.")


@dataclasses.dataclass
class Sample:
    """One sample's tokens so far, their log-probabilities, and why it ended (``"stop"``: an
    EOS, a stop token or a stop string; ``"length"``: ``max_tokens``; ``"cancelled"``;
    ``"error"``: a step raised, ``Request.error``)."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class Request:
    """A submitted prompt (``images``: an image model's pixels for it): its ``samples`` fill in
    as the engine steps; ``done`` is set when all have ended. In the engine's thread,
    ``on_token(request, index, token, logprob)`` is called for each new token of sample
    ``index`` (returning True ends that sample: a stop string), and ``on_end(request, index)``
    once the sample has ended."""

    def __init__(self, prompt: list[int], sampling: Sampling,
                 on_token: Callable[..., bool | None] | None = None,
                 on_end: Callable[..., None] | None = None, images=None):
        self.prompt, self.sampling, self.images = list(prompt), sampling, images
        self.on_token, self.on_end = on_token, on_end
        self.samples = [Sample() for _ in range(sampling.n)]
        self.done, self.cancelled = threading.Event(), False
        self.error: Exception | None = None  # why its samples ended with "error"

    def cancel(self) -> None:
        """End every sample at the engine's next step (a client that went away)."""
        self.cancelled = True
