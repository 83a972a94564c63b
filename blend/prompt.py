"""Prompt layout: the chat template split around the user's content, and the stop tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_SENTINEL = "\x00RAGCACHE-CONTENT\x00"
_SENTINEL_END = "\x00RAGCACHE-CONTENT-END\x00"
QUESTION = "Question: "  # what stands between the passages and the first user turn
SEPARATOR = "\n\n"  # what ends every passage in a prompt
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class ChatFrame:
    """Token ids around a user message: `head` (system turn, user turn opening) and `tail`."""

    head: list[int]
    tail: list[int]


def chat_frame(tokenizer, system: str) -> ChatFrame:
    """Render the template with a sentinel as the user content and cut it there.

    The head is the exact prefix every request shares: it is cached, never approximated.
    """
    if not getattr(tokenizer, "chat_template", None):
        return ChatFrame(encode(tokenizer, system + "\n\n"), encode(tokenizer, "\nAnswer:"))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_SENTINEL)
    return ChatFrame(encode(tokenizer, head), encode(tokenizer, tail))


def conversation(tokenizer, system: str, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """(head, suffix) ids of a chat whose passages go right after the head, inside the first user turn.

    `turns` are (role, content) pairs, user and assistant, ending with a user turn. The suffix is the
    first user turn's content behind QUESTION, then every later turn, then the assistant opening:
    for one turn exactly QUESTION + content followed by `chat_frame(...).tail`.
    """
    if not turns or turns[-1][0] != "user":
        raise ValueError("a conversation must end with a user turn")
    turns = [(role, content.replace("\x00", "")) for role, content in turns]  # our sentinels stay ours
    (_, first), rest = turns[0], turns[1:]
    if not getattr(tokenizer, "chat_template", None):
        frame = chat_frame(tokenizer, system)
        later = "".join(f"\n{'Answer' if r == 'assistant' else 'Question'}: {c}" for r, c in rest)
        return frame.head, encode(tokenizer, QUESTION + first + later) + frame.tail
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": _SENTINEL + QUESTION + first + _SENTINEL_END},
                *({"role": r, "content": c} for r, c in rest)]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, body = text.split(_SENTINEL)
    question, after = body.split(_SENTINEL_END)
    return encode(tokenizer, head), encode(tokenizer, question) + encode(tokenizer, after)


def encode(tokenizer, text: str) -> list[int]:
    """Text → ids with no special tokens added: templates write their own."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, config) -> frozenset[int]:
    """EOS from the config and tokenizer, plus the template's end-of-turn token if it has one."""
    ids: set[int] = set()
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
    return frozenset(ids)


def as_ids(ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
