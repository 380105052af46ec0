"""The LM pipeline's own settings, ``RunConfig.task`` of an LM run (``redco_zoo_models.settings``
has the groups every pipeline shares): how text is cut into examples, and how token files are
read and packed. Each field is the flag of its name; its default is the flag's."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LMData:
    """Examples of ``block_size + 1`` tokens: text from ``text_column`` tokenized by
    ``tokenizer`` (a ``tokenizer.json``; None: the model's), or token files whose end-of-document
    id and dtype are ``eos_id`` and ``token_dtype`` (None: their manifest's, else the model's
    ``eos_token_id`` and uint16), their documents packed into rows (``pack``) or one a row."""
    block_size: int = 128
    text_column: str = "text"
    tokenizer: str | None = None
    eos_id: int | None = None
    token_dtype: str | None = None
    pack: bool = True
