"""A GRPO run's algorithm settings (``GRPOConfig``): what it samples, how its loss weighs it
(``loss.py``) and which of DAPO's rollout pieces it uses (``dapo.py``), with the defaults each
loss's paper gives, checked before anything compiles.

Defaults by ``loss_type`` (each one given explicitly wins):

=========  =====================  ===============  ===================
loss_type  clip_low / clip_high   dynamic sampling  overlong filtering
=========  =====================  ===============  ===================
grpo       0.2 / 0.2              off              off
dr_grpo    0.2 / 0.2              off              off
dapo       0.2 / 0.28             on               on
gspo       3e-4 / 4e-4            off              off
=========  =====================  ===============  ===================
"""
from __future__ import annotations

from dataclasses import dataclass

from redco.protocols import UsageError
from redco_zoo_grpo.loss import LOSS_TYPES

CLIP_RANGES = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28),
               "gspo": (3e-4, 4e-4)}


@dataclass(frozen=True)
class GRPOConfig:
    """What a GRPO run samples and how its loss weighs it (module docstring: None takes the
    loss's default)."""
    n_samples: int = 8  # G, completions per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    loss_type: str = "grpo"
    clip_low: float | None = None
    clip_high: float | None = None
    beta: float = 0.0  # the KL penalty's weight (0: no reference needed)
    n_updates: int = 1  # mu, epochs over each round's samples
    dynamic_sampling: bool | None = None
    max_sampling_draws: int = 3  # draws of a round's prompts at most, the first one included
    overlong_filter: bool | None = None
    overlong_buffer: int = 0  # L_cache of the soft overlong punishment (0: none)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise UsageError(f"loss_type {self.loss_type!r}: choose one of {LOSS_TYPES}.")
        if self.n_samples < 2 or self.temperature <= 0:
            raise UsageError("GRPO compares samples within a group: give n_samples >= 2 and a "
                             f"temperature > 0 (got {self.n_samples} and {self.temperature}).")
        dapo = self.loss_type == "dapo"
        for name, default in (("clip_low", CLIP_RANGES[self.loss_type][0]),
                              ("clip_high", CLIP_RANGES[self.loss_type][1]),
                              ("dynamic_sampling", dapo), ("overlong_filter", dapo)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        self.check_ranges()

    def check_ranges(self) -> None:
        """Refuse a clip range that is empty or reaches a ratio of 0, and a draw cap or an
        overlong buffer out of range, naming the flag to change."""
        if not 0 < self.clip_low < 1 or self.clip_high <= 0:
            raise UsageError(f"--clip_low {self.clip_low} --clip_high {self.clip_high}: the ratio "
                             "is clipped to [1 - clip_low, 1 + clip_high]; give 0 < clip_low < 1 "
                             f"and clip_high > 0 (--loss {self.loss_type}'s defaults: "
                             f"{CLIP_RANGES[self.loss_type]}).")
        if self.max_sampling_draws < 1:
            raise UsageError(f"--max_sampling_draws {self.max_sampling_draws}: a round draws its "
                             "prompts at least once; give 1 or more.")
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise UsageError(f"--overlong_buffer {self.overlong_buffer}: the soft overlong "
                             "punishment's last tokens before --max_new_tokens "
                             f"{self.max_new_tokens}; give 0 (off) to {self.max_new_tokens}.")

    def sampling(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    top_k=self.top_k, top_p=self.top_p)

    def loss_kwargs(self) -> dict:
        return dict(loss_type=self.loss_type, temperature=self.temperature,
                    clip_low=self.clip_low, clip_high=self.clip_high, beta=self.beta)
