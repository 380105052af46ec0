"""The assistant's tokens under real chat templates: Llama 3.1 and 3.3 (one text), 3.2, Qwen3
(thinking and not), Gemma 2 and 3, Phi-3.5-mini, Phi-4-mini and Phi-4, their template texts as
their models' tokenizer_config.json ship them (``chat_templates/``, its README says whence), each
with a byte-level BPE tokenizer trained here on a few strings and given the template's special
tokens.

For a chat with a system message (where the template takes one) and two exchanges, the masked
tokens decode to exactly the replies as the template renders them plus its end of turn, written
here from the messages and the template's rules (Llama and Gemma trim a reply; Qwen3 keeps the
reasoning only of the turns after the last user message, and gives such a turn without reasoning
an empty ``<think>`` block), never the role headers, the system text, the user's messages or
what the template adds between turns (a newline, Phi's final EOS). DPO's chosen and rejected
replies are masked the same way and follow exactly the prompt that GRPO renders; Qwen3's
``enable_thinking=False`` moves the empty ``<think>`` block into that prompt."""
import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from redco.protocols import UsageError
from redco_zoo_dpo.pipeline import DPOPipeline, render_pair
from redco_zoo_grpo.pipeline import GRPOPipeline, prompt_examples
from redco_zoo_sft import render_chat
from redco_zoo_sft.chat import render_prompt

TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
GEMMA = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
PHI = ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>")


@dataclass
class Template:
    file: str
    specials: tuple  # the special tokens (added tokens that are not special: ``added``)
    end: str  # the end of an assistant's turn
    generation_prompt: str  # what the prompt ends with, so that the model's reply follows
    named: dict = field(default_factory=dict)  # bos_token, eos_token, ...
    added: tuple = ()
    system: bool = True  # whether the template takes a system message
    trims: bool = False  # whether it strips a reply's surrounding whitespace


TEMPLATE = {
    "llama-3.1/3.3": Template("llama-3.1-3.3.jinja", LLAMA, "<|eot_id|>",
                              "<|start_header_id|>assistant<|end_header_id|>\n\n",
                              dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                              trims=True),
    "llama-3.2": Template("llama-3.2.jinja", LLAMA, "<|eot_id|>",
                          "<|start_header_id|>assistant<|end_header_id|>\n\n",
                          dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), trims=True),
    "qwen3": Template("qwen3.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>",
                      "<|im_start|>assistant\n",
                      dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                      added=("<think>", "</think>")),
    "gemma-2": Template("gemma-2.jinja", GEMMA, "<end_of_turn>", "<start_of_turn>model\n",
                        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
                        system=False, trims=True),
    "gemma-3": Template("gemma-3.jinja", GEMMA, "<end_of_turn>", "<start_of_turn>model\n",
                        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"), trims=True),
    "phi-3.5-mini": Template("phi-3.5-mini.jinja", PHI, "<|end|>", "<|assistant|>\n",
                             dict(eos_token="<|endoftext|>")),
    "phi-4-mini": Template("phi-4-mini.jinja", PHI, "<|end|>", "<|assistant|>",
                           dict(eos_token="<|endoftext|>")),
    "phi-4": Template("phi-4.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"),
                      "<|im_end|>", "<|im_start|>assistant<|im_sep|>",
                      dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
}

SYSTEM = "You answer in one short line."
QUESTIONS = ["What is the capital of France?", "And the capital of Italy?"]
PLAIN = ["Paris is the capital of France.", "Rome.\nIt is on the Tiber."]
THINKING = ["<think>\nThe user asks about France. Its capital is Paris.\n</think>\n\nParis.",
            "<think>\nItaly's capital is Rome.\n</think>\n\nRome."]
CORPUS = [SYSTEM, *QUESTIONS, *PLAIN, *THINKING, "Milan. Turin. Florence."]


def tokenizer_for(name: str, template: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (as Llama 3's, Qwen's and Phi-4's are) trained on ``CORPUS``,
    with the special tokens and the chat template of ``name``."""
    spec = TEMPLATE[name]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in spec.specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=template or (TEMPLATES / spec.file).read_text(), **spec.named)


def chat(name: str, replies: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}] if TEMPLATE[name].system else []
    for question, reply in zip(QUESTIONS, replies):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return messages


def rendered_reply(name: str, messages: list[dict], i: int) -> str:
    """Assistant message ``i`` as ``name``'s template renders it in ``messages``, by the
    template's rules."""
    content = messages[i]["content"]
    if name == "qwen3":
        reasoning, answer = "", content
        if "</think>" in content:
            answer = content.split("</think>")[-1].lstrip("\n")
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        last_question = max(j for j, m in enumerate(messages) if m["role"] == "user")
        if i < last_question:  # earlier turns lose their reasoning
            return answer
        return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer.lstrip("\n")
    return content.strip() if TEMPLATE[name].trims else content


def expected(name: str, messages: list[dict], learn_from: int = 0) -> str:
    return "".join(rendered_reply(name, messages, i) + TEMPLATE[name].end
                   for i, m in enumerate(messages) if m["role"] == "assistant" and i >= learn_from)


def masked_text(tokenizer, rendered: dict) -> str:
    return tokenizer.decode(rendered["token_ids"][rendered["loss_mask"]].tolist(),
                            skip_special_tokens=False, clean_up_tokenization_spaces=False)


def text_of(tokenizer, rendered: dict) -> str:
    return tokenizer.decode(rendered["token_ids"].tolist(), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("replies", [PLAIN, THINKING], ids=["plain", "thinking"])
@pytest.mark.parametrize("name", TEMPLATE)
def test_the_mask_is_exactly_the_replies_and_their_end_of_turn(name, replies):
    tokenizer = tokenizer_for(name)
    messages = chat(name, replies)
    rendered = render_chat(tokenizer, messages, 512)
    assert text_of(tokenizer, rendered) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert masked_text(tokenizer, rendered) == expected(name, messages)
    # each reply one run of tokens: as many runs as replies
    runs = np.diff(rendered["loss_mask"].astype(int), prepend=0) == 1
    assert runs.sum() == 2


def test_qwen3_renders_what_the_mask_expects():
    """The expectations' Qwen3 rules, checked on the template's own rendering: the first reply
    loses its reasoning, the last keeps it, and a last reply without any gets an empty block."""
    tokenizer = tokenizer_for("qwen3")
    text = tokenizer.apply_chat_template(chat("qwen3", THINKING), tokenize=False)
    assert "<|im_start|>assistant\nParis.<|im_end|>\n" in text
    assert "The user asks" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\nItaly's capital is Rome.\n</think>\n\n"
                         "Rome.<|im_end|>\n")
    text = tokenizer.apply_chat_template(chat("qwen3", PLAIN), tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nRome.\nIt is on the "
                         "Tiber.<|im_end|>\n")


def test_gemma_2_refuses_a_system_message_and_gemma_3_folds_it_into_the_first_question():
    with pytest.raises(UsageError, match=r"row 7: the tokenizer's chat template refuses it: "
                                         r"System role not supported"):
        render_chat(tokenizer_for("gemma-2"), chat("gemma-3", PLAIN), 512, "row 7")
    tokenizer = tokenizer_for("gemma-3")
    rendered = render_chat(tokenizer, chat("gemma-3", PLAIN), 512)
    assert text_of(tokenizer, rendered).startswith(
        f"<bos><start_of_turn>user\n{SYSTEM}\n\n{QUESTIONS[0]}<end_of_turn>\n")
    assert SYSTEM not in masked_text(tokenizer, rendered)


@pytest.mark.parametrize("name, thinking", [(name, None) for name in TEMPLATE] +
                         [("qwen3", False)])
def test_a_preference_pairs_replies_follow_exactly_the_prompt_grpo_renders(name, thinking):
    """DPO's chosen and rejected: the mask is the reply and its end of turn, and the tokens
    before it are the prompt as ``render_prompt`` (GRPO's) renders it with the generation
    prompt, so the reply is what the model would say next."""
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    tokenizer = tokenizer_for(name)
    prompt = chat(name, THINKING)[:-1]
    row = {"prompt": prompt, "chosen": "Rome.", "rejected": "Milan."}
    rendered = render_pair(tokenizer, row, 512, "row 0", template_kwargs=kwargs)
    prompt_ids = render_prompt(tokenizer, prompt, 512, template_kwargs=kwargs)
    assert tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=False).endswith(
        TEMPLATE[name].generation_prompt + ("<think>\n\n</think>\n\n" if thinking is False
                                            else ""))
    for reply in ("chosen", "rejected"):
        r = rendered[reply]
        whole = prompt + [{"role": "assistant", "content": row[reply]}]
        want = expected(name, whole, learn_from=len(prompt))
        if thinking is False:  # the empty <think> block is the prompt's
            want = want.removeprefix("<think>\n\n</think>\n\n")
        assert masked_text(tokenizer, r) == want
        n = len(prompt_ids)
        np.testing.assert_array_equal(r["token_ids"][:n], prompt_ids)
        assert not r["loss_mask"][:n].any() and r["loss_mask"][n]  # the reply follows the prompt


def test_qwen3_prompts_with_and_without_thinking():
    """GRPO's prompts (``prompt_examples``): Qwen3 with ``enable_thinking=False`` ends the
    prompt with an empty ``<think>`` block; by default the model opens its own."""
    tokenizer = tokenizer_for("qwen3")
    rows = [{"prompt": "What is the capital of France?"}]
    for kwargs, tail in ((None, "<|im_start|>assistant\n"),
                         ({"enable_thinking": False},
                          "<|im_start|>assistant\n<think>\n\n</think>\n\n")):
        ((prompts, _), _) = prompt_examples(tokenizer, (rows, rows), "prompt", 64, kwargs)
        text = tokenizer.decode(prompts[0]["prompt_ids"][prompts[0]["prompt_mask"]].tolist(),
                                skip_special_tokens=False)
        assert text == ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" + tail)


def test_a_reply_the_template_does_not_render_as_it_is_is_refused_naming_it():
    """Not a silent mis-mask: a template that rewrites a reply (here a word of it) leaves the
    reply nowhere to be found."""
    template = (TEMPLATES / "phi-3.5-mini.jinja").read_text().replace(
        "'<|assistant|>\n' + message['content']",
        "'<|assistant|>\n' + message['content'] | replace('Paris', 'Lyon')")
    assert template != (TEMPLATES / "phi-3.5-mini.jinja").read_text()
    with pytest.raises(UsageError, match=r"row 2: message 2 \(the assistant's\) is not where the "
                                         r"chat template rendered it: its reply 'Paris is the"):
        render_chat(tokenizer_for("phi-3.5-mini", template), chat("phi-3.5-mini", PLAIN), 512,
                    "row 2")
    with pytest.raises(UsageError, match=r"row 3: message 0 is the assistant's"):
        render_chat(tokenizer_for("phi-3.5-mini"), chat("gemma-2", PLAIN)[1:], 512, "row 3")


def test_a_template_without_an_end_of_turn_is_masked_through_its_prefixes():
    """No token ends a turn: the reply's span is the chat through it rendered, less the chat
    before it with the generation prompt (the template's newline after it included)."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer = tokenizer_for("phi-4", template)
    messages = chat("phi-4", PLAIN)
    rendered = render_chat(tokenizer, messages, 512)
    assert masked_text(tokenizer, rendered) == PLAIN[0] + "\n" + PLAIN[1] + "\n"


def test_a_template_with_generation_blocks_is_masked_by_them():
    """A template whose replies are in ``{% generation %}`` blocks (as TRL's training templates
    have them): the blocks are the mask, from ``learn_from`` on."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
                "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = tokenizer_for("phi-4", template)
    messages = chat("phi-4", THINKING)
    assert masked_text(tokenizer, render_chat(tokenizer, messages, 512)) == \
        THINKING[0] + "<|im_end|>" + THINKING[1] + "<|im_end|>"
    assert masked_text(tokenizer, render_chat(tokenizer, messages, 512, learn_from=4)) == \
        THINKING[1] + "<|im_end|>"
    with pytest.raises(UsageError, match=r"row 1: the chat template's \{% generation %\} blocks "
                                         r"mark none of the assistant's messages"):
        render_chat(tokenizer_for("phi-4", template.replace("{% generation %}", "").replace(
            "{% endgeneration %}", "") + "{% generation %}{% endgeneration %}"), messages, 512,
            "row 1")


def test_chat_template_kwargs_flag_of_grpo_and_dpo():
    """``--chat_template_kwargs`` (``redco zoo run grpo`` and ``dpo``): a JSON object, or
    refused."""
    for pipeline in (GRPOPipeline(), DPOPipeline()):
        parser = argparse.ArgumentParser(exit_on_error=False)
        pipeline.add_arguments(parser)
        required = ["--model", "m", "--train", "t.jsonl"]
        assert parser.parse_args(required).chat_template_kwargs is None
        assert parser.parse_args(required + ["--chat_template_kwargs", '{"enable_thinking": '
                                             'false}']).chat_template_kwargs == \
            {"enable_thinking": False}
        for bad in ("[1]", "{enable_thinking: false}"):
            with pytest.raises(argparse.ArgumentError, match=r"--chat_template_kwargs: .*give "
                               r"(an object|one), e\.g\. .\{\"enable_thinking\": false\}"):
                parser.parse_args(required + ["--chat_template_kwargs", bad])


@pytest.mark.parametrize("name", TEMPLATE)
def test_sampling_stops_at_the_templates_end_of_turn(name):
    """GRPO's rollouts stop where the template ends an assistant's turn (Gemma's
    ``<end_of_turn>`` and Phi's ``<|end|>`` are not the tokenizer's EOS)."""
    from redco_zoo_sft.chat import stop_token_id
    tokenizer = tokenizer_for(name)
    assert tokenizer.convert_ids_to_tokens(stop_token_id(tokenizer)) == TEMPLATE[name].end
