"""Prompt helpers shared by the generation tasks: chat templating, tokenizing, middle truncation.

Chat template rule (``chat_template`` option of a task):
  ``auto``: wrap the prompt as one user turn with the tokenizer's own chat template when it has one
            (``add_generation_prompt=True``), else use the plain prompt;
  ``none``: never wrap;
  ``always``: wrap, and fail when the tokenizer has no template.
LongBench's ``pred.py`` wraps chat models with a per-family ``build_chat`` (e.g. ``[INST]{prompt}[/INST]`` for
Llama-2-chat, FastChat's vicuna template for LongChat/Vicuna); we use the tokenizer's template instead, which is
what current models ship and what later LongBench forks do for Llama-3.x.
"""

from __future__ import annotations

from typing import Any, Sequence

CHAT_MODES = ("auto", "none", "always")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(tokenizer: Any, mode: str) -> bool:
    if mode not in CHAT_MODES:
        raise ValueError(f"chat_template={mode!r}; valid: {list(CHAT_MODES)}")
    if mode == "none":
        return False
    if mode == "always" and not has_chat_template(tokenizer):
        raise ValueError("chat_template=always but the tokenizer has no chat template; use auto or none")
    return has_chat_template(tokenizer)


def render_chat(tokenizer: Any, prompt: str) -> str:
    """The prompt as one user turn plus the assistant header, as text (special tokens written out)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def encode(tokenizer: Any, text: str, templated: bool) -> list[int]:
    """Token ids of a prompt.  Plain prompts get the tokenizer's special tokens (BOS), as LongBench's
    ``tokenizer(prompt)``; a chat-rendered prompt already spells its special tokens (Llama-2/3 templates start
    with the BOS text), so it is tokenized without adding them, and BOS is prepended only when the tokenizer
    normally adds one and the template did not write it."""
    if not templated:
        return list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
    ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    if _adds_bos(tokenizer) and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id, *ids]
    return ids


def middle_truncate(ids: Sequence[int], max_length: int) -> tuple[list[int], list[int]] | None:
    """LongBench's truncation rule: when ``len(ids) > max_length`` keep the first and the last
    ``half = int(max_length / 2)`` tokens (so an odd ``max_length`` keeps ``max_length - 1``).  Returns
    ``(head, tail)``, or None when nothing needs cutting."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length}: must be >= 2")
    if len(ids) <= max_length:
        return None
    half = int(max_length / 2)
    return list(ids[:half]), list(ids[len(ids) - half :])


def context_split(tokenizer: Any, text: str, split_at: int, templated: bool, full_ids: Sequence[int]) -> int:
    """Token count of ``text[:split_at]`` (the context part, for protocol B), clipped so that at least one
    prompt token is left for the question part.  Tokenizing the prefix alone can differ from the full prompt at
    the boundary by a token; the prompt itself is always the full tokenization."""
    n = len(encode(tokenizer, text[:split_at], templated)) if split_at > 0 else 0
    return max(1, min(n, len(full_ids) - 1)) if len(full_ids) > 1 else len(full_ids)
