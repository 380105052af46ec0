"""The post-training walk-through's task, shared by the tests that train on it (``tests/zoo``,
``tests/zoo_parity``, ``tests/multihost``): a tiny word-level chat model and the task "x_a x_b" ->
"y_b" as SFT chats, DPO pairs and GRPO prompts."""
import json

import numpy as np

from redco_zoo_models.toy import save_tiny_chat_model

WORDS = ["system", "user", "assistant", "map", "it"] + [f"x{i}" for i in range(20)] + \
    [f"y{i}" for i in range(20)]


def write_task(root, seed: int = 0) -> None:
    """The README's files: ``tiny-chat``, and the task "x_a x_b" -> "y_b" split into pairs
    (a, b) to train on and 80 held out. DPO's and GRPO's prompts are those with b >= 10 (SFT's
    chats give those a random answer), DPO's with three wrong answers each."""
    save_tiny_chat_model(str(root / "tiny-chat"), WORDS, seed)
    rng = np.random.default_rng(seed)
    pairs = rng.permutation([(a, b) for a in range(20) for b in range(20)])
    held_out, seen = pairs[:80], pairs[80:]
    def write(name, rows):
        with open(root / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    def user(a, b):
        return [{"role": "user", "content": f"x{a} x{b}"}]
    write("chats.jsonl", [{"messages": user(a, b) + [{"role": "assistant", "content":
                                                       f"y{b if b < 10 else rng.integers(20)}"}]}
                          for a, b in seen])
    for name, part in (("pairs.jsonl", seen), ("pairs_held_out.jsonl", held_out)):
        write(name, [{"prompt": user(a, b), "chosen": f"y{b}",
                      "rejected": f"y{(b + wrong) % 20}"}
                     for a, b in part if b >= 10 for wrong in rng.choice(19, 3, False) + 1])
    for name, part in (("prompts.jsonl", seen), ("prompts_held_out.jsonl", held_out)):
        write(name, [{"prompt": user(a, b), "answer": f"y{b}"} for a, b in part if b >= 10])
