"""GRPO's rollouts on the continuous-batching engine (``redco_zoo_models.engine``), over the
trainer's own params: the engine reads the very arrays the trainer updates (no second copy of
the weights; they are handed over before each rollout and let go after, since the update
donates them), with its key/value cache on the trainer's mesh.

Every prompt's G samples share one prefill, and a completion that ends at its EOS frees its
row for the next at once, where the fixed-batch sampler runs every row to ``max_new_tokens``.
Each prompt samples with a seed of its own, from the run's seed, the round and the prompt's
place in the round, so a resumed run draws what the uninterrupted one drew."""
from __future__ import annotations

import numpy as np

from redco_zoo_models.engine import Engine
from redco_zoo_models.requests import Sampling


class EngineRollouts:
    def __init__(self, trainer, model, config, eos_id: int, pad_id: int, rows: int,
                 prompt_width: int, seed: int):
        self.trainer, self.config, self.pad_id, self.seed = trainer, config, pad_id, seed
        self.engine = Engine(model, None, max_seqs=rows,
                             max_len=prompt_width + config.max_new_tokens,
                             eos_token_ids=(eos_id,), mesh=trainer.deployer.mesh)

    def sample(self, prompts: list[dict], round_: int, greedy: bool):
        """``(tokens, logps)``, (len(prompts) * G, max_new_tokens) each (G = 1 when
        ``greedy``), rows ``i * G ... i * G + G - 1`` prompt ``i``'s; after a completion's EOS,
        pad tokens and log-probability 0, as ``generate`` returns them."""
        c, n_new = self.config, self.config.max_new_tokens
        sampling = dict(max_tokens=n_new, temperature=0.0) if greedy else dict(
            max_tokens=n_new, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
            n=c.n_samples)
        self.engine.params = self.trainer.params
        try:
            requests = [self.engine.submit(
                [int(t) for t in p["prompt_ids"][p["prompt_mask"]]],
                Sampling(seed=self._seed(round_, i), **sampling)) for i, p in enumerate(prompts)]
            self.engine.run_until_done(requests)
        finally:
            self.engine.params = None  # the next update donates them
        samples = [s for r in requests for s in r.samples]
        tokens = np.full((len(samples), n_new), self.pad_id, np.int32)
        logps = np.zeros((len(samples), n_new), np.float32)
        for row, s in enumerate(samples):
            tokens[row, :len(s.tokens)], logps[row, :len(s.logprobs)] = s.tokens, s.logprobs
        return tokens, logps

    def _seed(self, round_: int, prompt: int) -> int:
        return int(np.random.SeedSequence([self.seed, round_, prompt]).generate_state(1)[0]
                   % 2 ** 31)
